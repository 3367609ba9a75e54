#include "models/sdxl_lora.h"

#include <algorithm>

#include "common/error.h"
#include "models/loading.h"
#include "models/sd15_keys.h"
#include "models/sd15_lora.h"

namespace lorapipe::models {

std::vector<LoraTarget> sdxl_unet_lora_targets(const UNet& unet, bool conv_kxk) {
  // The diffusers paths of the SD1.x rule, renamed through the single-file key table: the SAI
  // path of a layer is its weight's ldm key without the prefix and the ".weight".
  const KeyMap map = sd15_unet_key_map(layout_of(unet->config()));
  std::vector<LoraTarget> targets = unet_lora_targets(unet, conv_kxk);
  for (LoraTarget& t : targets) {
    const std::optional<std::string> ldm = map.to_ldm(t.module_path + ".weight");
    if (!ldm) throw Error("SDXL LoRA: no single-file name for " + t.module_path);
    std::string path = ldm->substr(kLdmUnetPrefix.size());
    path.resize(path.size() - std::string(".weight").size());
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
