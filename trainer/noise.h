#pragma once
// The noise of a training step, as kohya sd-scripts' library/train_util.py and
// custom_train_functions.py draw it (kohya's noise options), and kohya's element-wise losses.
// Where the noise is put (the noise point, the noisy input, the target, the weighting) is the
// family's training objective (models/objective.h).

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>

namespace lorapipe::trainer {

struct NoiseOptions {
  double noise_offset = 0;              // --noise_offset
  bool noise_offset_random_strength = false;
  double adaptive_noise_scale = 0;      // --adaptive_noise_scale (0: off)
  int multires_noise_iterations = 0;    // --multires_noise_iterations (0: off)
  double multires_noise_discount = 0.3;
  double ip_noise_gamma = 0;            // --ip_noise_gamma: input perturbation (0: off)
  bool ip_noise_gamma_random_strength = false;
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

}  // namespace lorapipe::trainer
