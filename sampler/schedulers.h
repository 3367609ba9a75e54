#pragma once
// The samplers of kohya's sample images, each step for step equal to the diffusers scheduler of
// the same name (diffusers 0.36) on the same model outputs: DDIMScheduler (kohya's default),
// EulerDiscreteScheduler, EulerAncestralDiscreteScheduler and DPMSolverMultistepScheduler
// (DPM++ 2M), with epsilon or v-prediction, and Karras sigmas for the last two kinds that have
// them. The noise schedule is SD's (scaled_linear 0.00085-0.012 over 1000 steps).
//
// The arithmetic follows diffusers' code: the tables are built with the same LibTorch ops on the
// CPU, the scalars of a step are 0-dim fp32 tensors combined in diffusers' order, the timestep
// grids are computed in double as numpy does, so the samples agree to the last bit or nearly
// (SamplerParity states the tolerance). Schedulers are built as kohya builds them
// (train_util.get_my_scheduler: straight from the constructor, then clip_sample on), which for
// DDIM means steps_offset 0, a final alpha of 1 and x0 clamped to [-1, 1]; the SD1.5 config's
// DDIM (steps_offset 1, final alpha = alphas_cumprod[0], no clamp) is an option.

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

namespace lorapipe::sampler {

enum class SamplerKind { kDdim, kEuler, kEulerAncestral, kDpmSolverPlusPlus };

struct SchedulerOptions {
  SamplerKind kind = SamplerKind::kDdim;
  bool v_prediction = false;
  bool karras = false;  // Euler and DPM++ 2M: Karras et al.'s sigmas (rho 7)
  // DDIM only. kohya's: offset 0, final alpha 1, clamp x0; diffusers' SD1.5 config: 1, false,
  // false.
  int steps_offset = 0;
  bool set_alpha_to_one = true;
  bool clip_sample = true;
};

// kohya's --sample_sampler / --ss names: "ddim", "euler" / "k_euler", "euler_a" / "k_euler_a",
// "dpmsolver++" (add "_karras" or pass `karras` for Karras sigmas, e.g. "dpmsolver++_karras").
// Throws InputError naming an unknown sampler and listing these.
SchedulerOptions scheduler_options(const std::string& name, bool v_prediction);
std::vector<std::string> sampler_names();
// The names kohya's get_my_scheduler knows that lorapipe does not implement (pndm, lms, heun,
// dpm_2, dpm_2_a, dpmsolver, dpmsingle, ddpm and their k_ forms; kohya renders them with
// diffusers' schedulers of those names): prompt files that ask for one render with ddim,
// kohya's default, and say so.
bool is_kohya_sampler_not_implemented(const std::string& name);

class Scheduler {
 public:
  // `steps` denoising steps (>= 1).
  Scheduler(const SchedulerOptions& options, int steps);

  int steps() const { return steps_; }
  // The timestep the denoiser gets at each step: int64 (DDIM, DPM++) or fp32 (Euler), [steps].
  const at::Tensor& timesteps() const { return timesteps_; }
  // sigma_0 .. sigma_steps (the last is 0) for the sigma-based kinds; undefined for DDIM.
  const at::Tensor& sigmas() const { return sigmas_; }
  // The initial noise is randn * init_noise_sigma().
  double init_noise_sigma() const { return init_noise_sigma_; }
  // The denoiser's input at step `index` (Euler's divide by sqrt(sigma^2 + 1)).
  at::Tensor scale_model_input(const at::Tensor& sample, int index) const;
  // The sample after step `index` (0-based, in order), from the model's output there (after
  // classifier-free guidance). `generator` feeds Euler ancestral's noise (drawn on the CPU and
  // moved, as diffusers' randn_tensor does with a CPU generator); the others draw none.
  at::Tensor step(const at::Tensor& model_output, int index, const at::Tensor& sample,
                  at::Generator generator);

 private:
  at::Tensor ddim_step(const at::Tensor& model_output, int index, const at::Tensor& sample) const;
  at::Tensor euler_step(const at::Tensor& model_output, int index, const at::Tensor& sample) const;
  at::Tensor euler_ancestral_step(const at::Tensor& model_output, int index,
                                  const at::Tensor& sample, at::Generator generator) const;
  at::Tensor dpm_step(const at::Tensor& model_output, int index, const at::Tensor& sample);
  // The x0 prediction at sigma for the sigma-based kinds.
  at::Tensor predicted_original(const at::Tensor& model_output, const at::Tensor& sigma,
                                const at::Tensor& sample) const;

  SchedulerOptions options_;
  int steps_;
  at::Tensor alphas_cumprod_;  // [1000] fp32
  at::Tensor final_alpha_cumprod_;
  at::Tensor timesteps_, sigmas_;
  double init_noise_sigma_ = 1.0;
  at::Tensor previous_x0_;  // DPM++ 2M's model output of the step before
  int lower_order_count_ = 0;
};

}  // namespace lorapipe::sampler
