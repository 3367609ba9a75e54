// D-Adaptation Adam (Defazio & Mishchenko 2023, arXiv 2301.07733) behind the Optimizer seam:
// dadaptation 3.2's DAdaptAdam, the class kohya loads for --optimizer_type=DAdaptAdam (its
// "DAdaptation" is the experimental DAdaptAdamPreprint, refused by name), operation for
// operation (DAdaptAdamParity holds it bit-exact), its Python floats kept as doubles. Like
// Prodigy, its predecessor in kohya guides, it estimates the step size d itself and is run with
// a learning rate near 1. Not ported: FSDP's all-reduce of the estimate
// (lorapipe's ranks all-reduce gradients), layer_scale (kohya never sets it: 1).

#include "trainer/dadapt_optimizer.h"

#include <torch/serialize.h>
#include <torch/torch.h>

#include <cmath>

#include "common/error.h"
#include "trainer/device_scalars.h"
#include "trainer/optimizer_state.h"

namespace lorapipe::trainer {
namespace {

struct DAdaptState {
  bool initialised = false;
  int64_t step = 0;
  at::Tensor s, exp_avg, exp_avg_sq;
  std::vector<std::pair<const char*, at::Tensor*>> tensors() {
    return {{"s", &s}, {"exp_avg", &exp_avg}, {"exp_avg_sq", &exp_avg_sq}};
  }
};

class DAdaptAdam final : public GroupedOptimizer<DAdaptState> {
 public:
  using State = DAdaptState;
  DAdaptAdam(const OptimizerOptions& options, std::vector<ParamGroup> groups)
      : GroupedOptimizer(groups), options_(options), o_(options.prodigy) {
    weight_decay_ = options.weight_decay.value_or(0.0);  // dadaptation's default
    check_d_adaptation(options, groups, "DAdaptAdam");
    d_ = o_.d0;
  }

  void step() override {
    torch::NoGradGuard no_grad;
    const double beta1 = options_.beta1, beta2 = options_.beta2, eps = options_.eps;
    const bool decouple = decouple_();
    const double lr = top_lr();
    const double bias_correction =
        o_.use_bias_correction ? std::pow(1 - std::pow(beta2, k_ + 1), 0.5) /
                                     (1 - std::pow(beta1, k_ + 1))
                               : 1.0;
    double d = d_;
    const double dlr = d * lr * bias_correction;
    const double sqrt_beta2 = std::pow(beta2, 0.5);
    const double r = 1.0;  // layer_scale
    double numerator_acum = 0.0, sk_l1 = 0.0;
    // dadaptation's per-tensor .item() sums, taken as tensors and read in one copy after the
    // loop; summed in the same order in doubles, so the numbers are dadaptation's.
    std::vector<at::Tensor> dots, l1s;

    for (Group& g : groups_) {
      for (size_t i = 0; i < g.params.size(); ++i) {
        at::Tensor& p = g.params[i];
        if (!p.grad().defined()) continue;
        at::Tensor grad = p.grad();
        if (weight_decay_ != 0 && !decouple) grad.add_(p, weight_decay_);
        State& s = g.state[i];
        if (!s.initialised) {
          s.initialised = true;
          s.s = torch::zeros_like(p).detach();
          s.exp_avg = torch::zeros_like(p).detach();
          s.exp_avg_sq = torch::zeros_like(p).detach();
        }
        if (g.lr > 0.0) {
          const at::Tensor denom = s.exp_avg_sq.sqrt().add_(eps);
          dots.push_back(torch::dot(grad.flatten(), s.s.div(denom).flatten()));
          s.exp_avg.mul_(beta1).add_(grad, r * dlr * (1 - beta1));
          s.exp_avg_sq.mul_(beta2).addcmul_(grad, grad, 1 - beta2);
          s.s.mul_(sqrt_beta2).add_(grad, dlr * (1 - sqrt_beta2));
          l1s.push_back(s.s.abs().sum());
        }
      }
    }
    for (const double dot : read_scalars(dots)) numerator_acum += r * dlr * dot;
    for (const double l1 : read_scalars(l1s)) sk_l1 += r * l1;
    const double numerator_weighted =
        sqrt_beta2 * numerator_weighted_ + (1 - sqrt_beta2) * numerator_acum;
    if (sk_l1 == 0) return;  // no gradient reached any parameter: dadaptation changes nothing
    if (lr > 0.0) {
      const double d_hat = numerator_weighted / ((1 - sqrt_beta2) * sk_l1);
      d = std::max(d, std::min(d_hat, d * o_.growth_rate));
    }
    numerator_weighted_ = numerator_weighted;
    d_ = d;

    for (Group& g : groups_) {
      for (size_t i = 0; i < g.params.size(); ++i) {
        at::Tensor& p = g.params[i];
        if (!p.grad().defined()) continue;
        State& s = g.state[i];
        ++s.step;
        const at::Tensor denom = s.exp_avg_sq.sqrt().add_(eps);
        if (weight_decay_ != 0 && decouple) p.add_(p, -weight_decay_ * dlr);
        p.addcdiv_(s.exp_avg, denom, -1);
      }
    }
    ++k_;
  }

  std::optional<double> adapted_lr(size_t group) const override { return d_ * lr(group); }

  std::string describe() const override {
    return kohya_optimizer_name("dadaptation.dadapt_adam.DAdaptAdam", options_);
  }

 private:
  std::string name() const override { return "DAdaptAdam"; }
  std::vector<double*> scalars() override { return {&d_, &numerator_weighted_, &k_}; }
  void check_loaded(const at::Tensor& p, const State& s) const override {
    for (const at::Tensor* t : {&s.s, &s.exp_avg, &s.exp_avg_sq}) {
      TORCH_CHECK(t->defined() && t->sizes() == p.sizes(), "state of another shape");
    }
  }

  // dadaptation's decouple defaults to False (Prodigy's to True).
  bool decouple_() const { return options_.decouple_given ? o_.decouple : false; }

  OptimizerOptions options_;
  OptimizerOptions::ProdigyOptions o_;  // d0, growth_rate, decouple, use_bias_correction
  double weight_decay_ = 0;
  double d_ = 0, numerator_weighted_ = 0;
  double k_ = 0;  // steps taken (a double: saved with the other scalars)
};

}  // namespace

std::unique_ptr<Optimizer> make_dadapt_adam(const OptimizerOptions& options,
                                            std::vector<ParamGroup> groups) {
  return std::make_unique<DAdaptAdam>(options, std::move(groups));
}

}  // namespace lorapipe::trainer
