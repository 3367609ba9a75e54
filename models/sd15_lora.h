#pragma once
// The layers a LoRA adapts in a Stable Diffusion 1.x/2.x model and kohya's names for them
// (sd-scripts networks/lora.py, LoRANetwork.create_modules), next to sd15_keys (the family's
// checkpoint key map). Saving, loading and merging LoRA files all name layers through here.
//
// kohya's rule, followed exactly: inside every module of a target class, every Linear and every
// Conv2d is adapted, named prefix + "_" + (module path + "." + child path) with '.' -> '_'.
//  - UNet (prefix lora_unet): Transformer2DModel (proj_in/proj_out as 1x1 convs or Linear, attn1
//    and attn2 to_q/to_k/to_v/to_out.0, ff.net.0.proj, ff.net.2). With conv LoRA (LoCon,
//    network_args conv_dim), also ResnetBlock2D, Downsample2D and Upsample2D: their 3x3 convs
//    take the conv rank, their Linear (time_emb_proj) and 1x1 conv_shortcut the linear rank.
//  - CLIP text encoder (prefix lora_te): CLIPAttention (q/k/v/out_proj) and CLIPMLP (fc1, fc2).
// On SD1.5 that is 192 UNet and 72 text-encoder layers.

#include <memory>
#include <string>
#include <vector>

#include "models/clip_text.h"
#include "models/linear.h"
#include "models/lora_target.h"
#include "models/unet.h"

namespace lorapipe::models {

// The UNet's targets in module order; with `conv_kxk`, the ResnetBlock2D / Downsample2D /
// Upsample2D layers too (kohya's UNET_TARGET_REPLACE_MODULE_CONV2D_3X3).
std::vector<LoraTarget> unet_lora_targets(const UNet& unet, bool conv_kxk);

inline constexpr const char* kLoraUnetPrefix = "lora_unet";
inline constexpr const char* kLoraTextEncoderPrefix = "lora_te";

// The text encoder's targets in module order, named under `prefix` (SDXL's: lora_te1 and
// lora_te2), LoraTarget::encoder set to `encoder`.
std::vector<LoraTarget> text_encoder_lora_targets(const ClipTextModel& text_encoder,
                                                  const char* prefix = kLoraTextEncoderPrefix,
                                                  int encoder = 0);

// kohya's block of an SD1.x U-Net LoRA name (lora_unet_...), as networks/lora.py's
// get_block_index numbers the 25 blocks: IN01-IN11 are 1 + 3i + j for down_blocks.i's layer j
// (its downsampler j = 2), MID 12, OUT00-OUT11 13 + 3i + j for up_blocks.i; -1 for a layer in
// no block (time_embedding, conv_in, conv_out), which kohya's lists index as their last.
int sd15_kohya_block_index(const std::string& lora_name);

}  // namespace lorapipe::models
