#pragma once
// SDXL's second text encoder as single files hold it: OpenCLIP's own layout under
// "conditioner.embedders.1.model." (transformer.resblocks.N.attn.in_proj_weight fused q/k/v,
// ln_1/ln_2, mlp.c_fc/c_proj, positional_embedding, ln_final, text_projection stored
// [hidden, projection]), converted into transformers' CLIPTextModelWithProjection names, as
// diffusers' convert_open_clip_checkpoint converts it: the fused projections split in three by
// rows, text_projection transposed. The parity test checks it against that function.

#include <ATen/core/Tensor.h>

#include <map>
#include <string>
#include <string_view>

namespace lorapipe::models {

inline constexpr std::string_view kSdxlOpenClipPrefix = "conditioner.embedders.1.model.";

// The tensors of `tensors` under `prefix`, in transformers' layout (the others are left out).
// OpenCLIP's logit_scale and attn_mask carry nothing a text encoder needs and are dropped.
// Throws InputError naming `source` and the key for a key under `prefix` that is none of
// OpenCLIP's, or a fused projection whose rows are not three times the width.
std::map<std::string, at::Tensor> open_clip_to_transformers(
    const std::map<std::string, at::Tensor>& tensors, std::string_view prefix,
    const std::string& source);

// The inverse, for writing single files: transformers' CLIPTextModelWithProjection tensors (as
// module_tensors names them) in OpenCLIP's layout under `prefix`, q/k/v fused back by rows and
// text_projection transposed. Throws Error for a name that has no OpenCLIP place.
std::map<std::string, at::Tensor> transformers_to_open_clip(
    const std::map<std::string, at::Tensor>& tensors, std::string_view prefix);

}  // namespace lorapipe::models
