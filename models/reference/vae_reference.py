#!/usr/bin/env python3
"""Parity fixture for the VAE: a tiny diffusers AutoencoderKL with seeded random weights, saved
as diffusers saves it, and its outputs on fixed inputs.

    vae_reference.py OUT_DIR
writes OUT_DIR/vae/{config.json,diffusion_pytorch_model.safetensors} and
OUT_DIR/vae_io.safetensors with image, mean, logvar (encode) and latents, decoded (decode), for
a square and a non-square image; and the same for a VAE with Flux.1's AE settings (16 latent
channels, no quant_conv or post_quant_conv, scaling 0.3611, shift 0.1159) in OUT_DIR/flux_vae/
and OUT_DIR/flux_vae_io.safetensors.
"""
import os
import sys

import torch
from diffusers import AutoencoderKL
from safetensors.torch import save_file


def write_case(out, name, latent_channels, **settings) -> None:
    vae = AutoencoderKL(in_channels=3, out_channels=3,
                        down_block_types=("DownEncoderBlock2D",) * 3,
                        up_block_types=("UpDecoderBlock2D",) * 3,
                        block_out_channels=(32, 64, 64), layers_per_block=2,
                        latent_channels=latent_channels, norm_num_groups=32, sample_size=64,
                        **settings).eval()
    vae.set_attn_processor(__import__("diffusers.models.attention_processor",
                                      fromlist=["AttnProcessor"]).AttnProcessor())
    with torch.no_grad():
        for p in vae.parameters():  # every weight random, none left at its zero/one init
            fan_in = p[0].numel() if p.dim() > 1 else 1
            p.copy_(torch.randn_like(p) * (1.0 / fan_in) ** 0.5)
    vae.save_pretrained(os.path.join(out, name), safe_serialization=True)

    g = torch.Generator().manual_seed(1)
    tensors = {}
    for case, (h, w) in {"square": (32, 32), "wide": (24, 40)}.items():
        image = torch.rand((2, 3, h, w), generator=g) * 2 - 1
        with torch.no_grad():
            dist = vae.encode(image).latent_dist
            latents = torch.randn((2, latent_channels, h // 4, w // 4), generator=g)
            decoded = vae.decode(latents).sample
        tensors.update({f"{case}.image": image, f"{case}.mean": dist.mean.contiguous(),
                        f"{case}.logvar": dist.logvar.contiguous(), f"{case}.latents": latents,
                        f"{case}.decoded": decoded.contiguous()})
    save_file(tensors, os.path.join(out, f"{name}_io.safetensors"))


def main() -> None:
    out = sys.argv[1]
    torch.manual_seed(0)
    write_case(out, "vae", 4)
    write_case(out, "flux_vae", 16, use_quant_conv=False, use_post_quant_conv=False,
               scaling_factor=0.3611, shift_factor=0.1159)


if __name__ == "__main__":
    main()
