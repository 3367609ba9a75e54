#!/usr/bin/env python3
"""Reference for the single-file (ldm) key table: diffusers' own converters.

    ldm_keys_reference.py make OUT_DIR
        tiny diffusers UNet (3 levels, 2 layers, attention on some levels), VAE (3 levels) and
        transformers CLIP text model with random weights, saved in their diffusers layouts under
        OUT_DIR/{unet,vae,text_encoder}.
    ldm_keys_reference.py check OUT_DIR SINGLE_FILE
        converts SINGLE_FILE (written by lorapipe in the ldm layout) back with diffusers'
        convert_ldm_unet_checkpoint / convert_ldm_vae_checkpoint / convert_ldm_clip_checkpoint
        and requires exactly the saved weights: same names, shapes and values. Exit 0 if so.
    ldm_keys_reference.py check_unet OUT_DIR/unet_sdxl SINGLE_FILE
        the same for the SDXL-shaped tiny UNet that `make` also saves (unet_reference.py's
        config: no attention in the first level, depth per level, label_emb), UNet alone.
"""
import json
import os
import sys

import torch
from diffusers import AutoencoderKL, UNet2DConditionModel
from diffusers.loaders import single_file_utils as sfu
from safetensors.torch import load_file
from transformers import CLIPTextConfig, CLIPTextModel

from unet_reference import TINY


def make(out: str) -> None:
    torch.manual_seed(0)
    unet = UNet2DConditionModel(
        block_out_channels=(32, 64, 64), layers_per_block=2, sample_size=16, in_channels=4,
        out_channels=4, down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D",
                                          "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32, attention_head_dim=8, norm_num_groups=32)
    vae = AutoencoderKL(block_out_channels=(32, 64, 64), layers_per_block=2, latent_channels=4,
                        down_block_types=("DownEncoderBlock2D",) * 3,
                        up_block_types=("UpDecoderBlock2D",) * 3, norm_num_groups=32)
    clip = CLIPTextModel(CLIPTextConfig(vocab_size=1000, hidden_size=32, intermediate_size=37,
                                        num_hidden_layers=2, num_attention_heads=4))
    for model in (unet, vae, clip):
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn_like(p))
    unet.save_pretrained(os.path.join(out, "unet"), safe_serialization=True)
    sdxl = UNet2DConditionModel(**TINY["unet_sdxl"])
    with torch.no_grad():
        for p in sdxl.parameters():
            p.copy_(torch.randn_like(p))
    sdxl.save_pretrained(os.path.join(out, "unet_sdxl"), safe_serialization=True)
    vae.save_pretrained(os.path.join(out, "vae"), safe_serialization=True)
    clip.save_pretrained(os.path.join(out, "text_encoder"), safe_serialization=True)


def same(name: str, want: dict, got: dict) -> bool:
    if set(want) != set(got):
        print(f"{name}: missing {sorted(set(want) - set(got))[:5]} "
              f"extra {sorted(set(got) - set(want))[:5]}")
        return False
    for key, value in want.items():
        if tuple(got[key].shape) != tuple(value.shape) or not torch.equal(got[key], value):
            print(f"{name}: {key} differs ({tuple(got[key].shape)} vs {tuple(value.shape)})")
            return False
    return True


def check(out: str, single_file: str) -> int:
    ckpt = load_file(single_file)
    unet_config = json.load(open(os.path.join(out, "unet", "config.json")))
    vae_config = json.load(open(os.path.join(out, "vae", "config.json")))
    ok = same("unet", load_file(os.path.join(out, "unet", "diffusion_pytorch_model.safetensors")),
              sfu.convert_ldm_unet_checkpoint(ckpt, unet_config))
    ok &= same("vae", load_file(os.path.join(out, "vae", "diffusion_pytorch_model.safetensors")),
               sfu.convert_ldm_vae_checkpoint(ckpt, vae_config))
    ok &= same("text_encoder", load_file(os.path.join(out, "text_encoder", "model.safetensors")),
               sfu.convert_ldm_clip_checkpoint(ckpt))
    return 0 if ok else 1


def check_unet(folder: str, single_file: str) -> int:
    config = json.load(open(os.path.join(folder, "config.json")))
    want = load_file(os.path.join(folder, "diffusion_pytorch_model.safetensors"))
    return 0 if same("unet", want, sfu.convert_ldm_unet_checkpoint(load_file(single_file),
                                                                  config)) else 1


if __name__ == "__main__":
    if sys.argv[1] == "make":
        make(sys.argv[2])
        sys.exit(0)
    if sys.argv[1] == "check_unet":
        sys.exit(check_unet(sys.argv[2], sys.argv[3]))
    sys.exit(check(sys.argv[2], sys.argv[3]))
