#include "models/sd15_keys.h"

#include <algorithm>

namespace lorapipe::models {
namespace {

std::string str(std::string_view s) { return std::string(s); }

// An ldm ResBlock and its diffusers ResnetBlock2D.
void add_unet_resnet(KeyMap& map, const std::string& ldm, const std::string& diffusers) {
  map.add(ldm + ".in_layers.0", diffusers + ".norm1");
  map.add(ldm + ".in_layers.2", diffusers + ".conv1");
  map.add(ldm + ".emb_layers.1", diffusers + ".time_emb_proj");
  map.add(ldm + ".out_layers.0", diffusers + ".norm2");
  map.add(ldm + ".out_layers.3", diffusers + ".conv2");
  map.add(ldm + ".skip_connection", diffusers + ".conv_shortcut");
}

}  // namespace

void KeyMap::add(std::string ldm, std::string diffusers) {
  pairs_.emplace_back(std::move(ldm), std::move(diffusers));
}

std::optional<std::string> KeyMap::convert(
    std::string_view key, const std::vector<std::pair<std::string, std::string>>& pairs,
    bool forward) {
  const std::pair<std::string, std::string>* best = nullptr;
  size_t best_length = 0;
  for (const auto& pair : pairs) {
    const std::string& from = forward ? pair.first : pair.second;
    // Match whole module paths only: "x.1" must not match "x.10.weight".
    if (key.size() > from.size() && key.substr(0, from.size()) == from &&
        key[from.size()] == '.' && from.size() > best_length) {
      best = &pair;
      best_length = from.size();
    }
  }
  if (best == nullptr) return std::nullopt;
  const std::string& to = forward ? best->second : best->first;
  return to + std::string(key.substr(best_length));
}

std::optional<std::string> KeyMap::to_diffusers(std::string_view ldm_key) const {
  return convert(ldm_key, pairs_, /*forward=*/true);
}

std::optional<std::string> KeyMap::to_ldm(std::string_view diffusers_key) const {
  return convert(diffusers_key, pairs_, /*forward=*/false);
}

KeyMap sd15_unet_key_map(const UNetLayout& layout) {
  // Walked as diffusers' convert_ldm_unet_checkpoint walks it: input_blocks count one entry
  // per resnet plus one per downsampler; output_blocks layers_per_block + 1 per level.
  KeyMap map;
  const std::string p = str(kLdmUnetPrefix);
  const int layers = layout.layers_per_block;
  map.add(p + "time_embed.0", "time_embedding.linear_1");
  map.add(p + "time_embed.2", "time_embedding.linear_2");
  if (layout.text_time) {
    map.add(p + "label_emb.0.0", "add_embedding.linear_1");
    map.add(p + "label_emb.0.2", "add_embedding.linear_2");
  }
  map.add(p + "input_blocks.0.0", "conv_in");
  map.add(p + "out.0", "conv_norm_out");
  map.add(p + "out.2", "conv_out");
  const int levels = static_cast<int>(layout.down_attention.size());
  for (int i = 0; i < levels; ++i) {
    for (int j = 0; j < layers; ++j) {
      const std::string ldm = p + "input_blocks." + std::to_string(1 + i * (layers + 1) + j);
      const std::string d = "down_blocks." + std::to_string(i);
      add_unet_resnet(map, ldm + ".0", d + ".resnets." + std::to_string(j));
      if (layout.down_attention[i]) map.add(ldm + ".1", d + ".attentions." + std::to_string(j));
    }
    if (i + 1 < levels) {
      map.add(p + "input_blocks." + std::to_string(1 + i * (layers + 1) + layers) + ".0.op",
              "down_blocks." + std::to_string(i) + ".downsamplers.0.conv");
    }
  }
  add_unet_resnet(map, p + "middle_block.0", "mid_block.resnets.0");
  map.add(p + "middle_block.1", "mid_block.attentions.0");
  add_unet_resnet(map, p + "middle_block.2", "mid_block.resnets.1");
  const int up_levels = static_cast<int>(layout.up_attention.size());
  for (int i = 0; i < up_levels; ++i) {
    const std::string d = "up_blocks." + std::to_string(i);
    for (int j = 0; j <= layers; ++j) {
      const std::string ldm = p + "output_blocks." + std::to_string(i * (layers + 1) + j);
      add_unet_resnet(map, ldm + ".0", d + ".resnets." + std::to_string(j));
      if (layout.up_attention[i]) map.add(ldm + ".1", d + ".attentions." + std::to_string(j));
    }
    if (i + 1 < up_levels) {
      // The upsampler follows the last resnet (and its attention, when the level has one).
      const std::string last = p + "output_blocks." + std::to_string(i * (layers + 1) + layers);
      map.add(last + (layout.up_attention[i] ? ".2.conv" : ".1.conv"),
              d + ".upsamplers.0.conv");
    }
  }
  return map;
}

KeyMap sd15_vae_key_map(const VaeLayout& layout) {
  KeyMap map;
  const std::string p = str(kLdmVaePrefix);
  for (const char* part : {"encoder", "decoder"}) {
    const std::string e = p + part;
    const std::string d = part;
    map.add(e + ".conv_in", d + ".conv_in");
    map.add(e + ".conv_out", d + ".conv_out");
    map.add(e + ".norm_out", d + ".conv_norm_out");
    for (int r = 0; r < 2; ++r) {
      const std::string ldm = e + ".mid.block_" + std::to_string(r + 1);
      const std::string dif = d + ".mid_block.resnets." + std::to_string(r);
      map.add(ldm, dif);
      map.add(ldm + ".nin_shortcut", dif + ".conv_shortcut");
    }
    const std::string attn = e + ".mid.attn_1";
    const std::string dattn = d + ".mid_block.attentions.0";
    map.add(attn + ".norm", dattn + ".group_norm");
    map.add(attn + ".q", dattn + ".to_q");
    map.add(attn + ".k", dattn + ".to_k");
    map.add(attn + ".v", dattn + ".to_v");
    map.add(attn + ".proj_out", dattn + ".to_out.0");
  }
  for (int i = 0; i < layout.blocks; ++i) {
    // Encoder levels run in the same order in both layouts; ldm numbers decoder levels from
    // the bottom (up.3 is diffusers' up_blocks.0).
    const std::string enc = p + "encoder.down." + std::to_string(i);
    const std::string denc = "encoder.down_blocks." + std::to_string(i);
    for (int j = 0; j < layout.layers_per_block; ++j) {
      map.add(enc + ".block." + std::to_string(j), denc + ".resnets." + std::to_string(j));
      map.add(enc + ".block." + std::to_string(j) + ".nin_shortcut",
              denc + ".resnets." + std::to_string(j) + ".conv_shortcut");
    }
    if (i + 1 < layout.blocks) map.add(enc + ".downsample.conv", denc + ".downsamplers.0.conv");
    const std::string dec = p + "decoder.up." + std::to_string(layout.blocks - 1 - i);
    const std::string ddec = "decoder.up_blocks." + std::to_string(i);
    for (int j = 0; j <= layout.layers_per_block; ++j) {
      map.add(dec + ".block." + std::to_string(j), ddec + ".resnets." + std::to_string(j));
      map.add(dec + ".block." + std::to_string(j) + ".nin_shortcut",
              ddec + ".resnets." + std::to_string(j) + ".conv_shortcut");
    }
    if (i + 1 < layout.blocks) map.add(dec + ".upsample.conv", ddec + ".upsamplers.0.conv");
  }
  map.add(p + "quant_conv", "quant_conv");
  map.add(p + "post_quant_conv", "post_quant_conv");
  return map;
}

KeyMap sd15_text_key_map(std::string_view prefix) {
  KeyMap map;
  // Longest prefix first wins, so newer files ("...transformer.text_model.") map directly and
  // older ones ("...transformer.embeddings.") through the shorter entry.
  map.add(str(prefix) + "text_model", "text_model");
  map.add(str(prefix).substr(0, prefix.size() - 1), "text_model");
  return map;
}

bool is_known_optional_ldm_key(std::string_view key) {
  static const std::string_view kSchedule[] = {
      "betas", "alphas_cumprod", "alphas_cumprod_prev", "sqrt_alphas_cumprod",
      "sqrt_one_minus_alphas_cumprod", "log_one_minus_alphas_cumprod",
      "sqrt_recip_alphas_cumprod", "sqrt_recipm1_alphas_cumprod", "posterior_variance",
      "posterior_log_variance_clipped", "posterior_mean_coef1", "posterior_mean_coef2",
      "logvar"};
  if (std::find(std::begin(kSchedule), std::end(kSchedule), key) != std::end(kSchedule)) {
    return true;
  }
  return key.substr(0, 10) == "model_ema." ||
         key.find("embeddings.position_ids") != std::string_view::npos;
}

}  // namespace lorapipe::models
