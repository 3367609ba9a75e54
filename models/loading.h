#pragma once
// What the families' loaders share (models/pipeline.cpp for SD1.x, models/sdxl.cpp for SDXL):
// building a module straight in its storage dtype, the ldm layouts of configs, reading a
// config, and the attaching of a CLIP tokenizer. Internal to models/ (and the benches, which
// build modules the same way).

#include <c10/core/ScalarType.h>
#include <torch/nn/module.h>
#include <torch/utils.h>

#include <filesystem>
#include <optional>
#include <string>

#include "models/clip_tokenizer.h"
#include "models/diffusion_model.h"
#include "models/sd15_keys.h"
#include "models/unet.h"
#include "models/vae.h"
#include "models/weights.h"

namespace lorapipe::models {

// Sets LibTorch's default dtype for as long as it lives, so that modules built meanwhile create
// their parameters in it: a model built for bf16 never exists in fp32 first.
class DefaultDtype {
 public:
  explicit DefaultDtype(c10::ScalarType dtype) : saved_(c10::get_default_dtype()) {
    c10::set_default_dtype(c10::scalarTypeToTypeMeta(dtype));
  }
  ~DefaultDtype() { c10::set_default_dtype(saved_); }
  DefaultDtype(const DefaultDtype&) = delete;
  DefaultDtype& operator=(const DefaultDtype&) = delete;

 private:
  caffe2::TypeMeta saved_;
};

// `dtype` when it is a storage dtype (fp32, fp16, bf16); else throws InputError naming `option`.
c10::ScalarType storage_dtype(c10::ScalarType dtype, const char* option);

// A module built by `construct` on the CPU in `dtype`, in eval mode, with no graph.
template <typename Construct>
auto build_in(c10::ScalarType dtype, Construct construct) {
  torch::NoGradGuard no_grad;  // initial values are overwritten by the file's
  DefaultDtype guard(dtype);
  auto module = construct();
  module->to(dtype);  // any tensor a module made in an explicit fp32
  module->eval();
  return module;
}

std::string read_text(const std::filesystem::path& path);
void write_text(const std::filesystem::path& path, const std::string& text);

// The ldm single-file layouts of diffusers configs.
UNetLayout layout_of(const UNetConfig& config);
VaeLayout layout_of(const VaeConfig& config);

// ldm keeps the VAE mid-block attention projections as 1x1 convolutions.
AdaptTensor vae_attention_from_ldm();

// The tokenizer from `path`; without one, CLIP's built-in vocabulary when this build has it and
// `vocab_size` is CLIP's 49408; else none. Sets `builtin` when the built-in one was taken.
std::optional<ClipTokenizer> clip_tokenizer_for(const std::filesystem::path& path,
                                                int64_t vocab_size, const std::string& source,
                                                bool* builtin);

// DiffusionModel::tokenize for CLIP tokenizers: kohya's layout of each caption at
// `max_token_length` (0: the smallest of 75, 150, 225 that holds the longest in the first
// tokenizer), one id tensor per tokenizer (one per text encoder, each padding its own way).
TokenBatch kohya_token_batch(const std::vector<const ClipTokenizer*>& tokenizers,
                             const std::vector<std::string>& captions, int max_token_length,
                             bool weighted);

// kohya's --weighted_captions on chunked states ([B, 2 + 75k, C], ClipTextModel::encode_chunked):
// every state times its token's weight (`token_weights` [B, 77k] as tokenized).
at::Tensor weigh_chunked_states(const at::Tensor& states, const at::Tensor& token_weights,
                                int64_t chunk);

}  // namespace lorapipe::models
