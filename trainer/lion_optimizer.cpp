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

// Each parameter's state: its moment (undefined until its first gradient).
class Lion final : public GroupedOptimizer<at::Tensor> {
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
        if (!g.state[i].defined()) g.state[i] = torch::zeros_like(p);
        at::Tensor& exp_avg = g.state[i];
        p.mul_(1. - g.lr * weight_decay_);
        const at::Tensor update = exp_avg.clone().mul_(beta1).add(grad, 1. - beta1).sgn_();
        p.add_(update, -g.lr);
        exp_avg.mul_(beta2).add_(grad, 1. - beta2);
      }
    }
  }


  void save(const std::filesystem::path& file) const override {
    torch::serialize::OutputArchive archive;
    for (size_t g = 0; g < groups_.size(); ++g) {
      for (size_t i = 0; i < groups_[g].state.size(); ++i) {
        const at::Tensor& m = groups_[g].state[i];
        // An undefined moment (no gradient yet) is saved as an empty tensor.
        archive.write(state_key(g, i, "exp_avg"), m.defined() ? m.cpu() : torch::empty({0}));
      }
    }
    archive.save_to(file.string());
  }
  void load(const std::filesystem::path& file) override {
    load_state_archive(file, "Lion", [&](torch::serialize::InputArchive& archive) {
      for (size_t g = 0; g < groups_.size(); ++g) {
        for (size_t i = 0; i < groups_[g].state.size(); ++i) {
          const at::Tensor& p = groups_[g].params[i];
          const at::Tensor m = read_state(archive, state_key(g, i, "exp_avg"), p, false);
          TORCH_CHECK(m.numel() == 0 || m.sizes() == p.sizes(), "a moment of another shape");
          groups_[g].state[i] = m.numel() == 0 ? at::Tensor() : m;
        }
      }
    });
  }
  std::string describe() const override {
    return kohya_optimizer_name("lion_pytorch.lion_pytorch.Lion", options_);
  }

 private:
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
