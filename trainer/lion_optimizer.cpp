// lion-pytorch's Lion (Chen et al. 2023, arXiv 2302.06675) behind the Optimizer seam: the class
// kohya loads for --optimizer_type=Lion, operation for operation (LionParity holds it bit-exact):
// decay p *= 1 - lr * wd, step p -= lr * sign(beta1 m + (1 - beta1) g), then
// m = beta2 m + (1 - beta2) g. One moment: 4 bytes of state per parameter.

#include "trainer/lion_optimizer.h"

#include <torch/serialize.h>
#include <torch/torch.h>

#include "common/error.h"
#include "trainer/optimizer_state.h"

namespace lorapipe::trainer {
namespace {

// Each parameter's state: its moment, from its first gradient on.
struct LionState {
  bool initialised = false;
  int64_t step = 0;
  at::Tensor exp_avg;
  std::vector<std::pair<const char*, at::Tensor*>> tensors() { return {{"exp_avg", &exp_avg}}; }
};

class Lion final : public GroupedOptimizer<LionState> {
 public:
  Lion(const OptimizerOptions& options, std::vector<ParamGroup> groups)
      : GroupedOptimizer(std::move(groups)), options_(options) {
    weight_decay_ = options.weight_decay.value_or(0.0);  // lion-pytorch's default
    if (!(options.beta1 >= 0 && options.beta1 <= 1 && options.beta2 >= 0 && options.beta2 <= 1)) {
      throw InputError("--optimizer_args betas=" + std::to_string(options.beta1) + "," +
                       std::to_string(options.beta2) + ": Lion's must lie in [0, 1]");
    }
  }

  void step() override {
    torch::NoGradGuard no_grad;
    const double beta1 = options_.beta1, beta2 = options_.beta2;
    for (Group& g : groups_) {
      for (size_t i = 0; i < g.params.size(); ++i) {
        at::Tensor& p = g.params[i];
        if (!p.grad().defined()) continue;
        const at::Tensor& grad = p.grad();
        LionState& s = g.state[i];
        if (!s.initialised) {
          s.initialised = true;
          s.exp_avg = torch::zeros_like(p);
        }
        ++s.step;
        at::Tensor& exp_avg = s.exp_avg;
        p.mul_(1. - g.lr * weight_decay_);
        const at::Tensor update = exp_avg.clone().mul_(beta1).add(grad, 1. - beta1).sgn_();
        p.add_(update, -g.lr);
        exp_avg.mul_(beta2).add_(grad, 1. - beta2);
      }
    }
  }


  std::string describe() const override {
    return kohya_optimizer_name("lion_pytorch.lion_pytorch.Lion", options_);
  }

 private:
  std::string name() const override { return "Lion"; }
  void check_loaded(const at::Tensor& p, const LionState& s) const override {
    TORCH_CHECK(s.exp_avg.defined() && s.exp_avg.sizes() == p.sizes(), "a moment of another shape");
  }

  OptimizerOptions options_;
  double weight_decay_ = 0;
};

}  // namespace

std::unique_ptr<Optimizer> make_lion(const OptimizerOptions& options,
                                     std::vector<ParamGroup> groups) {
  // lion-pytorch's defaults, unless given: betas (0.9, 0.99), no eps.
  OptimizerOptions lion = options;
  if (!options.betas_given) lion.beta1 = 0.9, lion.beta2 = 0.99;
  return std::make_unique<Lion>(lion, std::move(groups));
}

}  // namespace lorapipe::trainer
