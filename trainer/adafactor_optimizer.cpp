// Adafactor (Shazeer & Stern 2018, arXiv 1804.04235) behind the Optimizer seam: transformers'
// Adafactor (transformers.optimization.Adafactor, the class kohya loads for
// --optimizer_type=Adafactor), operation for operation, so AdafactorParity holds it bit-exact.
// Second moments of a matrix (or conv kernel) are kept factored as row and column means: a
// LoRA's down [r, in] costs r + in floats instead of r * in.
//
// kohya's handling is kept: relative_step defaults to True, and then the step size is Adafactor's
// own (min(1e-2, 1/sqrt(step)), times the parameter's RMS with scale_parameter) and the learning
// rates and schedule are ignored (kohya swaps in transformers' AdafactorSchedule, which only
// reports that step size; lr() reports it the same way). warmup_init implies relative_step.

#include "trainer/adafactor_optimizer.h"

#include <torch/serialize.h>
#include <torch/torch.h>

#include <cmath>

#include "common/error.h"
#include "common/log.h"
#include "trainer/optimizer_state.h"

namespace lorapipe::trainer {
namespace {

// transformers' Adafactor._rms: the root mean square, a 0-d tensor.
at::Tensor rms(const at::Tensor& t) {
  return t.norm(2) / std::pow(static_cast<double>(t.numel()), 0.5);
}

struct AdafactorState {
  bool initialised = false;
  int64_t step = 0;
  at::Tensor rms;                     // 0-d, the parameter's RMS before this step
  at::Tensor row, col, sq, exp_avg;  // factored moments, or the full one; the first moment
  std::vector<std::pair<const char*, at::Tensor*>> tensors() {
    return {{"rms", &rms}, {"row", &row}, {"col", &col}, {"sq", &sq}, {"exp_avg", &exp_avg}};
  }
};

class Adafactor final : public GroupedOptimizer<AdafactorState> {
 public:
  using State = AdafactorState;
  Adafactor(const OptimizerOptions& options, std::vector<ParamGroup> groups)
      : GroupedOptimizer(groups), options_(options), o_(options.adafactor) {
    if (o_.warmup_init && !o_.relative_step) {
      LP_LOG(kInfo, "trainer") << "Adafactor: warmup_init sets relative_step, as kohya does";
      o_.relative_step = true;
    }
    weight_decay_ = options.weight_decay.value_or(0.0);  // transformers' default
    if (o_.relative_step) {
      LP_LOG(kInfo, "trainer") << "Adafactor: relative_step: its own step size, so the learning "
                                  "rates and their schedule are not used (as in kohya)";
    }
    for (const ParamGroup& g : groups) reported_lr_.push_back(g.lr);
  }

  void step() override {
    torch::NoGradGuard no_grad;
    for (size_t group = 0; group < groups_.size(); ++group) {
      Group& g = groups_[group];
      for (size_t i = 0; i < g.params.size(); ++i) {
        at::Tensor& p = g.params[i];
        if (!p.grad().defined()) continue;
        at::Tensor grad = p.grad();
        if (grad.scalar_type() == at::kHalf || grad.scalar_type() == at::kBFloat16) {
          grad = grad.to(at::kFloat);
        }
        State& s = g.state[i];
        const bool factored = grad.dim() >= 2;
        if (!s.initialised) {
          s.initialised = true;
          if (o_.beta1) s.exp_avg = torch::zeros_like(grad);
          if (factored) {
            std::vector<int64_t> row(grad.sizes().begin(), grad.sizes().end() - 1);
            std::vector<int64_t> col(grad.sizes().begin(), grad.sizes().end() - 2);
            col.push_back(grad.size(-1));
            s.row = torch::zeros(row).to(grad);
            s.col = torch::zeros(col).to(grad);
          } else {
            s.sq = torch::zeros_like(grad);
          }
        }
        at::Tensor p32 = p;
        if (p.scalar_type() == at::kHalf || p.scalar_type() == at::kBFloat16) p32 = p.to(at::kFloat);

        ++s.step;
        s.rms = rms(p32);
        const Lr lr = step_size(g, s);
        if (i == 0) reported_lr_[group] = lr.value();

        const double beta2t = 1.0 - std::pow(static_cast<double>(s.step), o_.decay_rate);
        at::Tensor update = grad.pow(2) + o_.eps1;
        if (factored) {
          s.row.mul_(beta2t).add_(update.mean(-1), 1.0 - beta2t);
          s.col.mul_(beta2t).add_(update.mean(-2), 1.0 - beta2t);
          const at::Tensor r = (s.row / s.row.mean(-1, /*keepdim=*/true)).rsqrt_().unsqueeze(-1);
          const at::Tensor c = s.col.unsqueeze(-2).rsqrt();
          update = torch::mul(r, c);
          update.mul_(grad);
        } else {
          s.sq.mul_(beta2t).add_(update, 1.0 - beta2t);
          update = s.sq.rsqrt().mul_(grad);
        }
        update.div_((rms(update) / o_.clip_threshold).clamp_(1.0));
        lr.multiply(update);
        if (o_.beta1) {
          s.exp_avg.mul_(*o_.beta1).add_(update, 1 - *o_.beta1);
          update = s.exp_avg;
        }
        if (weight_decay_ != 0) p32.add_(p32, lr.scaled(-weight_decay_));
        p32.add_(-update);
        if (!p32.is_same(p)) p.copy_(p32);
      }
    }
  }

  // With relative_step, the step size Adafactor took for the group's first parameter, as kohya's
  // AdafactorSchedule reports it (its rate before the first step).
  double lr(size_t group) const override {
    return o_.relative_step ? reported_lr_.at(group) : groups_.at(group).lr;
  }

  // kohya adds relative_step=True where it is not given, and sets it where warmup_init is on.
  std::string describe() const override {
    OptimizerOptions written = options_;
    for (std::string& arg : written.given_args) {
      if (arg.starts_with("relative_step=") && o_.relative_step) arg = "relative_step=True";
    }
    return kohya_optimizer_name("transformers.optimization.Adafactor", written,
                                {"relative_step=True"});
  }

 private:
  std::string name() const override { return "Adafactor"; }
  std::vector<double*> scalars() override {
    std::vector<double*> out;
    for (double& lr : reported_lr_) out.push_back(&lr);
    return out;
  }
  void check_loaded(const at::Tensor& p, const State& s) const override {
    TORCH_CHECK(s.rms.defined(), "no RMS");
    if (p.dim() >= 2) {  // factored: means over the last and the second-to-last dimension
      TORCH_CHECK(s.row.defined() && s.col.defined() &&
                      s.row.numel() * p.size(-1) == p.numel() &&
                      s.col.numel() * p.size(-2) == p.numel(),
                  "factored state of another shape");
    } else {
      TORCH_CHECK(s.sq.defined() && s.sq.sizes() == p.sizes(), "state of another shape");
    }
    TORCH_CHECK(s.exp_avg.defined() == o_.beta1.has_value() &&
                    (!s.exp_avg.defined() || s.exp_avg.sizes() == p.sizes()),
                "first moment of another shape or another beta1");
  }

  // transformers' _get_lr. Its result is a Python float, or a 0-d fp32 tensor when
  // scale_parameter picks the parameter's RMS (max(eps2, RMS) returns the tensor); the update is
  // multiplied by whichever it is, as transformers multiplies.
  struct Lr {
    at::Tensor tensor;  // defined: the step size is this fp32 0-d tensor
    double number = 0;  // otherwise this
    double value() const { return tensor.defined() ? tensor.item<double>() : number; }
    // k * lr as transformers computes it: in fp32 for the tensor, in double for the float.
    double scaled(double k) const {
      return tensor.defined() ? (tensor * k).item<double>() : k * number;
    }
    void multiply(at::Tensor& t) const {
      if (tensor.defined()) {
        t.mul_(tensor);
      } else {
        t.mul_(number);
      }
    }
  };
  Lr step_size(const Group& g, const State& s) const {
    double rel = g.lr;
    if (o_.relative_step) {
      const double min_step = o_.warmup_init ? 1e-6 * static_cast<double>(s.step) : 1e-2;
      rel = std::min(min_step, 1.0 / std::sqrt(static_cast<double>(s.step)));
    }
    Lr lr;
    if (o_.scale_parameter && (s.rms > o_.eps2).item<bool>()) {
      lr.tensor = s.rms * rel;
    } else {
      lr.number = (o_.scale_parameter ? o_.eps2 : 1.0) * rel;
    }
    return lr;
  }

  OptimizerOptions options_;
  OptimizerOptions::AdafactorOptions o_;
  double weight_decay_ = 0;
  std::vector<double> reported_lr_;  // per group: the step size its first parameter last took
};

}  // namespace

std::unique_ptr<Optimizer> make_adafactor(const OptimizerOptions& options,
                                          std::vector<ParamGroup> groups) {
  return std::make_unique<Adafactor>(options, std::move(groups));
}

}  // namespace lorapipe::trainer
