#pragma once
// The DDPM noise table of a family (ModelFamily::schedule), built once here for the trainer's
// objective and the sampler's schedulers alike: diffusers' DDPMScheduler with
// beta_schedule="scaled_linear", betas = linspace(sqrt(beta_start), sqrt(beta_end), steps)^2 in
// fp32, alphas_cumprod = cumprod(1 - betas) in fp32, with the same LibTorch ops on the CPU so the
// tables equal diffusers' bit for bit. Also the DDPM families' training objective
// (models/objective.h): kohya's train_network.py for SD1.x.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>

#include "models/family.h"
#include "models/objective.h"

namespace lorapipe::models {

at::Tensor ddpm_betas(const DdpmSchedule& schedule);           // [steps] fp32, CPU
at::Tensor ddpm_alphas_cumprod(const DdpmSchedule& schedule);  // [steps] fp32, CPU

// The family's DDPM training schedule with kohya's options on top.
//
// `zero_terminal_snr` (kohya's --zero_terminal_snr; Lin et al. 2023, arXiv 2305.08891) rescales
// the betas so that sqrt(alphas_cumprod) keeps its first value and ends at exactly 0: the last
// timestep is pure noise, as at the start of sampling. It is diffusers' rescale_zero_terminal_snr
// (DDPMScheduler(rescale_betas_zero_snr=True)), which kohya's fix_noise_scheduler_betas_for_
// zero_terminal_snr repeats. Noising and the v target use the rescaled schedule; snr() keeps the
// original one, because kohya computes its all_snr (prepare_scheduler_for_custom_training) before
// it rescales, so min-SNR and the other SNR weightings stay finite at the last timestep.
class DdpmNoiseSchedule {
 public:
  explicit DdpmNoiseSchedule(const DdpmSchedule& schedule, bool zero_terminal_snr = false);

  int64_t num_train_timesteps() const { return steps_; }
  const at::Tensor& alphas_cumprod() const { return alphas_cumprod_; }  // [steps] fp32, CPU

  // DDPMScheduler.add_noise: sqrt(a_t) * latents + sqrt(1 - a_t) * noise, a_t cast to the
  // latents' dtype first, as diffusers does. `timesteps` [B] int64.
  at::Tensor add_noise(const at::Tensor& latents, const at::Tensor& noise,
                       const at::Tensor& timesteps) const;
  // DDPMScheduler.get_velocity: sqrt(a_t) * noise - sqrt(1 - a_t) * latents (the v target).
  at::Tensor velocity(const at::Tensor& latents, const at::Tensor& noise,
                      const at::Tensor& timesteps) const;
  // kohya's all_snr[t] = (sqrt(a_t) / sqrt(1 - a_t))^2 of the schedule before any zero-terminal
  // rescale, [B] fp32 on the timesteps' device.
  at::Tensor snr(const at::Tensor& timesteps) const;

 private:
  int64_t steps_;
  at::Tensor alphas_cumprod_;
  at::Tensor all_snr_;
};

// kohya apply_snr_weight: per-sample weight min(snr, gamma) / snr for epsilon, / (snr + 1) for
// v-prediction (Min-SNR weighting, Hang et al. 2023).
at::Tensor min_snr_weight(const DdpmNoiseSchedule& schedule, const at::Tensor& timesteps,
                          double gamma, bool v_prediction);
// kohya get_snr_scale: snr / (snr + 1) with snr capped at 1000 (it is infinite at t = 0), the
// factor that --scale_v_pred_loss_like_noise_pred multiplies by and --v_pred_like_loss divides
// by.
at::Tensor snr_scale(const DdpmNoiseSchedule& schedule, const at::Tensor& timesteps);
// kohya apply_debiased_estimation: 1 / sqrt(snr) for epsilon, 1 / (snr + 1) for v-prediction,
// snr capped at 1000.
at::Tensor debiased_estimation_weight(const DdpmNoiseSchedule& schedule,
                                      const at::Tensor& timesteps, bool v_prediction);

// kohya's validation timesteps (train_network.py): four, evenly inside [min_timestep,
// max_timestep] (np.linspace(min, max, 6, dtype=int)[1:-1]; 200, 400, 600, 800 by default).
std::vector<int64_t> kohya_validation_timesteps(int64_t min_timestep, int64_t max_timestep);

// The DDPM families' objective (ObjectiveKind::kDdpm): kohya's train_network.py for SD1.x.
// Timesteps uniform in [min_timestep, max_timestep); the latents noised by add_noise; the target
// the noise, or v with v_prediction; kohya's SNR weightings in its order (min-SNR,
// v-prediction-like scaling, v-prediction-like loss, debiased estimation); kohya's Huber
// thresholds (get_huber_threshold_if_needed).
std::unique_ptr<TrainingObjective> make_ddpm_objective(const ModelFamily& family,
                                                       const ObjectiveOptions& options);

}  // namespace lorapipe::models
