#pragma once
// The explicit key table between Stable Diffusion's original single-file (ldm) layout and the
// diffusers/transformers names our modules use: "model.diffusion_model.input_blocks.1.0.
// in_layers.0.weight" <-> "down_blocks.0.resnets.0.norm1.weight", and so on. Built from the
// layout (blocks, layers, which blocks attend), the way diffusers' convert_ldm_* functions walk
// it; the parity test checks the table against those functions. No LibTorch.

#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace lorapipe::models {

// Which component of a single-file checkpoint a key belongs to.
enum class Component { kUnet, kVae, kTextEncoder };

inline constexpr std::string_view kLdmUnetPrefix = "model.diffusion_model.";
inline constexpr std::string_view kLdmVaePrefix = "first_stage_model.";
inline constexpr std::string_view kLdmTextPrefix = "cond_stage_model.transformer.";
// SDXL's first text encoder (CLIP-L, transformers' layout) in its single files; its second is
// OpenCLIP's (models/open_clip_keys.h).
inline constexpr std::string_view kSdxlClipLPrefix = "conditioner.embedders.0.transformer.";

struct UNetLayout {
  std::vector<bool> down_attention{true, true, true, false};  // CrossAttnDownBlock2D or not
  std::vector<bool> up_attention{false, true, true, true};
  int layers_per_block = 2;
  // SDXL's added conditions: ldm's label_emb.0.0 / label_emb.0.2 are add_embedding.linear_1/2.
  bool text_time = false;
};

struct VaeLayout {
  int blocks = 4;
  int layers_per_block = 2;
};

// Module-path pairs (ldm, diffusers); a key converts through the longest matching prefix.
class KeyMap {
 public:
  void add(std::string ldm, std::string diffusers);
  // The diffusers name of an ldm key (prefix included, e.g. "model.diffusion_model...."), or
  // nothing when the table has no entry for it.
  std::optional<std::string> to_diffusers(std::string_view ldm_key) const;
  std::optional<std::string> to_ldm(std::string_view diffusers_key) const;
  size_t size() const { return pairs_.size(); }

 private:
  static std::optional<std::string> convert(
      std::string_view key, const std::vector<std::pair<std::string, std::string>>& pairs,
      bool forward);
  std::vector<std::pair<std::string, std::string>> pairs_;
};

// UNet: ldm keys carry kLdmUnetPrefix, diffusers keys none.
KeyMap sd15_unet_key_map(const UNetLayout& layout);
// VAE: ldm keys carry kLdmVaePrefix. The mid-block attention's q/k/v/proj_out are 1x1 convs
// [C, C, 1, 1] in ldm files and linears [C, C] in diffusers: the loader reshapes them.
KeyMap sd15_vae_key_map(const VaeLayout& layout);
// CLIP text encoder: "cond_stage_model.transformer.text_model.*" (or, in older files, without
// "text_model.") <-> "text_model.*"; `prefix` is where the file keeps it (SDXL: kSdxlClipLPrefix).
KeyMap sd15_text_key_map(std::string_view prefix = kLdmTextPrefix);

// Top-level entries of SD single files that carry no weights we load: the DDPM schedule
// buffers, EMA copies, the text encoder's position_ids. Loaders skip them with a warning.
bool is_known_optional_ldm_key(std::string_view key);

}  // namespace lorapipe::models
