#include "sampler/schedulers.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <utility>

#include "common/error.h"
#include "models/ddpm.h"

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
  return {"ddim",      "euler",   "k_euler", "euler_a",   "k_euler_a", "dpmsolver++",
          "dpmsolver", "dpmsingle", "heun",  "dpm_2",     "k_dpm_2",   "dpm_2_a",
          "k_dpm_2_a", "lms",     "k_lms",   "pndm",      "ddpm",      "euler_karras",
          "dpmsolver++_karras"};
}

SchedulerOptions scheduler_options(const std::string& name, bool v_prediction,
                                   const models::DdpmSchedule& schedule) {
  static const std::map<std::string, std::pair<SamplerKind, bool>> kinds = {
      {"ddim", {SamplerKind::kDdim, false}},
      {"euler", {SamplerKind::kEuler, false}},
      {"k_euler", {SamplerKind::kEuler, false}},
      {"euler_karras", {SamplerKind::kEuler, true}},
      {"euler_a", {SamplerKind::kEulerAncestral, false}},
      {"k_euler_a", {SamplerKind::kEulerAncestral, false}},
      {"dpmsolver++", {SamplerKind::kDpmSolverPlusPlus, false}},
      {"dpmsolver++_karras", {SamplerKind::kDpmSolverPlusPlus, true}},
      {"dpmsolver", {SamplerKind::kDpmSolver, false}},
      {"dpmsingle", {SamplerKind::kDpmSingle, false}},
      {"heun", {SamplerKind::kHeun, false}},
      {"dpm_2", {SamplerKind::kDpm2, false}},
      {"k_dpm_2", {SamplerKind::kDpm2, false}},
      {"dpm_2_a", {SamplerKind::kDpm2Ancestral, false}},
      {"k_dpm_2_a", {SamplerKind::kDpm2Ancestral, false}},
      {"lms", {SamplerKind::kLms, false}},
      {"k_lms", {SamplerKind::kLms, false}},
      {"pndm", {SamplerKind::kPndm, false}},
      {"ddpm", {SamplerKind::kDdpm, false}},
  };
  const auto it = kinds.find(name);
  if (it == kinds.end()) {
    std::string known;
    for (const std::string& n : sampler_names()) known += (known.empty() ? "" : ", ") + n;
    throw InputError("unknown sampler '" + name + "' (known: " + known + ")");
  }
  SchedulerOptions o;
  o.v_prediction = v_prediction;
  o.kind = it->second.first;
  o.karras = it->second.second;
  o.schedule = schedule;
  return o;
}

Scheduler::Scheduler(const SchedulerOptions& options, int steps)
    : options_(options), steps_(steps) {
  const SamplerKind kind = options.kind;
  if (steps < 1 || steps > kTrainSteps) {
    throw InputError("sampling steps must be 1 to 1000, got " + std::to_string(steps));
  }
  if (kind == SamplerKind::kPndm && steps < 4) {
    // diffusers' PNDM takes its Runge-Kutta warm-up from the last four timesteps.
    throw InputError("the pndm sampler needs at least 4 steps, got " + std::to_string(steps));
  }
  if (options.karras && kind != SamplerKind::kEuler && kind != SamplerKind::kDpmSolverPlusPlus) {
    throw InputError("Karras sigmas apply to euler and dpmsolver++ only");
  }
  // The family's scaled_linear table (models/ddpm.h), the trainer's own.
  if (options.schedule.steps != kTrainSteps) {
    throw InputError("the samplers take a 1000-step training schedule, the model's has " +
                     std::to_string(options.schedule.steps));
  }
  alphas_cumprod_ = models::ddpm_alphas_cumprod(options.schedule);
  final_alpha_cumprod_ = kind == SamplerKind::kPndm || !options.set_alpha_to_one
                             ? alphas_cumprod_[0]
                             : scalar_tensor(1.0);
  const at::Tensor train_sigmas = ((1 - alphas_cumprod_) / alphas_cumprod_).pow(0.5).contiguous();
  const at::Tensor log_sigmas = train_sigmas.log().contiguous();
  init_noise_sigma_ = 1.0;

  switch (kind) {
    case SamplerKind::kDdim:
    case SamplerKind::kDdpm: {
      // "leading" spacing: every (1000 / steps)-th timestep from the top, plus the offset.
      const int64_t ratio = kTrainSteps / steps;
      const int offset = kind == SamplerKind::kDdim ? options.steps_offset : 0;
      std::vector<int64_t> t(steps);
      for (int i = 0; i < steps; ++i) t[i] = (steps - 1 - i) * ratio + offset;
      timesteps_ = torch::tensor(t, torch::kInt64);
      return;
    }
    case SamplerKind::kPndm: {
      // Three Runge-Kutta steps down the top four "leading" timesteps (four calls each, through
      // the midpoint t - ratio / 2), then linear multistep down the rest: steps + 9 calls.
      const int64_t ratio = kTrainSteps / steps, half = ratio / 2;
      std::vector<int64_t> t;
      for (int k = steps - 1; k > steps - 4; --k) {
        const int64_t top = k * ratio, bottom = (k - 1) * ratio;
        for (int64_t v : {top, bottom + half, bottom + half, bottom}) t.push_back(v);
      }
      for (int k = steps - 4; k >= 0; --k) t.push_back(k * ratio);
      timesteps_ = torch::tensor(t, torch::kInt64);
      return;
    }
    case SamplerKind::kDpmSolverPlusPlus:
    case SamplerKind::kDpmSolver:
    case SamplerKind::kDpmSingle: {
      std::vector<double> sigmas;
      std::vector<double> times;
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
      std::vector<float> s32(sigmas.begin(), sigmas.end());
      // The last sigma: 0 (final_sigmas_type "zero"), or the table's smallest for DPM-Solver.
      s32.push_back(kind == SamplerKind::kDpmSolver ? train_sigmas[0].item<float>() : 0.f);
      sigmas_ = torch::tensor(s32, torch::kFloat32);
      if (kind == SamplerKind::kDpmSingle) {
        // Order 2 with lower_order_final (diffusers forces it with a final sigma of 0): pairs of
        // (1, 2), the last step or two of order 1.
        for (int i = 0; i < steps; ++i) orders_.push_back(i % 2 == 0 ? 1 : 2);
        if (steps % 2 == 0) orders_[steps - 2] = 1;
        orders_[steps - 1] = 1;
      }
      return;
    }
    default:
      break;
  }

  // The K-samplers: numpy.linspace(0, 999, steps, dtype=float32)[::-1] and the table's sigmas
  // there (numpy.interp in double, stored as fp32).
  std::vector<float> grid(steps);
  for (int i = 0; i < steps; ++i) {
    const double y = steps == 1 ? 0.0 : (i == steps - 1 ? 999.0 : i * (999.0 / (steps - 1)));
    grid[steps - 1 - i] = static_cast<float>(y);
  }
  std::vector<double> sigmas;
  for (float t : grid) sigmas.push_back(interp(t, train_sigmas));
  std::vector<float> t32(grid);
  if (options.karras) {
    sigmas = karras_sigmas(sigmas.back(), sigmas.front(), steps);
    t32.clear();
    for (double s : sigmas) t32.push_back(static_cast<float>(sigma_to_t(s, log_sigmas)));
  }
  std::vector<float> s32(sigmas.begin(), sigmas.end());
  s32.push_back(0.f);  // final_sigmas_type "zero"
  const at::Tensor sig = torch::tensor(s32, torch::kFloat32);
  const at::Tensor times = torch::tensor(t32, torch::kFloat32);
  const int64_t n = steps;
  // diffusers' layout for DPM2's tables: the first entry, every later one twice, the last again.
  auto doubled = [](const at::Tensor& x) {
    return torch::cat({x.slice(0, 0, 1), x.slice(0, 1).repeat_interleave(2), x.slice(0, -1)});
  };
  // The fractional timestep of each sigma (_sigma_to_t); entries that are never called with may
  // be NaN and stay so.
  auto times_of = [&](const at::Tensor& s) {
    std::vector<float> out;
    for (int64_t k = 0; k < s.size(0); ++k) {
      const double v = s[k].item<float>();
      out.push_back(std::isfinite(v) ? static_cast<float>(sigma_to_t(v, log_sigmas)) : NAN);
    }
    return torch::tensor(out, torch::kFloat32);
  };
  switch (kind) {
    case SamplerKind::kEuler:
    case SamplerKind::kEulerAncestral:
    case SamplerKind::kLms:
      sigmas_ = sig;
      timesteps_ = times;
      break;
    case SamplerKind::kHeun:
      // Each inner sigma twice: an Euler step to it, then the correction from there.
      sigmas_ = torch::cat({sig.slice(0, 0, 1), sig.slice(0, 1, n).repeat_interleave(2),
                            sig.slice(0, n)});
      timesteps_ = torch::cat({times.slice(0, 0, 1), times.slice(0, 1).repeat_interleave(2)});
      break;
    case SamplerKind::kDpm2: {
      // The midpoints in log sigma between each sigma and the one before (roll wraps the first
      // to the final 0; that entry is never used).
      const at::Tensor interpol = sig.log().lerp(sig.roll(1).log(), 0.5).exp();
      sigmas_ = doubled(sig);
      sigmas_interpol_ = doubled(interpol);
      const at::Tensor inner = times_of(interpol);
      timesteps_ = torch::cat(
          {times.slice(0, 0, 1), torch::stack({inner.slice(0, 1, n), times.slice(0, 1)}, 1).flatten()});
      break;
    }
    case SamplerKind::kDpm2Ancestral: {
      at::Tensor next = sig.roll(-1);
      next[n] = 0.0;
      const at::Tensor up = (next.pow(2) * (sig.pow(2) - next.pow(2)) / sig.pow(2)).pow(0.5);
      at::Tensor down = (next.pow(2) - up.pow(2)).pow(0.5);
      down[n] = 0.0;
      at::Tensor interpol = sig.log().lerp(down.log(), 0.5).exp();
      interpol.slice(0, n - 1).fill_(0.0);
      sigmas_ = doubled(sig);
      sigmas_interpol_ = doubled(interpol);
      sigmas_up_ = doubled(up);
      sigmas_down_ = doubled(down);
      const at::Tensor inner = times_of(interpol);
      timesteps_ = torch::cat({times.slice(0, 0, 1),
                               torch::stack({inner.slice(0, 0, n - 1), times.slice(0, 1)}, 1).flatten()});
      break;
    }
    default:
      break;
  }
  init_noise_sigma_ = sigmas_.max().item<float>();
}

at::Tensor Scheduler::scale_model_input(const at::Tensor& sample, int index) const {
  at::Tensor sigma;
  const bool first_stage = index % 2 == 0;
  switch (options_.kind) {
    case SamplerKind::kEuler:
    case SamplerKind::kEulerAncestral:
    case SamplerKind::kLms:
    case SamplerKind::kHeun:
      sigma = sigmas_[index];
      break;
    case SamplerKind::kDpm2:
      sigma = first_stage ? sigmas_[index] : sigmas_interpol_[index];
      break;
    case SamplerKind::kDpm2Ancestral:
      sigma = first_stage ? sigmas_[index] : sigmas_interpol_[index - 1];
      break;
    default:
      return sample;
  }
  return sample / (sigma.pow(2) + 1).pow(0.5);
}

at::Tensor Scheduler::step(const at::Tensor& model_output, int index, const at::Tensor& sample,
                           at::Generator generator) {
  TORCH_CHECK(index >= 0 && index < calls(), "call ", index, " of ", calls());
  switch (options_.kind) {
    case SamplerKind::kDdim:
      return ddim_step(model_output, index, sample);
    case SamplerKind::kEuler:
      return euler_step(model_output, index, sample);
    case SamplerKind::kEulerAncestral:
      return euler_ancestral_step(model_output, index, sample, std::move(generator));
    case SamplerKind::kDpmSolverPlusPlus:
    case SamplerKind::kDpmSolver:
      return dpm_multistep(model_output, index, sample);
    case SamplerKind::kDpmSingle:
      return dpm_singlestep(model_output, index, sample);
    case SamplerKind::kHeun:
      return heun_step(model_output, index, sample);
    case SamplerKind::kDpm2:
      return dpm2_step(model_output, index, sample);
    case SamplerKind::kDpm2Ancestral:
      return dpm2_ancestral_step(model_output, index, sample, std::move(generator));
    case SamplerKind::kLms:
      return lms_step(model_output, index, sample);
    case SamplerKind::kPndm:
      return pndm_step(model_output, index, sample);
    case SamplerKind::kDdpm:
      return ddpm_step(model_output, index, sample, std::move(generator));
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

at::Tensor Scheduler::noise_like(const at::Tensor& model_output, at::Generator generator) {
  // diffusers' randn_tensor with a CPU generator: drawn on the CPU, then moved.
  return torch::randn(model_output.sizes(), generator,
                      torch::TensorOptions().dtype(model_output.scalar_type()))
      .to(model_output.device());
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
  prev = prev + noise_like(model_output, std::move(generator)) * sigma_up;
  return prev.to(model_output.scalar_type());
}

namespace {

std::pair<at::Tensor, at::Tensor> alpha_sigma(const at::Tensor& sigma) {
  const at::Tensor alpha = 1 / (sigma.pow(2) + 1).pow(0.5);
  return {alpha, sigma * alpha};
}

at::Tensor lambda(const at::Tensor& alpha, const at::Tensor& sigma) {
  return alpha.log() - sigma.log();
}

}  // namespace

at::Tensor Scheduler::dpm_model_output(const at::Tensor& model_output, int index,
                                       const at::Tensor& sample) const {
  const auto [alpha, sigma] = alpha_sigma(sigmas_[index]);
  if (options_.kind == SamplerKind::kDpmSolver) {  // the noise
    return options_.v_prediction ? alpha * model_output + sigma * sample : model_output;
  }
  return options_.v_prediction ? alpha * sample - sigma * model_output  // the data
                               : (sample - sigma * model_output) / alpha;
}

at::Tensor Scheduler::dpm_multistep(const at::Tensor& model_output, int index,
                                    const at::Tensor& sample_in) {
  // diffusers DPMSolverMultistepScheduler.step of order 2 (midpoint), dpmsolver++ or dpmsolver:
  // first order at the first step and at the last (always with a final sigma of 0; under 15
  // steps with sigma_min), second order between.
  const bool plus_plus = options_.kind == SamplerKind::kDpmSolverPlusPlus;
  const at::Tensor m0 = dpm_model_output(model_output, index, sample_in);
  const at::Tensor m1 = previous_x0_;
  previous_x0_ = m0;
  const at::Tensor sample = sample_in.to(torch::kFloat32);
  const bool last = index == steps_ - 1 && (plus_plus || steps_ < 15);
  const auto [alpha_t, sigma_t] = alpha_sigma(sigmas_[index + 1]);
  const auto [alpha_s0, sigma_s0] = alpha_sigma(sigmas_[index]);
  const at::Tensor lambda_s0 = lambda(alpha_s0, sigma_s0);
  const at::Tensor h = lambda(alpha_t, sigma_t) - lambda_s0;
  at::Tensor prev;
  if (lower_order_count_ < 1 || last) {
    prev = plus_plus ? (sigma_t / sigma_s0) * sample - (alpha_t * (torch::exp(-h) - 1.0)) * m0
                     : (alpha_t / alpha_s0) * sample - (sigma_t * (torch::exp(h) - 1.0)) * m0;
  } else {
    const auto [alpha_s1, sigma_s1] = alpha_sigma(sigmas_[index - 1]);
    const at::Tensor r0 = (lambda_s0 - lambda(alpha_s1, sigma_s1)) / h;
    const at::Tensor d1 = (1.0 / r0) * (m0 - m1);
    if (plus_plus) {
      prev = (sigma_t / sigma_s0) * sample - (alpha_t * (torch::exp(-h) - 1.0)) * m0 -
             0.5 * (alpha_t * (torch::exp(-h) - 1.0)) * d1;
    } else {
      prev = (alpha_t / alpha_s0) * sample - (sigma_t * (torch::exp(h) - 1.0)) * m0 -
             0.5 * (sigma_t * (torch::exp(h) - 1.0)) * d1;
    }
  }
  if (lower_order_count_ < 2) ++lower_order_count_;
  return prev.to(model_output.scalar_type());
}

at::Tensor Scheduler::dpm_singlestep(const at::Tensor& model_output, int index,
                                     const at::Tensor& sample) {
  // diffusers DPMSolverSinglestepScheduler.step, dpmsolver++ of order 2 (midpoint): a first-order
  // step to the next sigma, then a second-order step over both from the sample before the first.
  const at::Tensor m0 = dpm_model_output(model_output, index, sample);
  const at::Tensor m1 = previous_x0_;
  previous_x0_ = m0;
  const int order = orders_[index] == 2 && m1.defined() ? 2 : 1;
  if (order == 1) first_sample_ = sample;
  const auto [alpha_t, sigma_t] = alpha_sigma(sigmas_[index + 1]);
  const at::Tensor lambda_t = lambda(alpha_t, sigma_t);
  if (order == 1) {
    const auto [alpha_s, sigma_s] = alpha_sigma(sigmas_[index]);
    const at::Tensor h = lambda_t - lambda(alpha_s, sigma_s);
    return (sigma_t / sigma_s) * first_sample_ - (alpha_t * (torch::exp(-h) - 1.0)) * m0;
  }
  const auto [alpha_s0, sigma_s0] = alpha_sigma(sigmas_[index]);
  const auto [alpha_s1, sigma_s1] = alpha_sigma(sigmas_[index - 1]);
  const at::Tensor lambda_s1 = lambda(alpha_s1, sigma_s1);
  const at::Tensor h = lambda_t - lambda_s1;
  const at::Tensor r0 = (lambda(alpha_s0, sigma_s0) - lambda_s1) / h;
  const at::Tensor d1 = (1.0 / r0) * (m0 - m1);
  return (sigma_t / sigma_s1) * first_sample_ - (alpha_t * (torch::exp(-h) - 1.0)) * m1 -
         0.5 * (alpha_t * (torch::exp(-h) - 1.0)) * d1;
}

at::Tensor Scheduler::heun_step(const at::Tensor& model_output, int index,
                                const at::Tensor& sample) {
  // diffusers HeunDiscreteScheduler.step: even calls take an Euler step to the next sigma and
  // keep its slope; odd calls average that slope with the one found there and redo the step.
  const bool first_stage = index % 2 == 0;
  const at::Tensor sigma = first_stage ? sigmas_[index] : sigmas_[index - 1];
  const at::Tensor sigma_next = first_stage ? sigmas_[index + 1] : sigmas_[index];
  at::Tensor x0 = predicted_original(model_output, first_stage ? sigma : sigma_next, sample);
  if (options_.clip_sample) x0 = x0.clamp(-1.0, 1.0);
  if (first_stage) {
    const at::Tensor derivative = (sample - x0) / sigma;
    previous_derivative_ = derivative;
    previous_dt_ = sigma_next - sigma;
    first_sample_ = sample;
    return sample + derivative * previous_dt_;
  }
  const at::Tensor derivative = (previous_derivative_ + (sample - x0) / sigma_next) / 2;
  const at::Tensor prev = first_sample_ + derivative * previous_dt_;
  first_sample_ = previous_derivative_ = previous_dt_ = at::Tensor();
  return prev;
}

at::Tensor Scheduler::dpm2_stage(const at::Tensor& model_output, int index,
                                 const at::Tensor& sample, const at::Tensor& sigma,
                                 const at::Tensor& sigma_interpol, const at::Tensor& sigma_to) {
  // diffusers KDPM2(Ancestral)DiscreteScheduler.step: even calls take an Euler step from sigma to
  // the log-midpoint sigma_interpol; odd calls take the whole step from that first sample to
  // sigma_to with the slope found at the midpoint.
  const bool first_stage = index % 2 == 0;
  const at::Tensor x0 =
      predicted_original(model_output, first_stage ? sigma : sigma_interpol, sample);
  if (first_stage) {
    first_sample_ = sample;
    return sample + ((sample - x0) / sigma) * (sigma_interpol - sigma);
  }
  const at::Tensor derivative = (sample - x0) / sigma_interpol;
  const at::Tensor prev = first_sample_ + derivative * (sigma_to - sigma);
  first_sample_ = at::Tensor();
  return prev;
}

at::Tensor Scheduler::dpm2_step(const at::Tensor& model_output, int index,
                                const at::Tensor& sample) {
  const bool first_stage = index % 2 == 0;
  return dpm2_stage(model_output, index, sample, first_stage ? sigmas_[index] : sigmas_[index - 1],
                    first_stage ? sigmas_interpol_[index + 1] : sigmas_interpol_[index],
                    sigmas_[index]);
}

at::Tensor Scheduler::dpm2_ancestral_step(const at::Tensor& model_output, int index,
                                          const at::Tensor& sample, at::Generator generator) {
  // Towards sigma_down, then fresh noise of sigma_up after the second stage.
  const int at = index % 2 == 0 ? index : index - 1;
  const at::Tensor prev =
      dpm2_stage(model_output, index, sample, sigmas_[at], sigmas_interpol_[at], sigmas_down_[at]);
  if (index % 2 == 0) return prev;
  return prev + noise_like(model_output, generator) * sigmas_up_[at];
}

at::Tensor Scheduler::lms_step(const at::Tensor& model_output, int index,
                               const at::Tensor& sample) {
  // diffusers LMSDiscreteScheduler.step, order 4: the slopes of the last four steps weighted by
  // the integrals of their Lagrange polynomials over this step. diffusers integrates numerically
  // (scipy's quad); these cubics are integrated exactly, by 3-point Gauss-Legendre in double.
  const at::Tensor sigma = sigmas_[index];
  const at::Tensor x0 = predicted_original(model_output, sigma, sample);
  derivatives_.push_back((sample - x0) / sigma);
  if (derivatives_.size() > 4) derivatives_.erase(derivatives_.begin());
  const int order = std::min(index + 1, 4);
  const float* s = sigmas_.data_ptr<float>();
  const double a = s[index], b = s[index + 1];
  const double node = std::sqrt(0.6);
  const double nodes[3] = {-node, 0.0, node};
  const double weights[3] = {5.0 / 9.0, 8.0 / 9.0, 5.0 / 9.0};
  at::Tensor sum;
  for (int j = 0; j < order; ++j) {
    double coefficient = 0;
    for (int q = 0; q < 3; ++q) {
      const double tau = (a + b) / 2 + (b - a) / 2 * nodes[q];
      double product = 1;
      for (int k = 0; k < order; ++k) {
        if (k == j) continue;
        product *= (tau - s[index - k]) / (static_cast<double>(s[index - j]) - s[index - k]);
      }
      coefficient += weights[q] * product;
    }
    coefficient *= (b - a) / 2;
    // The newest slope first, as diffusers zips the coefficients with reversed(derivatives).
    const at::Tensor term = coefficient * derivatives_[derivatives_.size() - 1 - j];
    sum = sum.defined() ? sum + term : term;
  }
  return sample + sum;
}

at::Tensor Scheduler::pndm_previous(const at::Tensor& sample, int64_t t, int64_t prev_t,
                                    at::Tensor model_output) const {
  // diffusers PNDMScheduler._get_prev_sample (formula 9 of the PNDM paper).
  const at::Tensor a_t = alphas_cumprod_[t];
  const at::Tensor a_prev = prev_t >= 0 ? alphas_cumprod_[prev_t] : final_alpha_cumprod_;
  const at::Tensor b_t = 1 - a_t;
  const at::Tensor b_prev = 1 - a_prev;
  if (options_.v_prediction) model_output = a_t.pow(0.5) * model_output + b_t.pow(0.5) * sample;
  const at::Tensor sample_coeff = (a_prev / a_t).pow(0.5);
  const at::Tensor denominator = a_t * b_prev.pow(0.5) + (a_t * b_t * a_prev).pow(0.5);
  return sample_coeff * sample - (a_prev - a_t) * model_output / denominator;
}

at::Tensor Scheduler::pndm_step(const at::Tensor& model_output, int index,
                                const at::Tensor& sample) {
  // diffusers PNDMScheduler.step with its Runge-Kutta warm-up (kohya leaves skip_prk_steps off):
  // calls 0-11 are three fourth-order Runge-Kutta steps, the rest fourth-order linear multistep
  // (PLMS) steps on the last four outputs.
  const int64_t ratio = kTrainSteps / steps_;
  const int64_t timestep = timesteps_[index].item<int64_t>();
  if (index < 12) {
    const int64_t prev_t = timestep - (index % 2 ? 0 : ratio / 2);
    const int64_t start = timesteps_[index / 4 * 4].item<int64_t>();
    at::Tensor output = model_output;
    switch (index % 4) {
      case 0:
        pndm_combined_ = 1.0 / 6 * model_output;
        pndm_outputs_.push_back(model_output);
        first_sample_ = sample;
        break;
      case 1:
      case 2:
        pndm_combined_ = pndm_combined_ + 1.0 / 3 * model_output;
        break;
      default:
        output = pndm_combined_ + 1.0 / 6 * model_output;
        pndm_combined_ = at::Tensor();
        break;
    }
    return pndm_previous(first_sample_, start, prev_t, output);
  }
  if (pndm_outputs_.size() > 3) pndm_outputs_.erase(pndm_outputs_.begin());
  pndm_outputs_.push_back(model_output);
  const std::vector<at::Tensor>& e = pndm_outputs_;
  const at::Tensor combined = (1.0 / 24) * (55 * e[3] - 59 * e[2] + 37 * e[1] - 9 * e[0]);
  return pndm_previous(sample, timestep, timestep - ratio, combined);
}

at::Tensor Scheduler::ddpm_step(const at::Tensor& model_output, int index,
                                const at::Tensor& sample, at::Generator generator) const {
  // diffusers DDPMScheduler.step with variance "fixed_small": the posterior mean from x0
  // (clamped: clip_sample is DDPM's default) plus its noise, except at t = 0.
  const int64_t t = timesteps_[index].item<int64_t>();
  const int64_t prev_t = index == calls() - 1 ? -1 : timesteps_[index + 1].item<int64_t>();
  const at::Tensor a_t = alphas_cumprod_[t];
  const at::Tensor a_prev = prev_t >= 0 ? alphas_cumprod_[prev_t] : scalar_tensor(1.0);
  const at::Tensor b_t = 1 - a_t;
  const at::Tensor b_prev = 1 - a_prev;
  const at::Tensor current_alpha = a_t / a_prev;
  const at::Tensor current_beta = 1 - current_alpha;
  at::Tensor x0 = options_.v_prediction ? a_t.pow(0.5) * sample - b_t.pow(0.5) * model_output
                                        : (sample - b_t.pow(0.5) * model_output) / a_t.pow(0.5);
  if (options_.clip_sample) x0 = x0.clamp(-1.0, 1.0);
  const at::Tensor x0_coeff = (a_prev.pow(0.5) * current_beta) / b_t;
  const at::Tensor sample_coeff = current_alpha.pow(0.5) * b_prev / b_t;
  at::Tensor prev = x0_coeff * x0 + sample_coeff * sample;
  if (t > 0) {
    const at::Tensor variance = torch::clamp((1 - a_prev) / (1 - a_t) * (1 - a_t / a_prev), 1e-20);
    prev = prev + variance.pow(0.5) * noise_like(model_output, std::move(generator));
  }
  return prev;
}

}  // namespace lorapipe::sampler
