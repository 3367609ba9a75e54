// The DPM-Solvers: diffusers' DPMSolverMultistepScheduler (DPM++ 2M, kohya's "dpmsolver++", and
// DPM-Solver 2M, its "dpmsolver") and DPMSolverSinglestepScheduler (DPM++ 2S, "dpmsingle"), each
// of order 2 (midpoint), over diffusers' "linspace" timesteps or Karras sigmas.
#include <torch/torch.h>

#include <cmath>
#include <utility>
#include <vector>

#include "sampler/scheduler_math.h"

namespace lorapipe::sampler::detail {
namespace {

std::pair<at::Tensor, at::Tensor> alpha_sigma(const at::Tensor& sigma) {
  const at::Tensor alpha = 1 / (sigma.pow(2) + 1).pow(0.5);
  return {alpha, sigma * alpha};
}

at::Tensor lambda(const at::Tensor& alpha, const at::Tensor& sigma) {
  return alpha.log() - sigma.log();
}

// The timesteps and sigmas both solvers take, and the model output each converts.
class DpmSolver : public Scheduler {
 protected:
  DpmSolver(const SchedulerOptions& options, int steps) : Scheduler(options, steps) {
    const at::Tensor table = train_sigmas(alphas_cumprod_);
    const at::Tensor log_sigmas = table.log().contiguous();
    std::vector<double> sigmas;
    std::vector<double> times;
    if (options.karras) {
      const double sigma_min = table[0].item<float>();
      const double sigma_max = table[kTrainSteps - 1].item<float>();
      sigmas = karras_sigmas(sigma_min, sigma_max, steps);
      for (double s : sigmas) times.push_back(std::nearbyint(sigma_to_t(s, log_sigmas)));
    } else {
      // numpy.linspace(0, 999, steps + 1).round()[::-1][:-1]: round half to even.
      for (int k = steps; k >= 1; --k) {
        const double y = k == steps ? 999.0 : k * (999.0 / steps);
        times.push_back(std::nearbyint(y));
      }
      for (double t : times) sigmas.push_back(interp(t, table));
    }
    std::vector<int64_t> t64(times.begin(), times.end());
    timesteps_ = torch::tensor(t64, torch::kInt64);
    std::vector<float> s32(sigmas.begin(), sigmas.end());
    // The last sigma: 0 (final_sigmas_type "zero"), or the table's smallest for DPM-Solver.
    s32.push_back(options.kind == SamplerKind::kDpmSolver ? table[0].item<float>() : 0.f);
    sigmas_ = torch::tensor(s32, torch::kFloat32);
  }

  // The data (dpmsolver++) or noise (dpmsolver) prediction at call `index`.
  at::Tensor converted(const at::Tensor& model_output, int index, const at::Tensor& sample) const {
    const auto [alpha, sigma] = alpha_sigma(sigmas_[index]);
    if (options_.kind == SamplerKind::kDpmSolver) {  // the noise
      return options_.v_prediction ? alpha * model_output + sigma * sample : model_output;
    }
    return options_.v_prediction ? alpha * sample - sigma * model_output  // the data
                                 : (sample - sigma * model_output) / alpha;
  }

  at::Tensor previous_output_;  // the converted model output of the step before
};

// DPMSolverMultistepScheduler.step: first order at the first step and at the last (always with
// a final sigma of 0; under 15 steps with sigma_min), second order between.
class DpmMultistep final : public DpmSolver {
 public:
  DpmMultistep(const SchedulerOptions& options, int steps) : DpmSolver(options, steps) {}

 private:
  at::Tensor step_at(const at::Tensor& model_output, int index, const at::Tensor& sample_in,
                     at::Generator) override {
    const bool plus_plus = options_.kind == SamplerKind::kDpmSolverPlusPlus;
    const at::Tensor m0 = converted(model_output, index, sample_in);
    const at::Tensor m1 = previous_output_;
    previous_output_ = m0;
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

  int lower_order_count_ = 0;
};

// DPMSolverSinglestepScheduler.step, dpmsolver++ of order 2: a first-order step to the next
// sigma, then a second-order step over both from the sample before the first.
class DpmSinglestep final : public DpmSolver {
 public:
  DpmSinglestep(const SchedulerOptions& options, int steps) : DpmSolver(options, steps) {
    // Order 2 with lower_order_final (diffusers forces it with a final sigma of 0): pairs of
    // (1, 2), the last step or two of order 1.
    for (int i = 0; i < steps; ++i) orders_.push_back(i % 2 == 0 ? 1 : 2);
    if (steps % 2 == 0) orders_[steps - 2] = 1;
    orders_[steps - 1] = 1;
  }

 private:
  at::Tensor step_at(const at::Tensor& model_output, int index, const at::Tensor& sample,
                     at::Generator) override {
    const at::Tensor m0 = converted(model_output, index, sample);
    const at::Tensor m1 = previous_output_;
    previous_output_ = m0;
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

  std::vector<int> orders_;  // the order of each step
  at::Tensor first_sample_;
};

}  // namespace

std::unique_ptr<Scheduler> make_dpm_multistep(const SchedulerOptions& options, int steps) {
  return std::make_unique<DpmMultistep>(options, steps);
}
std::unique_ptr<Scheduler> make_dpm_singlestep(const SchedulerOptions& options, int steps) {
  return std::make_unique<DpmSinglestep>(options, steps);
}

}  // namespace lorapipe::sampler::detail
