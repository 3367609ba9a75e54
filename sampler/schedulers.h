#pragma once
// The samplers of kohya's sample images, each step for step equal to the diffusers scheduler of
// the same name (diffusers 0.36) on the same model outputs, as kohya's train_util.get_my_scheduler
// picks them: DDIMScheduler (kohya's default), EulerDiscreteScheduler,
// EulerAncestralDiscreteScheduler, DPMSolverMultistepScheduler (DPM++ 2M and DPM-Solver 2M),
// DPMSolverSinglestepScheduler (DPM++ 2S), HeunDiscreteScheduler, KDPM2DiscreteScheduler,
// KDPM2AncestralDiscreteScheduler, LMSDiscreteScheduler, PNDMScheduler and DDPMScheduler, with
// epsilon or v-prediction, and Karras sigmas for Euler and DPM++ 2M. The noise table is the
// model family's (ModelFamily::schedule through models/ddpm.h, the one the trainer noises with).
//
// The arithmetic follows diffusers' code: the tables are built with the same LibTorch ops on the
// CPU, the scalars of a step are 0-dim fp32 tensors combined in diffusers' order, the timestep
// grids are computed in double as numpy does, so the samples agree to the last bit or nearly
// (SamplerParity states the tolerance). Schedulers are built as kohya builds them (straight from
// the constructor, then clip_sample switched on where the class has it), which for DDIM means
// steps_offset 0, a final alpha of 1 and x0 clamped to [-1, 1], for Heun and DDPM x0 clamped
// too, and for PNDM its Runge-Kutta warm-up (skip_prk_steps off). The SD1.5 config's DDIM
// (steps_offset 1, final alpha = alphas_cumprod[0], no clamp) is an option. kohya's "dpmsolver"
// arguments are refused by diffusers 0.36 (a final sigma of 0 needs dpmsolver++): it ends at
// sigma_min, as diffusers asks and as diffusers did before it had the choice.
//
// Heun, DPM2 and PNDM call the model more often than their step count (2 * steps - 1, and
// steps + 9): timesteps() has one entry per model call and step() is called once per entry.

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>

#include <memory>
#include <string>
#include <vector>

#include "models/family.h"

namespace lorapipe::sampler {

enum class SamplerKind {
  kDdim,
  kEuler,
  kEulerAncestral,
  kDpmSolverPlusPlus,  // DPM++ 2M
  kDpmSolver,          // DPM-Solver 2M (kohya's "dpmsolver")
  kDpmSingle,          // DPM++ 2S, single-step (kohya's "dpmsingle")
  kHeun,
  kDpm2,
  kDpm2Ancestral,
  kLms,
  kPndm,
  kDdpm,
};

struct SchedulerOptions {
  SamplerKind kind = SamplerKind::kDdim;
  // The family's training schedule (ModelFamily::schedule): its table, over 1000 steps.
  models::DdpmSchedule schedule;
  bool v_prediction = false;
  bool karras = false;  // Euler and DPM++ 2M: Karras et al.'s sigmas (rho 7)
  // DDIM only. kohya's: offset 0, final alpha 1; diffusers' SD1.5 config: 1, false.
  int steps_offset = 0;
  bool set_alpha_to_one = true;
  // DDIM, Heun and DDPM: x0 clamped to [-1, 1], as kohya switches it on.
  bool clip_sample = true;
};

// kohya's --sample_sampler / --ss names: "ddim", "euler" / "k_euler", "euler_a" / "k_euler_a",
// "dpmsolver++", "dpmsolver", "dpmsingle", "heun", "dpm_2" / "k_dpm_2", "dpm_2_a" / "k_dpm_2_a",
// "lms" / "k_lms", "pndm", "ddpm"; and "euler_karras", "dpmsolver++_karras" for Karras sigmas.
// Throws InputError naming an unknown sampler and listing these.
SchedulerOptions scheduler_options(const std::string& name, bool v_prediction,
                                   const models::DdpmSchedule& schedule = {});
std::vector<std::string> sampler_names();

// One sampler, behind the one interface the renderer calls; make_scheduler() builds the one
// SchedulerOptions::kind names. Each is a class of its own: the timestep samplers DDIM, DDPM and
// PNDM (sampler/scheduler_timesteps.cpp), the DPM-Solvers (sampler/scheduler_dpm_solver.cpp) and
// the sigma-based K-samplers Euler, Euler ancestral, Heun, DPM2, DPM2 ancestral and LMS
// (sampler/scheduler_k.cpp). A flow-matching family's samplers arrive as more classes.
class Scheduler {
 public:
  virtual ~Scheduler() = default;

  int steps() const { return steps_; }
  // How many times the model is called: steps(), or more for Heun, DPM2 and PNDM.
  int calls() const { return static_cast<int>(timesteps_.size(0)); }
  // The timestep the denoiser gets at each call: int64 (DDIM, DPM-Solver, PNDM, DDPM) or fp32
  // (the sigma-based K-samplers), [calls()].
  const at::Tensor& timesteps() const { return timesteps_; }
  // The sigma table for the sigma-based kinds, as diffusers holds it (for Heun and DPM2 with the
  // inner sigmas repeated, one per call and one more); undefined for DDIM, PNDM and DDPM.
  const at::Tensor& sigmas() const { return sigmas_; }
  // The initial noise is randn * init_noise_sigma().
  double init_noise_sigma() const { return init_noise_sigma_; }
  // The denoiser's input at call `index` (the K-samplers divide by sqrt(sigma^2 + 1)).
  virtual at::Tensor scale_model_input(const at::Tensor& sample, int index) const {
    (void)index;
    return sample;
  }
  // The sample after call `index` (0-based, in order), from the model's output there (after
  // classifier-free guidance). `generator` feeds the noise of Euler ancestral, DPM2 ancestral and
  // DDPM (drawn on the CPU and moved, as diffusers' randn_tensor does with a CPU generator); the
  // others draw none.
  at::Tensor step(const at::Tensor& model_output, int index, const at::Tensor& sample,
                  at::Generator generator);

 protected:
  // Checks what every sampler needs (1 to 1000 steps, Karras sigmas only where they apply, the
  // family's 1000-step table) and builds the family's alphas_cumprod. Throws InputError.
  Scheduler(const SchedulerOptions& options, int steps);
  virtual at::Tensor step_at(const at::Tensor& model_output, int index, const at::Tensor& sample,
                             at::Generator generator) = 0;

  SchedulerOptions options_;
  int steps_;
  at::Tensor alphas_cumprod_;  // [1000] fp32, the family's (models/ddpm.h)
  at::Tensor timesteps_, sigmas_;
  double init_noise_sigma_ = 1.0;
};

// The sampler `options.kind` names, for `steps` denoising steps (>= 1; PNDM >= 4). Throws
// InputError otherwise.
std::unique_ptr<Scheduler> make_scheduler(const SchedulerOptions& options, int steps);

}  // namespace lorapipe::sampler
