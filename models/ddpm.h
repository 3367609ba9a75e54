#pragma once
// The DDPM noise table of a family (ModelFamily::schedule), built once here for the trainer's
// noising and the sampler's schedulers alike: diffusers' DDPMScheduler with
// beta_schedule="scaled_linear", betas = linspace(sqrt(beta_start), sqrt(beta_end), steps)^2 in
// fp32, alphas_cumprod = cumprod(1 - betas) in fp32, with the same LibTorch ops on the CPU so the
// tables equal diffusers' bit for bit.

#include <ATen/core/Tensor.h>

#include "models/family.h"

namespace lorapipe::models {

at::Tensor ddpm_betas(const DdpmSchedule& schedule);           // [steps] fp32, CPU
at::Tensor ddpm_alphas_cumprod(const DdpmSchedule& schedule);  // [steps] fp32, CPU

}  // namespace lorapipe::models
