#!/usr/bin/env python3
"""Reference for sampler/schedulers_test.cpp: diffusers' schedulers stepped on fixed model outputs.

    $LORAPIPE_PYTHON sampler/reference/schedulers_reference.py OUT_DIR

Each scheduler is built as kohya's train_util.get_my_scheduler builds it (the constructor with
SD's schedule, then clip_sample switched on where the class has it), except "ddim_sd15", which is
DDIMScheduler.from_config of the SD1.5 scheduler config, and "dpmsolver", whose kohya arguments
diffusers 0.36 refuses (algorithm_type "dpmsolver" with the default final sigma 0): it ends at
sigma_min, as diffusers' error asks and as diffusers did before it had the option. For every case it writes
OUT_DIR/<case>.safetensors: the timesteps, sigmas (if any), the initial sample (randn *
init_noise_sigma), the model output fed at each step (model_output.i, seeded, so the C++ side
reads rather than draws them), the scaled model input (input.i) and the sample after each step
(sample.i), one per model call (Heun, DPM2 and PNDM call the model more often than the step count).
The noise of the stochastic ones (Euler ancestral, DPM2 ancestral, DDPM) comes from
torch.Generator().manual_seed(NOISE_SEED), which the C++ side seeds the same way.
"""
import inspect
import sys
import warnings

import torch
from safetensors.torch import save_file

warnings.filterwarnings("ignore")
from diffusers import (DDIMScheduler, DDPMScheduler, DPMSolverMultistepScheduler,  # noqa: E402
                       DPMSolverSinglestepScheduler, EulerAncestralDiscreteScheduler,
                       EulerDiscreteScheduler, HeunDiscreteScheduler,
                       KDPM2AncestralDiscreteScheduler, KDPM2DiscreteScheduler,
                       LMSDiscreteScheduler, PNDMScheduler)

NOISE_SEED = 1234
SHAPE = (2, 4, 8, 8)
SD15 = {"_class_name": "PNDMScheduler", "beta_start": 0.00085, "beta_end": 0.012,
        "beta_schedule": "scaled_linear", "num_train_timesteps": 1000, "set_alpha_to_one": False,
        "skip_prk_steps": True, "steps_offset": 1, "clip_sample": False, "trained_betas": None}


def kohya(cls, v_prediction, **kwargs):
    """train_util.get_my_scheduler."""
    if v_prediction:
        kwargs["prediction_type"] = "v_prediction"
    scheduler = cls(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.0120,
                    beta_schedule="scaled_linear", **kwargs)
    if hasattr(scheduler.config, "clip_sample") and scheduler.config.clip_sample is False:
        scheduler.config.clip_sample = True
    return scheduler


def cases():
    for v in (False, True):
        tag = "_v" if v else ""
        yield "ddim" + tag, lambda v=v: kohya(DDIMScheduler, v)
        yield "euler" + tag, lambda v=v: kohya(EulerDiscreteScheduler, v)
        yield "euler_a" + tag, lambda v=v: kohya(EulerAncestralDiscreteScheduler, v)
        yield "dpmsolver++" + tag, lambda v=v: kohya(DPMSolverMultistepScheduler, v,
                                                     algorithm_type="dpmsolver++")
        yield "dpmsolver++_karras" + tag, lambda v=v: kohya(
            DPMSolverMultistepScheduler, v, algorithm_type="dpmsolver++", use_karras_sigmas=True)
        yield "euler_karras" + tag, lambda v=v: kohya(EulerDiscreteScheduler, v,
                                                      use_karras_sigmas=True)
        yield "heun" + tag, lambda v=v: kohya(HeunDiscreteScheduler, v)
        yield "dpm_2" + tag, lambda v=v: kohya(KDPM2DiscreteScheduler, v)
        yield "dpm_2_a" + tag, lambda v=v: kohya(KDPM2AncestralDiscreteScheduler, v)
        yield "lms" + tag, lambda v=v: kohya(LMSDiscreteScheduler, v)
        yield "pndm" + tag, lambda v=v: kohya(PNDMScheduler, v)
        yield "ddpm" + tag, lambda v=v: kohya(DDPMScheduler, v)
        yield "dpmsingle" + tag, lambda v=v: kohya(DPMSolverSinglestepScheduler, v)
        yield "dpmsolver" + tag, lambda v=v: kohya(DPMSolverMultistepScheduler, v,
                                                   algorithm_type="dpmsolver",
                                                   final_sigmas_type="sigma_min")
    yield "ddim_sd15", lambda: DDIMScheduler.from_config(SD15)


def run(make, steps, seed):
    scheduler = make()
    scheduler.set_timesteps(steps)
    data = torch.Generator().manual_seed(seed)
    noise = torch.Generator().manual_seed(NOISE_SEED)
    sample = torch.randn(SHAPE, generator=data) * scheduler.init_noise_sigma
    out = {"timesteps": scheduler.timesteps.clone(), "initial": sample.clone(),
           "init_noise_sigma": torch.tensor(float(scheduler.init_noise_sigma), dtype=torch.float64)}
    if hasattr(scheduler, "sigmas") and scheduler.sigmas is not None:
        out["sigmas"] = scheduler.sigmas.clone().float()
    for i, t in enumerate(scheduler.timesteps):
        out[f"input.{i}"] = scheduler.scale_model_input(sample, t).clone()
        model_output = torch.randn(SHAPE, generator=data)
        out[f"model_output.{i}"] = model_output
        takes_generator = "generator" in inspect.signature(scheduler.step).parameters
        extra = {"generator": noise} if takes_generator else {}
        sample = scheduler.step(model_output, t, sample, return_dict=False, **extra)[0]
        out[f"sample.{i}"] = sample.clone()
    return out


def main():
    folder = sys.argv[1]
    for name, make in cases():
        for steps in (20, 7):
            save_file({k: v.contiguous() for k, v in run(make, steps, seed=steps).items()},
                      f"{folder}/{name}_{steps}.safetensors")


if __name__ == "__main__":
    main()
