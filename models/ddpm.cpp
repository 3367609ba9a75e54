#include "models/ddpm.h"

#include <torch/torch.h>

#include <cmath>

#include "common/error.h"
#include "common/numbers.h"

namespace lorapipe::models {

at::Tensor ddpm_betas(const DdpmSchedule& s) {
  if (s.steps < 2 || !(s.beta_start > 0) || !(s.beta_end > s.beta_start) || s.beta_end >= 1) {
    throw Error("DDPM schedule: need 0 < beta_start < beta_end < 1 and at least 2 steps");
  }
  return torch::linspace(std::sqrt(s.beta_start), std::sqrt(s.beta_end), s.steps, torch::kFloat32)
      .pow(2);
}

at::Tensor ddpm_alphas_cumprod(const DdpmSchedule& s) {
  return torch::cumprod(1.0 - ddpm_betas(s), /*dim=*/0);
}

namespace {

at::Tensor per_sample(const at::Tensor& values, const at::Tensor& like) {
  at::Tensor v = values.to(like.device(), like.scalar_type()).flatten();
  while (v.dim() < like.dim()) v = v.unsqueeze(-1);
  return v;
}

}  // namespace

DdpmNoiseSchedule::DdpmNoiseSchedule(const DdpmSchedule& schedule, bool zero_terminal_snr)
    : steps_(schedule.steps) {
  const int64_t steps = schedule.steps;
  at::Tensor betas = ddpm_betas(schedule);
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

at::Tensor DdpmNoiseSchedule::add_noise(const at::Tensor& latents, const at::Tensor& noise,
                                        const at::Tensor& timesteps) const {
  const at::Tensor a = alphas_cumprod_.to(latents.device(), latents.scalar_type())
                           .index_select(0, timesteps.to(latents.device()));
  return per_sample(a.pow(0.5), latents) * latents + per_sample((1 - a).pow(0.5), latents) * noise;
}

at::Tensor DdpmNoiseSchedule::velocity(const at::Tensor& latents, const at::Tensor& noise,
                                       const at::Tensor& timesteps) const {
  const at::Tensor a = alphas_cumprod_.to(latents.device(), latents.scalar_type())
                           .index_select(0, timesteps.to(latents.device()));
  return per_sample(a.pow(0.5), latents) * noise - per_sample((1 - a).pow(0.5), latents) * latents;
}

at::Tensor DdpmNoiseSchedule::snr(const at::Tensor& timesteps) const {
  return all_snr_.index_select(0, timesteps.to(torch::kCPU)).to(timesteps.device());
}

at::Tensor min_snr_weight(const DdpmNoiseSchedule& schedule, const at::Tensor& timesteps,
                          double gamma, bool v_prediction) {
  const at::Tensor snr = schedule.snr(timesteps);
  const at::Tensor clipped = torch::minimum(snr, torch::full_like(snr, gamma));
  return (v_prediction ? clipped / (snr + 1) : clipped / snr).to(torch::kFloat32);
}

namespace {

at::Tensor capped_snr(const DdpmNoiseSchedule& schedule, const at::Tensor& timesteps) {
  const at::Tensor snr = schedule.snr(timesteps);
  return torch::minimum(snr, torch::ones_like(snr) * 1000);
}

}  // namespace

at::Tensor snr_scale(const DdpmNoiseSchedule& schedule, const at::Tensor& timesteps) {
  const at::Tensor snr = capped_snr(schedule, timesteps);
  return (snr / (snr + 1)).to(torch::kFloat32);
}

at::Tensor debiased_estimation_weight(const DdpmNoiseSchedule& schedule,
                                      const at::Tensor& timesteps, bool v_prediction) {
  const at::Tensor snr = capped_snr(schedule, timesteps);
  return (v_prediction ? 1 / (snr + 1) : 1 / torch::sqrt(snr)).to(torch::kFloat32);
}

std::vector<int64_t> kohya_validation_timesteps(int64_t min_timestep, int64_t max_timestep) {
  std::vector<int64_t> out;
  const double step = static_cast<double>(max_timestep - min_timestep) / 5.0;
  for (int k = 1; k <= 4; ++k) {
    out.push_back(static_cast<int64_t>(std::floor(static_cast<double>(min_timestep) + k * step)));
  }
  return out;
}

namespace {

// Python's repr of a float as kohya's metadata holds it, or "None" for 0 (an option left off).
std::string float_or_none(double v) {
  return v > 0 ? python_float_repr(v) : std::string("None");
}

class DdpmObjective final : public TrainingObjective {
 public:
  DdpmObjective(const ModelFamily& family, const ObjectiveOptions& options)
      : TrainingObjective(options), schedule_(family.schedule, options.zero_terminal_snr) {}

  at::Tensor draw_times(int64_t batch, at::Generator generator, const at::Device& device,
                        int64_t /*latent_height*/, int64_t /*latent_width*/) const override {
    const auto int64 = torch::TensorOptions().dtype(torch::kInt64);
    // kohya's get_timesteps: min == max is that one timestep, and draws no random number.
    if (options().min_timestep == options().max_timestep) {
      return at::full({batch}, options().max_timestep, int64).to(device);
    }
    return at::randint(options().min_timestep, options().max_timestep, {batch}, generator, int64)
        .to(device);
  }

  std::vector<ValidationPoint> validation_points(int64_t batch,
                                                 const at::Device& device) const override {
    std::vector<ValidationPoint> out;
    for (int64_t t : kohya_validation_timesteps(options().min_timestep, options().max_timestep)) {
      out.push_back({t, torch::full({batch}, t, torch::kInt64).to(device)});
    }
    return out;
  }

  at::Tensor noisy_latents(const at::Tensor& latents, const at::Tensor& noise,
                           const at::Tensor& times) const override {
    return schedule_.add_noise(latents, noise, times);
  }

  at::Tensor target(const at::Tensor& latents, const at::Tensor& noise,
                    const at::Tensor& times) const override {
    return options().v_prediction ? schedule_.velocity(latents, noise, times) : noise;
  }

  at::Tensor weighted(at::Tensor loss, const at::Tensor& times) const override {
    const ObjectiveOptions& o = options();
    // kohya train_network's order: min-SNR, v-prediction-like scaling, v-prediction-like loss,
    // debiased estimation.
    if (o.min_snr_gamma > 0) {
      loss = loss * min_snr_weight(schedule_, times, o.min_snr_gamma, o.v_prediction);
    }
    if (o.scale_v_pred_loss_like_noise_pred) loss = loss * snr_scale(schedule_, times);
    if (o.v_pred_like_loss > 0) {
      loss = loss + loss / snr_scale(schedule_, times) * o.v_pred_like_loss;
    }
    if (o.debiased_estimation_loss) {
      loss = debiased_estimation_weight(schedule_, times, o.v_prediction) * loss;
    }
    return loss;
  }

  at::Tensor huber_threshold(const at::Tensor& times) const override {
    const ObjectiveOptions& o = options();
    const at::Tensor t = times.to(torch::kCPU);
    at::Tensor c;
    if (o.huber_schedule == "exponential") {
      const double alpha =
          -std::log(o.huber_c) / static_cast<double>(schedule_.num_train_timesteps());
      c = torch::exp(-alpha * t.to(torch::kFloat32)) * o.huber_scale;
    } else if (o.huber_schedule == "snr") {
      const at::Tensor a = schedule_.alphas_cumprod().index_select(0, t);
      const at::Tensor sigmas = ((1.0 - a) / a).pow(0.5);
      c = (1 - o.huber_c) / (1 + sigmas).pow(2) + o.huber_c;
    } else {  // "constant" (check_objective_options refused the rest)
      c = torch::full({t.size(0)}, o.huber_c * o.huber_scale, torch::kFloat32);
    }
    return c.view({-1, 1, 1, 1}).to(times.device());
  }

  void write_metadata(std::map<std::string, std::string>& m) const override {
    const ObjectiveOptions& o = options();
    m["ss_v_parameterization"] = o.v_prediction ? "True" : "False";
    m["ss_min_snr_gamma"] = float_or_none(o.min_snr_gamma);
    m["ss_debiased_estimation"] = o.debiased_estimation_loss ? "True" : "False";
    m["ss_zero_terminal_snr"] = o.zero_terminal_snr ? "True" : "False";
    m["ss_huber_schedule"] = o.huber_schedule;
    m["ss_huber_scale"] = python_float_repr(o.huber_scale);
    m["ss_huber_c"] = python_float_repr(o.huber_c);
    m["modelspec.prediction_type"] = o.v_prediction ? "v" : "epsilon";
    if (o.min_timestep != 0 || o.max_timestep != 1000) {
      m["modelspec.timestep_range"] =
          std::to_string(o.min_timestep) + "," + std::to_string(o.max_timestep);
    }
  }

 private:
  DdpmNoiseSchedule schedule_;
};

}  // namespace

std::unique_ptr<TrainingObjective> make_ddpm_objective(const ModelFamily& family,
                                                       const ObjectiveOptions& options) {
  check_objective_options(options);
  // kohya's verify_training_args: each of these weighs one prediction type's loss like the
  // other's, so it means nothing (or weighs twice) with the other.
  if (options.scale_v_pred_loss_like_noise_pred && !options.v_prediction) {
    throw InputError("--scale_v_pred_loss_like_noise_pred scales a v-prediction loss and needs "
                     "--v_parameterization (kohya refuses it without)");
  }
  if (options.v_pred_like_loss > 0 && options.v_prediction) {
    throw InputError("--v_pred_like_loss adds a v-like loss to an epsilon model's and cannot be "
                     "used with --v_parameterization (kohya refuses it with)");
  }
  return std::make_unique<DdpmObjective>(family, options);
}

}  // namespace lorapipe::models
