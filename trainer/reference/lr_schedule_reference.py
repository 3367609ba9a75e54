"""Reference learning-rate schedules for lorapipe's schedule parity test: each case built as kohya
sd-scripts' get_scheduler_fix builds it (transformers.optimization's functions with kohya's
arguments; diffusers' for piecewise_constant), stepped through its steps.

    python lr_schedule_reference.py --config CASES.json --out OUT.json

CASES  a list of {name, lr, warmup, total, num_cycles, power, lr_end, min_lr_ratio, decay_steps,
       timescale, warmup_type, decay_type, step_rules, steps, processes}: what kohya's flags give
       (warmup and decay already counts of steps, total kohya's num_training_steps).
OUT    a list, per case, of the multiplier lr / initial lr at optimizer steps 0 .. steps-1.
"""
import argparse
import json

import torch
from diffusers.optimization import get_piecewise_constant_schedule
from transformers import optimization as o


def build(c, optimizer):
    name, w, t = c["name"], c["warmup"], c["total"]
    if name == "constant":
        return o.get_constant_schedule(optimizer)
    if name == "constant_with_warmup":
        return o.get_constant_schedule_with_warmup(optimizer, num_warmup_steps=w)
    if name == "linear":
        return o.get_linear_schedule_with_warmup(optimizer, w, t)
    if name == "cosine":
        return o.get_cosine_schedule_with_warmup(optimizer, w, t)
    if name == "cosine_with_restarts":
        return o.get_cosine_with_hard_restarts_schedule_with_warmup(
            optimizer, w, t, num_cycles=c["num_cycles"])
    if name == "polynomial":
        return o.get_polynomial_decay_schedule_with_warmup(
            optimizer, w, t, power=c["power"], lr_end=c["lr_end"])
    if name == "cosine_with_min_lr":
        return o.get_cosine_with_min_lr_schedule_with_warmup(
            optimizer, w, t, num_cycles=c["num_cycles"] / 2, min_lr_rate=c["min_lr_ratio"])
    if name == "warmup_stable_decay":
        decay = c["decay_steps"]
        return o.get_wsd_schedule(
            optimizer, w, num_stable_steps=t - w - decay, num_decay_steps=decay,
            num_cycles=c["num_cycles"] / 2, min_lr_ratio=c["min_lr_ratio"] or 0.0,
            warmup_type=c["warmup_type"], decay_type=c["decay_type"])
    if name == "inverse_sqrt":
        return o.get_inverse_sqrt_schedule(optimizer, num_warmup_steps=w,
                                           timescale=c["timescale"] or None)
    if name == "piecewise_constant":
        return get_piecewise_constant_schedule(optimizer, step_rules=c["step_rules"])
    raise ValueError(name)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    with open(args.config) as f:
        cases = json.load(f)
    out = []
    for c in cases:
        param = torch.zeros(1, requires_grad=True)
        optimizer = torch.optim.SGD([param], lr=c["lr"])
        scheduler = build(c, optimizer)
        values = []
        for _ in range(c["steps"]):
            values.append(optimizer.param_groups[0]["lr"] / c["lr"])
            optimizer.step()
            # accelerate's AcceleratedScheduler steps the scheduler once per process
            # (split_batches off, kohya's case) for each optimizer step.
            for _ in range(c.get("processes", 1)):
                scheduler.step()
        out.append(values)
    with open(args.out, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
