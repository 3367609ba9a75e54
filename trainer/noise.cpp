#include "trainer/noise.h"

#include <torch/torch.h>

#include <cmath>

#include "common/error.h"

namespace lorapipe::trainer {

at::Tensor apply_noise_offset(const at::Tensor& noise, const at::Tensor& latents,
                              const at::Tensor& offset_noise, double noise_offset,
                              double adaptive_noise_scale) {
  if (adaptive_noise_scale != 0) {
    const at::Tensor mean = latents.mean({2, 3}, /*keepdim=*/true).abs();
    const at::Tensor offset = (noise_offset + adaptive_noise_scale * mean).clamp_min(0.0);
    return noise + offset * offset_noise;
  }
  return noise + noise_offset * offset_noise;
}

at::Tensor draw_noise(const at::Tensor& latents, const NoiseOptions& options,
                      at::Generator generator) {
  const auto cpu = latents.options().device(torch::kCPU).dtype(torch::kFloat32);
  // Drawn on the CPU from our generator, so a run's numbers are the same on every device.
  at::Tensor noise = at::randn(latents.sizes(), generator, cpu);
  if (options.noise_offset != 0) {
    double offset = options.noise_offset;
    if (options.noise_offset_random_strength) {
      offset = at::rand({1}, generator, cpu).item<double>() * options.noise_offset;
    }
    const at::Tensor offset_noise =
        at::randn({latents.size(0), latents.size(1), 1, 1}, generator, cpu);
    noise = apply_noise_offset(noise, latents.to(torch::kCPU, torch::kFloat32), offset_noise,
                               offset, options.adaptive_noise_scale);
  }
  if (options.multires_noise_iterations > 0) {
    // kohya pyramid_noise_like: add bilinearly upsampled noise of shrinking size, each level
    // weighted discount^i, then renormalise to unit std.
    const int64_t b = noise.size(0), c = noise.size(1);
    const int64_t full_h = noise.size(2), full_w = noise.size(3);
    for (int i = 0; i < options.multires_noise_iterations; ++i) {
      const double r = at::rand({1}, generator, cpu).item<double>() * 2 + 2;
      const int64_t h = pyramid_level_size(full_h, r, i);
      const int64_t w = pyramid_level_size(full_w, r, i);
      const at::Tensor level = at::randn({b, c, h, w}, generator, cpu);
      noise = noise + at::upsample_bilinear2d(level, {full_h, full_w}, /*align_corners=*/false) *
                          std::pow(options.multires_noise_discount, i);
      if (h == 1 || w == 1) break;
    }
    noise = noise / noise.std();
  }
  return noise.to(latents.device(), latents.scalar_type());
}

at::Tensor draw_input_noise(const at::Tensor& noise, const NoiseOptions& options,
                            at::Generator generator) {
  if (options.ip_noise_gamma <= 0) return {};
  const auto cpu = torch::TensorOptions().dtype(torch::kFloat32);
  double strength = options.ip_noise_gamma;
  if (options.ip_noise_gamma_random_strength) {
    strength = at::rand({1}, generator, cpu).item<double>() * options.ip_noise_gamma;
  }
  return noise + strength * at::randn(noise.sizes(), generator, cpu).to(noise.device(),
                                                                         noise.scalar_type());
}

int64_t pyramid_level_size(int64_t full, double r, int level) {
  return std::max<int64_t>(1, static_cast<int64_t>(static_cast<double>(full) / std::pow(r, level)));
}

at::Tensor elementwise_loss(const at::Tensor& prediction, const at::Tensor& target,
                            const std::string& loss_type, const at::Tensor& huber_c) {
  const at::Tensor diff = prediction - target;
  if (loss_type == "l2") return diff.pow(2);
  if (loss_type == "l1") return diff.abs();
  if (loss_type == "huber") return 2 * huber_c * ((diff.pow(2) + huber_c.pow(2)).sqrt() - huber_c);
  if (loss_type == "smooth_l1") return 2 * ((diff.pow(2) + huber_c.pow(2)).sqrt() - huber_c);
  throw InputError("--loss_type='" + loss_type + "': use l2, l1, huber or smooth_l1");
}

}  // namespace lorapipe::trainer
