#pragma once
// The layers a LoRA adapts in an SDXL model and kohya's names for them (sd-scripts
// networks/lora.py on sdxl_original_unet): the same target classes as SD1.x (models/sd15_lora.h),
// but the U-Net's layers named by their paths in Stability AI's layout, as kohya's SDXL U-Net
// names its modules ("lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q",
// "lora_unet_middle_block_1_...", "lora_unet_output_blocks_..."), and the two text encoders
// under lora_te1 (CLIP-L) and lora_te2 (OpenCLIP ViT-bigG). At full size: 722 U-Net layers
// (without conv LoRA), 72 and 192 text-encoder layers.

#include <string>
#include <vector>

#include "models/lora_target.h"
#include "models/unet.h"

namespace lorapipe::models {

inline constexpr const char* kLoraTextEncoder1Prefix = "lora_te1";
inline constexpr const char* kLoraTextEncoder2Prefix = "lora_te2";

// The U-Net's targets in module order, named in SAI's layout; with `conv_kxk`, the
// ResnetBlock2D / Downsample2D / Upsample2D layers too.
std::vector<LoraTarget> sdxl_unet_lora_targets(const UNet& unet, bool conv_kxk);

// kohya's block of an SDXL U-Net LoRA name (networks/lora.py get_block_index, is_sdxl): BASE 0
// (time_embed, label_emb), input_blocks_N 1 + N, middle_block_N 10 + N, output_blocks_N 13 + N,
// out 22; -1 for a name in no block.
int sdxl_kohya_block_index(const std::string& lora_name);

}  // namespace lorapipe::models
