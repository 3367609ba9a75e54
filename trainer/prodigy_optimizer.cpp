// Prodigy (Mishchenko & Defazio 2023, arXiv 2306.06101) behind the Optimizer seam: Adam whose step
// size d is estimated from the run itself, so kohya users train with --learning_rate=1.0 and no
// search. A port of prodigyopt 1.1.2's Prodigy.step (the PyPI package kohya loads for
// --optimizer_type=Prodigy), operation for operation: its fp32 tensor updates are the same LibTorch
// kernels, its scalars (d, d_max, the numerator, the .item() sums) are doubles as Python's floats
// are, so a run equals prodigyopt's bit for bit (ProdigyParity). Not ported: FSDP's all-reduce of
// the d statistics (lorapipe's ranks all-reduce gradients, so every rank sees the same numbers).

#include "trainer/prodigy_optimizer.h"

#include <torch/serialize.h>
#include <torch/torch.h>

#include <cmath>
#include <sstream>

#include "common/error.h"
#include "trainer/device_scalars.h"
#include "trainer/optimizer_state.h"

namespace lorapipe::trainer {
namespace {

struct ProdigyState {
  bool initialised = false;
  int64_t step = 0;
  at::Tensor s, p0, exp_avg, exp_avg_sq;
  std::vector<std::pair<const char*, at::Tensor*>> tensors() {
    return {{"s", &s}, {"p0", &p0}, {"exp_avg", &exp_avg}, {"exp_avg_sq", &exp_avg_sq}};
  }
};

class Prodigy final : public GroupedOptimizer<ProdigyState> {
 public:
  using State = ProdigyState;
  Prodigy(const OptimizerOptions& options, std::vector<ParamGroup> groups)
      : GroupedOptimizer(groups), options_(options), o_(options.prodigy) {
    weight_decay_ = options.weight_decay.value_or(0.0);  // prodigyopt's default
    check_d_adaptation(options, groups, "Prodigy");
    d_ = d_max_ = o_.d0;
  }

  void step() override {
    torch::NoGradGuard no_grad;
    const double beta1 = options_.beta1, beta2 = options_.beta2;
    const double beta3 = o_.beta3.value_or(std::sqrt(beta2));
    const double lr = top_lr();
    const double bias_correction =
        o_.use_bias_correction ? std::pow(1 - std::pow(beta2, k_ + 1), 0.5) /
                                     (1 - std::pow(beta1, k_ + 1))
                               : 1.0;
    const double dlr = d_ * lr * bias_correction;
    double d = d_;
    double d_numerator = d_numerator_ * beta3;
    double delta_numerator = 0.0, d_denom = 0.0;
    // prodigyopt's per-tensor .item() sums, taken as tensors and read in one copy after the loop;
    // summed in the same order in doubles, so the numbers are prodigyopt's.
    std::vector<at::Tensor> dots, l1s;

    for (Group& g : groups_) {
      for (size_t i = 0; i < g.params.size(); ++i) {
        at::Tensor& p = g.params[i];
        if (!p.grad().defined()) continue;
        at::Tensor grad = p.grad();
        if (weight_decay_ != 0 && !o_.decouple) grad.add_(p, weight_decay_);
        State& s = g.state[i];
        if (!s.initialised) {
          s.initialised = true;
          s.s = torch::zeros_like(sliced(p)).detach();
          // prodigyopt keeps a 0-d zero for a parameter that starts all zero (LoRA's up);
          // `p0 - p` then broadcasts to the same values a vector of zeros gives.
          s.p0 = p.any().item<bool>() ? sliced(p).detach().clone()
                                      : torch::zeros({}, p.options());
          if (beta1 > 0) s.exp_avg = torch::zeros_like(p).detach();
          s.exp_avg_sq = torch::zeros_like(p).detach();
        }
        if (g.lr > 0.0) {
          const at::Tensor sliced_grad = sliced(grad);
          dots.push_back(torch::dot(sliced_grad, s.p0 - sliced(p)));
          if (beta1 > 0) s.exp_avg.mul_(beta1).add_(grad, d * (1 - beta1));
          s.exp_avg_sq.mul_(beta2).addcmul_(grad, grad, d * d * (1 - beta2));
          s.s.mul_(beta3).add_(sliced_grad, o_.safeguard_warmup ? (d / o_.d0) * d
                                                                : (d / o_.d0) * dlr);
          l1s.push_back(s.s.abs().sum());
        }
      }
    }
    for (const double dot : read_scalars(dots)) delta_numerator += (d / o_.d0) * dlr * dot;
    for (const double l1 : read_scalars(l1s)) d_denom += l1;
    if (d_denom == 0) return;  // no gradient reached any parameter: prodigyopt changes nothing

    const double global_numerator = d_numerator + delta_numerator;
    double d_hat = d;
    if (lr > 0.0) {
      d_hat = o_.d_coef * global_numerator / d_denom;
      if (d == o_.d0) d = std::max(d, d_hat);
      d_max_ = std::max(d_max_, d_hat);
      d = std::min(d_max_, d * o_.growth_rate);
    }
    d_numerator_ = global_numerator;
    d_ = d;

    for (Group& g : groups_) {
      for (size_t i = 0; i < g.params.size(); ++i) {
        at::Tensor& p = g.params[i];
        if (!p.grad().defined()) continue;
        State& s = g.state[i];
        ++s.step;
        const at::Tensor denom = s.exp_avg_sq.sqrt().add_(d * options_.eps);
        if (weight_decay_ != 0 && o_.decouple) p.add_(p, -weight_decay_ * dlr);
        if (beta1 > 0) {
          p.addcdiv_(s.exp_avg, denom, -dlr);
        } else {
          p.addcdiv_(p.grad(), denom, -dlr * d);
        }
      }
    }
    ++k_;
  }

  std::optional<double> adapted_lr(size_t group) const override { return d_ * lr(group); }

  std::string describe() const override {
    return kohya_optimizer_name("prodigyopt.prodigy.Prodigy", options_);
  }

 private:
  std::string name() const override { return "Prodigy"; }
  std::vector<double*> scalars() override { return {&d_, &d_max_, &d_numerator_, &k_}; }
  void check_loaded(const at::Tensor& p, const State& s) const override {
    // s and p0 hold every slice_p-th element (p0 may be prodigyopt's 0-d zero).
    const int64_t n = sliced(p).numel();
    TORCH_CHECK(s.s.numel() == n && (s.p0.dim() == 0 || s.p0.numel() == n),
                "state saved with another slice_p");
    TORCH_CHECK(s.exp_avg_sq.sizes() == p.sizes() && s.exp_avg.defined() == (options_.beta1 > 0) &&
                    (!s.exp_avg.defined() || s.exp_avg.sizes() == p.sizes()),
                "moments of another shape or another beta1");
  }

  // prodigyopt's p.flatten()[::slice_p]: every slice_p-th element (a view for slice_p 1).
  at::Tensor sliced(const at::Tensor& t) const {
    const at::Tensor flat = t.flatten();
    return o_.slice_p == 1 ? flat : flat.slice(0, 0, flat.numel(), o_.slice_p);
  }

  OptimizerOptions options_;
  OptimizerOptions::ProdigyOptions o_;
  double weight_decay_ = 0;
  // prodigyopt keeps these in every group, always equal; one copy here.
  double d_ = 0, d_max_ = 0, d_numerator_ = 0;
  double k_ = 0;  // steps taken (a double: saved with the other scalars)
};

}  // namespace

std::unique_ptr<Optimizer> make_prodigy(const OptimizerOptions& options,
                                        std::vector<ParamGroup> groups) {
  return std::make_unique<Prodigy>(options, std::move(groups));
}

}  // namespace lorapipe::trainer
