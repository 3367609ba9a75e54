#pragma once
// A layer a LoRA adapts, whatever the family: kohya's name for it, the module path the
// reference implementation gives it, which part of the model it belongs to (the denoiser, or
// which text encoder) and kohya's block index for block-wise network_args. Each family makes its
// own (models/sd15_lora.h for SD1.x); saving, loading, training and merging LoRAs go through
// this alone.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "models/linear.h"

namespace lorapipe::models {

struct LoraTarget {
  std::string name;         // kohya's: "lora_unet_down_blocks_0_attentions_0_proj_in"
  std::string module_path;  // diffusers' / transformers': "down_blocks.0.attentions.0.proj_in"
  // Another name LoRA files give the same layer, accepted when one is read (SDXL's U-Net layers
  // in diffusers' module names, "lora_unet_down_blocks_1_attentions_0_proj_in", as some
  // trainers write them; kohya converts them to `name` on load); empty: none.
  std::string alias;
  // Where the reference implementation (diffusers, transformers) splits a layer this model fuses,
  // or names it otherwise: its layers' module paths, whose outputs stacked in this order are this
  // layer's output rows, each with its row count (FLUX.1's img_attn.qkv: attn.to_q, attn.to_k,
  // attn.to_v; img_attn.proj: attn.to_out.0). Empty: module_path is the reference's own layer.
  // A LoRA file in the reference's PEFT naming is read through it (models/peft_lora.h).
  std::vector<std::pair<std::string, int64_t>> reference_parts;
  // The layer as ComfyUI names it: its module path in the family's original single file under
  // ComfyUI's component prefix ("diffusion_model.input_blocks.1.1.proj_in",
  // "diffusion_model.double_blocks.0.img_attn.qkv",
  // "text_encoders.clip_l.transformer.text_model.encoder.layers.0.self_attn.q_proj"). LoRA files
  // named so (ComfyUI's, diffusion-pipe's) are read through it (models/comfy_lora.h).
  std::string comfy_path;
  bool text_encoder = false;
  // Which text encoder (0: the first; SDXL's second is 1), for text-encoder targets.
  int encoder = 0;
  // kohya's block of a denoiser target, an index into the family's block table
  // (KohyaFamilyNames::blocks); -1 where the layer is in no block (kohya's Python index -1: the
  // last) and for text-encoder targets.
  int block = -1;
  // One of the family's input layers that kohya adapts only where network_args in_dims gives it
  // a rank (networks.lora_flux: img_in, time_in, vector_in, guidance_in, txt_in): the index of
  // its group in KohyaFamilyNames::in_dims; -1 for every other layer.
  int in_dims = -1;
  // Exactly one of the two is set.
  std::shared_ptr<LinearImpl> linear;
  std::shared_ptr<Conv2dImpl> conv;

  // A 3x3 (or larger) convolution: adapted only with conv LoRA, at the conv rank.
  bool is_conv_kxk() const;
  int64_t in_features() const;   // input channels for a conv
  int64_t out_features() const;  // output channels for a conv
  const at::Tensor& weight() const;
  std::shared_ptr<LoraAdapter>& slot() const;
};

}  // namespace lorapipe::models
