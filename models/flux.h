#pragma once
// The Flux.1 transformer (dev and schnell): Black Forest Labs' flow-matching DiT, built module for
// module in the original single-file layout (flux/model.py, as kohya's library/flux_models.py
// keeps it), so parameters carry the names users' files hold and kohya's LoRA names address:
// "double_blocks.0.img_attn.qkv.weight", "single_blocks.37.linear1.weight",
// "final_layer.adaLN_modulation.1.weight". diffusers' FluxTransformer2DModel holds the same
// weights split otherwise (separate q, k, v; the single blocks' proj_mlp beside them; the final
// layer's scale before its shift): flux_original_from_diffusers() says how each original tensor is
// assembled from diffusers' ones.
//
// The parts later flow-matching transformers reuse are free functions here: the 3-axis rotary
// position embedding (flux_rope, apply_rope), 2x2 latent packing and its image ids.
//
// A FluxTransformer is built in its storage dtype on its device with uninitialised weights (none
// at all on the meta device): the full model (11.9 B parameters) never exists in fp32, and a
// loader fills every tensor.

#include <ATen/core/Tensor.h>
#include <c10/core/TensorOptions.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/pimpl.h>

#include <filesystem>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "models/linear.h"

namespace lorapipe::models {

class SafetensorsFile;
class BlockSwap;

// The original FluxParams. Defaults: FLUX.1 [dev]; schnell differs only in having no guidance
// embedding.
struct FluxConfig {
  int64_t in_channels = 64;       // 16 latent channels packed 2x2
  int64_t vec_in_dim = 768;       // CLIP-L's pooled output
  int64_t context_in_dim = 4096;  // T5 XXL's width
  int64_t hidden_size = 3072;
  double mlp_ratio = 4.0;
  int64_t num_heads = 24;
  int64_t depth = 19;  // double-stream blocks
  int64_t depth_single_blocks = 38;
  std::vector<int64_t> axes_dim = {16, 56, 56};  // rotary widths per id axis; sum = head width
  double theta = 10000;
  bool qkv_bias = true;
  bool guidance_embed = true;  // dev: guidance_in; schnell: none

  static FluxConfig dev() { return {}; }
  static FluxConfig schnell() {
    FluxConfig c;
    c.guidance_embed = false;
    return c;
  }
  int64_t head_dim() const { return hidden_size / num_heads; }
  int64_t mlp_hidden() const { return static_cast<int64_t>(hidden_size * mlp_ratio); }
  // Throws InputError (naming `source`) for a config the network cannot be built from.
  void validate(const std::string& source) const;

  // From a diffusers transformer/config.json (FluxTransformer2DModel: num_layers,
  // num_single_layers, attention_head_dim, num_attention_heads, joint_attention_dim,
  // pooled_projection_dim, in_channels, guidance_embeds, axes_dims_rope; diffusers' defaults for
  // absent fields). patch_size must be 1 and out_channels absent or in_channels.
  static FluxConfig from_diffusers_json(const std::string& json, const std::string& source);
  // From an original-layout file's tensor names and shapes (block counts, widths, guidance_in);
  // `prefix`: "" or "model.diffusion_model.". The head count cannot be read from shapes: it is
  // hidden_size / 128, Flux's head width.
  static FluxConfig from_original_file(const SafetensorsFile& file, const std::string& prefix);
};

// The rotary embedding of positions `ids` ([L, n_axes] or [B, L, n_axes]): each axis i turns
// axes_dim[i] / 2 pairs of a head's channels by ids[..., i] * theta^(-2j / axes_dim[i]), computed
// in float64 as both references do. Returned as the cosines and sines of those angles, float32,
// [1 or B, 1, L, head_dim / 2], ready to broadcast over heads.
struct Rope {
  at::Tensor cos, sin;
};
Rope flux_rope(const at::Tensor& ids, const std::vector<int64_t>& axes_dim, double theta);

// Rotates the interleaved channel pairs (x[2j], x[2j+1]) of q or k [B, heads, L, head_dim], in
// float32, returned in x's dtype (BFL's apply_rope; diffusers' apply_rotary_emb with
// use_real_unbind_dim=-1).
at::Tensor apply_rope(const at::Tensor& x, const Rope& rope);

// Flux's sinusoidal embedding of a time or guidance value t in [0, 1] (times 1000 first), `dim`
// wide: cos then sin of t * 1000 * 10000^(-k / (dim / 2)), float32.
at::Tensor flux_timestep_embedding(const at::Tensor& t, int64_t dim = 256);

// 2x2 packing of latents [B, C, H, W] (H, W even) into tokens [B, H/2 * W/2, 4C], each token's
// channels ordered (c, row in patch, column in patch): BFL's rearrange, diffusers'
// _pack_latents.
at::Tensor pack_latents(const at::Tensor& latents);
// The inverse, for latents of `height` x `width`.
at::Tensor unpack_latents(const at::Tensor& tokens, int64_t height, int64_t width);
// The ids of the packed image tokens of a `height` x `width` latent: [H/2 * W/2, 3] float32,
// (0, row, column) per token, row-major.
at::Tensor image_ids(int64_t height, int64_t width);

// kohya's RMSNorm of the query and key heads: x / rms(x) in float32, times `scale`.
struct FluxRmsNormImpl : torch::nn::Module {
  FluxRmsNormImpl(int64_t dim, const at::TensorOptions& options);
  at::Tensor forward(const at::Tensor& x);
  at::Tensor scale;
};
TORCH_MODULE(FluxRmsNorm);

struct FluxQkNormImpl : torch::nn::Module {
  FluxQkNormImpl(int64_t dim, const at::TensorOptions& options);
  FluxRmsNorm query_norm{nullptr}, key_norm{nullptr};
};
TORCH_MODULE(FluxQkNorm);

// in_layer -> SiLU -> out_layer (time_in, vector_in, guidance_in).
struct FluxMlpEmbedderImpl : torch::nn::Module {
  FluxMlpEmbedderImpl(int64_t in_dim, int64_t hidden, const at::TensorOptions& options);
  at::Tensor forward(const at::Tensor& x);
  Linear in_layer{nullptr}, out_layer{nullptr};
};
TORCH_MODULE(FluxMlpEmbedder);

// The fused attention projections of one stream: qkv, its q/k norms and the output proj.
struct FluxSelfAttentionImpl : torch::nn::Module {
  FluxSelfAttentionImpl(int64_t dim, int64_t head_dim, bool qkv_bias,
                        const at::TensorOptions& options);
  Linear qkv{nullptr};
  FluxQkNorm norm{nullptr};
  Linear proj{nullptr};
};
TORCH_MODULE(FluxSelfAttention);

// A stream's feed-forward, named as the original's nn.Sequential: "0" (up), GELU(tanh), "2".
struct FluxMlpImpl : torch::nn::Module {
  FluxMlpImpl(int64_t dim, int64_t hidden, const at::TensorOptions& options);
  at::Tensor forward(const at::Tensor& x);
  Linear up{nullptr}, down{nullptr};
};
TORCH_MODULE(FluxMlp);

// adaLN modulation: lin(SiLU(vec)), cut into (shift, scale, gate) once or twice.
struct FluxModulationImpl : torch::nn::Module {
  FluxModulationImpl(int64_t dim, int parts, const at::TensorOptions& options);
  // `parts` tensors [B, 1, dim].
  std::vector<at::Tensor> forward(const at::Tensor& vec);
  Linear lin{nullptr};
  int parts;
};
TORCH_MODULE(FluxModulation);

// A double-stream block: image and text tokens keep their own weights and attend jointly (text
// first). `key_mask` [B, T + L] bool (true: attend) or undefined.
struct FluxDoubleBlockImpl : torch::nn::Module {
  FluxDoubleBlockImpl(const FluxConfig& config, const at::TensorOptions& options);
  // Returns {img, txt}.
  std::pair<at::Tensor, at::Tensor> forward(const at::Tensor& img, const at::Tensor& txt,
                                            const at::Tensor& vec, const Rope& pe,
                                            const at::Tensor& key_mask);
  int64_t heads;
  FluxModulation img_mod{nullptr}, txt_mod{nullptr};
  FluxSelfAttention img_attn{nullptr}, txt_attn{nullptr};
  FluxMlp img_mlp{nullptr}, txt_mlp{nullptr};
};
TORCH_MODULE(FluxDoubleBlock);

// A single-stream block over the joined sequence: linear1 gives q, k, v and the MLP's input in
// one matmul, linear2 takes the attention output and the activated MLP together.
struct FluxSingleBlockImpl : torch::nn::Module {
  FluxSingleBlockImpl(const FluxConfig& config, const at::TensorOptions& options);
  at::Tensor forward(const at::Tensor& x, const at::Tensor& vec, const Rope& pe,
                     const at::Tensor& key_mask);
  int64_t hidden, mlp_hidden, heads;
  Linear linear1{nullptr}, linear2{nullptr};
  FluxQkNorm norm{nullptr};
  FluxModulation modulation{nullptr};
};
TORCH_MODULE(FluxSingleBlock);

// norm_final (no affine), modulated by adaLN_modulation.1 (shift then scale), then linear.
struct FluxLastLayerImpl : torch::nn::Module {
  FluxLastLayerImpl(int64_t hidden, int64_t out_channels, const at::TensorOptions& options);
  at::Tensor forward(const at::Tensor& x, const at::Tensor& vec);
  Linear linear{nullptr};
  Linear modulation{nullptr};  // registered as "adaLN_modulation.1"
};
TORCH_MODULE(FluxLastLayer);

// One call of the transformer.
struct FluxInput {
  at::Tensor img;        // packed image tokens [B, L, in_channels]
  at::Tensor img_ids;    // [L, 3] or [B, L, 3]
  at::Tensor txt;        // T5 states [B, T, context_in_dim]
  at::Tensor txt_ids;    // [T, 3] or [B, T, 3] (zeros in Flux.1)
  at::Tensor timesteps;  // sigma in [0, 1], [B]
  at::Tensor y;          // CLIP-L pooled [B, vec_in_dim]
  at::Tensor guidance;   // [B], dev only (the distilled guidance scale, e.g. 3.5)
  // [B, T]: 1 where a text token is attended (kohya's --apply_t5_attn_mask); undefined: all are.
  at::Tensor txt_mask;
};

struct FluxTransformerImpl : torch::nn::Module {
  // Parameters made with `options` and left uninitialised (see above).
  FluxTransformerImpl(const FluxConfig& config, const at::TensorOptions& options);
  // The velocity prediction for the image tokens, [B, L, in_channels], in img's dtype.
  at::Tensor forward(const FluxInput& input);

  FluxConfig config;
  Linear img_in{nullptr}, txt_in{nullptr};
  FluxMlpEmbedder time_in{nullptr}, vector_in{nullptr}, guidance_in{nullptr};
  torch::nn::ModuleList double_blocks, single_blocks;
  FluxLastLayer final_layer{nullptr};
  // Each double and single block recomputed in backward (models/checkpoint.h), as kohya's
  // enable_gradient_checkpointing does per block.
  bool gradient_checkpointing = false;
  // kohya's --cpu_offload_checkpointing: each checkpointed block's inputs wait for backward in
  // pinned host memory (models/checkpoint.h).
  bool cpu_offload_checkpointing = false;
  // Block swap (--blocks_to_swap, models/block_swap.h): the blocks numbered double 0.., then
  // single 0.. after them, entered and left around each run. Empty: every block stays.
  std::shared_ptr<BlockSwap> block_swap;
  // The double then the single blocks, in forward order (block swap's numbering).
  std::vector<torch::nn::Module*> blocks();
};
TORCH_MODULE(FluxTransformer);

// The multiply-adds of one forward, counted twice (FLOPs): every Linear over its tokens and the
// attention's two L x L products per block; modulation and embeddings of the per-sample vectors
// are left out (a few per mille). For MFU figures (bench/trainer_bench.cpp).
double flux_forward_flops(const FluxConfig& config, int64_t batch, int64_t image_tokens,
                          int64_t text_tokens);

// How one original-layout tensor is made from diffusers' FluxTransformer2DModel tensors: the
// `sources` joined along dim 0, in order; `swap_halves` exchanges the two halves along dim 0
// afterwards (final_layer.adaLN_modulation.1: diffusers stores scale then shift).
struct FluxTensorRecipe {
  std::vector<std::string> sources;
  bool swap_halves = false;
};
// Every parameter name of a FluxTransformer of `config`, with its recipe from diffusers' names.
std::map<std::string, FluxTensorRecipe> flux_original_from_diffusers(const FluxConfig& config);

// Fills `model` (any dtype and device; converted on the way) from an original-layout file whose
// tensor names carry `prefix`, one tensor at a time. Throws InputError naming the file and the
// missing, unexpected or mis-shaped keys.
void load_flux_original(FluxTransformerImpl& model, const SafetensorsFile& file,
                        const std::string& prefix);
// The same from a diffusers transformer/ folder: diffusion_pytorch_model.safetensors, or the
// shards its .safetensors.index.json names.
void load_flux_diffusers(FluxTransformerImpl& model, const std::filesystem::path& folder);

}  // namespace lorapipe::models
