#pragma once
// The layers a LoRA adapts in a Flux.1 model and kohya's names for them (sd-scripts
// networks/lora_flux.py): every Linear of every double-stream and single-stream block, named by
// its path in the original layout under lora_unet ("lora_unet_double_blocks_0_img_attn_qkv",
// "lora_unet_single_blocks_37_linear2"), as ComfyUI loads them; CLIP-L's attention and MLP
// layers under lora_te1. At full size: 19 double blocks x 10 + 38 single blocks x 3 = 304
// transformer layers, 72 CLIP-L layers. The fused qkv and linear1 are one layer each (kohya's
// split_qkv trains them split and saves them merged, in this same form).

#include <cstdint>
#include <string>
#include <vector>

#include "models/flux.h"
#include "models/lora_target.h"

namespace lorapipe::models {

// kohya's network_args train_blocks: "all" (default), "single" or "double". Throws InputError
// naming the value otherwise. After the blocks' layers come the input layers of each group of
// `in_dims` (kohya's in_dims filters: "img_in", "time_in", ...; a Linear whose kohya name holds
// "_" + group, in named_modules order), marked with LoraTarget::in_dims, whatever train_blocks
// says: kohya adds them after the blocks whichever blocks train.
std::vector<LoraTarget> flux_lora_targets(const FluxTransformer& model,
                                          const std::string& train_blocks = "all",
                                          const std::vector<std::string>& in_dims = {});

// kohya's split_qkv parts of a layer (networks.lora_flux's split_dims), by its name, with the
// widths the layer has: q, k, v of a double block's qkv; q, k, v and the MLP of a single block's
// linear1; empty for every other layer (and for a conv or text-encoder layer).
std::vector<int64_t> flux_split_qkv_dims(const LoraTarget& target);

}  // namespace lorapipe::models
