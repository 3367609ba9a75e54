#!/usr/bin/env python3
"""FLOPs of one forward of diffusers' UNet2DConditionModel, as torch's FlopCounterMode counts
them, for models/unet_test.cpp (UNetFlops): the figure the benches divide by time for MFU.

    unet_flops_reference.py OUT_DIR

Writes OUT_DIR/<config>/config.json for each config (unet_reference.py's tiny ones and the
published SD1.5, SD2.1 and SDXL configs) and OUT_DIR/flops.json, a list of
{"config", "batch", "height", "width", "tokens", "flops"}: one forward on latents of that size
with `tokens` text tokens. The full-size UNets run on the meta device (shapes only, no memory),
with SDPA's math backend, whose two matrix products FlopCounterMode counts as its fused kernels'.
"""
import json
import os
import sys

import torch
from diffusers import UNet2DConditionModel
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from unet_reference import SD15_CONFIG, SD21_CONFIG, SDXL_CONFIG, TINY

# (config, batch, latent height, latent width, text tokens). The odd sizes make the resamplers
# round as the UNet's skips do.
CASES = [("unet", 2, 16, 16, 7), ("unet", 1, 9, 13, 77), ("unet_linear", 2, 16, 24, 7),
         ("sd15", 1, 64, 64, 77), ("sd15", 8, 64, 64, 77), ("sd15", 1, 96, 64, 154),
         ("sd21", 1, 96, 96, 77), ("unet_sdxl", 2, 16, 16, 7), ("sdxl", 1, 128, 128, 77)]


def main() -> None:
    out_dir = sys.argv[1]
    os.makedirs(out_dir, exist_ok=True)
    configs = {**TINY, "sd15": SD15_CONFIG, "sd21": SD21_CONFIG, "sdxl": SDXL_CONFIG}
    results = []
    for name, config in configs.items():
        kwargs = {k: v for k, v in config.items() if not k.startswith("_")}
        with torch.device("meta"):
            model = UNet2DConditionModel(**kwargs)
        folder = os.path.join(out_dir, name)
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(dict(model.config), f, indent=2)
        for case, batch, height, width, tokens in CASES:
            if case != name:
                continue
            sample = torch.empty(batch, model.config.in_channels, height, width, device="meta")
            context = torch.empty(batch, tokens, model.config.cross_attention_dim, device="meta")
            timesteps = torch.zeros(batch, dtype=torch.int64, device="meta")
            kwargs = {}
            if model.config.addition_embed_type == "text_time":  # SDXL: pooled text + 6 time ids
                pooled = (model.config.projection_class_embeddings_input_dim -
                          6 * model.config.addition_time_embed_dim)
                kwargs["added_cond_kwargs"] = {
                    "text_embeds": torch.empty(batch, pooled, device="meta"),
                    "time_ids": torch.empty(batch, 6, device="meta")}
            counter = FlopCounterMode(display=False)
            with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), counter:
                model(sample, timesteps, encoder_hidden_states=context, **kwargs)
            results.append({"config": name, "batch": batch, "height": height, "width": width,
                            "tokens": tokens, "flops": counter.get_total_flops()})
    with open(os.path.join(out_dir, "flops.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
