#pragma once
// The Stable Diffusion VAE (diffusers AutoencoderKL): encoder to a diagonal Gaussian over
// latents (mean, logvar), decoder back to pixels. Parameters are named as diffusers names them
// ("encoder.down_blocks.0.resnets.0.conv1.weight", "encoder.mid_block.attentions.0.to_q.weight"),
// so a diffusers `vae/` folder loads by name.

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <filesystem>
#include <string>
#include <vector>

namespace lorapipe::models {

struct VaeConfig {
  int64_t in_channels = 3;
  int64_t out_channels = 3;
  std::vector<int64_t> block_out_channels{128, 256, 512, 512};
  int64_t layers_per_block = 2;
  int64_t latent_channels = 4;
  int64_t norm_num_groups = 32;
  double scaling_factor = 0.18215;  // SD1.5; the family decides
  double shift_factor = 0;          // Flux.1's AE: 0.1159
  bool mid_block_add_attention = true;
  // The 1x1 convolutions around the latent distribution: SD's VAEs have both, Flux.1's AE neither.
  bool use_quant_conv = true;
  bool use_post_quant_conv = true;

  static VaeConfig sd15();
  // A diffusers `vae/config.json`; absent fields keep these defaults.
  // Throws InputError naming `source` for malformed JSON, a field of the wrong type or a VAE this
  // code does not build.
  static VaeConfig from_json(const std::string& text,
                             const std::string& source = "vae/config.json");
};

struct LatentDistribution {
  torch::Tensor mean;    // [B, latent_channels, H/8, W/8]
  torch::Tensor logvar;  // clamped to [-30, 20], as diffusers does
  torch::Tensor std() const;
  // mean + std * noise, with noise drawn from `generator` (the trainer's per-epoch draw).
  torch::Tensor sample(std::optional<at::Generator> generator = std::nullopt) const;
};

class VaeEncoderImpl;
class VaeDecoderImpl;

class AutoencoderKLImpl : public torch::nn::Module {
 public:
  explicit AutoencoderKLImpl(const VaeConfig& config);

  // `images` [B, 3, H, W] in [-1, 1], H and W multiples of 8.
  LatentDistribution encode(const torch::Tensor& images);
  // `latents` [B, latent_channels, h, w], unscaled (divide by scaling_factor first).
  torch::Tensor decode(const torch::Tensor& latents);

  const VaeConfig& config() const { return config_; }

 private:
  VaeConfig config_;
  std::shared_ptr<VaeEncoderImpl> encoder_;
  std::shared_ptr<VaeDecoderImpl> decoder_;
  std::shared_ptr<torch::nn::Module> quant_conv_, post_quant_conv_;
};
TORCH_MODULE(AutoencoderKL);

// Loads diffusers-layout weights (a `vae/` folder or its diffusion_pytorch_model.safetensors).
void load_vae(AutoencoderKL& vae, const std::filesystem::path& folder_or_file);

}  // namespace lorapipe::models
