#include "common/kohya_flags.h"

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <string>

#include "common/error.h"
#include "common/numbers.h"
#include "common/text.h"

namespace lorapipe::kohya {
namespace {

using T = Takes;
using K = Kind;

constexpr std::string_view kDeepSpeed =
    "DeepSpeed: lorapipe's ranks are plain data-parallel c10d ranks (see deploy/README.md)";
constexpr std::string_view kOnlyWithDeepSpeed = "acts only with --deepspeed, which lorapipe lacks";
constexpr std::string_view kDdp =
    "accelerate's DDP settings: lorapipe's ranks all-reduce the LoRA's gradients as one buffer";
constexpr std::string_view kHub =
    "uploads to the Hugging Face Hub: lorapipe writes files only (upload them with "
    "`huggingface-cli upload`)";
constexpr std::string_view kOnlyWithHub = "acts only with --huggingface_repo_id";
constexpr std::string_view kCachedLatents =
    "augments the pixels, which latents encoded once into the cache cannot (kohya refuses it "
    "with cached latents too)";

const std::vector<ForeignFlag> kFlags = {
    // Distributed and compiled training.
    {"deepspeed", K::kBoolean, "", T::kDefaultOnly, kDeepSpeed},
    {"zero_stage", K::kValue, "2", T::kAnyValue, kOnlyWithDeepSpeed},
    {"offload_optimizer_device", K::kValue, "", T::kAnyValue, kOnlyWithDeepSpeed},
    {"offload_optimizer_nvme_path", K::kValue, "", T::kAnyValue, kOnlyWithDeepSpeed},
    {"offload_param_device", K::kValue, "", T::kAnyValue, kOnlyWithDeepSpeed},
    {"offload_param_nvme_path", K::kValue, "", T::kAnyValue, kOnlyWithDeepSpeed},
    {"zero3_init_flag", K::kBoolean, "", T::kAnyValue, kOnlyWithDeepSpeed},
    {"zero3_save_16bit_model", K::kBoolean, "", T::kAnyValue, kOnlyWithDeepSpeed},
    {"fp16_master_weights_and_gradients", K::kBoolean, "", T::kAnyValue, kOnlyWithDeepSpeed},
    {"ddp_timeout", K::kValue, "", T::kAnyValue, kDdp},
    {"ddp_gradient_as_bucket_view", K::kBoolean, "", T::kAnyValue, kDdp},
    {"ddp_static_graph", K::kBoolean, "", T::kAnyValue, kDdp},
    {"torch_compile", K::kBoolean, "", T::kDefaultOnly,
     "torch.compile: lorapipe runs LibTorch from C++, with no compiler pass"},
    {"dynamo_backend", K::kValue, "inductor", T::kAnyValue, "acts only with --torch_compile"},
    // Uploads, trackers and console logging.
    {"huggingface_repo_id", K::kValue, "", T::kDefaultOnly, kHub},
    {"save_state_to_huggingface", K::kBoolean, "", T::kDefaultOnly, kHub},
    {"resume_from_huggingface", K::kBoolean, "", T::kDefaultOnly, kHub},
    {"huggingface_repo_type", K::kValue, "", T::kAnyValue, kOnlyWithHub},
    {"huggingface_path_in_repo", K::kValue, "", T::kAnyValue, kOnlyWithHub},
    {"huggingface_token", K::kValue, "", T::kAnyValue, kOnlyWithHub, {}, /*secret=*/true},
    {"huggingface_repo_visibility", K::kValue, "", T::kAnyValue, kOnlyWithHub},
    {"async_upload", K::kBoolean, "", T::kAnyValue, kOnlyWithHub},
    {"wandb_api_key", K::kValue, "", T::kAnyValue,
     "Weights & Biases: lorapipe writes TensorBoard event files alone", {}, /*secret=*/true},
    {"wandb_run_name", K::kValue, "", T::kAnyValue,
     "Weights & Biases: lorapipe writes TensorBoard event files alone"},
    {"log_tracker_config", K::kValue, "", T::kDefaultOnly,
     "accelerate tracker configs: lorapipe writes TensorBoard event files alone"},
    {"log_config", K::kBoolean, "", T::kAnyValue,
     "the settings are in the LoRA's ss_* metadata (and run.toml under `lorapipe run`)"},
    {"console_log_simple", K::kBoolean, "", T::kAnyValue, "lorapipe's log lines are always plain"},
    // Models and precision.
    {"v2", K::kBoolean, "", T::kDefaultOnly, "Stable Diffusion 2.x: not in lorapipe yet (SD 1.x only)"},
    {"tokenizer_cache_dir", K::kValue, "", T::kAnyValue,
     "lorapipe's CLIP vocabulary is built in (--tokenizer for another)"},
    {"full_fp16", K::kBoolean, "", T::kAnyValue,
     "the LoRA's own weights and their optimizer state stay fp32 (a few MB), over a base in "
     "--mixed_precision: what full_fp16 saves is that little, at a cost in precision"},
    {"full_bf16", K::kBoolean, "", T::kAnyValue,
     "the LoRA's own weights and their optimizer state stay fp32 (a few MB), over a base in "
     "--mixed_precision: what full_bf16 saves is that little, at a cost in precision"},
    {"disable_mmap_load_safetensors", K::kBoolean, "", T::kAnyValue,
     "lorapipe reads each safetensors tensor once through its own mapping"},
    {"train_inpainting", K::kBoolean, "", T::kDefaultOnly, "inpainting models: not in lorapipe yet"},
    // flux_train_network's model type: FLUX.1 itself, or Chroma (a FLUX.1 derivative).
    {"model_type", K::kValue, "flux", T::kDefaultOnly, "Chroma: not in lorapipe yet (FLUX.1 is)"},
    {"controlnet_model_name_or_path", K::kValue, "", T::kDefaultOnly,
     "ControlNet with FLUX.1: not in lorapipe yet"},
    {"show_timesteps", K::kValue, "", T::kDefaultOnly,
     "kohya's look at the timestep draw, which trains nothing: not in lorapipe"},
    {"fused_backward_pass", K::kBoolean, "", T::kAnyValue,
     "kohya fuses the backward with the optimizer in its full fine-tuning scripts, not in its "
     "LoRA scripts"},
    // Schedules and steps.
    {"lr_scheduler_type", K::kValue, "", T::kDefaultOnly,
     "a scheduler class of your own: lorapipe has kohya's named schedulers (--lr_scheduler)"},
    {"initial_epoch", K::kValue, "", T::kDefaultOnly,
     "starting the count elsewhere: lorapipe continues runs exactly with --resume", "1"},
    {"initial_step", K::kValue, "", T::kDefaultOnly,
     "starting the count elsewhere: lorapipe continues runs exactly with --resume", "0"},
    {"skip_until_initial_step", K::kBoolean, "", T::kDefaultOnly,
     "starting the count elsewhere: lorapipe continues runs exactly with --resume"},
    {"output_config", K::kBoolean, "", T::kDefaultOnly,
     "`lorapipe run` writes the run's settings to run.toml"},
    {"config_file", K::kValue, "", T::kDefaultOnly,
     "a kohya config file is read by `lorapipe run --config_file=FILE`"},
    // Data: these act on pixels or captions before the cache.
    {"color_aug", K::kBoolean, "", T::kDefaultOnly, kCachedLatents},
    {"face_crop_aug_range", K::kValue, "", T::kDefaultOnly,
     "face-centred crops: not in lorapipe yet"},
    {"conditioning_data_dir", K::kValue, "", T::kDefaultOnly,
     "masks from a folder of mask images: not in lorapipe yet (--alpha_mask reads the images' "
     "transparency)"},
    {"dataset_class", K::kValue, "", T::kDefaultOnly, "a dataset class of your own: not in lorapipe"},
    {"cache_info", K::kBoolean, "", T::kAnyValue, "lorapipe's cache always keeps each image's record"},
    {"text_encoder_batch_size", K::kValue, "", T::kAnyValue,
     "the cacher encodes captions in batches of its own choosing"},
    {"skip_cache_check", K::kBoolean, "", T::kAnyValue,
     "lorapipe's cache is content-addressed and checked before any compute"},
};

std::string lower(std::string_view s) {
  std::string out(s);
  std::transform(out.begin(), out.end(), out.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return out;
}

bool as_number(std::string_view text, double& out) {
  const std::string s(text);
  char* end = nullptr;
  out = std::strtod(s.c_str(), &end);
  return !s.empty() && end == s.c_str() + s.size();
}

}  // namespace

const std::vector<ForeignFlag>& foreign_flags() { return kFlags; }

const ForeignFlag* find_foreign_flag(std::string_view name) {
  for (const ForeignFlag& f : kFlags) {
    if (f.name == name) return &f;
  }
  return nullptr;
}

bool is_kohya_default(const ForeignFlag& flag, std::string_view value) {
  const std::string v = lower(value);
  double a = 0, b = 0;
  if (!flag.also_default.empty() && as_number(value, a) && as_number(flag.also_default, b) &&
      a == b) {
    return true;
  }
  if (flag.kind == Kind::kBoolean) return v == "false" || v == "0";
  if (flag.kohya_default.empty()) return v.empty() || v == "none" || v == "[]";
  if (as_number(value, a) && as_number(flag.kohya_default, b)) return a == b;
  return v == lower(flag.kohya_default);
}

std::string check_foreign_flag(const ForeignFlag& flag, std::string_view value) {
  if (is_kohya_default(flag, value)) return "";
  const std::string given =
      "--" + std::string(flag.name) + "=" + (flag.secret ? "***" : std::string(value));
  if (flag.takes == Takes::kDefaultOnly) {
    throw InputError(given + ": " + std::string(flag.why));
  }
  return given + " has no effect in lorapipe: " + std::string(flag.why);
}

std::string foreign_flag_value(const ForeignFlag& flag, const std::vector<std::string>& args,
                               size_t& i) {
  const std::string& arg = args[i];
  if (const size_t eq = arg.find('='); eq != std::string::npos) return arg.substr(eq + 1);
  switch (flag.kind) {
    case Kind::kBoolean:
      return "true";
    case Kind::kValue:
      if (i + 1 >= args.size() || args[i + 1].rfind("-", 0) == 0) {
        throw InputError(arg + " needs a value");
      }
      return args[++i];
  }
  return "";
}

}  // namespace lorapipe::kohya

namespace lorapipe::kohya {

std::vector<std::pair<std::string, double>> parse_base_weights(std::string_view files,
                                                               std::string_view multipliers) {
  const std::vector<std::string> names = split_words(files);
  const std::vector<std::string> values = split_words(multipliers);
  if (values.size() > names.size()) {
    throw InputError("--base_weights_multiplier gives " + std::to_string(values.size()) +
                     " multipliers for " + std::to_string(names.size()) + " --base_weights files");
  }
  std::vector<std::pair<std::string, double>> out;
  for (size_t i = 0; i < names.size(); ++i) {
    double multiplier = 1.0;
    if (i < values.size()) {
      const std::optional<double> v = parse_double(values[i]);
      if (!v) {
        throw InputError("--base_weights_multiplier: '" + values[i] + "' is not a number");
      }
      multiplier = *v;
    }
    out.emplace_back(names[i], multiplier);
  }
  return out;
}

}  // namespace lorapipe::kohya
