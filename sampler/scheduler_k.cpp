// The sigma-based K-samplers, each equal to diffusers' class: EulerDiscreteScheduler,
// EulerAncestralDiscreteScheduler, HeunDiscreteScheduler, KDPM2DiscreteScheduler,
// KDPM2AncestralDiscreteScheduler and LMSDiscreteScheduler.
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "sampler/scheduler_math.h"

namespace lorapipe::sampler::detail {
namespace {

// What every K-sampler starts from: numpy.linspace(0, 999, steps, dtype=float32)[::-1] and the
// table's sigmas there (numpy.interp in double, stored as fp32), or Karras sigmas between the
// same ends; a final sigma of 0 (final_sigmas_type "zero"). Each sampler lays its calls out from
// these (grid_sigmas_, grid_times_), sets sigmas_ and timesteps_, and the initial noise is the
// largest sigma.
class KScheduler : public Scheduler {
 protected:
  KScheduler(const SchedulerOptions& options, int steps) : Scheduler(options, steps) {
    const at::Tensor table = train_sigmas(alphas_cumprod_);
    log_sigmas_ = table.log().contiguous();
    std::vector<float> grid(steps);
    for (int i = 0; i < steps; ++i) {
      const double y = steps == 1 ? 0.0 : (i == steps - 1 ? 999.0 : i * (999.0 / (steps - 1)));
      grid[steps - 1 - i] = static_cast<float>(y);
    }
    std::vector<double> sigmas;
    for (float t : grid) sigmas.push_back(interp(t, table));
    std::vector<float> t32(grid);
    if (options.karras) {
      sigmas = karras_sigmas(sigmas.back(), sigmas.front(), steps);
      t32.clear();
      for (double s : sigmas) t32.push_back(static_cast<float>(sigma_to_t(s, log_sigmas_)));
    }
    std::vector<float> s32(sigmas.begin(), sigmas.end());
    s32.push_back(0.f);
    grid_sigmas_ = torch::tensor(s32, torch::kFloat32);
    grid_times_ = torch::tensor(t32, torch::kFloat32);
  }

  // Called by each sampler's constructor once sigmas_ is laid out.
  void set_init_noise_sigma() { init_noise_sigma_ = sigmas_.max().item<float>(); }
  // One call per grid point (Euler, Euler ancestral, LMS).
  void use_grid() {
    sigmas_ = grid_sigmas_;
    timesteps_ = grid_times_;
    set_init_noise_sigma();
  }

  // The sigma the model's input is scaled by at call `index`.
  virtual at::Tensor input_sigma(int index) const { return sigmas_[index]; }
  at::Tensor scale_model_input(const at::Tensor& sample, int index) const override {
    return sample / (input_sigma(index).pow(2) + 1).pow(0.5);
  }

  // The x0 prediction at sigma.
  at::Tensor predicted_original(const at::Tensor& model_output, const at::Tensor& sigma,
                                const at::Tensor& sample) const {
    if (options_.v_prediction) {
      return model_output * (-sigma / (sigma.pow(2) + 1).pow(0.5)) + (sample / (sigma.pow(2) + 1));
    }
    return sample - sigma * model_output;
  }

  // The fractional timestep of each sigma (_sigma_to_t); entries that are never called with may
  // be NaN and stay so.
  at::Tensor times_of(const at::Tensor& s) const {
    std::vector<float> out;
    for (int64_t k = 0; k < s.size(0); ++k) {
      const double v = s[k].item<float>();
      out.push_back(std::isfinite(v) ? static_cast<float>(sigma_to_t(v, log_sigmas_)) : NAN);
    }
    return torch::tensor(out, torch::kFloat32);
  }

  // diffusers' layout for DPM2's tables: the first entry, every later one twice, the last again.
  static at::Tensor doubled(const at::Tensor& x) {
    return torch::cat({x.slice(0, 0, 1), x.slice(0, 1).repeat_interleave(2), x.slice(0, -1)});
  }

  at::Tensor log_sigmas_;
  at::Tensor grid_sigmas_;  // [steps + 1] fp32
  at::Tensor grid_times_;   // [steps] fp32
};

// EulerDiscreteScheduler.step with s_churn 0: sigma_hat = sigma, no noise.
class Euler final : public KScheduler {
 public:
  Euler(const SchedulerOptions& options, int steps) : KScheduler(options, steps) {
    use_grid();
  }

 private:
  at::Tensor step_at(const at::Tensor& model_output, int index, const at::Tensor& sample_in,
                     at::Generator) override {
    const at::Tensor sample = sample_in.to(torch::kFloat32);
    const at::Tensor sigma = sigmas_[index];
    const at::Tensor sigma_hat = sigma * 1.0;
    const at::Tensor x0 = predicted_original(model_output, sigma_hat, sample);
    const at::Tensor derivative = (sample - x0) / sigma_hat;
    const at::Tensor dt = sigmas_[index + 1] - sigma_hat;
    return (sample + derivative * dt).to(model_output.scalar_type());
  }
};

class EulerAncestral final : public KScheduler {
 public:
  EulerAncestral(const SchedulerOptions& options, int steps) : KScheduler(options, steps) {
    use_grid();
  }

 private:
  at::Tensor step_at(const at::Tensor& model_output, int index, const at::Tensor& sample_in,
                     at::Generator generator) override {
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
    // Drawn at every step, the last too (where sigma_up is 0), as diffusers does: the
    // generator's stream stays in step with a diffusers run.
    prev = prev + noise_like(model_output, std::move(generator)) * sigma_up;
    return prev.to(model_output.scalar_type());
  }
};

// HeunDiscreteScheduler.step: even calls take an Euler step to the next sigma and keep its
// slope; odd calls average that slope with the one found there and redo the step. Each inner
// sigma comes twice: 2 * steps - 1 calls.
class Heun final : public KScheduler {
 public:
  Heun(const SchedulerOptions& options, int steps) : KScheduler(options, steps) {
    const at::Tensor& sig = grid_sigmas_;
    sigmas_ = torch::cat({sig.slice(0, 0, 1), sig.slice(0, 1, steps).repeat_interleave(2),
                          sig.slice(0, steps)});
    timesteps_ = torch::cat(
        {grid_times_.slice(0, 0, 1), grid_times_.slice(0, 1).repeat_interleave(2)});
    set_init_noise_sigma();
  }

 private:
  at::Tensor step_at(const at::Tensor& model_output, int index, const at::Tensor& sample,
                     at::Generator) override {
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

  at::Tensor first_sample_, previous_derivative_, previous_dt_;
};

// KDPM2(Ancestral)DiscreteScheduler: even calls take an Euler step from sigma to the
// log-midpoint sigma_interpol; odd calls take the whole step from that first sample to sigma_to
// with the slope found at the midpoint. 2 * steps - 1 calls.
class Dpm2Base : public KScheduler {
 protected:
  using KScheduler::KScheduler;

  at::Tensor stage(const at::Tensor& model_output, int index, const at::Tensor& sample,
                   const at::Tensor& sigma, const at::Tensor& sigma_interpol,
                   const at::Tensor& sigma_to) {
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

  at::Tensor sigmas_interpol_;
  at::Tensor first_sample_;
};

class Dpm2 final : public Dpm2Base {
 public:
  Dpm2(const SchedulerOptions& options, int steps) : Dpm2Base(options, steps) {
    const at::Tensor& sig = grid_sigmas_;
    // The midpoints in log sigma between each sigma and the one before (roll wraps the first
    // to the final 0; that entry is never used).
    const at::Tensor interpol = sig.log().lerp(sig.roll(1).log(), 0.5).exp();
    sigmas_ = doubled(sig);
    sigmas_interpol_ = doubled(interpol);
    const at::Tensor inner = times_of(interpol);
    timesteps_ = torch::cat({grid_times_.slice(0, 0, 1),
                             torch::stack({inner.slice(0, 1, steps), grid_times_.slice(0, 1)}, 1)
                                 .flatten()});
    set_init_noise_sigma();
  }

 private:
  at::Tensor input_sigma(int index) const override {
    return index % 2 == 0 ? sigmas_[index] : sigmas_interpol_[index];
  }

  at::Tensor step_at(const at::Tensor& model_output, int index, const at::Tensor& sample,
                     at::Generator) override {
    const bool first_stage = index % 2 == 0;
    return stage(model_output, index, sample, first_stage ? sigmas_[index] : sigmas_[index - 1],
                 first_stage ? sigmas_interpol_[index + 1] : sigmas_interpol_[index],
                 sigmas_[index]);
  }
};

// Towards sigma_down, then fresh noise of sigma_up after the second stage.
class Dpm2Ancestral final : public Dpm2Base {
 public:
  Dpm2Ancestral(const SchedulerOptions& options, int steps) : Dpm2Base(options, steps) {
    const at::Tensor& sig = grid_sigmas_;
    const int64_t n = steps;
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
    timesteps_ = torch::cat({grid_times_.slice(0, 0, 1),
                             torch::stack({inner.slice(0, 0, n - 1), grid_times_.slice(0, 1)}, 1)
                                 .flatten()});
    set_init_noise_sigma();
  }

 private:
  at::Tensor input_sigma(int index) const override {
    return index % 2 == 0 ? sigmas_[index] : sigmas_interpol_[index - 1];
  }

  at::Tensor step_at(const at::Tensor& model_output, int index, const at::Tensor& sample,
                     at::Generator generator) override {
    const int at = index % 2 == 0 ? index : index - 1;
    const at::Tensor prev =
        stage(model_output, index, sample, sigmas_[at], sigmas_interpol_[at], sigmas_down_[at]);
    if (index % 2 == 0) return prev;
    return prev + noise_like(model_output, generator) * sigmas_up_[at];
  }

  at::Tensor sigmas_up_, sigmas_down_;
};

// LMSDiscreteScheduler.step, order 4: the slopes of the last four steps weighted by the
// integrals of their Lagrange polynomials over this step. diffusers integrates numerically
// (scipy's quad); these cubics are integrated exactly, by 3-point Gauss-Legendre in double.
class Lms final : public KScheduler {
 public:
  Lms(const SchedulerOptions& options, int steps) : KScheduler(options, steps) {
    use_grid();
  }

 private:
  at::Tensor step_at(const at::Tensor& model_output, int index, const at::Tensor& sample,
                     at::Generator) override {
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

  std::vector<at::Tensor> derivatives_;  // the last four, oldest first
};

}  // namespace

std::unique_ptr<Scheduler> make_euler(const SchedulerOptions& options, int steps) {
  return std::make_unique<Euler>(options, steps);
}
std::unique_ptr<Scheduler> make_euler_ancestral(const SchedulerOptions& options, int steps) {
  return std::make_unique<EulerAncestral>(options, steps);
}
std::unique_ptr<Scheduler> make_heun(const SchedulerOptions& options, int steps) {
  return std::make_unique<Heun>(options, steps);
}
std::unique_ptr<Scheduler> make_dpm2(const SchedulerOptions& options, int steps) {
  return std::make_unique<Dpm2>(options, steps);
}
std::unique_ptr<Scheduler> make_dpm2_ancestral(const SchedulerOptions& options, int steps) {
  return std::make_unique<Dpm2Ancestral>(options, steps);
}
std::unique_ptr<Scheduler> make_lms(const SchedulerOptions& options, int steps) {
  return std::make_unique<Lms>(options, steps);
}

}  // namespace lorapipe::sampler::detail
