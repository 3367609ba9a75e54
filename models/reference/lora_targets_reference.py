"""kohya sd-scripts' LoRA targets on the real SD1.5 architecture, for the LoraTargets test.

    python lora_targets_reference.py OUT_DIR

Writes OUT_DIR/targets.json: {"unet": [...], "unet_conv": [...], "text_encoder": [...]}, kohya's
module names in the order kohya creates them. The rule is networks/lora.py's
LoRANetwork.create_modules, applied to diffusers' UNet2DConditionModel and transformers'
CLIPTextModel built on the meta device from SD1.5's published configs (no weights, no memory):
inside every module whose class is a target, every Linear and Conv2d below it becomes
prefix + "." + module path + "." + child path with "." -> "_". A kxk convolution (k > 1) is a
target only with conv LoRA (network_args conv_dim), which also adds the ResNet, downsampler and
upsampler blocks to the U-Net's target classes. "unet" is the plain LoRA, "unet_conv" LoCon's.
"""
import json
import os
import sys

import torch
from diffusers import UNet2DConditionModel
from transformers import CLIPTextConfig, CLIPTextModel

from unet_reference import SD15_CONFIG

# kohya's class lists (networks/lora.py).
UNET_TARGET_REPLACE_MODULE = ["Transformer2DModel"]
UNET_TARGET_REPLACE_MODULE_CONV2D_3X3 = ["ResnetBlock2D", "Downsample2D", "Upsample2D"]
TEXT_ENCODER_TARGET_REPLACE_MODULE = ["CLIPAttention", "CLIPSdpaAttention", "CLIPMLP"]

# openai/clip-vit-large-patch14's text tower, SD1.5's text encoder.
SD15_TEXT_ENCODER = dict(vocab_size=49408, hidden_size=768, intermediate_size=3072,
                         num_hidden_layers=12, num_attention_heads=12,
                         max_position_embeddings=77, hidden_act="quick_gelu")


def kohya_names(root, prefix, target_classes, conv_kxk):
    names = []
    for name, module in root.named_modules():
        if module.__class__.__name__ not in target_classes:
            continue
        for child_name, child in module.named_modules():
            is_linear = child.__class__.__name__ in ("Linear", "LoRACompatibleLinear")
            is_conv2d = child.__class__.__name__ in ("Conv2d", "LoRACompatibleConv")
            is_conv2d_1x1 = is_conv2d and tuple(child.kernel_size) == (1, 1)
            if not (is_linear or is_conv2d):
                continue
            if not (is_linear or is_conv2d_1x1 or conv_kxk):
                continue  # kohya: a kxk conv needs conv_lora_dim
            names.append(f"{prefix}.{name}.{child_name}".replace(".", "_"))
    return names


def main():
    out_dir = sys.argv[1]
    os.makedirs(out_dir, exist_ok=True)
    kwargs = {k: v for k, v in SD15_CONFIG.items() if not k.startswith("_")}
    with torch.device("meta"):
        unet = UNet2DConditionModel(**kwargs)
        text_encoder = CLIPTextModel(CLIPTextConfig(**SD15_TEXT_ENCODER))
    targets = {
        "unet": kohya_names(unet, "lora_unet", UNET_TARGET_REPLACE_MODULE, conv_kxk=False),
        "unet_conv": kohya_names(unet, "lora_unet", UNET_TARGET_REPLACE_MODULE +
                                 UNET_TARGET_REPLACE_MODULE_CONV2D_3X3, conv_kxk=True),
        "text_encoder": kohya_names(text_encoder, "lora_te", TEXT_ENCODER_TARGET_REPLACE_MODULE,
                                    conv_kxk=False),
    }
    with open(os.path.join(out_dir, "targets.json"), "w") as f:
        json.dump(targets, f, indent=1)


if __name__ == "__main__":
    main()
