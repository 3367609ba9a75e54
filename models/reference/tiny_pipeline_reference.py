#!/usr/bin/env python3
"""Loads lorapipe's tiny SD1.5 diffusers folder with diffusers and transformers, as written, and
runs fixed inputs: proof that the folder (configs, weights, tokenizer) is what they expect, and
the reference outputs the C++ side must match.

    tiny_pipeline_reference.py FOLDER OUT.safetensors
"""
import sys

import torch
from diffusers import AutoencoderKL, UNet2DConditionModel
from diffusers.models.attention_processor import AttnProcessor
from safetensors.torch import save_file
from transformers import CLIPTextModel, CLIPTokenizer

PROMPTS = ["a red circle on a blue background", "a green square, BREAK (masterpiece:1.2)"]


def main() -> None:
    folder, out = sys.argv[1], sys.argv[2]
    tokenizer = CLIPTokenizer.from_pretrained(folder, subfolder="tokenizer")
    text_encoder = CLIPTextModel.from_pretrained(folder, subfolder="text_encoder",
                                                 attn_implementation="eager").eval()
    unet = UNet2DConditionModel.from_pretrained(folder, subfolder="unet").eval()
    vae = AutoencoderKL.from_pretrained(folder, subfolder="vae").eval()
    unet.set_attn_processor(AttnProcessor())
    vae.set_attn_processor(AttnProcessor())
    ids = tokenizer(PROMPTS, padding="max_length", max_length=77, truncation=True,
                    return_tensors="pt").input_ids
    g = torch.Generator().manual_seed(3)
    image = torch.rand((2, 3, 64, 48), generator=g) * 2 - 1
    latents = torch.randn((2, 4, 8, 6), generator=g)
    with torch.no_grad():
        hidden = text_encoder(ids).last_hidden_state
        noise_pred = unet(latents, torch.tensor([10, 700]), hidden).sample
        dist = vae.encode(image).latent_dist
        decoded = vae.decode(latents).sample
    save_file({"input_ids": ids.contiguous(), "hidden": hidden.contiguous(), "image": image,
               "latents": latents, "noise_pred": noise_pred.contiguous(),
               "mean": dist.mean.contiguous(), "logvar": dist.logvar.contiguous(),
               "decoded": decoded.contiguous()}, out)


if __name__ == "__main__":
    main()
