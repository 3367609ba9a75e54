#include "sampler/schedulers.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <utility>

#include "common/error.h"
#include "models/ddpm.h"
#include "sampler/scheduler_math.h"

namespace lorapipe::sampler {
namespace detail {

double interp(double x, const at::Tensor& table) {
  const auto* fp = table.data_ptr<float>();
  const auto j = static_cast<int64_t>(std::floor(x));
  if (j >= kTrainSteps - 1) return fp[kTrainSteps - 1];
  if (x == static_cast<double>(j)) return fp[j];
  const double lo = fp[j], hi = fp[j + 1];
  return (hi - lo) / 1.0 * (x - static_cast<double>(j)) + lo;
}

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

at::Tensor noise_like(const at::Tensor& model_output, at::Generator generator) {
  return torch::randn(model_output.sizes(), generator,
                      torch::TensorOptions().dtype(model_output.scalar_type()))
      .to(model_output.device());
}

at::Tensor train_sigmas(const at::Tensor& alphas_cumprod) {
  return ((1 - alphas_cumprod) / alphas_cumprod).pow(0.5).contiguous();
}

}  // namespace detail

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

using detail::kTrainSteps;

Scheduler::Scheduler(const SchedulerOptions& options, int steps)
    : options_(options), steps_(steps) {
  if (steps < 1 || steps > kTrainSteps) {
    throw InputError("sampling steps must be 1 to 1000, got " + std::to_string(steps));
  }
  if (options.karras && options.kind != SamplerKind::kEuler &&
      options.kind != SamplerKind::kDpmSolverPlusPlus) {
    throw InputError("Karras sigmas apply to euler and dpmsolver++ only");
  }
  // The family's scaled_linear table (models/ddpm.h), the trainer's own.
  if (options.schedule.steps != kTrainSteps) {
    throw InputError("the samplers take a 1000-step training schedule, the model's has " +
                     std::to_string(options.schedule.steps));
  }
  alphas_cumprod_ = models::ddpm_alphas_cumprod(options.schedule);
}

at::Tensor Scheduler::step(const at::Tensor& model_output, int index, const at::Tensor& sample,
                           at::Generator generator) {
  TORCH_CHECK(index >= 0 && index < calls(), "call ", index, " of ", calls());
  return step_at(model_output, index, sample, std::move(generator));
}

std::unique_ptr<Scheduler> make_scheduler(const SchedulerOptions& options, int steps) {
  switch (options.kind) {
    case SamplerKind::kDdim:
      return detail::make_ddim(options, steps);
    case SamplerKind::kDdpm:
      return detail::make_ddpm(options, steps);
    case SamplerKind::kPndm:
      return detail::make_pndm(options, steps);
    case SamplerKind::kDpmSolverPlusPlus:
    case SamplerKind::kDpmSolver:
      return detail::make_dpm_multistep(options, steps);
    case SamplerKind::kDpmSingle:
      return detail::make_dpm_singlestep(options, steps);
    case SamplerKind::kEuler:
      return detail::make_euler(options, steps);
    case SamplerKind::kEulerAncestral:
      return detail::make_euler_ancestral(options, steps);
    case SamplerKind::kHeun:
      return detail::make_heun(options, steps);
    case SamplerKind::kDpm2:
      return detail::make_dpm2(options, steps);
    case SamplerKind::kDpm2Ancestral:
      return detail::make_dpm2_ancestral(options, steps);
    case SamplerKind::kLms:
      return detail::make_lms(options, steps);
  }
  throw Error("unknown sampler kind");
}

}  // namespace lorapipe::sampler
