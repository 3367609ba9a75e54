// Schedule-free AdamW (Defazio et al. 2024, "The Road Less Scheduled", arXiv 2405.15682) behind
// the Optimizer seam: schedulefree's AdamWScheduleFree, the class kohya loads for
// --optimizer_type=AdamWScheduleFree, operation for operation (ScheduleFreeParity holds it
// bit-exact). Two sequences per parameter: z, Adam-normalised SGD steps, and x, their running
// average weighted by lr_max^weight_lr_power (no schedule needed: the averaging anneals). The
// gradient is taken at y, between them; the parameter holds y while training (train()) and x,
// the model, while it is saved, validated or previewed (eval()), as kohya switches it. State:
// z and the second moment, 8 bytes per parameter; the parameter itself stands for y or x.

#include "trainer/schedulefree_optimizer.h"

#include <torch/serialize.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>

#include "common/error.h"
#include "trainer/optimizer_state.h"

namespace lorapipe::trainer {
namespace {

struct ScheduleFreeState {
  bool initialised = false;
  int64_t step = 0;
  at::Tensor z, exp_avg_sq;
  std::vector<std::pair<const char*, at::Tensor*>> tensors() {
    return {{"z", &z}, {"exp_avg_sq", &exp_avg_sq}};
  }
};

class AdamWScheduleFree final : public GroupedOptimizer<ScheduleFreeState> {
 public:
  using State = ScheduleFreeState;
  AdamWScheduleFree(const OptimizerOptions& options, std::vector<ParamGroup> groups)
      : GroupedOptimizer(std::move(groups)), options_(options), o_(options.schedulefree) {
    weight_decay_ = options.weight_decay.value_or(0.0);
    if (!(options.beta1 > 0 && options.beta1 < 1 && options.beta2 >= 0 && options.beta2 < 1)) {
      // beta1 0 would divide by zero in eval(); 1 would never move y.
      throw InputError("--optimizer_args betas=" + std::to_string(options.beta1) + "," +
                       std::to_string(options.beta2) +
                       ": AdamWScheduleFree's must lie in (0, 1) and [0, 1)");
    }
    for (size_t g = 0; g < groups_.size(); ++g) counters_.push_back({});
  }

  void step() override {
    if (!training_) {
      throw Error("AdamWScheduleFree stepped with its evaluation weights in the parameters "
                  "(train() was not called)");
    }
    torch::NoGradGuard no_grad;
    const double beta1 = options_.beta1, beta2 = options_.beta2, eps = options_.eps;
    for (size_t group = 0; group < groups_.size(); ++group) {
      Group& g = groups_[group];
      Counters& c = counters_[group];
      const double k = c.k;
      const double sched = c.k < o_.warmup_steps ? (k + 1) / static_cast<double>(o_.warmup_steps)
                                                 : 1.0;
      const double bias_correction2 = 1 - std::pow(beta2, k + 1);
      const double lr = g.lr * sched;
      c.lr_max = std::max(lr, c.lr_max);
      const double weight = std::pow(k + 1, o_.r) * std::pow(c.lr_max, o_.weight_lr_power);
      c.weight_sum = c.weight_sum + weight;
      const double ckp1 = c.weight_sum != 0 ? weight / c.weight_sum : 0;
      for (size_t i = 0; i < g.params.size(); ++i) {
        at::Tensor& y = g.params[i];
        if (!y.grad().defined()) continue;
        State& s = g.state[i];
        if (!s.initialised) {
          s.initialised = true;
          s.z = y.detach().clone();
          s.exp_avg_sq = torch::zeros_like(y);
        }
        ++s.step;
        // As schedulefree does: the gradient's own buffer becomes the normalised step.
        at::Tensor grad = y.mutable_grad();
        s.exp_avg_sq.mul_(beta2).addcmul_(grad, grad, 1 - beta2);
        const at::Tensor denom = s.exp_avg_sq.div(bias_correction2).sqrt_().add_(eps);
        grad.div_(denom);
        if (weight_decay_ != 0) grad.add_(y, weight_decay_);  // decay taken at y
        y.lerp_(s.z, ckp1);
        y.add_(grad, lr * (beta1 * (1 - ckp1) - 1));
        s.z.sub_(grad, lr);
      }
      c.k = c.k + 1;
    }
  }

  // x = y + (1 - 1/beta1)(z - y); y = x + (1 - beta1)(z - x): schedulefree's own switches, for
  // the parameters that have stepped (the others hold both).
  void eval() override {
    if (!training_) return;
    lerp_all(1 - 1 / options_.beta1);
    training_ = false;
  }
  void train() override {
    if (training_) return;
    lerp_all(1 - options_.beta1);
    training_ = true;
  }

  std::string describe() const override {
    return kohya_optimizer_name("schedulefree.adamw_schedulefree.AdamWScheduleFree", options_);
  }

 private:
  struct Counters {
    int64_t k = 0;  // steps taken
    double weight_sum = 0, lr_max = -1;
  };

  void lerp_all(double weight) {
    torch::NoGradGuard no_grad;
    for (Group& g : groups_) {
      for (size_t i = 0; i < g.params.size(); ++i) {
        if (g.state[i].initialised) g.params[i].lerp_(g.state[i].z, weight);
      }
    }
  }

  std::string name() const override { return "AdamWScheduleFree"; }
  // The mode is state: a state saved with the evaluation weights in the parameters resumes
  // them, and the next step's train() moves them back exactly as the run saving it did.
  std::vector<double*> scalars() override {
    std::vector<double*> out{&mode_};
    mode_ = training_ ? 1 : 0;
    k_as_double_.resize(counters_.size());
    for (size_t g = 0; g < counters_.size(); ++g) {
      k_as_double_[g] = static_cast<double>(counters_[g].k);
      out.push_back(&k_as_double_[g]);
      out.push_back(&counters_[g].weight_sum);
      out.push_back(&counters_[g].lr_max);
    }
    return out;
  }
  void loaded_scalars() override {
    training_ = mode_ != 0;
    for (size_t g = 0; g < counters_.size(); ++g) {
      counters_[g].k = static_cast<int64_t>(k_as_double_[g]);
    }
  }
  void check_loaded(const at::Tensor& p, const State& s) const override {
    TORCH_CHECK(s.z.defined() && s.z.sizes() == p.sizes() && s.exp_avg_sq.defined() &&
                    s.exp_avg_sq.sizes() == p.sizes(),
                "state of another shape");
  }

  OptimizerOptions options_;
  OptimizerOptions::ScheduleFreeOptions o_;
  double weight_decay_ = 0;
  std::vector<Counters> counters_;
  bool training_ = false;  // schedulefree starts in eval mode; kohya calls train() at once
  double mode_ = 0;
  std::vector<double> k_as_double_;
};

}  // namespace

std::unique_ptr<Optimizer> make_adamw_schedulefree(const OptimizerOptions& options,
                                                   std::vector<ParamGroup> groups) {
  auto optimizer = std::make_unique<AdamWScheduleFree>(options, std::move(groups));
  optimizer->train();  // as kohya's get_optimizer does right after building it
  return optimizer;
}

}  // namespace lorapipe::trainer
