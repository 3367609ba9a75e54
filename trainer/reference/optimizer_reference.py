"""Reference runs of the PyPI optimizers kohya sd-scripts loads (prodigyopt's Prodigy for
--optimizer_type=Prodigy, dadaptation's DAdaptAdam for DAdaptAdam, lion-pytorch's Lion for
Lion, transformers' Adafactor for Adafactor, came-pytorch's CAME for came_pytorch.CAME,
schedulefree's AdamWScheduleFree for AdamWScheduleFree)
for lorapipe's optimizer parity tests.

    python optimizer_reference.py --inputs IN.safetensors --config CONFIG.json --out OUT.safetensors

IN      param.<i> the initial parameters (fp32); grad.<s>.<i> the gradient of parameter i at step
        s (absent: no gradient that step, as a parameter the loss did not reach); lr.<g> [S] the
        learning rate of group g at each step (as kohya's schedule sets it).
CONFIG  optimizer: "Prodigy", "DAdaptAdam", "Lion", "Adafactor", "CAME" or "AdamWScheduleFree"; groups: [[parameter indices], ...]; steps;
        kwargs: the keyword arguments given to its constructor (betas, eps as lists). Adafactor
        with relative_step (its default, and kohya's) is built as kohya builds it: lr=None, the
        groups without rates, none set per step.
OUT     param.<i> after the last step; for Prodigy and DAdaptAdam, d [S], the step-size estimate
        after each step (float64); for AdamWScheduleFree (put in train mode once built, as kohya
        does), eval.<i> after eval() and train.<i> after train() again.
"""
import argparse
import json

import torch
from came_pytorch import CAME
from dadaptation import DAdaptAdam
from lion_pytorch import Lion
from prodigyopt import Prodigy
from safetensors.torch import load_file, save_file
from schedulefree import AdamWScheduleFree
from transformers.optimization import Adafactor

OPTIMIZERS = {"Prodigy": Prodigy, "DAdaptAdam": DAdaptAdam, "Lion": Lion, "Adafactor": Adafactor,
              "CAME": CAME, "AdamWScheduleFree": AdamWScheduleFree}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag in ("--inputs", "--config", "--out"):
        parser.add_argument(flag, required=True)
    args = parser.parse_args()
    with open(args.config) as f:
        cfg = json.load(f)
    inputs = load_file(args.inputs)
    params = {}
    for key, value in inputs.items():
        if key.startswith("param."):
            params[int(key.split(".")[1])] = value.clone().requires_grad_(True)
    kwargs = dict(cfg["kwargs"])
    for key in ("betas", "eps"):
        if isinstance(kwargs.get(key), list):
            kwargs[key] = tuple(kwargs[key])
    relative = cfg["optimizer"] == "Adafactor" and kwargs.get("relative_step", True)
    groups = [{"params": [params[i] for i in g], "lr": inputs[f"lr.{n}"][0].item()}
              for n, g in enumerate(cfg["groups"])]
    if relative:
        for group in groups:
            del group["lr"]
    # kohya constructs with lr=--learning_rate beside the groups' own rates (None for a
    # relative-step Adafactor).
    optimizer = OPTIMIZERS[cfg["optimizer"]](groups, lr=None if relative else groups[0]["lr"],
                                             **kwargs)
    schedule_free = hasattr(optimizer, "eval")
    if schedule_free:
        optimizer.train()
    ds = []
    for step in range(cfg["steps"]):
        for n, group in enumerate(optimizer.param_groups):
            if not relative:
                group["lr"] = inputs[f"lr.{n}"][step].item()
        for i, p in params.items():
            grad = inputs.get(f"grad.{step}.{i}")
            p.grad = None if grad is None else grad.clone()
        optimizer.step()
        if "d" in optimizer.param_groups[0]:
            ds.append(optimizer.param_groups[0]["d"])
    out = {f"param.{i}": p.detach().clone().contiguous() for i, p in params.items()}
    if ds:
        out["d"] = torch.tensor(ds, dtype=torch.float64)
    if schedule_free:
        optimizer.eval()
        out.update({f"eval.{i}": p.detach().clone().contiguous() for i, p in params.items()})
        optimizer.train()
        out.update({f"train.{i}": p.detach().clone().contiguous() for i, p in params.items()})
    save_file(out, args.out)


if __name__ == "__main__":
    main()
