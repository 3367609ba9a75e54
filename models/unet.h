#pragma once
// The Stable Diffusion UNet: diffusers' UNet2DConditionModel (models/unets/unet_2d_condition.py,
// diffusers 0.36), rebuilt module for module so that parameters carry diffusers' state-dict names
// ("down_blocks.0.attentions.1.transformer_blocks.0.attn2.to_k.weight") and a diffusers
// `unet/diffusion_pytorch_model.safetensors` loads by name.
//
// Covered: SD1.x, SD2.x (use_linear_projection, heads per block) and SDXL (transformer depth per
// level, and addition_embed_type "text_time": the projected pooled text embedding and six time
// ids through add_embedding). Not yet: class embeddings and the other variants diffusers' config
// can ask for; the config refuses them by name rather than build a different network.

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>

#include <filesystem>
#include <string>
#include <vector>

#include "models/linear.h"

namespace lorapipe::models {

class BlockSwap;

// The fields of diffusers' unet/config.json that decide the network. Members default to
// diffusers' own defaults (UNet2DConditionModel.__init__), so a config.json that leaves a field
// out means what it means to diffusers. Per-block lists hold one entry per down block; a single
// number in config.json is repeated for every block, as diffusers does.
struct UNetConfig {
  int64_t in_channels = 4;
  int64_t out_channels = 4;
  std::vector<int64_t> block_out_channels = {320, 640, 1280, 1280};
  std::vector<int64_t> layers_per_block = {2, 2, 2, 2};
  std::vector<std::string> down_block_types = {"CrossAttnDownBlock2D", "CrossAttnDownBlock2D",
                                               "CrossAttnDownBlock2D", "DownBlock2D"};
  std::string mid_block_type = "UNetMidBlock2DCrossAttn";
  std::vector<std::string> up_block_types = {"UpBlock2D", "CrossAttnUpBlock2D",
                                             "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"};
  int64_t cross_attention_dim = 1280;
  // diffusers' famous misnomer: for UNet2DConditionModel `attention_head_dim` is the NUMBER of
  // heads of each block's attention (diffusers issue #2011); a head is channels / heads wide.
  // SD1.5: 8 heads everywhere (head widths 40, 80, 160); SD2.x: [5, 10, 20, 20] (64 wide).
  std::vector<int64_t> attention_head_dim = {8, 8, 8, 8};
  std::vector<int64_t> transformer_layers_per_block = {1, 1, 1, 1};
  int64_t norm_num_groups = 32;
  double norm_eps = 1e-5;
  bool use_linear_projection = false;  // proj_in/proj_out as Linear (SD2) or 1x1 Conv2d (SD1)
  bool flip_sin_to_cos = true;         // timestep embedding order: cos, sin
  double freq_shift = 0;               // diffusers' downscale_freq_shift
  int64_t sample_size = 0;             // training latent side (0: not given); [h, w]: h
  // SDXL's added conditions (addition_embed_type "text_time"; empty: none): each time id gets an
  // addition_time_embed_dim-wide sinusoidal embedding (flip_sin_to_cos and freq_shift as the
  // timestep's), those are joined after the pooled text embedding into
  // projection_class_embeddings_input_dim values (SDXL: 1280 + 6 x 256 = 2816), and add_embedding
  // (a TimestepEmbedding) maps them onto the time embedding, which they are added to.
  std::string addition_embed_type;
  int64_t addition_time_embed_dim = 0;
  int64_t projection_class_embeddings_input_dim = 0;

  // SD1.5 (runwayml/stable-diffusion-v1-5 unet/config.json).
  static UNetConfig sd15();
  // SDXL 1.0 base (stabilityai/stable-diffusion-xl-base-1.0 unet/config.json): 2,567,463,684
  // parameters.
  static UNetConfig sdxl();
  // Parses a diffusers unet/config.json. Unknown fields are ignored, missing ones take diffusers'
  // defaults; fields set to something this UNet does not build (addition_embed_type,
  // class_embed_type, a non-default act_fn, ...) throw InputError naming the field and value, as
  // does malformed JSON or a field of the wrong type. `source` names the file in messages.
  static UNetConfig from_json(const std::string& text, const std::string& source = "config.json");

  // Throws InputError naming the first inconsistency (list lengths, unknown block types, channels
  // not divisible by groups or heads). The UNet constructor calls it.
  void validate() const;
};

// The building blocks, named as diffusers' unet_2d_blocks.py, resnet.py and attention.py name
// them; public so a trainer can reach single blocks (gradient checkpointing wraps their forward).
namespace unet_blocks {

// diffusers Attention with AttnProcessor2_0 (models/attention_processor.py): to_q/to_k/to_v
// without bias, to_out.0 with bias. Self-attention when `context` is undefined. The product runs
// through models/attention.h (set_force_math_attention forces the math path everywhere).
struct AttentionImpl : torch::nn::Module {
  AttentionImpl(int64_t query_dim, int64_t context_dim, int64_t heads, int64_t head_dim);
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& context = {});

  int64_t heads;
  int64_t head_dim;
  Linear to_q{nullptr}, to_k{nullptr}, to_v{nullptr};
  torch::nn::ModuleList to_out;  // [0]: out_proj (diffusers' [1] is a parameterless Dropout)
  Linear out_proj{nullptr};
};
TORCH_MODULE(Attention);

// diffusers GEGLU (models/activations.py): proj to 2x inner, then value * gelu(gate), exact gelu.
struct GEGLUImpl : torch::nn::Module {
  GEGLUImpl(int64_t dim_in, int64_t dim_out);
  torch::Tensor forward(const torch::Tensor& x);
  Linear proj{nullptr};
};
TORCH_MODULE(GEGLU);

// diffusers FeedForward with activation_fn "geglu", mult 4: net.0 GEGLU, net.1 Dropout (no
// parameters; an Identity here), net.2 Linear.
struct FeedForwardImpl : torch::nn::Module {
  explicit FeedForwardImpl(int64_t dim);
  torch::Tensor forward(const torch::Tensor& x);
  torch::nn::ModuleList net;
  GEGLU geglu{nullptr};
  Linear out{nullptr};
};
TORCH_MODULE(FeedForward);

// diffusers BasicTransformerBlock with norm_type "layer_norm": pre-LayerNorm self-attention,
// cross-attention on the text states, GEGLU feed-forward, each added back as a residual.
struct BasicTransformerBlockImpl : torch::nn::Module {
  BasicTransformerBlockImpl(int64_t dim, int64_t heads, int64_t head_dim, int64_t context_dim);
  torch::Tensor forward(torch::Tensor x, const torch::Tensor& context);
  torch::nn::LayerNorm norm1{nullptr}, norm2{nullptr}, norm3{nullptr};
  Attention attn1{nullptr}, attn2{nullptr};
  FeedForward ff{nullptr};
};
TORCH_MODULE(BasicTransformerBlock);

// diffusers Transformer2DModel over continuous input: GroupNorm (eps 1e-6), proj_in, the blocks on
// (B, H*W, C) tokens, proj_out, plus the input. proj_in/proj_out are 1x1 convolutions, or Linear
// layers with use_linear_projection (applied after / before the reshape, as diffusers does).
struct Transformer2DImpl : torch::nn::Module {
  Transformer2DImpl(int64_t channels, int64_t heads, int64_t layers, int64_t context_dim,
                    int64_t groups, bool linear_projection);
  // `checkpointed`: each BasicTransformerBlock runs under models::checkpoint, as diffusers'
  // Transformer2DModel and kohya's U-Nets checkpoint them; the norm and proj_in share the first
  // block's checkpoint and proj_out the last's, so only the tokens between blocks are kept.
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& context,
                        bool checkpointed = false);
  torch::nn::GroupNorm norm{nullptr};
  Conv2d proj_in_conv{nullptr}, proj_out_conv{nullptr};
  Linear proj_in_linear{nullptr}, proj_out_linear{nullptr};
  torch::nn::ModuleList transformer_blocks;
  std::vector<BasicTransformerBlock> blocks;
  // Block swap (models/block_swap.h): the U-Net's swap, and the number its first
  // BasicTransformerBlock has in the swap's list; each block is entered and left around its run.
  std::shared_ptr<BlockSwap> swap;
  size_t swap_first = 0;
};
TORCH_MODULE(Transformer2D);

// diffusers ResnetBlock2D (models/resnet.py), time_embedding_norm "default":
// x + conv2(silu(norm2(conv1(silu(norm1(x))) + time_emb_proj(silu(temb))))), with a 1x1
// conv_shortcut on x when the channel count changes.
struct ResnetBlock2DImpl : torch::nn::Module {
  ResnetBlock2DImpl(int64_t in_channels, int64_t out_channels, int64_t temb_channels,
                    int64_t groups, double eps);
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& temb);
  torch::nn::GroupNorm norm1{nullptr}, norm2{nullptr};
  Conv2d conv1{nullptr}, conv2{nullptr}, conv_shortcut{nullptr};
  Linear time_emb_proj{nullptr};
};
TORCH_MODULE(ResnetBlock2D);

// diffusers Downsample2D(use_conv=True, padding=1): a 3x3 stride-2 convolution.
struct Downsample2DImpl : torch::nn::Module {
  explicit Downsample2DImpl(int64_t channels);
  torch::Tensor forward(const torch::Tensor& x);
  Conv2d conv{nullptr};
};
TORCH_MODULE(Downsample2D);

// diffusers Upsample2D(use_conv=True): nearest-neighbour upsampling, then a 3x3 convolution.
// `size` is the skip connection's height and width: for even inputs that is exactly 2x (the same
// result as diffusers' scale_factor=2), and for odd latent sizes it is what diffusers' forward
// passes as upsample_size, so the concatenation with the skip lines up.
struct Upsample2DImpl : torch::nn::Module {
  explicit Upsample2DImpl(int64_t channels);
  torch::Tensor forward(const torch::Tensor& x, c10::IntArrayRef size);
  Conv2d conv{nullptr};
};
TORCH_MODULE(Upsample2D);

// CrossAttnDownBlock2D (with_attention) or DownBlock2D: `layers` x (resnet[, transformer]), then
// an optional downsampler. forward appends every output that the up path concatenates later.
struct DownBlockImpl : torch::nn::Module {
  DownBlockImpl(int64_t in_channels, int64_t out_channels, int64_t temb_channels, int64_t layers,
                bool with_attention, int64_t heads, int64_t transformer_layers, int64_t context_dim,
                const UNetConfig& config, bool add_downsample);
  // `checkpointed`: each resnet and each transformer block runs under models::checkpoint.
  torch::Tensor forward(torch::Tensor x, const torch::Tensor& temb, const torch::Tensor& context,
                        std::vector<torch::Tensor>& skips, bool checkpointed = false);
  torch::nn::ModuleList resnets, attentions, downsamplers;
  std::vector<ResnetBlock2D> resnet_list;
  std::vector<Transformer2D> attention_list;  // empty for DownBlock2D
  Downsample2D downsampler{nullptr};
};
TORCH_MODULE(DownBlock);

// UNetMidBlock2DCrossAttn with one attention layer: resnet, transformer, resnet.
struct MidBlockImpl : torch::nn::Module {
  MidBlockImpl(int64_t channels, int64_t temb_channels, int64_t heads, int64_t transformer_layers,
               int64_t context_dim, const UNetConfig& config);
  torch::Tensor forward(torch::Tensor x, const torch::Tensor& temb, const torch::Tensor& context,
                        bool checkpointed = false);
  torch::nn::ModuleList resnets, attentions;
  std::vector<ResnetBlock2D> resnet_list;
  std::vector<Transformer2D> attention_list;
};
TORCH_MODULE(MidBlock);

// CrossAttnUpBlock2D (with_attention) or UpBlock2D: `layers` x (concatenate the next skip, resnet
// [, transformer]), then an optional upsampler to `upsample_size`.
struct UpBlockImpl : torch::nn::Module {
  UpBlockImpl(int64_t in_channels, int64_t prev_output_channels, int64_t out_channels,
              int64_t temb_channels, int64_t layers, bool with_attention, int64_t heads,
              int64_t transformer_layers, int64_t context_dim, const UNetConfig& config,
              bool add_upsample);
  // `skips` are this block's skip tensors in the order the down path produced them (the last is
  // used first). `upsample_size` is required when the block has an upsampler.
  torch::Tensor forward(torch::Tensor x, const std::vector<torch::Tensor>& skips,
                        const torch::Tensor& temb, const torch::Tensor& context,
                        c10::IntArrayRef upsample_size, bool checkpointed = false);
  torch::nn::ModuleList resnets, attentions, upsamplers;
  std::vector<ResnetBlock2D> resnet_list;
  std::vector<Transformer2D> attention_list;
  Upsample2D upsampler{nullptr};
};
TORCH_MODULE(UpBlock);

// diffusers TimestepEmbedding: linear_1, SiLU, linear_2.
struct TimestepEmbeddingImpl : torch::nn::Module {
  TimestepEmbeddingImpl(int64_t in_dim, int64_t time_embed_dim);
  torch::Tensor forward(const torch::Tensor& x);
  Linear linear_1{nullptr}, linear_2{nullptr};
};
TORCH_MODULE(TimestepEmbedding);

}  // namespace unet_blocks

// The sinusoidal timestep embedding of diffusers' get_timestep_embedding (models/embeddings.py,
// after DDPM): for i < dim/2, freq_i = exp(-ln(10000) * i / (dim/2 - freq_shift)), then
// [sin(t freq), cos(t freq)] (swapped to [cos, sin] with flip_sin_to_cos), zero-padded to an odd
// dim. Computed in float32 whatever the timesteps' dtype. `timesteps` is 1-d.
torch::Tensor timestep_embedding(const torch::Tensor& timesteps, int64_t dim, bool flip_sin_to_cos,
                                 double freq_shift);

struct UNetImpl : torch::nn::Module {
  // Throws InputError when config.validate() does.
  explicit UNetImpl(const UNetConfig& config);

  // The noise (or v) prediction for `sample` (B, in_channels, H, W) at `timesteps` (0-d, or 1-d
  // of length 1 or B; any numeric dtype), conditioned on `encoder_hidden_states`
  // (B, tokens, cross_attention_dim). Any H and W work: upsamplers follow the skip sizes. With
  // addition_embed_type "text_time", `text_embeds` (B, pooled width) and `time_ids` (B, n) are
  // required (diffusers' added_cond_kwargs); otherwise they must be left undefined.
  torch::Tensor forward(const torch::Tensor& sample, const torch::Tensor& timesteps,
                        const torch::Tensor& encoder_hidden_states,
                        const torch::Tensor& text_embeds = {}, const torch::Tensor& time_ids = {});

  // The timestep embedding `emb` the resnets receive, (B, 4 * block_out_channels[0]), with the
  // added conditions' embedding added where the config has them.
  torch::Tensor time_embed(const torch::Tensor& timesteps, int64_t batch, const torch::Tensor& like,
                           const torch::Tensor& text_embeds = {},
                           const torch::Tensor& time_ids = {});

  const UNetConfig& config() const { return config_; }

  // With grad mode on, each resnet and each BasicTransformerBlock (diffusers' and kohya's
  // granularity) runs under models::checkpoint (models/checkpoint.h): its activations are
  // recomputed in backward, and the LoRA tensors inside it are passed explicitly so a frozen base
  // still gives them gradients. Only the layers' outputs stay alive through the forward, and the
  // recomputation holds one layer's activations at a time (a whole block's at 64x64 is over a GiB
  // in fp32; SDXL's ten-deep Transformer2D at 1024x1024 holds 0.7 GiB in bf16 where one
  // transformer block holds a tenth of it).
  bool gradient_checkpointing = false;
  // Block swap (--blocks_to_swap; models/pipeline.h says which blocks): set on each Transformer2D.
  std::shared_ptr<BlockSwap> block_swap;
  // The Transformer2D modules in forward order (down, mid, up): one per kohya block that has
  // transformer blocks (IN04, IN05, IN07, IN08, MID, OUT00-OUT05 in SDXL).
  std::vector<unet_blocks::Transformer2D> transformers() const;

  Conv2d conv_in{nullptr};
  unet_blocks::TimestepEmbedding time_embedding{nullptr};
  unet_blocks::TimestepEmbedding add_embedding{nullptr};  // "text_time" configs only
  torch::nn::ModuleList down_blocks, up_blocks;
  std::vector<unet_blocks::DownBlock> down_list;
  std::vector<unet_blocks::UpBlock> up_list;
  unet_blocks::MidBlock mid_block{nullptr};
  torch::nn::GroupNorm conv_norm_out{nullptr};
  Conv2d conv_out{nullptr};

 private:
  UNetConfig config_;
};
TORCH_MODULE(UNet);

// Loads diffusers-layout weights into `unet`: `folder_or_file` is a safetensors file, or a folder
// holding diffusion_pytorch_model.safetensors (or the .fp16 variant when that is all there is).
// Every parameter must be present with its shape and every tensor used; otherwise throws
// InputError naming the file and the missing, unexpected or mis-shaped keys.
void load_unet_diffusers(UNet& unet, const std::filesystem::path& folder_or_file);

// FLOPs of one forward of the UNet `config` builds, on `batch` latents of height x width with
// `tokens` text tokens, counted as torch's FlopCounterMode counts them: 2 per multiply-add of
// every convolution, Linear and attention product (Q K^T and the weights times V); norms,
// activations, additions and resampling count nothing. The benches divide it by the step time
// for MFU; UNetFlops checks it against FlopCounterMode on diffusers' UNet.
double unet_forward_flops(const UNetConfig& config, int64_t batch, int64_t height, int64_t width,
                          int64_t tokens);

}  // namespace lorapipe::models
