#pragma once
// The CLIP text encoder of Stable Diffusion (transformers CLIPTextModel: the ViT-L/14 text tower
// in SD1.5 and SDXL; with `with_projection`, CLIPTextModelWithProjection: SDXL's OpenCLIP
// ViT-bigG tower, whose projected pooled output SDXL also conditions on), with parameters named
// as transformers names them ("text_model.encoder.layers.0.self_attn.q_proj.weight",
// "text_projection.weight", ...), so a transformers checkpoint loads by name.

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>

#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "models/linear.h"

namespace lorapipe::models {

struct ClipTextConfig {
  int64_t vocab_size = 49408;
  int64_t hidden_size = 768;
  int64_t intermediate_size = 3072;
  int64_t num_hidden_layers = 12;
  int64_t num_attention_heads = 12;
  int64_t max_position_embeddings = 77;
  std::string hidden_act = "quick_gelu";  // or "gelu" (SD2's OpenCLIP tower)
  double layer_norm_eps = 1e-5;
  int64_t eos_token_id = 2;  // 2: the legacy config, where the pooled token is argmax(input_ids)
  // CLIPTextModelWithProjection (config.json's architectures say so): text_projection, a Linear
  // without bias from hidden_size to projection_dim, over the pooled state.
  bool with_projection = false;
  int64_t projection_dim = 512;

  static ClipTextConfig sd15();
  // SDXL's second text encoder, OpenCLIP ViT-bigG/14 as transformers holds it
  // (stabilityai/stable-diffusion-xl-base-1.0 text_encoder_2/config.json).
  static ClipTextConfig sdxl_clip_g();
  // A transformers `text_encoder/config.json`; absent fields keep these defaults. Throws InputError
  // naming `source` for malformed JSON, a field of the wrong type or an unsupported activation.
  static ClipTextConfig from_json(const std::string& text,
                                  const std::string& source = "text_encoder/config.json");
};

struct ClipAttentionImpl : torch::nn::Module {
  explicit ClipAttentionImpl(const ClipTextConfig& config);
  torch::Tensor forward(const torch::Tensor& x);  // causal self-attention
  int64_t heads;
  Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, out_proj{nullptr};
};
TORCH_MODULE(ClipAttention);

struct ClipMlpImpl : torch::nn::Module {
  explicit ClipMlpImpl(const ClipTextConfig& config);
  torch::Tensor forward(const torch::Tensor& x);
  bool quick_gelu;
  Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(ClipMlp);

struct ClipEncoderLayerImpl : torch::nn::Module {
  explicit ClipEncoderLayerImpl(const ClipTextConfig& config);
  torch::Tensor forward(const torch::Tensor& x);
  ClipAttention self_attn{nullptr};
  torch::nn::LayerNorm layer_norm1{nullptr}, layer_norm2{nullptr};
  ClipMlp mlp{nullptr};
};
TORCH_MODULE(ClipEncoderLayer);

struct ClipTextOutput {
  torch::Tensor last_hidden_state;           // [B, T, C], after the final layer norm
  torch::Tensor pooled;                      // [B, C], the end-of-text token's state
  torch::Tensor text_embeds;                 // [B, projection_dim]: pooled through
                                             // text_projection (with_projection only)
  std::vector<torch::Tensor> hidden_states;  // embeddings, then each layer's output (no final LN)
};

// text_model.{embeddings, encoder, final_layer_norm}, under a parent named "text_model".
struct ClipTextTransformerImpl : torch::nn::Module {
  explicit ClipTextTransformerImpl(const ClipTextConfig& config);
  ClipTextConfig config;
  // Plain containers that only give the checkpoint's key prefixes "embeddings." and "encoder.".
  std::shared_ptr<torch::nn::Module> embeddings, encoder;
  torch::nn::Embedding token_embedding{nullptr}, position_embedding{nullptr};
  torch::nn::ModuleList layers{nullptr};
  torch::nn::LayerNorm final_layer_norm{nullptr};
};
TORCH_MODULE(ClipTextTransformer);

class ClipTextModelImpl : public torch::nn::Module {
 public:
  explicit ClipTextModelImpl(const ClipTextConfig& config);

  // `input_ids` [B, T] int64, T <= max_position_embeddings.
  ClipTextOutput forward(const torch::Tensor& input_ids);

  // The conditioning SD trains on, as kohya and A1111 apply clip skip: the output of the
  // clip_skip-th layer from the end, through the final layer norm (clip_skip 1 is the last
  // hidden state).
  torch::Tensor encode(const torch::Tensor& input_ids, int clip_skip = 1);
  // The same conditioning from an output already computed.
  torch::Tensor conditioning(const ClipTextOutput& output, int clip_skip = 1);
  // kohya's long-prompt conditioning (train_util.get_hidden_states, SD1 branch) for ids made of
  // k chunks of max_position_embeddings tokens each ([B, k * 77], models/long_prompt.h):
  // every chunk is encoded on its own, then joined as the first chunk's BOS state, tokens 1..75
  // of each chunk, and the last chunk's final state: [B, 2 + 75k, width]. With one chunk it is
  // encode(). Also returns the first chunk's pooled output in `pooled` when given.
  torch::Tensor encode_chunked(const torch::Tensor& input_ids, int clip_skip = 1,
                               torch::Tensor* pooled = nullptr);
  // SDXL's conditioning from either encoder (kohya's get_hidden_states_sdxl; diffusers'
  // StableDiffusionXLPipeline.encode_prompt without clip_skip): the penultimate layer's output
  // without the final layer norm, chunked as encode_chunked. `pooled`, when given, gets the first
  // chunk's pooled output through text_projection (with_projection: bigG's text_embeds), else
  // the pooled state itself.
  torch::Tensor encode_chunked_penultimate(const torch::Tensor& input_ids,
                                           torch::Tensor* pooled = nullptr);

  const ClipTextConfig& config() const { return text_model_->config; }

  Linear text_projection{nullptr};  // with_projection only

  // With grad mode on, each encoder layer runs under models::checkpoint (models/checkpoint.h),
  // its LoRA tensors passed explicitly: kohya checkpoints the text encoder too when it trains.
  bool gradient_checkpointing = false;

 private:
  // The chunked encoding: `states` picks each chunk's states from its output; `pooled` gets the
  // first chunk's pooled output (projected with `projected`).
  torch::Tensor chunked(const torch::Tensor& input_ids,
                        const std::function<torch::Tensor(const ClipTextOutput&)>& states,
                        torch::Tensor* pooled, bool projected);

  ClipTextTransformer text_model_{nullptr};
};
TORCH_MODULE(ClipTextModel);

// Loads transformers-layout weights (a `text_encoder/` folder or its model.safetensors).
void load_clip_text(ClipTextModel& model, const std::filesystem::path& folder_or_file);

}  // namespace lorapipe::models
