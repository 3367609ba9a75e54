// The launcher's flags: which stage takes each one, parsing, and run.toml.

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <toml++/toml.h>

#include "common/error.h"
#include "common/file.h"
#include "common/kohya_flags.h"
#include "common/text.h"
#include "deploy/launcher.h"

namespace lorapipe::launcher {
namespace {

namespace fs = std::filesystem;
using S = Stage;

// Which stage takes each flag, under which name. Flags that name the same thing in several
// stages go to all of them (one model, one cache, one clip skip). Endpoints, folders and
// following are the launcher's own and are not accepted from the user.
std::vector<FlagInfo> make_table() {
  std::vector<FlagInfo> t;
  auto add = [&](std::string name, std::vector<std::pair<Stage, std::string>> targets,
                 bool boolean = false) {
    for (auto& target : targets) {
      if (target.second.empty()) target.second = name;
    }
    t.push_back({std::move(name), std::move(targets), boolean});
  };
  auto value = [&](std::string name, std::vector<Stage> stages) {
    std::vector<std::pair<Stage, std::string>> targets;
    for (Stage s : stages) targets.emplace_back(s, "");
    add(std::move(name), std::move(targets), false);
  };
  auto boolean = [&](std::string name, std::vector<Stage> stages) {
    std::vector<std::pair<Stage, std::string>> targets;
    for (Stage s : stages) targets.emplace_back(s, "");
    add(std::move(name), std::move(targets), true);
  };
  // The model, its tokenizer, the cache: every stage that loads or reads them.
  value("pretrained_model_name_or_path", {S::kCacher, S::kTrainer, S::kSampler});
  value("model_family", {S::kCacher, S::kTrainer, S::kSampler});  // detection's override
  boolean("merge_lora", {S::kSampler});
  boolean("map_weights", {S::kTrainer, S::kSampler});
  value("tokenizer", {S::kCacher, S::kTrainer, S::kSampler});
  value("vae", {S::kCacher, S::kTrainer, S::kSampler});  // kohya's: the one VAE of the run
  // FLUX.1's separate parts and T5 settings (models/model_parts.h): every stage that loads it.
  for (const char* name : {"clip_l", "t5xxl", "ae", "t5_tokenizer", "t5xxl_max_token_length"}) {
    value(name, {S::kCacher, S::kTrainer, S::kSampler});
  }
  boolean("apply_t5_attn_mask", {S::kCacher, S::kTrainer, S::kSampler});
  // LoRAs merged into the base before training: the sampler renders on the same base.
  value("base_weights", {S::kTrainer, S::kSampler});
  value("base_weights_multiplier", {S::kTrainer, S::kSampler});
  value("cache_dir", {S::kCacher, S::kTrainer});
  value("dataset_id", {S::kPreprocess, S::kTrainer});
  value("clip_skip", {S::kCacher, S::kTrainer, S::kSampler});
  value("max_token_length", {S::kCacher, S::kTrainer});
  boolean("v_parameterization", {S::kTrainer, S::kSampler});
  value("device", {S::kCacher, S::kTrainer});
  value("seed", {S::kPreprocess, S::kTrainer});
  // preprocess
  for (const char* name :
       {"data_dir", "reg_data_dir", "dataset_config", "in_json", "dataset_repeats", "resolution",
        "min_bucket_reso", "max_bucket_reso", "bucket_reso_steps", "caption_extension",
        "class_tokens", "keep_tokens",
        "caption_dropout_rate", "caption_dropout_every_n_epochs", "caption_tag_dropout_rate",
        "caption_prefix", "caption_suffix", "caption_separator", "keep_tokens_separator",
        "secondary_separator", "token_warmup_min", "token_warmup_step", "min_image_side",
        "max_aspect_ratio", "max_image_pixels", "resize_filter", "resize_interpolation",
        "skip_image_resolution"}) {
    value(name, {S::kPreprocess});
  }
  for (const char* name : {"enable_bucket", "bucket_no_upscale", "flip_aug", "random_crop",
                           "shuffle_caption", "enable_wildcard", "alpha_mask", "jpeg_fast_path"}) {
    boolean(name, {S::kPreprocess});
  }
  add("preprocess_threads", {{S::kPreprocess, "threads"}});
  // cacher
  value("vae_batch_size", {S::kCacher});
  value("max_map_mb", {S::kCacher});
  add("cache_dtype", {{S::kCacher, "dtype"}});
  // trainer
  for (const char* name :
       {"output_name", "save_precision", "save_every_n_steps", "save_every_n_epochs",
        "save_last_n_steps", "save_last_n_epochs", "save_n_epoch_ratio", "training_comment",
        "threads", "max_train_steps", "max_train_epochs", "train_batch_size",
        "prior_loss_weight", "validation_split", "validation_seed", "validate_every_n_steps",
        "max_bad_steps", "timeout_s", "max_data_loader_n_workers", "network_dim", "network_alpha", "network_dropout",
        "network_weights", "network_multiplier", "network_args", "optimizer_type",
        "optimizer_args", "learning_rate", "unet_lr", "text_encoder_lr", "lr_scheduler",
        "lr_warmup_steps", "lr_scheduler_num_cycles", "lr_scheduler_power", "max_grad_norm",
        "gradient_accumulation_steps", "min_snr_gamma", "noise_offset", "adaptive_noise_scale",
        "multires_noise_iterations", "multires_noise_discount", "min_timestep", "max_timestep",
        "loss_type", "huber_schedule", "huber_c", "huber_scale", "sample_every_n_steps",
        "sample_every_n_epochs", "checkpoint_reannounce_s", "network_module", "save_model_as",
        "log_with", "logging_dir", "log_prefix", "log_tracker_name", "v_pred_like_loss", "ip_noise_gamma",
        "scale_weight_norms", "save_last_n_steps_state", "save_last_n_epochs_state",
        "metadata_title", "metadata_author", "metadata_description", "metadata_license",
        "metadata_tags", "metadata_trigger_phrase", "metadata_usage_hint", "metadata_thumbnail",
        "metadata_merged_from", "metadata_preprocessor", "metadata_is_negative_embedding",
        "console_log_level", "validate_every_n_epochs", "lr_scheduler_min_lr_ratio",
        "lr_decay_steps", "lr_scheduler_timescale", "lr_scheduler_args",
        "max_validation_steps", "timestep_sampling", "discrete_flow_shift", "sigmoid_scale",
        "weighting_scheme", "logit_mean", "logit_std", "mode_scale", "model_prediction_type", "guidance_scale"}) {
    value(name, {S::kTrainer});
  }
  for (const char* name :
       {"fill_last_batch", "network_train_unet_only", "network_train_text_encoder_only",
        "use_8bit_adam", "gradient_checkpointing",
        "noise_offset_random_strength", "cache_latents", "cache_latents_to_disk", "sdpa",
        "cache_text_encoder_outputs", "cache_text_encoder_outputs_to_disk",
        "xformers", "mem_eff_attn", "persistent_data_loader_workers", "sample_at_first",
        "lowram", "highvram", "scale_v_pred_loss_like_noise_pred",
        "debiased_estimation_loss", "ip_noise_gamma_random_strength", "zero_terminal_snr",
        "weighted_captions", "save_state_on_train_end", "no_metadata", "use_lion_optimizer",
        "dim_from_weights", "masked_loss", "debug_dataset"}) {
    boolean(name, {S::kTrainer});
  }
  boolean("no_half_vae", {S::kCacher, S::kTrainer});  // the cacher's VAE in fp32
  // Previews render as the run trains: in its precision, over its float8 weights.
  value("mixed_precision", {S::kTrainer, S::kSampler});
  // Previews fit the card the training fitted: the sampler swaps the same blocks.
  value("blocks_to_swap", {S::kTrainer, S::kSampler});
  boolean("cpu_offload_checkpointing", {S::kTrainer});
  boolean("split_mode", {S::kTrainer});  // kohya's deprecated FLUX.1 flag (parse_run_args)
  for (const char* name : {"fp8_base", "fp8_base_unet", "fp8_scaled"}) {
    boolean(name, {S::kCacher, S::kTrainer, S::kSampler});  // the cacher's text encoders too
  }
  boolean("fp8_fast", {S::kTrainer, S::kSampler});  // the denoiser's: the cacher has none
  // sampler
  value("sample_prompts", {S::kSampler});
  value("sample_sampler", {S::kSampler});
  add("sample_seed", {{S::kSampler, "seed"}});
  add("sampler_device", {{S::kSampler, "device"}});
  add("sampler_threads", {{S::kSampler, "threads"}});
  // The share of the device's time the sampler's renders take beside the training.
  add("sampler_device_share", {{S::kSampler, "device_share"}});
  // The launcher's own: the sampler waits for the training's end (auto: when it shares the
  // trainer's device, and that is not the CPU).
  add("sample_after_training", {}, /*boolean=*/true);
  // `lorapipe plan`'s recommendation for this budget, taken without asking (deploy/plan.h).
  add("plan_budget", {}, /*boolean=*/false);
  // A batch per bucket for the card's memory (deploy/plan.h apply_auto_batch), which the
  // trainer takes as --bucket_batch_sizes.
  add("auto_batch", {}, /*boolean=*/true);
  add("vram_budget", {}, /*boolean=*/false);
  value("bucket_batch_sizes", {S::kTrainer});
  return t;
}

const std::vector<FlagInfo>& table() {
  static const std::vector<FlagInfo> t = make_table();
  return t;
}

const FlagInfo* find_flag(const std::string& name) {
  for (const FlagInfo& f : table()) {
    if (f.name == name) return &f;
  }
  return nullptr;
}

// kohya's flags that take several space-separated words.
bool multi_value(const std::string& name) {
  return name == "optimizer_args" || name == "network_args" || name == "lr_scheduler_args" ||
         name == "base_weights" || name == "base_weights_multiplier" ||
         name == "text_encoder_lr";
}

std::string canonical(const std::string& name) {
  if (name == "model") return "pretrained_model_name_or_path";
  if (name == "train_data_dir") return "data_dir";  // kohya's name
  if (name == "caption_extention") return "caption_extension";  // kohya's old spelling
  if (name == "output_dir") return "output";
  if (name == "config_file") return "config";  // kohya's name (kohya_ss's GUI writes these)
  return name;
}

// A kohya flag lorapipe does not act on (common/kohya_flags.h): taken at kohya's default,
// refused naming it and why otherwise; it goes to no stage.
bool take_foreign(const std::string& name, const std::string& value,
                  std::vector<std::string>& notes) {
  if (name == "save_state") return true;  // lorapipe run always saves states, for lorapipe resume
  if (name == "resume") {
    // kohya's way on: its --resume takes a state folder. A run folder holds its states here, and
    // kohya's (accelerate's) state folders are not a lorapipe trainer's.
    throw InputError("--resume" + (value.empty() ? std::string() : "=" + value) +
                     ": lorapipe run starts a run; `lorapipe resume DIR` continues the run in DIR "
                     "from its newest state (lorapipe-trainer --resume=STATE takes a state folder "
                     "itself)");
  }
  if (name == "console_log_file") {
    if (value.empty()) return true;
    throw InputError("--console_log_file=" + value +
                     ": lorapipe run keeps each stage's log in the run folder's logs/");
  }
  const kohya::ForeignFlag* foreign = kohya::find_foreign_flag(name);
  if (foreign == nullptr) return false;
  const std::string note = kohya::check_foreign_flag(*foreign, value);
  if (!note.empty()) notes.push_back(note);
  return true;
}

// Keys the kohya_ss GUI writes into the config it hands kohya's LoRA scripts that are no
// argument of theirs: kohya's read_config_from_file leaves them on its namespace, where nothing
// reads them. So they act in neither; each is said, with what the GUI meant.
const char* kohya_gui_key(const std::string& name) {
  static const std::map<std::string, const char*, std::less<>> keys = {
      {"epoch", "the GUI's epoch box, which it turns into max_train_steps itself"},
      {"noise_offset_type", "the GUI's choice of which noise keys it writes"},
      {"stop_text_encoder_training", "read by kohya's train_db.py alone"},
      {"lowvram", "not an argument of kohya's scripts (--lowram and --highvram are)"},
      {"loraplus_lr_ratio", "kohya reads LoRA+ from network_args alone: give "
                            "network_args = [\"loraplus_lr_ratio=R\"] for it to act"},
      {"loraplus_unet_lr_ratio", "kohya reads LoRA+ from network_args alone: give "
                                 "network_args = [\"loraplus_unet_lr_ratio=R\"] for it to act"},
      {"loraplus_text_encoder_lr_ratio",
       "kohya reads LoRA+ from network_args alone: give "
       "network_args = [\"loraplus_text_encoder_lr_ratio=R\"] for it to act"},
      {"mem_eff_save", "read by kohya's flux_train.py (full fine-tuning) alone"},
      {"single_blocks_to_swap", "read by kohya's flux_train.py alone (blocks_to_swap is the "
                                "LoRA script's)"},
      {"double_blocks_to_swap", "read by kohya's flux_train.py alone (blocks_to_swap is the "
                                "LoRA script's)"},
      {"show_timesteps_resolution", "not an argument of kohya's LoRA scripts"}};
  const auto it = keys.find(name);
  return it == keys.end() ? nullptr : it->second;
}

void check_known(const std::string& name) {
  if (name == "output" || name == "config" || name == "save_state" || name == "resume" ||
      name == "console_log_file" || find_flag(name) != nullptr ||
      kohya::find_foreign_flag(name) != nullptr) {
    return;
  }
  std::vector<std::string> names = {"output", "config", "save_state", "resume", "console_log_file",
                                    "model", "train_data_dir", "output_dir", "config_file"};
  for (const FlagInfo& f : table()) names.push_back(f.name);
  for (const kohya::ForeignFlag& f : kohya::foreign_flags()) names.emplace_back(f.name);
  throw InputError("unknown flag --" + name + did_you_mean(name, names, "--") +
                   " (lorapipe run takes the stages' kohya-style flags; see lorapipe help)");
}

std::string toml_quote(const std::string& value) {
  std::string out = "\"";
  for (char c : value) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {  // TOML's \u escape for control characters
          char escaped[8];
          std::snprintf(escaped, sizeof escaped, "\\u%04x", static_cast<unsigned char>(c));
          out += escaped;
        } else {
          out += c;
        }
    }
  }
  return out + "\"";
}

}  // namespace

const char* stage_name(Stage stage) {
  switch (stage) {
    case Stage::kPreprocess: return "preprocess";
    case Stage::kCacher: return "cacher";
    case Stage::kTrainer: return "trainer";
    case Stage::kSampler: return "sampler";
  }
  return "?";
}

bool Settings::has(const std::string& name) const {
  return std::any_of(flags.begin(), flags.end(), [&](const auto& f) { return f.first == name; });
}

std::string Settings::get(const std::string& name, const std::string& fallback) const {
  for (const auto& [key, value] : flags) {
    if (key == name) return value;
  }
  return fallback;
}

void Settings::set(const std::string& name, const std::string& value) {
  for (auto& [key, v] : flags) {
    if (key == name) {
      v = value;
      return;
    }
  }
  flags.emplace_back(name, value);
}

std::vector<FlagInfo> flag_table() { return table(); }

std::vector<std::pair<std::string, std::string>> read_config(const fs::path& given,
                                                             std::vector<std::string>* notes) {
  std::vector<std::string> unused;
  std::vector<std::string>& said = notes != nullptr ? *notes : unused;
  // kohya's --config_file may leave out the extension.
  fs::path file = given;
  if (!fs::exists(file) && file.extension() != ".toml" && fs::exists(file.string() + ".toml")) {
    file += ".toml";
  }
  toml::table doc;
  try {
    doc = toml::parse_file(file.string());
  } catch (const toml::parse_error& e) {
    std::ostringstream where;
    where << file.string() << ":" << e.source().begin.line << ": " << e.description();
    throw InputError(where.str());
  }
  auto scalar = [&](const std::string& name, const toml::node& node) -> std::optional<std::string> {
    if (const auto* s = node.as_string()) return s->get();
    if (const auto* i = node.as_integer()) return std::to_string(i->get());
    if (const auto* d = node.as_floating_point()) {
      std::ostringstream text;
      text.precision(17);
      text << d->get();
      return text.str();
    }
    if (const auto* b = node.as_boolean()) return b->get() ? "true" : "false";
    (void)name;
    return std::nullopt;
  };
  std::vector<std::pair<std::string, std::string>> out;
  auto take = [&](const std::string& key, const toml::node& node) {
    const std::string name = canonical(key);
    if (name == "config") throw InputError(file.string() + ": a config cannot name another");
    if (const char* why = kohya_gui_key(name); why != nullptr && find_flag(name) == nullptr) {
      said.push_back(file.string() + ": " + name + " is the kohya_ss GUI's, which kohya's LoRA "
                     "scripts do not read, nor does lorapipe: " + why);
      return;
    }
    try {
      check_known(name);
    } catch (const InputError& e) {
      throw InputError(file.string() + ": " + e.what());
    }
    std::string value;
    if (const auto* list = node.as_array()) {
      // kohya's lists (network_args = ["conv_dim=4", "conv_alpha=1"]): the words of the flag;
      // an empty list is the flag not given.
      for (const toml::node& item : *list) {
        const auto word = scalar(name, item);
        if (!word) throw InputError(file.string() + ": " + name + " holds a list or a table");
        if (multi_value(name)) {
          append_word(value, *word);  // marked: a word may hold spaces (common/text.h)
        } else {
          value += (value.empty() ? "" : " ") + *word;
        }
      }
      if (value.empty()) return;
      // kohya's text_encoder_lr is a list of one rate per text encoder: one item is one value.
      if (!multi_value(name) && kohya::find_foreign_flag(name) == nullptr && list->size() > 1) {
        throw InputError(file.string() + ": " + name + " takes one value, not a list");
      }
    } else if (const auto v = scalar(name, node)) {
      value = *v;
    } else {
      throw InputError(file.string() + ": " + name + " must be a string, a number, a boolean or a list");
    }
    try {
      if (take_foreign(name, value, said)) return;
    } catch (const InputError& e) {
      throw InputError(file.string() + ": " + e.what());
    }
    out.emplace_back(name, value);
  };
  for (const auto& [key, node] : doc) {
    // kohya's read_config_from_file flattens one level of tables: [model] path = ... is path.
    if (const auto* section = node.as_table()) {
      for (const auto& [inner, inner_node] : *section) {
        if (inner_node.is_table()) {
          throw InputError(file.string() + ": [" + std::string(key.str()) + "." +
                           std::string(inner.str()) + "]: tables nest one level deep");
        }
        take(std::string(inner.str()), inner_node);
      }
    } else {
      take(std::string(key.str()), node);
    }
  }
  return out;
}

void write_config(const Settings& settings, const fs::path& file) {
  // Written whole under another name and renamed over the last: a full disk leaves the run's
  // settings as they were (`lorapipe resume` reads them), never an empty file.
  const fs::path partial = file.string() + ".partial";
  {
    std::ostringstream out;
    out << "# The settings of this run, as flags of `lorapipe run` (also --config=FILE).\n";
    out << "output = " << toml_quote(settings.output.string()) << "\n";
    for (const auto& [name, value] : settings.flags) {
      const FlagInfo* f = find_flag(name);
      if (f != nullptr && f->boolean && (value == "true" || value == "false")) {
        out << name << " = " << value << "\n";
      } else if (multi_value(name)) {  // kohya's list form, one word an item
        out << name << " = [";
        const std::vector<std::string> words = split_words(value);
        for (size_t i = 0; i < words.size(); ++i) out << (i ? ", " : "") << toml_quote(words[i]);
        out << "]\n";
      } else {
        out << name << " = " << toml_quote(value) << "\n";
      }
    }
    write_file(partial, out.str(), true);
  }
  fs::rename(partial, file);
}

Settings parse_run_args(const std::vector<std::string>& args) {
  Settings cli;
  fs::path config;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    if (arg.rfind("--", 0) != 0 || arg.size() == 2) {
      throw InputError("unexpected argument '" + arg + "' (flags are --name=value)");
    }
    const size_t eq = arg.find('=');
    std::string name = canonical(arg.substr(2, eq == std::string::npos ? std::string::npos : eq - 2));
    check_known(name);
    const FlagInfo* f = find_flag(name);
    std::string value;
    if (f == nullptr && name != "config" && name != "output") {  // a kohya flag lorapipe lacks
      if (name == "save_state") {
        value = eq == std::string::npos ? "true" : arg.substr(eq + 1);
      } else if (name == "console_log_file" || name == "resume") {
        value = eq != std::string::npos ? arg.substr(eq + 1) : i + 1 < args.size() ? args[++i] : "";
      } else {
        value = kohya::foreign_flag_value(*kohya::find_foreign_flag(name), args, i);
      }
      take_foreign(name, value, cli.notes);
      continue;
    }
    if (eq != std::string::npos) {
      value = arg.substr(eq + 1);
    } else if (f != nullptr && f->boolean) {
      value = "true";
    } else if (multi_value(name)) {  // kohya: --optimizer_args a=1 b=2, or no words at all
      while (i + 1 < args.size() && args[i + 1].rfind("--", 0) != 0) {
        append_word(value, args[++i]);
      }
      if (value.empty()) continue;  // kohya's empty list: the flag not given
    } else {
      if (i + 1 >= args.size()) throw InputError("--" + name + " needs a value");
      value = args[++i];
    }
    if (f != nullptr && f->boolean && value != "true" && value != "false") {
      throw InputError("--" + name + " is true or false, not '" + value + "'");
    }
    if (name == "config") {
      config = value;
    } else if (name == "output") {
      cli.output = value;
    } else {
      cli.set(name, value);
    }
  }
  Settings settings;
  if (!config.empty()) {
    for (const auto& [name, value] : read_config(config, &settings.notes)) {
      if (name == "output") {
        settings.output = value;
      } else {
        settings.set(name, value);
      }
    }
  }
  for (const auto& [name, value] : cli.flags) settings.set(name, value);  // flags win
  settings.notes.insert(settings.notes.end(), cli.notes.begin(), cli.notes.end());
  // kohya's deprecated --split_mode (FLUX.1) is --blocks_to_swap=18 where that is not given, as
  // kohya's flux_train_network sets it; what the stages and the plan see is the swap.
  if (settings.has("split_mode")) {
    if (settings.get("split_mode") == "true") {
      if (settings.has("blocks_to_swap")) {
        settings.notes.push_back("--split_mode is kohya's deprecated form of --blocks_to_swap, "
                                 "which is given: --split_mode is ignored, as kohya ignores it");
      } else {
        settings.set("blocks_to_swap", "18");
        settings.notes.push_back("--split_mode is kohya's deprecated form of --blocks_to_swap: "
                                 "--blocks_to_swap=18, as kohya sets it");
      }
    }
    std::erase_if(settings.flags, [](const auto& f) { return f.first == "split_mode"; });
  }
  // The sampler swaps the blocks the training swaps (previews fit the card it fitted), and a
  // LoRA cannot be merged into weights that stay in host memory: previews then apply it beside
  // them, which renders the same images.
  if (settings.has("blocks_to_swap") && settings.get("blocks_to_swap") != "0" &&
      settings.has("merge_lora") && settings.get("merge_lora") != "false") {
    settings.notes.push_back("--merge_lora is left out: with --blocks_to_swap the previews apply "
                             "each LoRA beside the weights, some of which stay in host memory");
    std::erase_if(settings.flags, [](const auto& f) { return f.first == "merge_lora"; });
  }
  // kohya's train_network: a dataset config names the images, and the folder flags a kohya
  // command or config file often still carries beside it are ignored, with a warning.
  if (settings.has("dataset_config")) {
    std::string ignored;
    for (const char* name : {"data_dir", "reg_data_dir", "in_json"}) {
      if (!settings.has(name)) continue;
      ignored += (ignored.empty() ? "--" : ", --") + std::string(name == std::string("data_dir")
                                                                    ? "train_data_dir"
                                                                    : name) +
                 "=" + settings.get(name);
    }
    if (!ignored.empty()) {
      settings.notes.push_back("ignoring " + ignored + ": --dataset_config=" +
                               settings.get("dataset_config") +
                               " names the images, as kohya ignores them there");
      std::erase_if(settings.flags, [](const auto& f) {
        return f.first == "data_dir" || f.first == "reg_data_dir" || f.first == "in_json";
      });
    }
  }
  if (!cli.output.empty()) settings.output = cli.output;
  // Files and folders as absolute paths: the stages start in this folder, but run.toml must
  // mean the same files when `lorapipe resume` runs from another one (folders the run creates,
  // --cache_dir or --logging_dir, included).
  for (const char* name :
       {"pretrained_model_name_or_path", "tokenizer", "vae", "clip_l", "t5xxl", "ae",
        "t5_tokenizer", "base_weights", "cache_dir",
        "data_dir", "reg_data_dir", "dataset_config", "in_json", "network_weights",
        "logging_dir", "sample_prompts", "console_log_file"}) {
    if (!settings.has(name)) continue;
    auto absolute = [](const std::string& given) {
      std::error_code ec;
      const fs::path path(given);
      if (given.empty() || path.is_absolute()) return given;
      const fs::path full = fs::absolute(path, ec).lexically_normal();
      return ec ? given : full.string();
    };
    if (multi_value(name)) {
      std::string words;
      for (const std::string& word : split_words(settings.get(name))) {
        append_word(words, absolute(word));
      }
      settings.set(name, words);
    } else {
      settings.set(name, absolute(settings.get(name)));
    }
  }
  return settings;
}

std::vector<std::string> stage_args(const Settings& settings, Stage stage) {
  std::vector<std::string> out;
  for (const auto& [name, value] : settings.flags) {
    const FlagInfo* f = find_flag(name);
    if (f == nullptr) continue;
    for (const auto& [target, target_name] : f->targets) {
      if (target == stage) out.push_back("--" + target_name + "=" + value);
    }
  }
  return out;
}

}  // namespace lorapipe::launcher
