#include "models/sdxl_lora.h"

#include <algorithm>

#include "models/sd15_lora.h"

namespace lorapipe::models {

std::vector<LoraTarget> sdxl_unet_lora_targets(const UNet& unet, bool conv_kxk) {
  // The diffusers paths of the SD1.x rule, renamed to the SAI path: the layer's path in the
  // single file (ComfyUI's name for it without "diffusion_model.").
  std::vector<LoraTarget> targets = unet_lora_targets(unet, conv_kxk);
  for (LoraTarget& t : targets) {
    std::string path = t.comfy_path.substr(std::string("diffusion_model.").size());
    std::replace(path.begin(), path.end(), '.', '_');
    t.alias = t.name;  // the SD1.x rule's name: diffusers' module path
    t.name = std::string(kLoraUnetPrefix) + "_" + path;
    t.block = sdxl_kohya_block_index(t.name);
  }
  return targets;
}

int sdxl_kohya_block_index(const std::string& lora_name) {
  const std::string prefix = std::string(kLoraUnetPrefix) + "_";
  if (lora_name.rfind(prefix, 0) != 0) return -1;
  const std::string name = lora_name.substr(prefix.size());
  auto number_after = [&](const std::string& head) {
    const size_t end = name.find('_', head.size());
    return std::stoi(name.substr(head.size(), end - head.size()));
  };
  if (name.rfind("time_embed_", 0) == 0 || name.rfind("label_emb_", 0) == 0) return 0;
  if (name.rfind("input_blocks_", 0) == 0) return 1 + number_after("input_blocks_");
  if (name.rfind("middle_block_", 0) == 0) return 10 + number_after("middle_block_");
  if (name.rfind("output_blocks_", 0) == 0) return 13 + number_after("output_blocks_");
  if (name.rfind("out_", 0) == 0) return 22;
  return -1;
}

}  // namespace lorapipe::models
