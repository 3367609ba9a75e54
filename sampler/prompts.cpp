#include "sampler/prompts.h"

#include <toml++/toml.h>

#include <algorithm>
#include <iomanip>
#include <cmath>
#include <cctype>
#include <fstream>
#include <optional>
#include <nlohmann/json.hpp>
#include <sstream>

#include "common/error.h"
#include "common/text.h"
#include "models/clip_tokenizer.h"
#include "models/prompt_attention.h"
#include "sampler/schedulers.h"

namespace lorapipe::sampler {
namespace {

// kohya strips lines and values with Python's str.strip(): Unicode's whitespace too (a line of
// ideographic spaces is blank to it).
std::string trim(const std::string& s) { return python_strip(s); }

constexpr const char* kNoPromptKey =
    "no 'prompt' (an empty prompt is prompt = \"\", which renders as kohya renders it)";

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  return s;
}

int64_t whole_number(const std::string& option, const std::string& value) {
  // 18 digits always fit an int64 (the prompt-line reader leaves longer ones out with a note).
  if (value.empty() || !std::all_of(value.begin(), value.end(), ::isdigit) || value.size() > 18) {
    throw InputError("--" + option + " wants a whole number, got '" + value + "'");
  }
  return std::stoll(value);
}

double decimal(const std::string& option, const std::string& value) {
  size_t used = 0;
  double v = 0;
  try {
    v = std::stod(value, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != value.size() || v < 0 || !std::isfinite(v)) {
    throw InputError("--" + option + " wants a number, got '" + value + "'");
  }
  return v;
}

// kohya: sizes rounded down to a multiple of 8, at least 64. Past 16384 pixels a side (a
// quarter-gigapixel preview) is a typo, not a request: the line is refused by its value.
int size_value(const std::string& option, const std::string& value) {
  constexpr int64_t kLargest = 16384;
  const int64_t pixels = whole_number(option, value);
  if (pixels > kLargest) {
    throw InputError("--" + option + " " + value + " is larger than a preview can be (" +
                     std::to_string(kLargest) + " pixels a side)");
  }
  return static_cast<int>(std::max<int64_t>(64, pixels / 8 * 8));
}

// A sampler as kohya names it (any case). kohya renders a name it does not know with ddim; so
// does lorapipe, and notes it.
template <typename Note>
std::string sampler_choice(const std::string& value, Note&& note) {
  const std::string name = lower(trim(value));
  try {
    (void)scheduler_options(name, false);
  } catch (const InputError& e) {
    note(std::string(e.what()) + ": rendered with ddim, as kohya does");
    return "ddim";
  }
  return name;
}

// Throws InputError when a prompt cannot be rendered: its text invalid UTF-8 or an attention
// weight not a number, or a step count its sampler cannot take (pndm under 4). Checked when the
// file is read, so such a line is skipped there rather than failing every checkpoint's render.
void check_request(const RenderRequest& r, const PromptDefaults& defaults) {
  if (defaults.check_sampler_steps) {
    (void)make_scheduler(scheduler_options(r.sampler, false), r.steps != 0 ? r.steps : 30);
  }
  for (const std::string* text : {&r.prompt, &r.negative_prompt}) {
    if (!defaults.weighted_prompts) {
      (void)models::fix_text(*text);
      continue;
    }
    for (const models::WeightedText& piece : models::parse_prompt_attention(*text)) {
      (void)models::fix_text(piece.text);
    }
  }
}

// kohya's prompt options for other models and networks (ControlNet image, additional-network
// multipliers, frame count, flow shift, CFG truncation / renormalisation).
bool is_other_models_option(const std::string& option) {
  for (const char* name : {"cn", "am", "f", "fs", "ctr", "rcfg"}) {
    if (option == name) return true;
  }
  return false;
}

// Fills `r` from one kohya-style object (TOML table or JSON object, read through `get`, which
// gives nothing for a key that is absent or null, as kohya's dict.get).
template <typename Get>
void apply_fields(RenderRequest& r, Get&& get_value, std::vector<std::string>& notes) {
  auto get = [&](const char* key) -> std::optional<std::string> {
    try {
      return get_value(key);
    } catch (const InputError& e) {
      throw InputError(std::string(key) + ": " + e.what());
    }
  };
  if (auto v = get("prompt")) r.prompt = *v;
  if (auto v = get("negative_prompt")) r.negative_prompt = *v;
  if (auto v = get("width")) r.width = size_value("width", *v);
  if (auto v = get("height")) r.height = size_value("height", *v);
  if (auto v = get("seed")) {
    // A negative seed (A1111's habit of -1) is taken as torch.manual_seed takes it: modulo 2^64.
    const bool negative = v->size() > 1 && (*v)[0] == '-';
    const int64_t magnitude = whole_number("seed", negative ? v->substr(1) : *v);
    r.seed = negative ? -magnitude : magnitude;
  }
  if (auto v = get("sample_steps")) {
    r.steps = static_cast<int>(std::clamp<int64_t>(whole_number("sample_steps", *v), 1, 1000));
  }
  if (auto v = get("scale")) {
    r.cfg_scale = decimal("scale", *v);
    r.cfg_scale_given = true;
  }
  if (auto v = get("guidance_scale")) r.guidance = decimal("guidance_scale", *v);
  if (auto v = get("sample_sampler")) {
    r.sampler = sampler_choice(*v, [&](const std::string& text) { notes.push_back(text); });
  }
}

std::string toml_text(const toml::node& node) {
  if (auto s = node.value<std::string>()) return *s;
  if (auto i = node.value<int64_t>()) return std::to_string(*i);
  if (auto d = node.value<double>()) {
    std::ostringstream out;
    out << std::setprecision(17) << *d;  // every digit back: 7.1234567 stays itself
    return out.str();
  }
  throw InputError("a value that is not text or a number");
}

std::string json_text(const nlohmann::json& v) {
  if (v.is_string()) return v.get<std::string>();
  if (v.is_number_integer()) return std::to_string(v.get<int64_t>());
  if (v.is_number()) {
    std::ostringstream out;
    out << std::setprecision(17) << v.get<double>();
    return out.str();
  }
  throw InputError("a value that is not text or a number");
}

}  // namespace

RenderRequest parse_prompt_line(const std::string& line_in, const RenderRequest& defaults,
                                std::vector<std::string>* notes) {
  RenderRequest r = defaults;
  auto note = [&](const std::string& text) {
    if (notes) notes->push_back(text);
  };
  // A line that starts with an option has no prompt (kohya would render "--w 512" as one).
  const std::string line = line_in.rfind("--", 0) == 0 ? " " + line_in : line_in;
  // kohya splits on " --": the first part is the prompt, each other one an option.
  std::vector<std::string> parts;
  size_t start = 0;
  while (true) {
    const size_t at = line.find(" --", start);
    parts.push_back(line.substr(start, at == std::string::npos ? std::string::npos : at - start));
    if (at == std::string::npos) break;
    start = at + 3;
  }
  r.prompt = trim(parts[0]);
  if (r.prompt.empty()) throw InputError("no prompt before the options");
  // kohya matches each option's value from its start (re.match(r"w (\d+)")): "--s 28steps" is
  // 28 steps, and a value that does not start as a number leaves the option out, as does an
  // option it does not know. Each such reading is noted; the prompt is kept.
  auto leading = [&](const std::string& option, const std::string& value,
                     const std::string& chars) -> std::optional<std::string> {
    const size_t end = std::min(value.find_first_not_of(chars), value.size());
    if (end == 0) {
      note("--" + option + " '" + value + "' is not a number: left out, as kohya does");
      return std::nullopt;
    }
    if (end < value.size()) {
      note("--" + option + " '" + value + "' read as " + value.substr(0, end) + ", as kohya does");
    }
    return value.substr(0, end);
  };
  bool karras = false;
  for (size_t i = 1; i < parts.size(); ++i) {
    const std::string part = trim(parts[i]);
    const size_t space = part.find(' ');
    const std::string option = lower(part.substr(0, space));
    const std::string value = space == std::string::npos ? "" : trim(part.substr(space + 1));
    if (option == "n") {
      r.negative_prompt = value;
    } else if (option == "w" || option == "h" || option == "d" || option == "s") {
      const std::optional<std::string> digits = leading(option, value, "0123456789");
      if (!digits) continue;
      if (digits->size() > 18) {
        note("--" + option + " " + *digits + " is too large: left out");
        continue;
      }
      if (option == "w") r.width = size_value(option, *digits);
      if (option == "h") r.height = size_value(option, *digits);
      if (option == "d") r.seed = whole_number(option, *digits);
      if (option == "s") {
        const int64_t steps = whole_number(option, *digits);
        r.steps = static_cast<int>(std::clamp<int64_t>(steps, 1, 1000));
        if (r.steps != steps) {
          note("--s " + *digits + " read as " + std::to_string(r.steps) + " (1 to 1000 steps)");
        }
      }
    } else if (option == "l" || option == "g") {
      const std::optional<std::string> number = leading(option, value, "0123456789.");
      if (!number) continue;
      try {
        if (option == "l") {
          r.cfg_scale = decimal(option, *number);
          r.cfg_scale_given = true;
        } else {
          r.guidance = decimal(option, *number);  // FLUX.1 [dev]'s embedded guidance
        }
      } catch (const InputError& e) {
        note(std::string(e.what()) + ": left out, as kohya does");
      }
    } else if (option == "ss") {
      r.sampler = sampler_choice(value, note);
    } else if (option == "karras") {
      // lorapipe's: Karras sigmas for the sampler (A1111's "Euler Karras", "DPM++ 2M Karras").
      karras = value.empty() || !(lower(value) == "false" || value == "0" || lower(value) == "no");
    } else if (is_other_models_option(option)) {
      note("--" + option + " is for other models or networks: ignored");
    } else {
      note("unknown option --" + option +
           ": ignored, as kohya does (its options: --n, --w, --h, --d, --s, --l, --g, --ss)");
    }
  }
  if (karras && !r.sampler.ends_with("_karras")) {
    const std::string base = r.sampler == "k_euler" ? "euler" : r.sampler;
    if (base == "euler" || base == "dpmsolver++") {
      r.sampler = base + "_karras";
    } else {
      note("--karras applies to euler and dpmsolver++ only: " + r.sampler + " renders without it");
    }
  }
  return r;
}

PromptSet load_prompts(const std::filesystem::path& file, const PromptDefaults& defaults) {
  std::ifstream in(file);
  if (!in) throw InputError(file.string() + ": cannot read the prompt file");
  PromptSet set;
  // kohya numbers the prompts by their place in the file (its "enum", in the image names): a
  // prompt that cannot be read keeps its number, so fixing it renames and reseeds no other.
  int position = -1;
  auto base = [&] {
    RenderRequest r;
    r.sampler = defaults.sampler;
    r.index = ++position;
    r.seed = defaults.first_seed + r.index;
    return r;
  };
  const std::string ext = lower(file.extension().string());
  if (ext == ".txt") {
    std::string line;
    for (int number = 1; std::getline(in, line); ++number) {
      const std::string text = trim(line);
      if (text.empty()) continue;
      if (text[0] == '#') {
        // kohya takes a comment only where '#' is the line's first character: an indented one
        // is a prompt there, numbered. Not rendered here, but numbered as kohya numbers it, so
        // every later prompt keeps kohya's number (its image names and default seed).
        if (line[0] != '#') {
          (void)base();
          set.problems.push_back(file.string() + ":" + std::to_string(number) +
                                 ": an indented '#' line: kohya renders it as a prompt, lorapipe "
                                 "reads it as a comment (it keeps its number)");
        }
        continue;
      }
      std::vector<std::string> notes;
      const RenderRequest defaults_here = base();
      try {
        RenderRequest r = parse_prompt_line(text, defaults_here, &notes);
        check_request(r, defaults);
        set.prompts.push_back(std::move(r));
      } catch (const InputError& e) {
        set.problems.push_back(file.string() + ":" + std::to_string(number) + ": " + e.what());
        continue;
      }
      for (const std::string& note : notes) {
        set.notes.push_back(file.string() + ":" + std::to_string(number) + ": " + note);
      }
    }
    return set;
  }
  if (ext == ".toml") {
    toml::table root;
    try {
      root = toml::parse_file(file.string());
    } catch (const toml::parse_error& e) {
      throw InputError(file.string() + ": not TOML: " + std::string(e.description()));
    }
    const toml::table* prompt = root["prompt"].as_table();
    if (prompt == nullptr) throw InputError(file.string() + ": no [prompt] table");
    const toml::array* subsets = (*prompt)["subset"].as_array();
    if (subsets == nullptr) throw InputError(file.string() + ": no [[prompt.subset]] entries");
    for (size_t i = 0; i < subsets->size(); ++i) {
      RenderRequest r = base();
      try {
        const toml::table* subset = (*subsets)[i].as_table();
        if (subset == nullptr) throw InputError("not a table");
        auto get = [&](const char* key) -> std::optional<std::string> {
          if (const toml::node* v = subset->get(key)) return toml_text(*v);
          if (const toml::node* v = prompt->get(key)) return toml_text(*v);
          return std::nullopt;
        };
        std::vector<std::string> notes;
        // An empty prompt renders, as kohya renders it (what the LoRA adds to nothing); an
        // entry without one is more likely a misspelt key.
        if (!get("prompt")) throw InputError(kNoPromptKey);
        apply_fields(r, get, notes);
        check_request(r, defaults);
        set.prompts.push_back(std::move(r));
        for (const std::string& note : notes) {
          set.notes.push_back(file.string() + ": prompt.subset " + std::to_string(i + 1) + ": " +
                              note);
        }
      } catch (const InputError& e) {
        set.problems.push_back(file.string() + ": prompt.subset " + std::to_string(i + 1) + ": " +
                               e.what());
      }
    }
    return set;
  }
  if (ext == ".json") {
    nlohmann::json root;
    try {
      root = nlohmann::json::parse(in);
    } catch (const nlohmann::json::exception& e) {
      throw InputError(file.string() + ": not JSON: " + e.what());
    }
    if (!root.is_array()) throw InputError(file.string() + ": expected a list of prompts");
    for (size_t i = 0; i < root.size(); ++i) {
      RenderRequest r = base();
      try {
        std::vector<std::string> notes;
        if (root[i].is_string()) {
          // A plain string is a prompt line, options and all (kohya's line_to_prompt_dict).
          const std::string line = trim(root[i].get<std::string>());
          if (line.empty()) throw InputError("no prompt");
          r = parse_prompt_line(line, r, &notes);
        } else if (root[i].is_object()) {
          auto get = [&](const char* key) -> std::optional<std::string> {
            if (!root[i].contains(key) || root[i][key].is_null()) return std::nullopt;
            return json_text(root[i][key]);
          };
          if (!get("prompt")) throw InputError(kNoPromptKey);
          apply_fields(r, get, notes);
        } else {
          throw InputError("neither a prompt nor an object");
        }
        check_request(r, defaults);
        set.prompts.push_back(std::move(r));
        for (const std::string& note : notes) {
          set.notes.push_back(file.string() + ": entry " + std::to_string(i + 1) + ": " + note);
        }
      } catch (const InputError& e) {
        set.problems.push_back(file.string() + ": entry " + std::to_string(i + 1) + ": " +
                               e.what());
      }
    }
    return set;
  }
  throw InputError(file.string() + ": prompt files are .txt, .toml or .json");
}

}  // namespace lorapipe::sampler
