#include "trainer/optimizer.h"

#include <torch/torch.h>

#include <algorithm>
#include <cctype>
#include <sstream>
#include <vector>

#include "common/error.h"
#include "trainer/optimizer_state.h"
#include "common/numbers.h"
#include "kernels/cuda_device.h"
#include "trainer/adafactor_optimizer.h"
#include "trainer/adamw8bit_optimizer.h"
#include "trainer/dadapt_optimizer.h"
#include "trainer/came_optimizer.h"
#include "trainer/lion_optimizer.h"
#include "trainer/schedulefree_optimizer.h"
#include "trainer/prodigy_optimizer.h"

namespace lorapipe::trainer {
namespace {

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  return s;
}

double parse_number(const std::string& arg, const std::string& text) {
  if (const auto value = parse_double(text)) return *value;
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
    save_archive(archive, file);
  }
  void load(const std::filesystem::path& file) override {
    torch::serialize::InputArchive archive;
    // Onto the parameters' device: the archive would bring each moment back to the device it was
    // saved from (rank 0's cuda:0 for every rank; a CUDA device on a machine that has none).
    const auto& params = adamw_->param_groups().front().params();
    const c10::Device device = params.empty() ? c10::Device(c10::kCPU) : params.front().device();
    // The run's own settings, before the archive's replace them (torch's optimizers load their
    // groups' hyperparameters with their moments, as torch's load_state_dict does in kohya).
    std::vector<torch::optim::AdamWOptions> asked;
    for (size_t g = 0; g < group_count(); ++g) asked.push_back(options(g));
    try {
      archive.load_from(file.string(), device);
      adamw_->load(archive);
    } catch (const c10::Error& e) {
      throw InputError(file.string() + ": not an AdamW optimizer state for this network: " +
                       e.what_without_backtrace());
    }
    // A state trained under other --optimizer_args is refused, as every optimizer's is: resumed,
    // it would train on under the old ones while the LoRA's metadata named the new.
    for (size_t g = 0; g < asked.size(); ++g) {
      const torch::optim::AdamWOptions& saved = options(g);
      auto say = [&](const std::string& what, const std::string& then, const std::string& now) {
        throw InputError(file.string() + ": that state was trained with --optimizer_args " +
                         what + "=" + then + ", this run gives " + now +
                         ": resume with the same value");
      };
      auto text = [](double v) { return python_float_repr(v); };
      if (std::get<0>(saved.betas()) != std::get<0>(asked[g].betas()) ||
          std::get<1>(saved.betas()) != std::get<1>(asked[g].betas())) {
        say("betas", text(std::get<0>(saved.betas())) + "," + text(std::get<1>(saved.betas())),
            text(std::get<0>(asked[g].betas())) + "," + text(std::get<1>(asked[g].betas())));
      }
      if (saved.eps() != asked[g].eps()) say("eps", text(saved.eps()), text(asked[g].eps()));
      if (saved.weight_decay() != asked[g].weight_decay()) {
        say("weight_decay", text(saved.weight_decay()), text(asked[g].weight_decay()));
      }
    }
  }
  // kohya's ss_optimizer: the class, and the arguments only where the user gave some.
  std::string describe() const override {
    return kohya_optimizer_name("torch.optim.adamw.AdamW", options_);
  }

 private:
  torch::optim::AdamWOptions& options(size_t group) {
    return static_cast<torch::optim::AdamWOptions&>(adamw_->param_groups()[group].options());
  }

  OptimizerOptions options_;
  std::unique_ptr<torch::optim::AdamW> adamw_;
};

}  // namespace

namespace {

std::string trim(const std::string& s) {
  const size_t a = s.find_first_not_of(' '), b = s.find_last_not_of(' ');
  return a == std::string::npos ? std::string() : s.substr(a, b - a + 1);
}

// str() of what Python's ast.literal_eval makes of an --optimizer_args value, for the forms the
// optimizers here read: a number (an int stays one; 1e-2 is 0.01), True/False, a quoted string
// (printed bare), a comma list as a tuple ("0.9,0.99" is "(0.9, 0.99)") or in brackets as a
// list. Anything else is kept as written.
std::string python_str_of_literal(const std::string& given) {
  const std::string text = trim(given);
  if (text.empty()) return text;
  if (text == "True" || text == "False") return text;
  if (text.size() >= 2 && (text.front() == '\'' || text.front() == '"') &&
      text.back() == text.front()) {
    return text.substr(1, text.size() - 2);
  }
  const char open = text.front();
  const bool bracketed = (open == '(' && text.back() == ')') || (open == '[' && text.back() == ']');
  if (bracketed || text.find(',') != std::string::npos) {
    const std::string inner = bracketed ? text.substr(1, text.size() - 2) : text;
    // "(0.5)" is the number itself; a comma makes a tuple.
    if (open == '(' && bracketed && inner.find(',') == std::string::npos) {
      return python_str_of_literal(inner);
    }
    std::vector<std::string> items;
    size_t start = 0;
    while (start <= inner.size()) {
      const size_t comma = inner.find(',', start);
      const std::string item = trim(inner.substr(start, comma - start));
      if (!item.empty()) items.push_back(python_str_of_literal(item));
      if (comma == std::string::npos) break;
      start = comma + 1;
    }
    const bool list = bracketed && open == '[';
    std::string out(1, list ? '[' : '(');
    for (size_t i = 0; i < items.size(); ++i) out += (i ? ", " : "") + items[i];
    if (!list && items.size() == 1) out += ",";  // Python's one-element tuple
    return out + (list ? "]" : ")");
  }
  const bool integer = text.find_first_not_of("+-0123456789") == std::string::npos;
  if (integer) {
    try {
      return std::to_string(std::stoll(text));
    } catch (const std::exception&) {
      return text;
    }
  }
  if (const auto value = parse_double(text)) return python_float_repr(*value);
  return text;
}

}  // namespace

std::string kohya_optimizer_name(const std::string& cls, const OptimizerOptions& options,
                                 const std::vector<std::string>& defaults) {
  // kohya's get_optimizer: a dict of the arguments, each literal_eval'd (a key given twice keeps
  // its first place and its last value), then the defaults it adds; written
  // ",".join(f"{k}={v}") after the class's module path and name.
  std::vector<std::pair<std::string, std::string>> kwargs;
  auto put = [&kwargs](const std::string& key, const std::string& value) {
    for (auto& [k, v] : kwargs) {
      if (k == key) {
        v = value;
        return;
      }
    }
    kwargs.emplace_back(key, value);
  };
  for (const std::string& arg : options.given_args) {
    const size_t eq = arg.find('=');
    put(arg.substr(0, eq), python_str_of_literal(arg.substr(eq + 1)));
  }
  for (const std::string& arg : defaults) {
    const size_t eq = arg.find('=');
    const std::string key = arg.substr(0, eq);
    if (std::none_of(kwargs.begin(), kwargs.end(), [&](const auto& kv) { return kv.first == key; })) {
      kwargs.emplace_back(key, arg.substr(eq + 1));
    }
  }
  if (kwargs.empty()) return cls;
  std::string out = cls + "(";
  for (size_t i = 0; i < kwargs.size(); ++i) {
    out += (i ? "," : "") + kwargs[i].first + "=" + kwargs[i].second;
  }
  return out + ")";
}

namespace {

std::vector<double> parse_numbers(const std::string& arg, std::string text) {
  text.erase(std::remove_if(text.begin(), text.end(),
                            [](char c) {
                              return c == '(' || c == ')' || c == '[' || c == ']' || c == ' ';
                            }),
             text.end());
  std::vector<double> out;
  size_t start = 0;
  while (true) {
    const size_t comma = text.find(',', start);
    out.push_back(parse_number(arg, text.substr(start, comma - start)));
    if (comma == std::string::npos) return out;
    start = comma + 1;
  }
}

int64_t parse_whole(const std::string& arg, const std::string& text, int64_t least) {
  const double v = parse_number(arg, text);
  if (v < static_cast<double>(least) || v != static_cast<double>(static_cast<int64_t>(v))) {
    throw InputError("--optimizer_args '" + arg + "': wants a whole number >= " +
                     std::to_string(least));
  }
  return static_cast<int64_t>(v);
}

enum class Type {
  kAdamW, kAdamW8bit, kPagedAdamW8bit, kProdigy, kDAdaptAdam, kLion, kAdafactor, kCame,
  kAdamWScheduleFree
};

struct Kind {
  Type type;
  std::vector<std::string> names;  // --optimizer_type spellings, lower case
  std::string display;
  std::vector<std::string> keys;   // the --optimizer_args it takes
};

const std::vector<Kind>& kinds() {
  static const std::vector<Kind> k = {
      // kohya's PagedAdamW and PagedAdamW32bit are bitsandbytes' 32-bit AdamW with its state in
      // paged memory: AdamW's update; a LoRA's state is too small for the paging to matter.
      {Type::kAdamW,
       {"adamw", "torch.optim.adamw", "pagedadamw", "pagedadamw32bit",
        "bitsandbytes.optim.pagedadamw", "bitsandbytes.optim.pagedadamw32bit"},
       "AdamW",
       {"weight_decay", "betas", "eps"}},
      {Type::kAdamW8bit,
       {"adamw8bit", "bitsandbytes.optim.adamw8bit"},
       "AdamW8bit",
       {"weight_decay", "betas", "eps", "min_8bit_size"}},
      {Type::kPagedAdamW8bit,
       {"pagedadamw8bit", "bitsandbytes.optim.pagedadamw8bit"},
       "PagedAdamW8bit",
       {"weight_decay", "betas", "eps", "min_8bit_size"}},
      {Type::kProdigy,
       {"prodigy", "prodigyopt.prodigy"},
       "Prodigy",
       {"weight_decay", "betas", "eps", "decouple", "use_bias_correction", "safeguard_warmup",
        "d0", "d_coef", "growth_rate", "beta3", "slice_p"}},
      {Type::kDAdaptAdam,
       {"dadaptadam", "dadaptation.dadaptadam"},
       "DAdaptAdam",
       {"weight_decay", "betas", "eps", "decouple", "use_bias_correction", "d0", "growth_rate"}},
      {Type::kLion, {"lion", "lion_pytorch.lion"}, "Lion", {"weight_decay", "betas"}},
      {Type::kAdafactor,
       {"adafactor", "transformers.optimization.adafactor"},
       "Adafactor",
       {"weight_decay", "eps", "clip_threshold", "decay_rate", "beta1", "scale_parameter",
        "relative_step", "warmup_init"}},
      // kohya loads it by its class path (--optimizer_type=came_pytorch.CAME).
      {Type::kCame,
       {"came", "came_pytorch.came", "came_pytorch.came.came"},
       "CAME",
       {"weight_decay", "betas", "eps", "clip_threshold"}},
      {Type::kAdamWScheduleFree,
       {"adamwschedulefree", "schedulefree.adamwschedulefree",
        "schedulefree.adamw_schedulefree.adamwschedulefree"},
       "AdamWScheduleFree",
       {"weight_decay", "betas", "eps", "warmup_steps", "r", "weight_lr_power"}},
  };
  return k;
}

}  // namespace

void apply_optimizer_args(OptimizerOptions& options, const std::vector<std::string>& args) {
  for (const std::string& arg : args) {
    const size_t eq = arg.find('=');
    if (eq == std::string::npos) {
      throw InputError("--optimizer_args '" + arg + "': expected key=value");
    }
    const std::string key = arg.substr(0, eq);
    const std::string value = arg.substr(eq + 1);
    options.given_args.push_back(arg);
    options.given_keys.push_back(key);
    auto& prodigy = options.prodigy;
    auto& adafactor = options.adafactor;
    if (key == "weight_decay") {
      options.weight_decay = parse_number(arg, value);
    } else if (key == "betas") {
      const std::vector<double> b = parse_numbers(arg, value);
      if (b.size() != 2 && b.size() != 3) {
        throw InputError("--optimizer_args '" + arg + "': betas wants two numbers, b1,b2 (three "
                         "for CAME)");
      }
      options.beta1 = b[0];
      options.beta2 = b[1];
      options.beta3.reset();
      if (b.size() == 3) options.beta3 = b[2];
      options.betas_given = true;
    } else if (key == "eps") {  // one number; Adafactor's is a pair
      const std::vector<double> e = parse_numbers(arg, value);
      if (e.size() == 2) {
        adafactor.eps1 = e[0];
        adafactor.eps2 = e[1];
        options.adafactor_eps_pair = true;
      } else if (e.size() == 1) {
        options.eps = e[0];
      } else {
        throw InputError("--optimizer_args '" + arg + "': eps wants one number (two for "
                         "Adafactor)");
      }
    } else if (key == "min_8bit_size") {
      options.min_8bit_size = parse_whole(arg, value, 0);
    } else if (key == "decouple") {
      prodigy.decouple = parse_bool(arg, value);
      options.decouple_given = true;
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
      prodigy.slice_p = parse_whole(arg, value, 1);
    } else if (key == "warmup_steps") {
      options.schedulefree.warmup_steps = parse_whole(arg, value, 0);
    } else if (key == "r") {
      options.schedulefree.r = parse_number(arg, value);
    } else if (key == "weight_lr_power") {
      options.schedulefree.weight_lr_power = parse_number(arg, value);
    } else if (key == "clip_threshold") {
      adafactor.clip_threshold = parse_number(arg, value);
    } else if (key == "decay_rate") {
      adafactor.decay_rate = parse_number(arg, value);
    } else if (key == "beta1") {
      if (value != "None") adafactor.beta1 = parse_number(arg, value);
    } else if (key == "scale_parameter") {
      adafactor.scale_parameter = parse_bool(arg, value);
    } else if (key == "relative_step") {
      adafactor.relative_step = parse_bool(arg, value);
    } else if (key == "warmup_init") {
      adafactor.warmup_init = parse_bool(arg, value);
    } else {
      std::string known;
      for (const Kind& k : kinds()) {
        known += (known.empty() ? "" : "; ") + k.display + ":";
        for (const std::string& name : k.keys) known += " " + name;
      }
      throw InputError("--optimizer_args '" + arg + "': unknown argument '" + key +
                       "' (" + known + ")");
    }
  }
}

void check_optimizer_device(const OptimizerOptions& options, const c10::Device& device) {
  const std::string type = lower(options.type);
  for (const Kind& k : kinds()) {
    const bool eight_bit = k.type == Type::kAdamW8bit || k.type == Type::kPagedAdamW8bit;
    if (eight_bit && device.is_cuda() && !kernels::built_with_cuda() &&
        std::find(k.names.begin(), k.names.end(), type) != k.names.end()) {
      throw InputError("--optimizer_type=" + options.type + " on " + device.str() +
                       ": this build of lorapipe has no CUDA kernels (it was configured without "
                       "nvcc); rebuild with CUDA's nvcc on the PATH, or use --optimizer_type=AdamW");
    }
  }
}

std::unique_ptr<Optimizer> make_optimizer(const OptimizerOptions& options,
                                          std::vector<ParamGroup> groups) {
  const std::string type = lower(options.type);
  const Kind* kind = nullptr;
  for (const Kind& k : kinds()) {
    if (std::find(k.names.begin(), k.names.end(), type) != k.names.end()) kind = &k;
  }
  if (type == "dadaptation" || type == "dadaptadampreprint") {
    // kohya's get_optimizer gives these names dadaptation.experimental's DAdaptAdamPreprint,
    // the paper's first algorithm, not the DAdaptAdam lorapipe runs: they train differently.
    throw InputError("--optimizer_type='" + options.type +
                     "': kohya runs dadaptation's DAdaptAdamPreprint (its first, experimental "
                     "algorithm) for it, which lorapipe does not have; DAdaptAdam is "
                     "dadaptation's current D-Adaptation Adam (it trains differently)");
  }
  if (kind == nullptr) {
    std::string names;
    for (const Kind& k : kinds()) names += (names.empty() ? "" : ", ") + k.display;
    throw InputError("--optimizer_type='" + options.type + "' is not available: use " + names);
  }
  for (const std::string& key : options.given_keys) {
    if (std::find(kind->keys.begin(), kind->keys.end(), key) == kind->keys.end()) {
      std::string takes;
      for (const std::string& k : kind->keys) takes += (takes.empty() ? "" : ", ") + k;
      throw InputError("--optimizer_args " + key + ": " + kind->display +
                       " does not take it (it takes " + takes + ")");
    }
  }
  const bool single_eps =
      std::find(options.given_keys.begin(), options.given_keys.end(), "eps") !=
          options.given_keys.end() &&
      !options.adafactor_eps_pair;
  if (kind->type == Type::kAdafactor && single_eps) {
    throw InputError("--optimizer_args eps: Adafactor's is a pair, eps=1e-30,1e-3");
  }
  if (kind->type == Type::kCame && single_eps) {
    throw InputError("--optimizer_args eps: CAME's is a pair, eps=1e-30,1e-16");
  }
  const bool eps_pair = kind->type == Type::kAdafactor || kind->type == Type::kCame;
  if (!eps_pair && options.adafactor_eps_pair) {
    throw InputError("--optimizer_args eps: " + kind->display + " takes one number");
  }
  // came-pytorch indexes three betas: two would fail there at the first step.
  if (kind->type == Type::kCame && options.betas_given && !options.beta3) {
    throw InputError("--optimizer_args betas: CAME's are three, b1,b2,b3 (came-pytorch's "
                     "default 0.9,0.999,0.9999)");
  }
  if (kind->type != Type::kCame && options.beta3) {
    throw InputError("--optimizer_args betas: " + kind->display + " takes two, b1,b2");
  }
  switch (kind->type) {
    case Type::kAdamW:
      return std::make_unique<TorchAdamW>(options, std::move(groups));
    case Type::kAdamW8bit:
      return make_adamw8bit(options, std::move(groups), /*paged=*/false);
    case Type::kPagedAdamW8bit:
      return make_adamw8bit(options, std::move(groups), /*paged=*/true);
    case Type::kProdigy:
      return make_prodigy(options, std::move(groups));
    case Type::kDAdaptAdam:
      return make_dadapt_adam(options, std::move(groups));
    case Type::kLion:
      return make_lion(options, std::move(groups));
    case Type::kAdafactor:
      return make_adafactor(options, std::move(groups));
    case Type::kCame:
      return make_came(options, std::move(groups));
    case Type::kAdamWScheduleFree:
      return make_adamw_schedulefree(options, std::move(groups));
  }
  throw Error("unreachable optimizer type");
}

}  // namespace lorapipe::trainer
