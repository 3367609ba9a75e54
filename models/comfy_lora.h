#pragma once
// LoRA files that name each layer by ComfyUI's path for it (LoraTarget::comfy_path): the
// original single file's module path under "diffusion_model." or
// "text_encoders.clip_l.transformer." / "text_encoders.clip_g.transformer.", as ComfyUI's own
// LoRA saving and diffusion-pipe write them and ComfyUI reads them:
//   diffusion_model.double_blocks.0.img_attn.qkv.lora_down.weight   (.lora_up.weight, .alpha)
//   diffusion_model.input_blocks.4.1.proj_in.lora_A.weight          (.lora_B.weight)
// Read into kohya's names of the model's LoRA targets, so the rest of lorapipe sees one naming.
// These paths name the layers lorapipe's modules have (FLUX.1's fused qkv and linear1 too), so
// every module keeps its rank. A module's alpha is its ".alpha" tensor; without one it is the
// module's rank (scale 1), as ComfyUI and kohya read such a module. Keys of other names pass
// through unchanged (kohya's, where a file mixes both).

#include <ATen/core/Tensor.h>

#include <map>
#include <string>
#include <vector>

#include "models/lora_target.h"

namespace lorapipe::models {

// Whether a key of `tensors` starts with ComfyUI's "diffusion_model." or "text_encoders.".
bool is_comfy_lora(const std::map<std::string, at::Tensor>& tensors);

// The same LoRA in kohya's naming for `targets` ("<name>.lora_down.weight", ".lora_up.weight",
// ".alpha"). Throws InputError naming `file` and the key for: modules of no target (a LoRA for
// another model; the first few named), a module without its down or up weight, and ComfyUI's
// other kinds under these names (".diff", ".diff_b", "dora_scale", LoHa / LoKr weights).
std::map<std::string, at::Tensor> kohya_lora_from_comfy(
    const std::map<std::string, at::Tensor>& tensors, const std::vector<LoraTarget>& targets,
    const std::string& file);

}  // namespace lorapipe::models
