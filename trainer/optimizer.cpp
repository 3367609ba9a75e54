#include "trainer/optimizer.h"

#include <torch/torch.h>

#include <algorithm>
#include <cctype>
#include <sstream>

#include "common/error.h"

namespace lorapipe::trainer {
namespace {

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  return s;
}

double parse_number(const std::string& arg, const std::string& text) {
  try {
    size_t used = 0;
    const double v = std::stod(text, &used);
    if (used == text.size()) return v;
  } catch (const std::exception&) {
  }
  throw InputError("--optimizer_args '" + arg + "': '" + text + "' is not a number");
}

// torch.optim.AdamW through LibTorch's implementation (the same update as Python's
// single-tensor AdamW: decoupled decay p *= 1 - lr * wd, then Adam with bias correction).
class TorchAdamW final : public Optimizer {
 public:
  TorchAdamW(const OptimizerOptions& options, std::vector<ParamGroup> groups) : options_(options) {
    std::vector<torch::optim::OptimizerParamGroup> torch_groups;
    for (ParamGroup& g : groups) {
      auto group_options = std::make_unique<torch::optim::AdamWOptions>(g.lr);
      group_options->betas({options.beta1, options.beta2})
          .eps(options.eps)
          .weight_decay(options.weight_decay);
      torch_groups.emplace_back(g.params, std::move(group_options));
    }
    torch::optim::AdamWOptions defaults(groups.empty() ? 1e-4 : groups[0].lr);
    defaults.betas({options.beta1, options.beta2}).eps(options.eps).weight_decay(
        options.weight_decay);
    adamw_ = std::make_unique<torch::optim::AdamW>(std::move(torch_groups), defaults);
  }

  void step() override { adamw_->step(); }
  void zero_grad() override { adamw_->zero_grad(/*set_to_none=*/true); }
  size_t group_count() const override { return adamw_->param_groups().size(); }
  void set_lr(size_t group, double lr) override { options(group).lr(lr); }
  double lr(size_t group) const override {
    return static_cast<const torch::optim::AdamWOptions&>(adamw_->param_groups()[group].options())
        .lr();
  }
  void save(const std::filesystem::path& file) const override {
    torch::serialize::OutputArchive archive;
    adamw_->save(archive);
    archive.save_to(file.string());
  }
  void load(const std::filesystem::path& file) override {
    torch::serialize::InputArchive archive;
    try {
      archive.load_from(file.string());
    } catch (const c10::Error& e) {
      throw InputError(file.string() + ": not an optimizer state: " + e.what_without_backtrace());
    }
    adamw_->load(archive);
  }
  std::string describe() const override {
    std::ostringstream out;
    out << "torch.optim.adamw.AdamW(weight_decay=" << options_.weight_decay << ",betas=("
        << options_.beta1 << "," << options_.beta2 << "),eps=" << options_.eps << ")";
    return out.str();
  }

 private:
  torch::optim::AdamWOptions& options(size_t group) {
    return static_cast<torch::optim::AdamWOptions&>(adamw_->param_groups()[group].options());
  }

  OptimizerOptions options_;
  std::unique_ptr<torch::optim::AdamW> adamw_;
};

}  // namespace

void apply_optimizer_args(OptimizerOptions& options, const std::vector<std::string>& args) {
  for (const std::string& arg : args) {
    const size_t eq = arg.find('=');
    if (eq == std::string::npos) {
      throw InputError("--optimizer_args '" + arg + "': expected key=value");
    }
    const std::string key = arg.substr(0, eq);
    const std::string value = arg.substr(eq + 1);
    if (key == "weight_decay") {
      options.weight_decay = parse_number(arg, value);
    } else if (key == "eps") {
      options.eps = parse_number(arg, value);
    } else if (key == "betas") {
      std::string v = value;
      v.erase(std::remove_if(v.begin(), v.end(),
                             [](char c) { return c == '(' || c == ')' || c == ' '; }),
              v.end());
      const size_t comma = v.find(',');
      if (comma == std::string::npos) {
        throw InputError("--optimizer_args '" + arg + "': betas wants two numbers, b1,b2");
      }
      options.beta1 = parse_number(arg, v.substr(0, comma));
      options.beta2 = parse_number(arg, v.substr(comma + 1));
    } else {
      throw InputError("--optimizer_args '" + arg + "': unknown argument '" + key +
                       "' (known: weight_decay, betas, eps)");
    }
  }
}

std::unique_ptr<Optimizer> make_optimizer(const OptimizerOptions& options,
                                          std::vector<ParamGroup> groups) {
  const std::string type = lower(options.type);
  if (type == "adamw" || type == "torch.optim.adamw") {
    return std::make_unique<TorchAdamW>(options, std::move(groups));
  }
  throw InputError("--optimizer_type='" + options.type +
                   "' is not available: use AdamW (AdamW8bit and PagedAdamW8bit arrive with the "
                   "kernels' 8-bit optimizers)");
}

}  // namespace lorapipe::trainer
