#!/usr/bin/env python3
"""Reference for kernels/adamw8bit_test.cpp: bitsandbytes' AdamW8bit (its CPU backend) and
torch.optim.AdamW in fp32 on the cases the test runs, with the same inputs.

    $LORAPIPE_PYTHON kernels/reference/adamw8bit_reference.py OUT_DIR

Writes OUT_DIR/maps.safetensors (bitsandbytes.functional.create_dynamic_map, signed and unsigned)
and, per case, OUT_DIR/<case>.safetensors: p0, and after STEPS steps bnb_p / bnb_m / bnb_v (the
8-bit moments dequantised, or bnb's fp32 moments under 4096 elements) and adamw_p / adamw_m /
adamw_v. The inputs are reproducible from the case alone (the C++ side draws the same numbers
with LibTorch's CPU generator): gen = torch.Generator().manual_seed(seed); p0 = randn(n) * 0.1;
each step g = randn(n) * 0.01, then the case's zero block and NaN lane are applied. These are
bitsandbytes' own test_optimizer8bit scales (parameters 0.1, gradients 0.01, lr 1e-3).
"""
import json
import sys
import warnings

import torch
from safetensors.torch import save_file

warnings.filterwarnings("ignore")
import bitsandbytes as bnb  # noqa: E402
import bitsandbytes.functional as F  # noqa: E402

STEPS = 100
LR = 1e-3
BETAS = (0.9, 0.999)
EPS = 1e-8

# name: (numel, seed, zero block index or -1, NaN lane or -1, weight decay)
CASES = {
    "n4095": (4095, 1, -1, -1, 0.0),
    "n4096": (4096, 2, -1, -1, 0.0),
    "n256x4097": (256 * 4097, 3, -1, -1, 0.0),
    "zero_block": (8192, 4, 5, -1, 0.0),
    "nan_lane": (8192, 5, -1, 1000, 0.0),
    "n4095_decay": (4095, 6, -1, -1, 0.1),
}
NAN_STEPS = range(10, 20)  # 0-based steps whose gradient has a NaN at the lane


def gradient(gen, n, step, zero_block, nan_lane):
    g = torch.randn(n, generator=gen) * 0.01
    if zero_block >= 0:
        g[zero_block * 256:(zero_block + 1) * 256] = 0
    if nan_lane >= 0 and step in NAN_STEPS:
        g[nan_lane] = float("nan")
    return g


def moments(opt, p):
    state = opt.state[p]
    if state["state1"].dtype == torch.uint8:
        m = F.dequantize_blockwise(state["state1"], absmax=state["absmax1"], code=state["qmap1"],
                                   blocksize=256)
        v = F.dequantize_blockwise(state["state2"], absmax=state["absmax2"], code=state["qmap2"],
                                   blocksize=256)
        return m.reshape(-1), v.reshape(-1)
    return state["state1"].reshape(-1).clone(), state["state2"].reshape(-1).clone()


def run_case(n, seed, zero_block, nan_lane, weight_decay):
    gen = torch.Generator().manual_seed(seed)
    p0 = torch.randn(n, generator=gen) * 0.1
    p_bnb = torch.nn.Parameter(p0.clone())
    p_ref = torch.nn.Parameter(p0.clone())
    opt_bnb = bnb.optim.AdamW8bit([p_bnb], lr=LR, betas=BETAS, eps=EPS, weight_decay=weight_decay)
    opt_ref = torch.optim.AdamW([p_ref], lr=LR, betas=BETAS, eps=EPS, weight_decay=weight_decay)
    for step in range(STEPS):
        g = gradient(gen, n, step, zero_block, nan_lane)
        p_bnb.grad = g.clone()
        p_ref.grad = g.clone()
        opt_bnb.step()
        opt_ref.step()
    bnb_m, bnb_v = moments(opt_bnb, p_bnb)
    ref_state = opt_ref.state[p_ref]
    return {
        "p0": p0,
        "bnb_p": p_bnb.detach().clone(), "bnb_m": bnb_m, "bnb_v": bnb_v,
        "adamw_p": p_ref.detach().clone(),
        "adamw_m": ref_state["exp_avg"].clone(), "adamw_v": ref_state["exp_avg_sq"].clone(),
    }


def main():
    out = sys.argv[1]
    save_file({"signed": F.create_dynamic_map(signed=True),
               "unsigned": F.create_dynamic_map(signed=False)}, f"{out}/maps.safetensors")
    for name, case in CASES.items():
        save_file({k: v.contiguous() for k, v in run_case(*case).items()},
                  f"{out}/{name}.safetensors")
    with open(f"{out}/cases.json", "w") as f:
        json.dump({"steps": STEPS, "lr": LR, "betas": BETAS, "eps": EPS,
                   "nan_steps": [NAN_STEPS.start, NAN_STEPS.stop],
                   "cases": {k: dict(zip(["numel", "seed", "zero_block", "nan_lane",
                                          "weight_decay"], v)) for k, v in CASES.items()}}, f)


if __name__ == "__main__":
    main()
