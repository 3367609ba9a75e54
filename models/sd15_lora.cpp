#include "models/sd15_lora.h"

#include <torch/nn/module.h>

#include <algorithm>
#include <regex>
#include <set>

#include "common/error.h"
#include "models/loading.h"
#include "models/lora_collect.h"
#include "models/sd15_keys.h"

namespace lorapipe::models {
namespace {

std::string kohya_name(const std::string& prefix, const std::string& path) {
  std::string name = prefix + "." + path;
  std::replace(name.begin(), name.end(), '.', '_');
  return name;
}

template <typename T>
bool is(const torch::nn::Module& m) {
  return dynamic_cast<const T*>(&m) != nullptr;
}

}  // namespace

std::vector<LoraTarget> collect_lora_targets(
    const torch::nn::Module& root, const std::string& prefix, bool text_encoder,
    const std::function<bool(const torch::nn::Module&)>& is_target,
    const std::function<int(const std::string&)>& block_of, int encoder) {
  std::vector<LoraTarget> out;
  std::set<const torch::nn::Module*> seen;
  for (const auto& item : root.named_modules(/*name_prefix=*/"", /*include_self=*/false)) {
    if (!is_target(*item.value())) continue;
    for (const auto& child : item.value()->named_modules("", /*include_self=*/false)) {
      LoraTarget target;
      target.linear = std::dynamic_pointer_cast<LinearImpl>(child.value());
      target.conv = std::dynamic_pointer_cast<Conv2dImpl>(child.value());
      if (!target.linear && !target.conv) continue;
      if (!seen.insert(child.value().get()).second) continue;
      target.module_path = item.key() + "." + child.key();
      target.name = kohya_name(prefix, target.module_path);
      // ComfyUI's text encoders are clip_l and clip_g around transformers' layout; a denoiser's
      // own path is its single file's unless the family renames it (unet_lora_targets).
      target.comfy_path = text_encoder ? std::string("text_encoders.clip_") +
                                             (encoder == 0 ? "l" : "g") + ".transformer." +
                                             target.module_path
                                       : "diffusion_model." + target.module_path;
      target.text_encoder = text_encoder;
      target.encoder = text_encoder ? encoder : 0;
      target.block = text_encoder ? -1 : block_of(target.name);
      out.push_back(std::move(target));
    }
  }
  return out;
}

int sd15_kohya_block_index(const std::string& lora_name) {
  static const std::regex updown(
      "(up|down)_blocks_(\\d+)_(resnets|upsamplers|downsamplers|attentions)_(\\d+)_");
  std::smatch m;
  if (std::regex_search(lora_name, m, updown)) {
    const int i = std::stoi(m[2].str()), j = std::stoi(m[4].str());
    const int index = m[3] == "resnets" || m[3] == "attentions" ? 3 * i + j : 3 * i + 2;
    return m[1] == "down" ? 1 + index : 13 + index;
  }
  if (lora_name.find("mid_block_") != std::string::npos) return 12;
  return -1;
}

bool LoraTarget::is_conv_kxk() const {
  if (!conv) return false;
  const auto& k = conv->options.kernel_size();
  return (*k)[0] != 1 || (*k)[1] != 1;
}

int64_t LoraTarget::in_features() const {
  return linear ? linear->options.in_features() : conv->options.in_channels();
}

int64_t LoraTarget::out_features() const {
  return linear ? linear->options.out_features() : conv->options.out_channels();
}

const at::Tensor& LoraTarget::weight() const { return linear ? linear->weight : conv->weight; }

std::shared_ptr<LoraAdapter>& LoraTarget::slot() const {
  return linear ? linear->lora : conv->lora;
}

std::vector<LoraTarget> unet_lora_targets(const UNet& unet, bool conv_kxk) {
  using namespace unet_blocks;
  std::vector<LoraTarget> targets = collect_lora_targets(
      *unet, kLoraUnetPrefix, /*text_encoder=*/false,
      [conv_kxk](const torch::nn::Module& m) {
        if (is<Transformer2DImpl>(m)) return true;
        return conv_kxk &&
               (is<ResnetBlock2DImpl>(m) || is<Downsample2DImpl>(m) || is<Upsample2DImpl>(m));
      },
      sd15_kohya_block_index);
  // ComfyUI names the U-Net's layers by the single file's (ldm) paths.
  const KeyMap map = sd15_unet_key_map(layout_of(unet->config()));
  for (LoraTarget& t : targets) {
    const std::optional<std::string> ldm = map.to_ldm(t.module_path + ".weight");
    if (!ldm) throw Error("U-Net LoRA: no single-file name for " + t.module_path);
    t.comfy_path = "diffusion_model." + ldm->substr(kLdmUnetPrefix.size(),
                                                    ldm->size() - kLdmUnetPrefix.size() -
                                                        std::string(".weight").size());
  }
  return targets;
}

std::vector<LoraTarget> text_encoder_lora_targets(const ClipTextModel& text_encoder,
                                                  const char* prefix, int encoder) {
  return collect_lora_targets(
      *text_encoder, prefix, /*text_encoder=*/true,
      [](const torch::nn::Module& m) { return is<ClipAttentionImpl>(m) || is<ClipMlpImpl>(m); },
      [](const std::string&) { return -1; }, encoder);
}

}  // namespace lorapipe::models
