#include "trainer/noise.h"

#include <torch/torch.h>

#include <cmath>

#include "common/error.h"
#include "models/ddpm.h"

namespace lorapipe::trainer {
namespace {

at::Tensor per_sample(const at::Tensor& values, const at::Tensor& like) {
  at::Tensor v = values.to(like.device(), like.scalar_type()).flatten();
  while (v.dim() < like.dim()) v = v.unsqueeze(-1);
  return v;
}

}  // namespace

NoiseSchedule::NoiseSchedule(const models::DdpmSchedule& schedule, bool zero_terminal_snr)
    : steps_(schedule.steps) {
  const int64_t steps = schedule.steps;
  at::Tensor betas = models::ddpm_betas(schedule);
  alphas_cumprod_ = torch::cumprod(1.0 - betas, /*dim=*/0);
  all_snr_ = (alphas_cumprod_.sqrt() / (1.0 - alphas_cumprod_).sqrt()).pow(2);
  if (!zero_terminal_snr) return;
  // Shift sqrt(alphas_cumprod) so its last value is 0, scale it back to its first value, and
  // turn it into betas again; each fp32 operation in diffusers' order, so the schedule is
  // diffusers' bit for bit.
  at::Tensor root = alphas_cumprod_.sqrt();
  const at::Tensor first = root[0].clone();
  const at::Tensor last = root[-1].clone();
  root = (root - last) * (first / (first - last));
  const at::Tensor bar = root.pow(2);
  const at::Tensor alphas = torch::cat({bar.narrow(0, 0, 1), bar.narrow(0, 1, steps - 1) /
                                                                 bar.narrow(0, 0, steps - 1)});
  betas = 1 - alphas;
  alphas_cumprod_ = torch::cumprod(1.0 - betas, /*dim=*/0);
}

at::Tensor NoiseSchedule::add_noise(const at::Tensor& latents, const at::Tensor& noise,
                                    const at::Tensor& timesteps) const {
  const at::Tensor a = alphas_cumprod_.to(latents.device(), latents.scalar_type())
                           .index_select(0, timesteps.to(latents.device()));
  return per_sample(a.pow(0.5), latents) * latents + per_sample((1 - a).pow(0.5), latents) * noise;
}

at::Tensor NoiseSchedule::velocity(const at::Tensor& latents, const at::Tensor& noise,
                                   const at::Tensor& timesteps) const {
  const at::Tensor a = alphas_cumprod_.to(latents.device(), latents.scalar_type())
                           .index_select(0, timesteps.to(latents.device()));
  return per_sample(a.pow(0.5), latents) * noise - per_sample((1 - a).pow(0.5), latents) * latents;
}

at::Tensor NoiseSchedule::snr(const at::Tensor& timesteps) const {
  return all_snr_.index_select(0, timesteps.to(torch::kCPU)).to(timesteps.device());
}

at::Tensor min_snr_weight(const NoiseSchedule& schedule, const at::Tensor& timesteps, double gamma,
                          bool v_prediction) {
  const at::Tensor snr = schedule.snr(timesteps);
  const at::Tensor clipped = torch::minimum(snr, torch::full_like(snr, gamma));
  return (v_prediction ? clipped / (snr + 1) : clipped / snr).to(torch::kFloat32);
}

namespace {

at::Tensor capped_snr(const NoiseSchedule& schedule, const at::Tensor& timesteps) {
  const at::Tensor snr = schedule.snr(timesteps);
  return torch::minimum(snr, torch::ones_like(snr) * 1000);
}

}  // namespace

at::Tensor snr_scale(const NoiseSchedule& schedule, const at::Tensor& timesteps) {
  const at::Tensor snr = capped_snr(schedule, timesteps);
  return (snr / (snr + 1)).to(torch::kFloat32);
}

at::Tensor debiased_estimation_weight(const NoiseSchedule& schedule, const at::Tensor& timesteps,
                                      bool v_prediction) {
  const at::Tensor snr = capped_snr(schedule, timesteps);
  return (v_prediction ? 1 / (snr + 1) : 1 / torch::sqrt(snr)).to(torch::kFloat32);
}

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

at::Tensor draw_timesteps(int64_t batch, const NoiseOptions& options, at::Generator generator,
                          const at::Device& device) {
  return at::randint(options.min_timestep, options.max_timestep, {batch}, generator,
                     torch::TensorOptions().dtype(torch::kInt64))
      .to(device);
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

at::Tensor huber_threshold(const NoiseSchedule& noise, const at::Tensor& timesteps,
                           const std::string& schedule, double huber_c, double huber_scale) {
  const at::Tensor t = timesteps.to(torch::kCPU);
  at::Tensor c;
  if (schedule == "exponential") {
    const double alpha = -std::log(huber_c) / static_cast<double>(noise.num_train_timesteps());
    c = torch::exp(-alpha * t.to(torch::kFloat32)) * huber_scale;
  } else if (schedule == "snr") {
    const at::Tensor a = noise.alphas_cumprod().index_select(0, t);
    const at::Tensor sigmas = ((1.0 - a) / a).pow(0.5);
    c = (1 - huber_c) / (1 + sigmas).pow(2) + huber_c;
  } else if (schedule == "constant") {
    c = torch::full({t.size(0)}, huber_c * huber_scale, torch::kFloat32);
  } else {
    throw InputError("--huber_schedule='" + schedule + "': use constant, exponential or snr");
  }
  return c.view({-1, 1, 1, 1}).to(timesteps.device());
}

}  // namespace lorapipe::trainer
