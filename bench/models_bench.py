#!/usr/bin/env python3
"""SD1.5 at real size, fp32 on CPU: lorapipe against diffusers on the same random weights (lorapipe
writes them, diffusers loads them), same machine, same run, one process each so peak RSS is each
side's own.

    $LORAPIPE_PYTHON bench/models_bench.py [--build build] [--iterations 3] [--only vae|unet]
Prints best-of-N milliseconds and peak RSS for both, and the ratios (reference / lorapipe for
time: above 1 means lorapipe is faster; lorapipe / reference for memory).
"""
import argparse
import os
import re
import resource
import subprocess
import sys
import tempfile
import time

REFERENCE = r'''
import resource, sys, time, torch
from diffusers import AutoencoderKL, UNet2DConditionModel
from safetensors import safe_open
what, iterations, weights = sys.argv[1], int(sys.argv[2]), sys.argv[3]
def load_same_weights(model):
    # One tensor at a time, so loading adds no more than one tensor to the peak RSS.
    with safe_open(weights, framework="pt") as f, torch.no_grad():
        state = model.state_dict()
        assert set(f.keys()) == set(state), "lorapipe and diffusers name different weights"
        for key, value in state.items():
            value.copy_(f.get_tensor(key))
torch.manual_seed(0)
def best(fn):
    b = 1e30
    for _ in range(iterations):
        s = time.perf_counter(); fn(); b = min(b, (time.perf_counter() - s) * 1e3)
    return b
if what == "vae":
    vae = AutoencoderKL(block_out_channels=(128, 256, 512, 512), layers_per_block=2,
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
        latent_channels=4, sample_size=512).eval()
    load_same_weights(vae)
    image = torch.rand(1, 3, 512, 512) * 2 - 1
    with torch.no_grad():
        ms = best(lambda: vae.encode(image))
    name = "vae_encode_512"
else:
    unet = UNet2DConditionModel(sample_size=64, cross_attention_dim=768, attention_head_dim=8,
        block_out_channels=(320, 640, 1280, 1280), layers_per_block=2).train()
    load_same_weights(unet)
    unet.requires_grad_(False)
    latents = torch.randn(1, 4, 64, 64, requires_grad=True)
    context = torch.randn(1, 77, 768)
    t = torch.tensor([500])
    def step():
        unet(latents, t, context).sample.square().mean().backward()
    ms = best(step)
    name = "unet_fwd_bwd_64"
print(f"{name} {ms:.1f} ms, peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")
'''

LINE = re.compile(r"(\S+) ([\d.]+) ms, peak RSS ([\d.]+) MiB")


def run(command):
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    match = LINE.search(out)
    if not match:
        sys.exit(f"unexpected output from {command[0]}: {out}")
    return float(match.group(2)), float(match.group(3))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--build", default="build")
    parser.add_argument("--iterations", default="3")
    parser.add_argument("--only", choices=["vae", "unet"])
    args = parser.parse_args()
    binary = os.path.join(args.build, "bin", "models_bench")
    for what in ([args.only] if args.only else ["vae", "unet"]):
        with tempfile.TemporaryDirectory() as tmp:
            weights = os.path.join(tmp, f"{what}.safetensors")
            ours_ms, ours_rss = run([binary, what, args.iterations, weights])
            ref_ms, ref_rss = run([sys.executable, "-c", REFERENCE, what, args.iterations, weights])
        print(f"{what}: lorapipe {ours_ms:.0f} ms / {ours_rss:.0f} MiB, diffusers {ref_ms:.0f} ms"
              f" / {ref_rss:.0f} MiB; speed ratio {ref_ms / ours_ms:.2f}x, memory ratio "
              f"{ours_rss / ref_rss:.2f}x")


if __name__ == "__main__":
    main()
