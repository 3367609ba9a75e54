// The samplers that step over integer timesteps of the training table: DDIM, DDPM and PNDM, each
// equal to diffusers' class of the same name.
#include <torch/torch.h>

#include <string>
#include <vector>

#include "common/error.h"
#include "sampler/scheduler_math.h"

namespace lorapipe::sampler::detail {
namespace {

// "leading" spacing: every (1000 / steps)-th timestep from the top, plus `offset`.
at::Tensor leading_timesteps(int steps, int offset) {
  const int64_t ratio = kTrainSteps / steps;
  std::vector<int64_t> t(steps);
  for (int i = 0; i < steps; ++i) t[i] = (steps - 1 - i) * ratio + offset;
  return torch::tensor(t, torch::kInt64);
}

// diffusers DDIMScheduler, stepped with eta 0 (no noise).
class Ddim final : public Scheduler {
 public:
  Ddim(const SchedulerOptions& options, int steps) : Scheduler(options, steps) {
    final_alpha_cumprod_ = options.set_alpha_to_one ? scalar_tensor(1.0) : alphas_cumprod_[0];
    timesteps_ = leading_timesteps(steps, options.steps_offset);
  }

 private:
  at::Tensor step_at(const at::Tensor& model_output, int index, const at::Tensor& sample,
                     at::Generator) override {
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

  at::Tensor final_alpha_cumprod_;
};

// diffusers DDPMScheduler with variance "fixed_small": the posterior mean from x0 (clamped:
// clip_sample is DDPM's default) plus its noise, except at t = 0.
class Ddpm final : public Scheduler {
 public:
  Ddpm(const SchedulerOptions& options, int steps) : Scheduler(options, steps) {
    timesteps_ = leading_timesteps(steps, 0);
  }

 private:
  at::Tensor step_at(const at::Tensor& model_output, int index, const at::Tensor& sample,
                     at::Generator generator) override {
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
      const at::Tensor variance =
          torch::clamp((1 - a_prev) / (1 - a_t) * (1 - a_t / a_prev), 1e-20);
      prev = prev + variance.pow(0.5) * noise_like(model_output, std::move(generator));
    }
    return prev;
  }
};

// diffusers PNDMScheduler with its Runge-Kutta warm-up (kohya leaves skip_prk_steps off): calls
// 0-11 are three fourth-order Runge-Kutta steps down the top four "leading" timesteps (four calls
// each, through the midpoint t - ratio / 2), the rest fourth-order linear multistep (PLMS) steps
// on the last four outputs: steps + 9 calls.
class Pndm final : public Scheduler {
 public:
  Pndm(const SchedulerOptions& options, int steps) : Scheduler(options, steps) {
    if (steps < 4) {
      // diffusers' PNDM takes its Runge-Kutta warm-up from the last four timesteps.
      throw InputError("the pndm sampler needs at least 4 steps, got " + std::to_string(steps));
    }
    final_alpha_cumprod_ = alphas_cumprod_[0];
    const int64_t ratio = kTrainSteps / steps, half = ratio / 2;
    std::vector<int64_t> t;
    for (int k = steps - 1; k > steps - 4; --k) {
      const int64_t top = k * ratio, bottom = (k - 1) * ratio;
      for (int64_t v : {top, bottom + half, bottom + half, bottom}) t.push_back(v);
    }
    for (int k = steps - 4; k >= 0; --k) t.push_back(k * ratio);
    timesteps_ = torch::tensor(t, torch::kInt64);
  }

 private:
  // diffusers PNDMScheduler._get_prev_sample (formula 9 of the PNDM paper).
  at::Tensor previous(const at::Tensor& sample, int64_t t, int64_t prev_t,
                      at::Tensor model_output) const {
    const at::Tensor a_t = alphas_cumprod_[t];
    const at::Tensor a_prev = prev_t >= 0 ? alphas_cumprod_[prev_t] : final_alpha_cumprod_;
    const at::Tensor b_t = 1 - a_t;
    const at::Tensor b_prev = 1 - a_prev;
    if (options_.v_prediction) model_output = a_t.pow(0.5) * model_output + b_t.pow(0.5) * sample;
    const at::Tensor sample_coeff = (a_prev / a_t).pow(0.5);
    const at::Tensor denominator = a_t * b_prev.pow(0.5) + (a_t * b_t * a_prev).pow(0.5);
    return sample_coeff * sample - (a_prev - a_t) * model_output / denominator;
  }

  at::Tensor step_at(const at::Tensor& model_output, int index, const at::Tensor& sample,
                     at::Generator) override {
    const int64_t ratio = kTrainSteps / steps_;
    const int64_t timestep = timesteps_[index].item<int64_t>();
    if (index < 12) {
      const int64_t prev_t = timestep - (index % 2 ? 0 : ratio / 2);
      const int64_t start = timesteps_[index / 4 * 4].item<int64_t>();
      at::Tensor output = model_output;
      switch (index % 4) {
        case 0:
          combined_ = 1.0 / 6 * model_output;
          outputs_.push_back(model_output);
          first_sample_ = sample;
          break;
        case 1:
        case 2:
          combined_ = combined_ + 1.0 / 3 * model_output;
          break;
        default:
          output = combined_ + 1.0 / 6 * model_output;
          combined_ = at::Tensor();
          break;
      }
      return previous(first_sample_, start, prev_t, output);
    }
    if (outputs_.size() > 3) outputs_.erase(outputs_.begin());
    outputs_.push_back(model_output);
    const std::vector<at::Tensor>& e = outputs_;
    const at::Tensor combined = (1.0 / 24) * (55 * e[3] - 59 * e[2] + 37 * e[1] - 9 * e[0]);
    return previous(sample, timestep, timestep - ratio, combined);
  }

  at::Tensor final_alpha_cumprod_;
  std::vector<at::Tensor> outputs_;  // its "ets"
  at::Tensor combined_;              // the Runge-Kutta sum so far
  at::Tensor first_sample_;
};

}  // namespace

std::unique_ptr<Scheduler> make_ddim(const SchedulerOptions& options, int steps) {
  return std::make_unique<Ddim>(options, steps);
}
std::unique_ptr<Scheduler> make_ddpm(const SchedulerOptions& options, int steps) {
  return std::make_unique<Ddpm>(options, steps);
}
std::unique_ptr<Scheduler> make_pndm(const SchedulerOptions& options, int steps) {
  return std::make_unique<Pndm>(options, steps);
}

}  // namespace lorapipe::sampler::detail
