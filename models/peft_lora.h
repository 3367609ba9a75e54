#pragma once
// LoRA files in diffusers' PEFT naming, as diffusers' save_lora_weights writes them and
// ai-toolkit, SimpleTuner and diffusers' training scripts share them:
// "<component>.<module path>.lora_A.weight" and ".lora_B.weight", the component "unet" or
// "transformer", "text_encoder" or "text_encoder_2". Read into kohya's modules of the model's
// LoRA targets (models/lora_target.h), so the rest of lorapipe sees one naming.
//
// A module's scale is the one diffusers' load_lora_weights gives it, alpha / rank:
//  - where the file's lora_adapter_metadata names the component, peft's LoraConfig from it
//    alone: lora_alpha (peft's default 8), alpha_pattern, use_rslora (alpha / sqrt(rank));
//  - else the module's own ".alpha" tensor, as diffusers' FLUX.1 loader takes them (a module
//    without one: the most common alpha of its component). diffusers' SD loaders ignore such
//    tensors in this naming; lorapipe takes them as the file's word for every family;
//  - else diffusers' default, alpha = the rank of the component's first lora_B in key order (1
//    for every module of a file of one rank).
// Both .alpha tensors and metadata for one component are refused, as diffusers refuses them.
//
// A layer the reference splits and lorapipe fuses (FLUX.1's qkv from to_q, to_k, to_v) gets one
// module: its downs stacked, its ups block-diagonal, each part's scale folded into its up rows,
// and zero rows where the file adapts no part; alpha is then the stacked rank (scale 1).

#include <ATen/core/Tensor.h>

#include <map>
#include <string>
#include <vector>

#include "models/lora_target.h"

namespace lorapipe::models {

// Whether `tensors` use PEFT's naming (some key holds ".lora_A." or ".lora_B.").
bool is_peft_lora(const std::map<std::string, at::Tensor>& tensors);

// The same LoRA in kohya's naming for `targets` ("<name>.lora_down.weight", ".lora_up.weight",
// ".alpha", in fp32). `adapter_metadata` is the file's lora_adapter_metadata JSON (empty: none).
// Throws InputError naming `file` and the key for: a module of no target, a lora_A without its
// lora_B, DoRA (lora_magnitude_vector) or LoRA biases (lora_B.bias), a key of another kind.
std::map<std::string, at::Tensor> kohya_lora_from_peft(
    const std::map<std::string, at::Tensor>& tensors, const std::string& adapter_metadata,
    const std::vector<LoraTarget>& targets, const std::string& file);

}  // namespace lorapipe::models
