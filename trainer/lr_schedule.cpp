#include "trainer/lr_schedule.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <numbers>
#include <sstream>

#include "common/error.h"
#include "common/numbers.h"

namespace lorapipe::trainer {
namespace {

constexpr const char* kNames =
    "constant, constant_with_warmup, linear, cosine, cosine_with_restarts, polynomial, "
    "cosine_with_min_lr, warmup_stable_decay, inverse_sqrt or piecewise_constant";

// kohya reads lr_scheduler_args values with Python's literal_eval: strings come quoted.
std::string unquote(const std::string& value) {
  if (value.size() >= 2 && (value.front() == '\'' || value.front() == '"') &&
      value.back() == value.front()) {
    return value.substr(1, value.size() - 2);
  }
  return value;
}

double number(const std::string& arg, const std::string& value) {
  if (const auto parsed = parse_double(value)) return *parsed;
  throw InputError("--lr_scheduler_args '" + arg + "': '" + value + "' is not a number");
}

// transformers' warmup and decay shapes of warmup_stable_decay, at progress p in [0, 1].
double shape(const std::string& type, double p, bool decay) {
  if (type == "linear") return decay ? 1.0 - p : p;
  if (type == "cosine") {
    return decay ? 0.5 * (1.0 + std::cos(std::numbers::pi * p))
                 : 0.5 * (1.0 - std::cos(std::numbers::pi * p));
  }
  return decay ? 1.0 - std::sqrt(p) : 1.0 - std::sqrt(1.0 - p);  // 1-sqrt
}

struct Rules {
  std::map<int64_t, double> before;  // step boundary -> multiplier before it
  double last = 1.0;
};

Rules parse_rules(const std::string& text) {
  Rules rules;
  std::vector<std::string> parts;
  std::stringstream in(text);
  for (std::string part; std::getline(in, part, ',');) parts.push_back(part);
  if (parts.empty()) throw InputError("piecewise_constant needs --lr_scheduler_args step_rules=");
  const std::string where = "--lr_scheduler_args step_rules='" + text + "'";
  for (size_t i = 0; i + 1 < parts.size(); ++i) {
    const size_t colon = parts[i].find(':');
    if (colon == std::string::npos) {
      throw InputError(where + ": '" + parts[i] + "' is not multiplier:step");
    }
    const double value = number(where, parts[i].substr(0, colon));
    const double step = number(where, parts[i].substr(colon + 1));
    rules.before[static_cast<int64_t>(step)] = value;
  }
  rules.last = number(where, parts.back());
  return rules;
}

}  // namespace

void apply_lr_scheduler_args(LrScheduleOptions& o, const std::vector<std::string>& args) {
  for (const std::string& arg : args) {
    const size_t eq = arg.find('=');
    if (eq == std::string::npos) throw InputError("--lr_scheduler_args '" + arg + "': expected key=value");
    const std::string key = arg.substr(0, eq), value = unquote(arg.substr(eq + 1));
    auto only_for = [&](const char* schedule) {
      if (o.name != schedule) {
        throw InputError("--lr_scheduler_args '" + arg + "': " + key + " is " + schedule +
                         "'s, not " + o.name + "'s");
      }
    };
    if (key == "lr_end") {
      only_for("polynomial");
      o.lr_end = number(arg, value);
    } else if (key == "min_lr") {  // transformers: an absolute floor, as a rate of the lr
      only_for("cosine_with_min_lr");
      if (o.min_lr_ratio) {
        throw InputError("--lr_scheduler_args '" + arg +
                         "': give min_lr or --lr_scheduler_min_lr_ratio, not both");
      }
      o.min_lr_ratio = number(arg, value) / o.initial_lr;
    } else if (key == "warmup_type" || key == "decay_type") {
      only_for("warmup_stable_decay");
      if (value != "linear" && value != "cosine" && value != "1-sqrt") {
        throw InputError("--lr_scheduler_args '" + arg + "': expected linear, cosine or 1-sqrt");
      }
      (key == "warmup_type" ? o.warmup_type : o.decay_type) = value;
    } else if (key == "step_rules") {
      only_for("piecewise_constant");
      o.step_rules = value;
      (void)parse_rules(value);
    } else {
      throw InputError("--lr_scheduler_args '" + arg + "': " + o.name + " takes no '" + key +
                       "' (lorapipe reads lr_end, min_lr, warmup_type, decay_type, step_rules)");
    }
  }
}

void validate(const LrScheduleOptions& o) {
  bool known = false;
  for (const char* name : {"constant", "constant_with_warmup", "linear", "cosine",
                           "cosine_with_restarts", "polynomial", "cosine_with_min_lr",
                           "warmup_stable_decay", "inverse_sqrt", "piecewise_constant"}) {
    known |= o.name == name;
  }
  // kohya's name for transformers' AdafactorSchedule, "adafactor:<lr>" (main.cpp pairs it with
  // Adafactor's relative_step).
  known |= o.name == "adafactor" || o.name.starts_with("adafactor:");
  if (!known) {
    throw InputError("--lr_scheduler='" + o.name + "' is not a schedule: use " + kNames);
  }
  if (o.name == "cosine_with_min_lr" && !o.min_lr_ratio) {
    throw InputError("--lr_scheduler=cosine_with_min_lr needs --lr_scheduler_min_lr_ratio (or "
                     "--lr_scheduler_args min_lr=), as transformers' does");
  }
  if (o.min_lr_ratio && (*o.min_lr_ratio < 0 || *o.min_lr_ratio > 1)) {
    throw InputError("--lr_scheduler_min_lr_ratio must be in [0, 1]");
  }
  if (o.name == "piecewise_constant") (void)parse_rules(o.step_rules);
}

double lr_multiplier(const LrScheduleOptions& o, int64_t optimizer_step) {
  const int64_t step = optimizer_step * std::max<int64_t>(1, o.processes);
  const double s = static_cast<double>(step);
  const double warmup = static_cast<double>(o.warmup_steps);
  const double total = static_cast<double>(o.training_steps);
  // Adafactor's relative_step ignores the rates: its schedule only reports the step it takes.
  if (o.name == "constant" || o.name.starts_with("adafactor")) return 1.0;
  if (o.name == "piecewise_constant") {
    const Rules rules = parse_rules(o.step_rules);
    for (const auto& [boundary, value] : rules.before) {
      if (step < boundary) return value;
    }
    return rules.last;
  }
  if (o.name == "warmup_stable_decay") {
    // kohya: the decay is --lr_decay_steps, the stable part the rest, the warmup and decay
    // shapes blended towards min_lr_ratio (transformers' get_wsd_schedule).
    const double r = o.min_lr_ratio.value_or(0.0);
    const double decay = static_cast<double>(warmup_steps_from(o.decay_steps, o.training_steps));
    const double stable = total - warmup - decay;
    if (s < warmup) {
      return std::max(0.0, shape(o.warmup_type, s / std::max(1.0, warmup), false) * (1 - r) + r);
    }
    if (s < warmup + stable) return 1.0;
    if (s < warmup + stable + decay) {
      const double p = (s - warmup - stable) / std::max(1.0, decay);
      // kohya passes num_cycles / 2 (0.5 by default): a half cosine.
      const double cosine =
          0.5 * (1.0 + std::cos(std::numbers::pi * (o.num_cycles / 2.0) * 2.0 * p));
      const double f = o.decay_type == "cosine" ? cosine : shape(o.decay_type, p, true);
      return std::max(0.0, f * (1 - r) + r);
    }
    return r;
  }
  if (step < o.warmup_steps) return s / std::max(1.0, warmup);
  if (o.name == "constant_with_warmup") return 1.0;
  if (o.name == "inverse_sqrt") {
    const double timescale =
        o.timescale > 0 ? static_cast<double>(o.timescale) : (warmup > 0 ? warmup : 10000.0);
    return 1.0 / std::sqrt((s + timescale - warmup) / timescale);
  }
  const double progress = (s - warmup) / std::max(1.0, total - warmup);
  if (o.name == "linear") return std::max(0.0, (total - s) / std::max(1.0, total - warmup));
  if (o.name == "cosine") {
    // diffusers' default num_cycles 0.5: half a cosine from 1 down to 0.
    return std::max(0.0, 0.5 * (1.0 + std::cos(std::numbers::pi * 0.5 * 2.0 * progress)));
  }
  if (o.name == "cosine_with_min_lr") {
    const double r = o.min_lr_ratio.value_or(0.0);
    const double f =
        0.5 * (1.0 + std::cos(std::numbers::pi * (o.num_cycles / 2.0) * 2.0 * progress));
    return std::max(0.0, f * (1 - r) + r);
  }
  if (o.name == "cosine_with_restarts") {
    if (progress >= 1.0) return 0.0;
    return std::max(0.0, 0.5 * (1.0 + std::cos(std::numbers::pi *
                                               std::fmod(o.num_cycles * progress, 1.0))));
  }
  if (o.name == "polynomial") {
    if (s > total) return o.lr_end / o.initial_lr;
    const double range = o.initial_lr - o.lr_end;
    const double remaining = 1.0 - (s - warmup) / (total - warmup);
    return (range * std::pow(remaining, o.power) + o.lr_end) / o.initial_lr;
  }
  validate(o);
  return 1.0;
}

int64_t warmup_steps_from(double value, int64_t training_steps) {
  if (value < 0) throw InputError("--lr_warmup_steps and --lr_decay_steps must not be negative");
  if (value < 1.0 && value > 0.0) return static_cast<int64_t>(value * training_steps);
  return static_cast<int64_t>(value);
}

}  // namespace lorapipe::trainer
