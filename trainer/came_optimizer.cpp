// CAME (Luo et al. 2023, "Confidence-guided Adaptive Memory Efficient Optimization", arXiv
// 2307.02047) behind the Optimizer seam: came-pytorch's CAME, the class kohya loads for
// --optimizer_type=came_pytorch.CAME, operation for operation (CameParity holds it bit-exact).
// Adafactor's factored second moment (rows and columns of a matrix or a conv kernel's last two
// dimensions) normalises the gradient; the update is clipped to an RMS of clip_threshold and
// averaged (beta1); the average's instability, (update - average)^2, is kept factored too
// (beta3) and scales the step: a steady direction steps further than a noisy one. Decay is
// decoupled, p -= lr * wd * p. A LoRA's down [r, in] keeps 2 (r + in) floats of second moments
// beside its r * in first moment.

#include "trainer/came_optimizer.h"

#include <torch/serialize.h>
#include <torch/torch.h>

#include <cmath>

#include "common/error.h"
#include "trainer/optimizer_state.h"

namespace lorapipe::trainer {
namespace {

// came-pytorch's _rms: the root mean square, a 0-d tensor.
at::Tensor rms(const at::Tensor& t) {
  return t.norm(2) / std::pow(static_cast<double>(t.numel()), 0.5);
}

// came-pytorch's _approx_sq_grad: the factored moment's reciprocal square root, row x column.
at::Tensor approx_rsqrt(const at::Tensor& row, const at::Tensor& col) {
  const at::Tensor r = (row / row.mean(-1, /*keepdim=*/true)).rsqrt_().unsqueeze(-1);
  const at::Tensor c = col.unsqueeze(-2).rsqrt();
  return torch::mul(r, c);
}

struct CameState {
  bool initialised = false;
  int64_t step = 0;
  at::Tensor exp_avg;             // the update's average
  at::Tensor row, col, sq;        // the squared gradient's: factored, or whole for a vector
  at::Tensor res_row, res_col;    // the instability's, factored (matrices and kernels only)
  std::vector<std::pair<const char*, at::Tensor*>> tensors() {
    return {{"exp_avg", &exp_avg}, {"row", &row},         {"col", &col},
            {"sq", &sq},           {"res_row", &res_row}, {"res_col", &res_col}};
  }
};

class Came final : public GroupedOptimizer<CameState> {
 public:
  using State = CameState;
  Came(const OptimizerOptions& options, std::vector<ParamGroup> groups)
      : GroupedOptimizer(std::move(groups)), options_(options) {
    weight_decay_ = options.weight_decay.value_or(0.0);
    betas_ = {options.beta1, options.beta2, options.beta3.value_or(0.9999)};
    eps_ = {options.adafactor.eps1, options.adafactor.eps2};
    for (double b : betas_) {
      if (!(b >= 0 && b <= 1)) {  // came-pytorch asserts it
        throw InputError("--optimizer_args betas=" + std::to_string(betas_[0]) + "," +
                         std::to_string(betas_[1]) + "," + std::to_string(betas_[2]) +
                         ": CAME's must lie in [0, 1]");
      }
    }
  }

  void step() override {
    torch::NoGradGuard no_grad;
    const double clip = options_.adafactor.clip_threshold;
    for (Group& g : groups_) {
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
          s.exp_avg = torch::zeros_like(grad);
          if (factored) {
            std::vector<int64_t> row(grad.sizes().begin(), grad.sizes().end() - 1);
            std::vector<int64_t> col(grad.sizes().begin(), grad.sizes().end() - 2);
            col.push_back(grad.size(-1));
            s.row = torch::zeros(row).to(grad);
            s.col = torch::zeros(col).to(grad);
            s.res_row = torch::zeros(row).to(grad);
            s.res_col = torch::zeros(col).to(grad);
          } else {
            s.sq = torch::zeros_like(grad);
          }
        }
        ++s.step;

        at::Tensor update = grad.pow(2) + eps_[0];
        if (factored) {
          s.row.mul_(betas_[1]).add_(update.mean(-1), 1.0 - betas_[1]);
          s.col.mul_(betas_[1]).add_(update.mean(-2), 1.0 - betas_[1]);
          update = approx_rsqrt(s.row, s.col);
          update.mul_(grad);
        } else {
          s.sq.mul_(betas_[1]).add_(update, 1.0 - betas_[1]);
          update = s.sq.rsqrt().mul_(grad);
        }
        update.div_((rms(update) / clip).clamp_(1.0));
        s.exp_avg.mul_(betas_[0]).add_(update, 1 - betas_[0]);
        // The confidence: how far this update strays from the average.
        const at::Tensor res = (update - s.exp_avg).pow(2) + eps_[1];
        if (factored) {
          s.res_row.mul_(betas_[2]).add_(res.mean(-1), 1.0 - betas_[2]);
          s.res_col.mul_(betas_[2]).add_(res.mean(-2), 1.0 - betas_[2]);
          update = approx_rsqrt(s.res_row, s.res_col).mul_(s.exp_avg);
        } else {
          update = s.exp_avg.clone();
        }
        if (weight_decay_ != 0) p.add_(p, -weight_decay_ * g.lr);
        update.mul_(g.lr);
        p.add_(-update);
      }
    }
  }

  std::string describe() const override {
    return kohya_optimizer_name("came_pytorch.CAME.CAME", options_);
  }

 private:
  std::string name() const override { return "CAME"; }
  void check_loaded(const at::Tensor& p, const State& s) const override {
    TORCH_CHECK(s.exp_avg.defined() && s.exp_avg.sizes() == p.sizes(),
                "an average of another shape");
    if (p.dim() >= 2) {  // factored: means over the last and the second-to-last dimension
      for (const at::Tensor* t : {&s.row, &s.res_row}) {
        TORCH_CHECK(t->defined() && t->numel() * p.size(-1) == p.numel(),
                    "factored state of another shape");
      }
      for (const at::Tensor* t : {&s.col, &s.res_col}) {
        TORCH_CHECK(t->defined() && t->numel() * p.size(-2) == p.numel(),
                    "factored state of another shape");
      }
    } else {
      TORCH_CHECK(s.sq.defined() && s.sq.sizes() == p.sizes(), "state of another shape");
    }
  }

  OptimizerOptions options_;
  double weight_decay_ = 0;
  std::vector<double> betas_, eps_;
};

}  // namespace

std::unique_ptr<Optimizer> make_came(const OptimizerOptions& options,
                                     std::vector<ParamGroup> groups) {
  // came-pytorch's defaults, unless given.
  OptimizerOptions came = options;
  if (!options.betas_given) came.beta1 = 0.9, came.beta2 = 0.999, came.beta3 = 0.9999;
  if (!options.adafactor_eps_pair) came.adafactor.eps1 = 1e-30, came.adafactor.eps2 = 1e-16;
  return std::make_unique<Came>(came, std::move(groups));
}

}  // namespace lorapipe::trainer
