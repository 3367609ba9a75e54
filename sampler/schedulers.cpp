#include "sampler/schedulers.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>

#include "common/error.h"

namespace lorapipe::sampler {
namespace {

constexpr int kTrainSteps = 1000;

// numpy.interp(x, arange(1000), table) for x in [0, 999], in double (table read as double).
double interp(double x, const at::Tensor& table) {
  const auto* fp = table.data_ptr<float>();
  const auto j = static_cast<int64_t>(std::floor(x));
  if (j >= kTrainSteps - 1) return fp[kTrainSteps - 1];
  if (x == static_cast<double>(j)) return fp[j];
  const double lo = fp[j], hi = fp[j + 1];
  return (hi - lo) / 1.0 * (x - static_cast<double>(j)) + lo;
}

// Karras et al. (2022) sigmas between the table's ends, rho 7 (diffusers _convert_to_karras).
std::vector<double> karras_sigmas(double sigma_min, double sigma_max, int steps) {
  const double rho = 7.0;
  const double min_inv_rho = std::pow(sigma_min, 1.0 / rho);
  const double max_inv_rho = std::pow(sigma_max, 1.0 / rho);
  std::vector<double> out(steps);
  for (int i = 0; i < steps; ++i) {
    // numpy.linspace(0, 1, steps): i * (1 / (steps - 1)), the last exactly 1.
    const double ramp = steps == 1 ? 0.0 : (i == steps - 1 ? 1.0 : i * (1.0 / (steps - 1)));
    out[i] = std::pow(max_inv_rho + ramp * (min_inv_rho - max_inv_rho), rho);
  }
  return out;
}

// diffusers _sigma_to_t: the fractional timestep whose log-sigma interpolates to log(sigma).
// `log_sigmas` are the fp32 logs of the table; the denominator is an fp32 difference, as there.
double sigma_to_t(double sigma, const at::Tensor& log_sigmas) {
  const auto* ls = log_sigmas.data_ptr<float>();
  const double log_sigma = std::log(std::max(sigma, 1e-10));
  // The last index whose log-sigma is not above log(sigma) (0 when none), as numpy's
  // cumsum(dists >= 0).argmax() finds it on the ascending table.
  int low = 0;
  for (int i = 0; i < kTrainSteps; ++i) {
    if (log_sigma - static_cast<double>(ls[i]) >= 0.0) low = i;
  }
  low = std::min(low, kTrainSteps - 2);
  const int high = low + 1;
  const float denominator = ls[low] - ls[high];
  double w = (static_cast<double>(ls[low]) - log_sigma) / static_cast<double>(denominator);
  w = std::clamp(w, 0.0, 1.0);
  return (1.0 - w) * low + w * high;
}

at::Tensor scalar_tensor(double v) { return torch::tensor(static_cast<float>(v), torch::kFloat32); }

}  // namespace

std::vector<std::string> sampler_names() {
  return {"ddim",
          "euler",
          "k_euler",
          "euler_a",
          "k_euler_a",
          "dpmsolver++",
          "dpmsolver++_karras",
          "euler_karras"};
}

bool is_kohya_sampler_not_implemented(const std::string& name) {
  for (const char* kohya : {"ddpm", "pndm", "lms", "k_lms", "heun", "dpm_2", "k_dpm_2", "dpm_2_a",
                            "k_dpm_2_a", "dpmsolver", "dpmsingle"}) {
    if (name == kohya) return true;
  }
  return false;
}

SchedulerOptions scheduler_options(const std::string& name, bool v_prediction) {
  SchedulerOptions o;
  o.v_prediction = v_prediction;
  if (name == "ddim") {
    o.kind = SamplerKind::kDdim;
  } else if (name == "euler" || name == "k_euler") {
    o.kind = SamplerKind::kEuler;
  } else if (name == "euler_karras") {
    o.kind = SamplerKind::kEuler;
    o.karras = true;
  } else if (name == "euler_a" || name == "k_euler_a") {
    o.kind = SamplerKind::kEulerAncestral;
  } else if (name == "dpmsolver++" || name == "dpmsolver++_karras") {
    o.kind = SamplerKind::kDpmSolverPlusPlus;
    o.karras = name == "dpmsolver++_karras";
  } else {
    std::string known;
    for (const std::string& n : sampler_names()) known += (known.empty() ? "" : ", ") + n;
    throw InputError("unknown sampler '" + name + "' (known: " + known + ")");
  }
  return o;
}

Scheduler::Scheduler(const SchedulerOptions& options, int steps)
    : options_(options), steps_(steps) {
  if (steps < 1 || steps > kTrainSteps) {
    throw InputError("sampling steps must be 1 to 1000, got " + std::to_string(steps));
  }
  if (options.karras &&
      (options.kind == SamplerKind::kDdim || options.kind == SamplerKind::kEulerAncestral)) {
    throw InputError("Karras sigmas apply to euler and dpmsolver++ only");
  }
  // diffusers' scaled_linear schedule, with the same ops on the CPU (linspace of square roots in
  // fp32, squared; cumprod).
  const at::Tensor betas =
      torch::linspace(std::sqrt(0.00085), std::sqrt(0.012), kTrainSteps, torch::kFloat32).pow(2);
  alphas_cumprod_ = torch::cumprod(1.0 - betas, 0);
  final_alpha_cumprod_ = options.set_alpha_to_one ? scalar_tensor(1.0) : alphas_cumprod_[0];
  const at::Tensor train_sigmas = ((1 - alphas_cumprod_) / alphas_cumprod_).pow(0.5).contiguous();

  if (options.kind == SamplerKind::kDdim) {
    // "leading" spacing: every (1000 / steps)-th timestep from the top, plus the offset.
    const int64_t ratio = kTrainSteps / steps;
    std::vector<int64_t> t(steps);
    for (int i = 0; i < steps; ++i) t[i] = (steps - 1 - i) * ratio + options.steps_offset;
    timesteps_ = torch::tensor(t, torch::kInt64);
    init_noise_sigma_ = 1.0;
    return;
  }

  const at::Tensor log_sigmas = train_sigmas.log().contiguous();
  std::vector<double> sigmas;
  std::vector<double> times;
  if (options.kind == SamplerKind::kDpmSolverPlusPlus) {
    if (options.karras) {
      const double sigma_min = train_sigmas[0].item<float>();
      const double sigma_max = train_sigmas[kTrainSteps - 1].item<float>();
      sigmas = karras_sigmas(sigma_min, sigma_max, steps);
      for (double s : sigmas) times.push_back(std::nearbyint(sigma_to_t(s, log_sigmas)));
    } else {
      // numpy.linspace(0, 999, steps + 1).round()[::-1][:-1]: round half to even.
      for (int k = steps; k >= 1; --k) {
        const double y = k == steps ? 999.0 : k * (999.0 / steps);
        times.push_back(std::nearbyint(y));
      }
      for (double t : times) sigmas.push_back(interp(t, train_sigmas));
    }
    std::vector<int64_t> t64(times.begin(), times.end());
    timesteps_ = torch::tensor(t64, torch::kInt64);
    init_noise_sigma_ = 1.0;
  } else {
    // Euler and Euler ancestral: numpy.linspace(0, 999, steps, dtype=float32)[::-1].
    std::vector<float> grid(steps);
    for (int i = 0; i < steps; ++i) {
      const double y = steps == 1 ? 0.0 : (i == steps - 1 ? 999.0 : i * (999.0 / (steps - 1)));
      grid[steps - 1 - i] = static_cast<float>(y);
    }
    for (float t : grid) sigmas.push_back(interp(t, train_sigmas));
    std::vector<float> t32(grid);
    if (options.karras) {
      sigmas = karras_sigmas(sigmas.back(), sigmas.front(), steps);
      t32.clear();
      for (double s : sigmas) t32.push_back(static_cast<float>(sigma_to_t(s, log_sigmas)));
    }
    timesteps_ = torch::tensor(t32, torch::kFloat32);
  }
  std::vector<float> s32;
  for (double s : sigmas) s32.push_back(static_cast<float>(s));
  s32.push_back(0.f);  // final_sigmas_type "zero"
  sigmas_ = torch::tensor(s32, torch::kFloat32);
  if (options.kind != SamplerKind::kDpmSolverPlusPlus) {
    init_noise_sigma_ = sigmas_.max().item<float>();
  }
}

at::Tensor Scheduler::scale_model_input(const at::Tensor& sample, int index) const {
  if (options_.kind != SamplerKind::kEuler && options_.kind != SamplerKind::kEulerAncestral) {
    return sample;
  }
  const at::Tensor sigma = sigmas_[index];
  return sample / (sigma.pow(2) + 1).pow(0.5);
}

at::Tensor Scheduler::step(const at::Tensor& model_output, int index, const at::Tensor& sample,
                           at::Generator generator) {
  TORCH_CHECK(index >= 0 && index < steps_, "step ", index, " of ", steps_);
  switch (options_.kind) {
    case SamplerKind::kDdim:
      return ddim_step(model_output, index, sample);
    case SamplerKind::kEuler:
      return euler_step(model_output, index, sample);
    case SamplerKind::kEulerAncestral:
      return euler_ancestral_step(model_output, index, sample, std::move(generator));
    case SamplerKind::kDpmSolverPlusPlus:
      return dpm_step(model_output, index, sample);
  }
  return {};
}

at::Tensor Scheduler::ddim_step(const at::Tensor& model_output, int index,
                                const at::Tensor& sample) const {
  // diffusers DDIMScheduler.step with eta 0 (no noise).
  const int64_t t = timesteps_[index].item<int64_t>();
  const int64_t prev_t = t - kTrainSteps / steps_;
  const at::Tensor a_t = alphas_cumprod_[t];
  const at::Tensor a_prev = prev_t >= 0 ? alphas_cumprod_[prev_t] : final_alpha_cumprod_;
  const at::Tensor b_t = 1 - a_t;
  at::Tensor x0, eps;
  if (options_.v_prediction) {
    x0 = a_t.pow(0.5) * sample - b_t.pow(0.5) * model_output;
    eps = a_t.pow(0.5) * model_output + b_t.pow(0.5) * sample;
  } else {
    x0 = (sample - b_t.pow(0.5) * model_output) / a_t.pow(0.5);
    eps = model_output;
  }
  if (options_.clip_sample) x0 = x0.clamp(-1.0, 1.0);
  const at::Tensor variance = ((1 - a_prev) / b_t) * (1 - a_t / a_prev);
  const at::Tensor std_dev = 0.0 * variance.pow(0.5);
  const at::Tensor direction = (1 - a_prev - std_dev.pow(2)).pow(0.5) * eps;
  return a_prev.pow(0.5) * x0 + direction;
}

at::Tensor Scheduler::predicted_original(const at::Tensor& model_output, const at::Tensor& sigma,
                                         const at::Tensor& sample) const {
  if (options_.v_prediction) {
    return model_output * (-sigma / (sigma.pow(2) + 1).pow(0.5)) + (sample / (sigma.pow(2) + 1));
  }
  return sample - sigma * model_output;
}

at::Tensor Scheduler::euler_step(const at::Tensor& model_output, int index,
                                 const at::Tensor& sample_in) const {
  // diffusers EulerDiscreteScheduler.step with s_churn 0: sigma_hat = sigma, no noise.
  const at::Tensor sample = sample_in.to(torch::kFloat32);
  const at::Tensor sigma = sigmas_[index];
  const at::Tensor sigma_hat = sigma * 1.0;
  const at::Tensor x0 = predicted_original(model_output, sigma_hat, sample);
  const at::Tensor derivative = (sample - x0) / sigma_hat;
  const at::Tensor dt = sigmas_[index + 1] - sigma_hat;
  return (sample + derivative * dt).to(model_output.scalar_type());
}

at::Tensor Scheduler::euler_ancestral_step(const at::Tensor& model_output, int index,
                                           const at::Tensor& sample_in,
                                           at::Generator generator) const {
  const at::Tensor sample = sample_in.to(torch::kFloat32);
  const at::Tensor sigma = sigmas_[index];
  const at::Tensor x0 = predicted_original(model_output, sigma, sample);
  const at::Tensor sigma_from = sigmas_[index], sigma_to = sigmas_[index + 1];
  const at::Tensor sigma_up =
      (sigma_to.pow(2) * (sigma_from.pow(2) - sigma_to.pow(2)) / sigma_from.pow(2)).pow(0.5);
  const at::Tensor sigma_down = (sigma_to.pow(2) - sigma_up.pow(2)).pow(0.5);
  const at::Tensor derivative = (sample - x0) / sigma;
  const at::Tensor dt = sigma_down - sigma;
  at::Tensor prev = sample + derivative * dt;
  // Drawn at every step, the last too (where sigma_up is 0), as diffusers does: the generator's
  // stream stays in step with a diffusers run.
  const at::Tensor noise = torch::randn(model_output.sizes(), generator,
                                        torch::TensorOptions().dtype(model_output.scalar_type()))
                               .to(model_output.device());
  prev = prev + noise * sigma_up;
  return prev.to(model_output.scalar_type());
}

at::Tensor Scheduler::dpm_step(const at::Tensor& model_output, int index,
                               const at::Tensor& sample_in) {
  // diffusers DPMSolverMultistepScheduler.step, dpmsolver++ of order 2 (midpoint): first order at
  // the first step and at the last (final_sigmas_type "zero"), second order between.
  auto alpha_sigma = [](const at::Tensor& sigma) {
    const at::Tensor alpha = 1 / (sigma.pow(2) + 1).pow(0.5);
    return std::pair{alpha, sigma * alpha};
  };
  const auto [alpha_s0, sigma_s0] = alpha_sigma(sigmas_[index]);
  at::Tensor m0 = options_.v_prediction ? alpha_s0 * sample_in - sigma_s0 * model_output
                                        : (sample_in - sigma_s0 * model_output) / alpha_s0;
  const at::Tensor m1 = previous_x0_;
  previous_x0_ = m0;
  const at::Tensor sample = sample_in.to(torch::kFloat32);
  const bool last = index == steps_ - 1;
  const auto [alpha_t, sigma_t] = alpha_sigma(sigmas_[index + 1]);
  const at::Tensor lambda_t = alpha_t.log() - sigma_t.log();
  const at::Tensor lambda_s0 = alpha_s0.log() - sigma_s0.log();
  const at::Tensor h = lambda_t - lambda_s0;
  at::Tensor prev;
  if (lower_order_count_ < 1 || last) {
    prev = (sigma_t / sigma_s0) * sample - (alpha_t * (torch::exp(-h) - 1.0)) * m0;
  } else {
    const auto [alpha_s1, sigma_s1] = alpha_sigma(sigmas_[index - 1]);
    const at::Tensor lambda_s1 = alpha_s1.log() - sigma_s1.log();
    const at::Tensor h_0 = lambda_s0 - lambda_s1;
    const at::Tensor r0 = h_0 / h;
    const at::Tensor d1 = (1.0 / r0) * (m0 - m1);
    prev = (sigma_t / sigma_s0) * sample - (alpha_t * (torch::exp(-h) - 1.0)) * m0 -
           0.5 * (alpha_t * (torch::exp(-h) - 1.0)) * d1;
  }
  if (lower_order_count_ < 2) ++lower_order_count_;
  return prev.to(model_output.scalar_type());
}

}  // namespace lorapipe::sampler
