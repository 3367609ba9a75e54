#pragma once
// The diffusion side of a training step, as diffusers' DDPMScheduler and kohya sd-scripts'
// library/train_util.py + custom_train_functions.py compute it: the noise schedule, noising,
// targets, kohya's noise options and loss weights.

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>

#include "models/family.h"

namespace lorapipe::trainer {

// The family's DDPM training schedule (ModelFamily::schedule, its table from models/ddpm.h:
// diffusers' DDPMScheduler with scaled_linear betas), with kohya's options on top.
//
// `zero_terminal_snr` (kohya's --zero_terminal_snr; Lin et al. 2023, arXiv 2305.08891) rescales
// the betas so that sqrt(alphas_cumprod) keeps its first value and ends at exactly 0: the last
// timestep is pure noise, as at the start of sampling. It is diffusers' rescale_zero_terminal_snr
// (DDPMScheduler(rescale_betas_zero_snr=True)), which kohya's fix_noise_scheduler_betas_for_
// zero_terminal_snr repeats. Noising and the v target use the rescaled schedule; snr() keeps the
// original one, because kohya computes its all_snr (prepare_scheduler_for_custom_training) before
// it rescales, so min-SNR and the other SNR weightings stay finite at the last timestep.
class NoiseSchedule {
 public:
  explicit NoiseSchedule(const models::DdpmSchedule& schedule, bool zero_terminal_snr = false);

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
at::Tensor min_snr_weight(const NoiseSchedule& schedule, const at::Tensor& timesteps, double gamma,
                          bool v_prediction);

// kohya get_snr_scale: snr / (snr + 1) with snr capped at 1000 (it is infinite at t = 0), the
// factor that --scale_v_pred_loss_like_noise_pred multiplies by and --v_pred_like_loss divides
// by.
at::Tensor snr_scale(const NoiseSchedule& schedule, const at::Tensor& timesteps);
// kohya apply_debiased_estimation: 1 / sqrt(snr) for epsilon, 1 / (snr + 1) for v-prediction,
// snr capped at 1000.
at::Tensor debiased_estimation_weight(const NoiseSchedule& schedule, const at::Tensor& timesteps,
                                      bool v_prediction);

struct NoiseOptions {
  double noise_offset = 0;              // --noise_offset
  bool noise_offset_random_strength = false;
  double adaptive_noise_scale = 0;      // --adaptive_noise_scale (0: off)
  int multires_noise_iterations = 0;    // --multires_noise_iterations (0: off)
  double multires_noise_discount = 0.3;
  double ip_noise_gamma = 0;            // --ip_noise_gamma: input perturbation (0: off)
  bool ip_noise_gamma_random_strength = false;
  int64_t min_timestep = 0;             // --min_timestep
  int64_t max_timestep = 1000;          // --max_timestep (exclusive, as kohya's randint)
};

// The noise kohya's get_noise_noisy_latents_and_timesteps draws for `latents`, every random
// number from `generator`, in kohya's order: randn_like(latents); with noise_offset, the offset
// strength (rand(1) * offset with random strength) and kohya's apply_noise_offset
// (noise + offset * randn(B, C, 1, 1), offset grown by adaptive_noise_scale * |mean(latents)|);
// with multires noise, kohya's pyramid_noise_like.
at::Tensor draw_noise(const at::Tensor& latents, const NoiseOptions& options,
                      at::Generator generator);
// The side of multires (pyramid) noise level `level` with ratio `r` on a latent side `full`:
// kohya's max(1, int(full / r**level)), always of the full side (levels do not compound).
int64_t pyramid_level_size(int64_t full, double r, int level);

// Uniform timesteps in [min_timestep, max_timestep), [batch] int64.
at::Tensor draw_timesteps(int64_t batch, const NoiseOptions& options, at::Generator generator,
                          const at::Device& device);

// kohya's input perturbation (--ip_noise_gamma): the noise the latents are noised with,
// `noise` + strength x randn (strength rand(1) x gamma with random strength), drawn from
// `generator` after the noise and the timesteps, as kohya draws it; the target keeps `noise`.
// Undefined when ip_noise_gamma is 0.
at::Tensor draw_input_noise(const at::Tensor& noise, const NoiseOptions& options,
                            at::Generator generator);

// kohya apply_noise_offset with a given offset draw `offset_noise` [B, C, 1, 1].
at::Tensor apply_noise_offset(const at::Tensor& noise, const at::Tensor& latents,
                              const at::Tensor& offset_noise, double noise_offset,
                              double adaptive_noise_scale);

// kohya conditional_loss with reduction "none", per element: l2 (squared error), l1, huber
// (2c(sqrt(d^2 + c^2) - c)), smooth_l1 (2(sqrt(d^2 + c^2) - c)); `huber_c` [B,1,1,1] or scalar.
at::Tensor elementwise_loss(const at::Tensor& prediction, const at::Tensor& target,
                            const std::string& loss_type, const at::Tensor& huber_c);
// kohya get_huber_threshold_if_needed: the per-sample c for huber / smooth_l1 under
// `schedule` "constant", "exponential" or "snr"; [B,1,1,1] fp32.
at::Tensor huber_threshold(const NoiseSchedule& noise, const at::Tensor& timesteps,
                           const std::string& schedule, double huber_c, double huber_scale);

}  // namespace lorapipe::trainer
