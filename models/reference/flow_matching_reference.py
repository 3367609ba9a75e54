#!/usr/bin/env python3
"""Reference draws and losses of kohya's Flux flow-matching objective for
models/flow_matching_test.cpp.

    flow_matching_reference.py OUT_DIR

For each case in CASES (kohya's --timestep_sampling, --weighting_scheme, --discrete_flow_shift,
--sigmoid_scale, --logit_mean/--logit_std, --mode_scale, --model_prediction_type), from a CPU
generator seeded 77, a batch of 8 on latents of 64x48 (flux_shift's 768 packed tokens), as
library/flux_train_utils.py get_noisy_model_input_and_timesteps draws it: diffusers'
compute_density_for_timestep_sampling and FlowMatchEulerDiscreteScheduler (the real ones) for
--timestep_sampling sigma, kohya's formulas written out for the other modes. Then, on fixed
latents x0, noise and a model output:
  sigma [8]          the drawn noise levels (kohya's sigmas, or its t)
  noisy              (1 - sigma) x0 + sigma noise
  target             noise - x0
  prediction         apply_model_prediction_type's model_pred
  weight [8]         its weighting (compute_loss_weighting_for_sd3 in sigma_scaled mode), 1 else
OUT_DIR/cases.json lists the cases; OUT_DIR/<index>.safetensors holds each one's tensors, and
OUT_DIR/inputs.safetensors x0, noise and output.
"""
import json
import math
import os
import sys

import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.training_utils import compute_density_for_timestep_sampling, compute_loss_weighting_for_sd3
from safetensors.torch import save_file

BASE = dict(timestep_sampling="sigma", weighting_scheme="none", discrete_flow_shift=3.0,
            sigmoid_scale=1.0, logit_mean=0.0, logit_std=1.0, mode_scale=1.29,
            model_prediction_type="sigma_scaled")
CASES = [
    dict(),
    dict(weighting_scheme="logit_normal", logit_mean=0.3, logit_std=1.4),
    dict(weighting_scheme="mode", mode_scale=1.29, discrete_flow_shift=1.0),
    dict(weighting_scheme="sigma_sqrt"),
    dict(weighting_scheme="cosmap", discrete_flow_shift=3.1582),
    dict(weighting_scheme="uniform"),  # kohya's current default, "none" by another name
    dict(timestep_sampling="uniform", model_prediction_type="raw"),
    dict(timestep_sampling="sigmoid", sigmoid_scale=1.7, model_prediction_type="additive"),
    dict(timestep_sampling="shift", discrete_flow_shift=3.1582, model_prediction_type="raw"),
    dict(timestep_sampling="shift", sigmoid_scale=0.5, discrete_flow_shift=0.5,
         model_prediction_type="sigma_scaled", weighting_scheme="cosmap"),
    dict(timestep_sampling="flux_shift", model_prediction_type="raw"),
]
BATCH, H, W = 8, 64, 48


def draw(a, gen):
    if a["timestep_sampling"] in ("uniform", "sigmoid"):
        if a["timestep_sampling"] == "sigmoid":
            return torch.sigmoid(a["sigmoid_scale"] * torch.randn((BATCH,), generator=gen))
        return torch.rand((BATCH,), generator=gen)
    if a["timestep_sampling"] == "shift":
        shift = a["discrete_flow_shift"]
        t = (torch.randn(BATCH, generator=gen) * a["sigmoid_scale"]).sigmoid()
        return (t * shift) / (1 + (shift - 1) * t)
    if a["timestep_sampling"] == "flux_shift":
        t = (torch.randn(BATCH, generator=gen) * a["sigmoid_scale"]).sigmoid()
        x1, y1, x2, y2 = 256, 0.5, 4096, 1.15  # get_lin_function
        m = (y2 - y1) / (x2 - x1)
        mu = m * ((H // 2) * (W // 2)) + (y1 - m * x1)
        return math.exp(mu) / (math.exp(mu) + (1 / t - 1) ** 1.0)  # time_shift(mu, 1.0, t)
    u = compute_density_for_timestep_sampling(
        weighting_scheme=a["weighting_scheme"], batch_size=BATCH, logit_mean=a["logit_mean"],
        logit_std=a["logit_std"], mode_scale=a["mode_scale"], generator=gen)
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=a["discrete_flow_shift"])
    indices = (u * scheduler.config.num_train_timesteps).long()
    timesteps = scheduler.timesteps[indices]
    # kohya's get_sigmas: each timestep's index in the schedule, its sigma.
    step = [(scheduler.timesteps == t).nonzero().item() for t in timesteps]
    return scheduler.sigmas[step].flatten()


def main() -> None:
    out = sys.argv[1]
    g = torch.Generator().manual_seed(3)
    x0 = torch.randn(BATCH, 4, 3, 2, generator=g)
    noise = torch.randn(BATCH, 4, 3, 2, generator=g)
    output = torch.randn(BATCH, 4, 3, 2, generator=g)
    save_file({"x0": x0, "noise": noise, "output": output}, os.path.join(out, "inputs.safetensors"))
    cases = []
    for i, case in enumerate(CASES):
        a = dict(BASE, **case)
        sigma = draw(a, torch.Generator().manual_seed(77)).float()
        s = sigma.view(-1, 1, 1, 1)
        noisy = (1 - s) * x0 + s * noise
        weight = torch.ones(BATCH)
        if a["model_prediction_type"] == "additive":
            prediction = output + noisy
        elif a["model_prediction_type"] == "sigma_scaled":
            prediction = output * (-s) + noisy
            weight = compute_loss_weighting_for_sd3(a["weighting_scheme"], sigma)
        else:
            prediction = output
        save_file({"sigma": sigma, "noisy": noisy, "target": noise - x0, "prediction": prediction,
                   "weight": weight.float().contiguous()}, os.path.join(out, f"{i}.safetensors"))
        cases.append(a)
    with open(os.path.join(out, "cases.json"), "w") as f:
        json.dump(cases, f, indent=1)


if __name__ == "__main__":
    main()
