#include "trainer/optimizer.h"

#include <torch/torch.h>

#include <algorithm>
#include <cctype>
#include <sstream>

#include "common/error.h"
#include "trainer/adamw8bit_optimizer.h"
#include "trainer/prodigy_optimizer.h"

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

// torch.optim.AdamW's default weight decay (bitsandbytes' AdamW8bit has the same).
constexpr double kAdamWWeightDecay = 0.01;

bool parse_bool(const std::string& arg, const std::string& text) {
  if (text == "True" || text == "true" || text == "1") return true;
  if (text == "False" || text == "false" || text == "0") return false;
  throw InputError("--optimizer_args '" + arg + "': '" + text + "' is not True or False");
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
          .weight_decay(options.weight_decay.value_or(kAdamWWeightDecay));
      torch_groups.emplace_back(g.params, std::move(group_options));
    }
    torch::optim::AdamWOptions defaults(groups.empty() ? 1e-4 : groups[0].lr);
    defaults.betas({options.beta1, options.beta2})
        .eps(options.eps)
        .weight_decay(options.weight_decay.value_or(kAdamWWeightDecay));
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
    out << "torch.optim.adamw.AdamW(weight_decay=" << options_.weight_decay.value_or(kAdamWWeightDecay)
        << ",betas=("
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

// lion-pytorch's Lion (Chen et al. 2023, arXiv 2302.06675), the class kohya loads for
// --optimizer_type=Lion, operation for operation (LionParity holds it bit-exact): decay
// p *= 1 - lr * wd, step p -= lr * sign(beta1 m + (1 - beta1) g), then m = beta2 m + (1 - beta2) g.
// One moment: 4 bytes of state per parameter.
class Lion final : public Optimizer {
 public:
  Lion(const OptimizerOptions& options, std::vector<ParamGroup> groups) : options_(options) {
    weight_decay_ = options.weight_decay.value_or(0.0);  // lion-pytorch's default
    if (!(options.beta1 >= 0 && options.beta1 <= 1 && options.beta2 >= 0 && options.beta2 <= 1)) {
      throw InputError("--optimizer_args betas must lie in [0, 1] (Lion)");
    }
    for (ParamGroup& g : groups) {
      groups_.push_back(Group{std::move(g.params), g.lr, {}});
      groups_.back().exp_avg.resize(groups_.back().params.size());
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
        if (!g.exp_avg[i].defined()) g.exp_avg[i] = torch::zeros_like(p);
        at::Tensor& exp_avg = g.exp_avg[i];
        p.mul_(1. - g.lr * weight_decay_);
        const at::Tensor update = exp_avg.clone().mul_(beta1).add(grad, 1. - beta1).sgn_();
        p.add_(update, -g.lr);
        exp_avg.mul_(beta2).add_(grad, 1. - beta2);
      }
    }
  }

  void zero_grad() override {
    for (Group& g : groups_) {
      for (at::Tensor& p : g.params) p.mutable_grad() = at::Tensor();
    }
  }
  size_t group_count() const override { return groups_.size(); }
  void set_lr(size_t group, double lr) override { groups_.at(group).lr = lr; }
  double lr(size_t group) const override { return groups_.at(group).lr; }

  void save(const std::filesystem::path& file) const override {
    torch::serialize::OutputArchive archive;
    for (size_t g = 0; g < groups_.size(); ++g) {
      for (size_t i = 0; i < groups_[g].exp_avg.size(); ++i) {
        const at::Tensor& m = groups_[g].exp_avg[i];
        // An undefined moment (no gradient yet) is saved as an empty tensor.
        archive.write("g" + std::to_string(g) + "_" + std::to_string(i),
                      m.defined() ? m.cpu() : torch::empty({0}));
      }
    }
    archive.save_to(file.string());
  }
  void load(const std::filesystem::path& file) override {
    torch::serialize::InputArchive archive;
    try {
      archive.load_from(file.string());
      for (size_t g = 0; g < groups_.size(); ++g) {
        for (size_t i = 0; i < groups_[g].exp_avg.size(); ++i) {
          at::Tensor m;
          archive.read("g" + std::to_string(g) + "_" + std::to_string(i), m);
          const at::Tensor& p = groups_[g].params[i];
          if (m.numel() == 0) {
            groups_[g].exp_avg[i] = at::Tensor();
            continue;
          }
          TORCH_CHECK(m.sizes() == p.sizes(), "a moment of another shape");
          groups_[g].exp_avg[i] = m.to(p.device(), p.scalar_type());
        }
      }
    } catch (const c10::Error& e) {
      throw InputError(file.string() + ": not a Lion optimizer state for this network: " +
                       e.what_without_backtrace());
    }
  }
  std::string describe() const override {
    return kohya_optimizer_name("lion_pytorch.lion_pytorch.Lion", options_);
  }

 private:
  struct Group {
    std::vector<at::Tensor> params;
    double lr;
    std::vector<at::Tensor> exp_avg;
  };
  OptimizerOptions options_;
  double weight_decay_ = 0;
  std::vector<Group> groups_;
};

}  // namespace

std::string kohya_optimizer_name(const std::string& cls, const OptimizerOptions& options) {
  if (options.given_args.empty()) return cls;
  std::string out = cls + "(";
  for (size_t i = 0; i < options.given_args.size(); ++i) {
    out += (i ? "," : "") + options.given_args[i];
  }
  return out + ")";
}

void apply_optimizer_args(OptimizerOptions& options, const std::vector<std::string>& args) {
  for (const std::string& arg : args) {
    const size_t eq = arg.find('=');
    if (eq == std::string::npos) {
      throw InputError("--optimizer_args '" + arg + "': expected key=value");
    }
    const std::string key = arg.substr(0, eq);
    const std::string value = arg.substr(eq + 1);
    options.given_args.push_back(arg);
    auto& prodigy = options.prodigy;
    const bool prodigy_only = key == "decouple" || key == "use_bias_correction" ||
                              key == "safeguard_warmup" || key == "d0" || key == "d_coef" ||
                              key == "growth_rate" || key == "beta3" || key == "slice_p";
    if (prodigy_only && options.prodigy_arg.empty()) options.prodigy_arg = key;
    if (key == "decouple") {
      prodigy.decouple = parse_bool(arg, value);
    } else if (key == "use_bias_correction") {
      prodigy.use_bias_correction = parse_bool(arg, value);
    } else if (key == "safeguard_warmup") {
      prodigy.safeguard_warmup = parse_bool(arg, value);
    } else if (key == "d0") {
      prodigy.d0 = parse_number(arg, value);
    } else if (key == "d_coef") {
      prodigy.d_coef = parse_number(arg, value);
    } else if (key == "growth_rate") {
      prodigy.growth_rate = value == "inf" || value == "float('inf')" ? prodigy.growth_rate
                                                                       : parse_number(arg, value);
    } else if (key == "beta3") {
      prodigy.beta3 = parse_number(arg, value);
    } else if (key == "slice_p") {
      const double v = parse_number(arg, value);
      if (v < 1 || v != static_cast<double>(static_cast<int64_t>(v))) {
        throw InputError("--optimizer_args '" + arg + "': slice_p wants a whole number >= 1");
      }
      prodigy.slice_p = static_cast<int64_t>(v);
    } else if (key == "weight_decay") {
      options.weight_decay = parse_number(arg, value);
    } else if (key == "min_8bit_size") {
      const double v = parse_number(arg, value);
      if (v < 0 || v != static_cast<double>(static_cast<int64_t>(v))) {
        throw InputError("--optimizer_args '" + arg + "': min_8bit_size wants a whole number >= 0");
      }
      options.min_8bit_size = static_cast<int64_t>(v);
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
      options.betas_given = true;
    } else {
      throw InputError("--optimizer_args '" + arg + "': unknown argument '" + key +
                       "' (known: weight_decay, betas, eps; min_8bit_size for the 8-bit AdamW; "
                       "decouple, use_bias_correction, safeguard_warmup, d0, d_coef, "
                       "growth_rate, beta3, slice_p for Prodigy)");
    }
  }
}

std::unique_ptr<Optimizer> make_optimizer(const OptimizerOptions& options,
                                          std::vector<ParamGroup> groups) {
  const std::string type = lower(options.type);
  if (type == "prodigy" || type == "prodigyopt.prodigy") {
    if (options.min_8bit_size) {
      throw InputError("--optimizer_args min_8bit_size belongs to AdamW8bit and PagedAdamW8bit, "
                       "not Prodigy");
    }
    return make_prodigy(options, std::move(groups));
  }
  if (type == "lion" || type == "lion_pytorch.lion") {
    if (options.min_8bit_size) {
      throw InputError("--optimizer_args min_8bit_size belongs to AdamW8bit and PagedAdamW8bit, "
                       "not Lion");
    }
    if (!options.prodigy_arg.empty()) {
      throw InputError("--optimizer_args " + options.prodigy_arg +
                       " is Prodigy's; Lion takes weight_decay and betas");
    }
    // lion-pytorch's defaults, unless given: betas (0.9, 0.99), no eps.
    OptimizerOptions lion = options;
    if (!options.betas_given) lion.beta1 = 0.9, lion.beta2 = 0.99;
    return std::make_unique<Lion>(lion, std::move(groups));
  }
  if (!options.prodigy_arg.empty()) {
    throw InputError("--optimizer_args " + options.prodigy_arg + " is Prodigy's; --optimizer_type=" +
                     options.type + " takes weight_decay, betas, eps" +
                     (type == "adamw" ? "" : ", min_8bit_size"));
  }
  if (type == "adamw" || type == "torch.optim.adamw") {
    if (options.min_8bit_size) {
      throw InputError(
          "--optimizer_args min_8bit_size: AdamW keeps fp32 state; the argument "
          "belongs to AdamW8bit and PagedAdamW8bit");
    }
    return std::make_unique<TorchAdamW>(options, std::move(groups));
  }
  if (type == "adamw8bit" || type == "bitsandbytes.optim.adamw8bit") {
    return make_adamw8bit(options, std::move(groups), /*paged=*/false);
  }
  if (type == "pagedadamw8bit" || type == "bitsandbytes.optim.pagedadamw8bit") {
    return make_adamw8bit(options, std::move(groups), /*paged=*/true);
  }
  throw InputError("--optimizer_type='" + options.type +
                   "' is not available: use AdamW, AdamW8bit, PagedAdamW8bit, Prodigy or Lion");
}

}  // namespace lorapipe::trainer
