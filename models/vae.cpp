#include "models/vae.h"

#include <torch/torch.h>

#include <map>
#include <nlohmann/json.hpp>
#include <string_view>
#include <utility>

#include "common/error.h"
#include "models/attention.h"
#include "models/linear.h"
#include "models/safetensors.h"
#include "models/weights.h"

namespace lorapipe::models {
namespace nn = torch::nn;

namespace {

nn::Conv2d conv(int64_t in, int64_t out, int64_t kernel, int64_t stride = 1, int64_t padding = 0) {
  return nn::Conv2d(nn::Conv2dOptions(in, out, kernel).stride(stride).padding(padding));
}

nn::GroupNorm group_norm(int64_t groups, int64_t channels) {
  return nn::GroupNorm(nn::GroupNormOptions(groups, channels).eps(1e-6));
}

// diffusers ResnetBlock2D without a time embedding: norm, SiLU, conv, twice, plus a 1x1
// conv_shortcut when the channel count changes.
struct ResnetBlockImpl : nn::Module {
  ResnetBlockImpl(int64_t in, int64_t out, int64_t groups) {
    norm1 = register_module("norm1", group_norm(groups, in));
    conv1 = register_module("conv1", conv(in, out, 3, 1, 1));
    norm2 = register_module("norm2", group_norm(groups, out));
    conv2 = register_module("conv2", conv(out, out, 3, 1, 1));
    if (in != out) conv_shortcut = register_module("conv_shortcut", conv(in, out, 1));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    // Without autograd (the cacher's encode, the sampler's decode) SiLU and the residual add
    // run in place and each intermediate is dropped as soon as it is used, so at most the input
    // and two activations of its size are alive at once; at 512x512 each is 128 MiB.
    const bool in_place = !torch::GradMode::is_enabled();
    auto silu = [&](torch::Tensor t) { return in_place ? torch::silu_(t) : torch::silu(t); };
    torch::Tensor h = silu(norm1(x));
    h = conv1(h);
    h = silu(norm2(h));
    h = conv2(h);
    torch::Tensor skip = conv_shortcut ? conv_shortcut(x) : x;
    return in_place ? h.add_(skip) : skip + h;
  }
  nn::GroupNorm norm1{nullptr}, norm2{nullptr};
  nn::Conv2d conv1{nullptr}, conv2{nullptr}, conv_shortcut{nullptr};
};
TORCH_MODULE(ResnetBlock);

// diffusers Attention as the VAE mid block uses it: one head over all channels, group norm in
// front, residual connection.
struct SpatialAttentionImpl : nn::Module {
  SpatialAttentionImpl(int64_t channels, int64_t groups) {
    group_norm_ = register_module("group_norm", group_norm(groups, channels));
    to_q = register_module("to_q", Linear(channels, channels));
    to_k = register_module("to_k", Linear(channels, channels));
    to_v = register_module("to_v", Linear(channels, channels));
    to_out = register_module("to_out", nn::ModuleList());
    to_out->push_back(Linear(channels, channels));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    const int64_t b = x.size(0), c = x.size(1), h = x.size(2), w = x.size(3);
    torch::Tensor t = group_norm_(x).view({b, c, h * w}).transpose(1, 2);  // [B, HW, C]
    auto head = [&](const torch::Tensor& y) { return y.unsqueeze(1); };   // one head
    torch::Tensor out = attention(head(to_q(t)), head(to_k(t)), head(to_v(t))).squeeze(1);
    out = to_out[0]->as<Linear>()->forward(out);
    return out.transpose(1, 2).reshape({b, c, h, w}) + x;
  }
  nn::GroupNorm group_norm_{nullptr};
  Linear to_q{nullptr}, to_k{nullptr}, to_v{nullptr};
  nn::ModuleList to_out{nullptr};
};
TORCH_MODULE(SpatialAttention);

// UNetMidBlock2D without time embedding: resnet, attention, resnet.
struct MidBlockImpl : nn::Module {
  MidBlockImpl(int64_t channels, int64_t groups, bool add_attention) {
    resnets = register_module("resnets", nn::ModuleList());
    resnets->push_back(ResnetBlock(channels, channels, groups));
    resnets->push_back(ResnetBlock(channels, channels, groups));
    if (add_attention) {
      attentions = register_module("attentions", nn::ModuleList());
      attentions->push_back(SpatialAttention(channels, groups));
    }
  }
  torch::Tensor forward(torch::Tensor x) {
    x = resnets[0]->as<ResnetBlock>()->forward(x);
    if (attentions) x = attentions[0]->as<SpatialAttention>()->forward(x);
    return resnets[1]->as<ResnetBlock>()->forward(x);
  }
  nn::ModuleList resnets{nullptr}, attentions{nullptr};
};
TORCH_MODULE(MidBlock);

// DownEncoderBlock2D / UpDecoderBlock2D: resnets, then a 2x down- or upsampler.
struct SampleBlockImpl : nn::Module {
  SampleBlockImpl(int64_t in, int64_t out, int64_t layers, int64_t groups, bool down, bool resample)
      : down_(down) {
    resnets = register_module("resnets", nn::ModuleList());
    for (int64_t i = 0; i < layers; ++i) resnets->push_back(ResnetBlock(i == 0 ? in : out, out, groups));
    if (resample) {
      auto holder = register_module(down ? "downsamplers" : "upsamplers", nn::ModuleList());
      auto sampler = std::make_shared<nn::Module>();
      // Downsample2D: stride-2 conv, padding 0 after an asymmetric (0,1,0,1) pad; Upsample2D:
      // nearest 2x then a 3x3 conv.
      resample_conv = sampler->register_module("conv", down ? conv(out, out, 3, 2, 0) : conv(out, out, 3, 1, 1));
      holder->push_back(sampler);
    }
  }
  torch::Tensor forward(torch::Tensor x) {
    for (const auto& r : *resnets) x = r->as<ResnetBlock>()->forward(x);
    if (!resample_conv) return x;
    if (down_) return resample_conv(torch::constant_pad_nd(x, {0, 1, 0, 1}, 0));
    namespace F = torch::nn::functional;
    x = F::interpolate(x, F::InterpolateFuncOptions()
                              .scale_factor(std::vector<double>{2.0, 2.0})
                              .mode(torch::kNearest));
    return resample_conv(x);
  }
  bool down_;
  nn::ModuleList resnets{nullptr};
  nn::Conv2d resample_conv{nullptr};
};
TORCH_MODULE(SampleBlock);

}  // namespace

class VaeEncoderImpl : public nn::Module {
 public:
  explicit VaeEncoderImpl(const VaeConfig& c) {
    const auto& ch = c.block_out_channels;
    conv_in = register_module("conv_in", conv(c.in_channels, ch[0], 3, 1, 1));
    down_blocks = register_module("down_blocks", nn::ModuleList());
    for (size_t i = 0; i < ch.size(); ++i) {
      down_blocks->push_back(SampleBlock(i == 0 ? ch[0] : ch[i - 1], ch[i], c.layers_per_block,
                                         c.norm_num_groups, /*down=*/true,
                                         /*resample=*/i + 1 < ch.size()));
    }
    mid_block = register_module("mid_block", MidBlock(ch.back(), c.norm_num_groups,
                                                      c.mid_block_add_attention));
    conv_norm_out = register_module("conv_norm_out", group_norm(c.norm_num_groups, ch.back()));
    conv_out = register_module("conv_out", conv(ch.back(), 2 * c.latent_channels, 3, 1, 1));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    torch::Tensor h = conv_in(x);
    for (const auto& block : *down_blocks) h = block->as<SampleBlock>()->forward(h);
    h = mid_block(h);
    return conv_out(torch::silu(conv_norm_out(h)));
  }
  nn::Conv2d conv_in{nullptr}, conv_out{nullptr};
  nn::ModuleList down_blocks{nullptr};
  MidBlock mid_block{nullptr};
  nn::GroupNorm conv_norm_out{nullptr};
};

class VaeDecoderImpl : public nn::Module {
 public:
  explicit VaeDecoderImpl(const VaeConfig& c) {
    std::vector<int64_t> ch(c.block_out_channels.rbegin(), c.block_out_channels.rend());
    conv_in = register_module("conv_in", conv(c.latent_channels, ch[0], 3, 1, 1));
    mid_block = register_module("mid_block", MidBlock(ch[0], c.norm_num_groups,
                                                      c.mid_block_add_attention));
    up_blocks = register_module("up_blocks", nn::ModuleList());
    for (size_t i = 0; i < ch.size(); ++i) {
      up_blocks->push_back(SampleBlock(i == 0 ? ch[0] : ch[i - 1], ch[i], c.layers_per_block + 1,
                                       c.norm_num_groups, /*down=*/false,
                                       /*resample=*/i + 1 < ch.size()));
    }
    conv_norm_out = register_module("conv_norm_out", group_norm(c.norm_num_groups, ch.back()));
    conv_out = register_module("conv_out", conv(ch.back(), c.out_channels, 3, 1, 1));
  }
  torch::Tensor forward(const torch::Tensor& z) {
    torch::Tensor h = mid_block(conv_in(z));
    for (const auto& block : *up_blocks) h = block->as<SampleBlock>()->forward(h);
    return conv_out(torch::silu(conv_norm_out(h)));
  }
  nn::Conv2d conv_in{nullptr}, conv_out{nullptr};
  nn::ModuleList up_blocks{nullptr};
  MidBlock mid_block{nullptr};
  nn::GroupNorm conv_norm_out{nullptr};
};

VaeConfig VaeConfig::sd15() { return VaeConfig{}; }

VaeConfig VaeConfig::from_json(const std::string& text, const std::string& source) try {
  const nlohmann::json j = nlohmann::json::parse(text);
  VaeConfig c;
  c.in_channels = j.value("in_channels", c.in_channels);
  c.out_channels = j.value("out_channels", c.out_channels);
  c.block_out_channels = j.value("block_out_channels", c.block_out_channels);
  c.layers_per_block = j.value("layers_per_block", c.layers_per_block);
  c.latent_channels = j.value("latent_channels", c.latent_channels);
  c.norm_num_groups = j.value("norm_num_groups", c.norm_num_groups);
  c.scaling_factor = j.value("scaling_factor", c.scaling_factor);
  c.mid_block_add_attention = j.value("mid_block_add_attention", c.mid_block_add_attention);
  for (const char* key : {"down_block_types", "up_block_types"}) {
    if (!j.contains(key)) continue;
    for (const auto& type : j[key]) {
      const std::string t = type.get<std::string>();
      if (t != "DownEncoderBlock2D" && t != "UpDecoderBlock2D") {
        throw InputError(source + ": VAE config: " + key + " '" + t + "' is not supported");
      }
    }
  }
  c.use_quant_conv = j.value("use_quant_conv", c.use_quant_conv);
  c.use_post_quant_conv = j.value("use_post_quant_conv", c.use_post_quant_conv);
  if (j.contains("shift_factor") && !j["shift_factor"].is_null()) {
    c.shift_factor = j["shift_factor"].get<double>();
  }
  return c;
} catch (const nlohmann::json::exception& e) {
  throw InputError(source + ": VAE config: " + e.what());
}

torch::Tensor LatentDistribution::std() const { return torch::exp(0.5 * logvar); }

torch::Tensor LatentDistribution::sample(std::optional<at::Generator> generator) const {
  // Drawn on the CPU, where the generator is (a CPU generator cannot draw on a CUDA device), in
  // the mean's dtype, then moved: the same draw whatever device the VAE is on.
  const at::Tensor noise =
      at::randn(mean.sizes(), generator, mean.options().device(at::kCPU)).to(mean.device());
  return mean + std() * noise;
}

AutoencoderKLImpl::AutoencoderKLImpl(const VaeConfig& config) : config_(config) {
  encoder_ = register_module("encoder", std::make_shared<VaeEncoderImpl>(config));
  decoder_ = register_module("decoder", std::make_shared<VaeDecoderImpl>(config));
  const int64_t l = config.latent_channels;
  if (config.use_quant_conv) {
    quant_conv_ = register_module("quant_conv", conv(2 * l, 2 * l, 1).ptr());
  }
  if (config.use_post_quant_conv) {
    post_quant_conv_ = register_module("post_quant_conv", conv(l, l, 1).ptr());
  }
}

LatentDistribution AutoencoderKLImpl::encode(const torch::Tensor& images) {
  torch::Tensor moments = encoder_->forward(images);
  if (quant_conv_) moments = quant_conv_->as<nn::Conv2d>()->forward(moments);
  auto parts = moments.chunk(2, /*dim=*/1);
  return {parts[0], torch::clamp(parts[1], -30.0, 20.0)};
}

torch::Tensor AutoencoderKLImpl::decode(const torch::Tensor& latents) {
  return decoder_->forward(
      post_quant_conv_ ? post_quant_conv_->as<nn::Conv2d>()->forward(latents) : latents);
}

void load_vae(AutoencoderKL& vae, const std::filesystem::path& folder_or_file) {
  const std::filesystem::path file = std::filesystem::is_directory(folder_or_file)
                                         ? folder_or_file / "diffusion_pytorch_model.safetensors"
                                         : folder_or_file;
  const SafetensorsFile weights = SafetensorsFile::open(file);
  // Many VAEs on the hub predate diffusers' rename of the attention projections (query, key,
  // value, proj_attn); diffusers renames them on load, and so does this.
  const std::pair<std::string_view, std::string_view> renames[] = {
      {".query.", ".to_q."}, {".key.", ".to_k."}, {".value.", ".to_v."}, {".proj_attn.", ".to_out.0."}};
  std::map<std::string, const TensorInfo*> names;
  for (const TensorInfo& info : weights.tensors()) {
    std::string name = info.name;
    for (const auto& [old_part, new_part] : renames) {
      const size_t at = name.find(old_part);
      if (at != std::string::npos) name.replace(at, old_part.size(), new_part);
    }
    names[name] = &info;
  }
  load_into(*vae, weights, names, file.string());
}

}  // namespace lorapipe::models
