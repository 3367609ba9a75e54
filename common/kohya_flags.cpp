#include "common/kohya_flags.h"

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <string>

#include "common/error.h"

namespace lorapipe::kohya {
namespace {

using T = Takes;

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
constexpr std::string_view kNotYet = "not in lorapipe yet";

const std::vector<ForeignFlag> kFlags = {
    // Distributed and compiled training.
    {"deepspeed", true, "", T::kDefaultOnly, kDeepSpeed},
    {"zero_stage", false, "2", T::kAnyValue, kOnlyWithDeepSpeed},
    {"offload_optimizer_device", false, "", T::kAnyValue, kOnlyWithDeepSpeed},
    {"offload_optimizer_nvme_path", false, "", T::kAnyValue, kOnlyWithDeepSpeed},
    {"offload_param_device", false, "", T::kAnyValue, kOnlyWithDeepSpeed},
    {"offload_param_nvme_path", false, "", T::kAnyValue, kOnlyWithDeepSpeed},
    {"zero3_init_flag", true, "", T::kAnyValue, kOnlyWithDeepSpeed},
    {"zero3_save_16bit_model", true, "", T::kAnyValue, kOnlyWithDeepSpeed},
    {"fp16_master_weights_and_gradients", true, "", T::kAnyValue, kOnlyWithDeepSpeed},
    {"ddp_timeout", false, "", T::kAnyValue, kDdp},
    {"ddp_gradient_as_bucket_view", true, "", T::kAnyValue, kDdp},
    {"ddp_static_graph", true, "", T::kAnyValue, kDdp},
    {"torch_compile", true, "", T::kDefaultOnly,
     "torch.compile: lorapipe runs LibTorch from C++, with no compiler pass"},
    {"dynamo_backend", false, "inductor", T::kAnyValue, "acts only with --torch_compile"},
    // Uploads, trackers and console logging.
    {"huggingface_repo_id", false, "", T::kDefaultOnly, kHub},
    {"save_state_to_huggingface", true, "", T::kDefaultOnly, kHub},
    {"resume_from_huggingface", true, "", T::kDefaultOnly, kHub},
    {"huggingface_repo_type", false, "", T::kAnyValue, kOnlyWithHub},
    {"huggingface_path_in_repo", false, "", T::kAnyValue, kOnlyWithHub},
    {"huggingface_token", false, "", T::kAnyValue, kOnlyWithHub},
    {"huggingface_repo_visibility", false, "", T::kAnyValue, kOnlyWithHub},
    {"async_upload", true, "", T::kAnyValue, kOnlyWithHub},
    {"wandb_api_key", false, "", T::kAnyValue,
     "Weights & Biases: lorapipe writes TensorBoard event files alone"},
    {"wandb_run_name", false, "", T::kAnyValue,
     "Weights & Biases: lorapipe writes TensorBoard event files alone"},
    {"log_tracker_name", false, "", T::kAnyValue,
     "lorapipe's TensorBoard run folder is --logging_dir/--log_prefix's, as kohya's default"},
    {"log_tracker_config", false, "", T::kDefaultOnly,
     "accelerate tracker configs: lorapipe writes TensorBoard event files alone"},
    {"log_config", true, "", T::kAnyValue,
     "the settings are in the LoRA's ss_* metadata (and run.toml under `lorapipe run`)"},
    {"console_log_simple", true, "", T::kAnyValue, "lorapipe's log lines are always plain"},
    // Models and precision.
    {"v2", true, "", T::kDefaultOnly, "Stable Diffusion 2.x: not in lorapipe yet (SD 1.x only)"},
    {"vae", false, "", T::kDefaultOnly,
     "another VAE: not in lorapipe yet (latents come from the cache, encoded with the "
     "checkpoint's own VAE)"},
    {"tokenizer_cache_dir", false, "", T::kAnyValue,
     "lorapipe's CLIP vocabulary is built in (--tokenizer for another)"},
    {"fp8_base", true, "", T::kDefaultOnly,
     "fp8 base weights: not in lorapipe yet (--mixed_precision=bf16 halves them)"},
    {"fp8_base_unet", true, "", T::kDefaultOnly,
     "fp8 base weights: not in lorapipe yet (--mixed_precision=bf16 halves them)"},
    {"full_fp16", true, "", T::kAnyValue,
     "the LoRA's own weights and their optimizer state stay fp32 (a few MB), over a base in "
     "--mixed_precision: what full_fp16 saves is that little, at a cost in precision"},
    {"full_bf16", true, "", T::kAnyValue,
     "the LoRA's own weights and their optimizer state stay fp32 (a few MB), over a base in "
     "--mixed_precision: what full_bf16 saves is that little, at a cost in precision"},
    {"cpu_offload_checkpointing", true, "", T::kDefaultOnly, kNotYet},
    {"fused_backward_pass", true, "", T::kDefaultOnly,
     "kohya fuses the backward with the optimizer for SDXL, SD3 and Flux only"},
    {"base_weights", false, "", T::kDefaultOnly,
     "merging LoRAs into the base before training: not in lorapipe yet"},
    {"base_weights_multiplier", false, "", T::kDefaultOnly,
     "merging LoRAs into the base before training: not in lorapipe yet"},
    // Schedules and steps.
    {"lr_scheduler_type", false, "", T::kDefaultOnly,
     "a scheduler class of your own: lorapipe has kohya's named schedulers (--lr_scheduler)"},
    {"lr_scheduler_args", false, "", T::kDefaultOnly, kNotYet},
    {"lr_decay_steps", false, "0", T::kDefaultOnly, kNotYet},
    {"lr_scheduler_timescale", false, "", T::kDefaultOnly, kNotYet},
    {"lr_scheduler_min_lr_ratio", false, "", T::kDefaultOnly, kNotYet},
    {"initial_epoch", false, "", T::kDefaultOnly,
     "starting the count elsewhere: lorapipe continues runs exactly with --resume"},
    {"initial_step", false, "", T::kDefaultOnly,
     "starting the count elsewhere: lorapipe continues runs exactly with --resume"},
    {"skip_until_initial_step", true, "", T::kDefaultOnly,
     "starting the count elsewhere: lorapipe continues runs exactly with --resume"},
    {"save_n_epoch_ratio", false, "", T::kDefaultOnly, "use --save_every_n_epochs"},
    {"output_config", true, "", T::kDefaultOnly,
     "`lorapipe run` writes the run's settings to run.toml"},
    {"config_file", false, "", T::kDefaultOnly,
     "a kohya config file is read by `lorapipe run --config_file=FILE`"},
    // Data: these act on pixels or captions before the cache.
    {"color_aug", true, "", T::kDefaultOnly, kCachedLatents},
    {"face_crop_aug_range", false, "", T::kDefaultOnly, kCachedLatents},
    {"alpha_mask", true, "", T::kDefaultOnly, "masked loss: not in lorapipe yet"},
    {"masked_loss", true, "", T::kDefaultOnly, "masked loss: not in lorapipe yet"},
    {"conditioning_data_dir", false, "", T::kDefaultOnly, "masked loss: not in lorapipe yet"},
    {"token_warmup_min", false, "1", T::kDefaultOnly, kNotYet},
    {"token_warmup_step", false, "0", T::kDefaultOnly, kNotYet},
    {"enable_wildcard", true, "", T::kDefaultOnly, kNotYet},
    {"caption_separator", false, ",", T::kDefaultOnly, kNotYet},
    {"keep_tokens_separator", false, "", T::kDefaultOnly, kNotYet},
    {"secondary_separator", false, "", T::kDefaultOnly, kNotYet},
    {"resize_interpolation", false, "", T::kDefaultOnly,
     "lorapipe-preprocess's --resize_filter picks the filter"},
    {"in_json", false, "", T::kDefaultOnly,
     "kohya's fine-tuning metadata JSON: use caption files or --dataset_config"},
    {"dataset_repeats", false, "1", T::kAnyValue, "acts only with --in_json"},
    {"dataset_class", false, "", T::kDefaultOnly, "a dataset class of your own: not in lorapipe"},
    {"debug_dataset", true, "", T::kDefaultOnly,
     "lorapipe-preprocess --report_only shows what the dataset holds"},
    {"cache_info", true, "", T::kAnyValue, "lorapipe's cache always keeps each image's record"},
    {"skip_cache_check", true, "", T::kAnyValue,
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
  if (flag.boolean) return v == "false" || v == "0";
  if (flag.kohya_default.empty()) return v.empty() || v == "none" || v == "[]";
  double a = 0, b = 0;
  if (as_number(value, a) && as_number(flag.kohya_default, b)) return a == b;
  return v == lower(flag.kohya_default);
}

std::string check_foreign_flag(const ForeignFlag& flag, std::string_view value) {
  if (is_kohya_default(flag, value)) return "";
  const std::string given = "--" + std::string(flag.name) + "=" + std::string(value);
  if (flag.takes == Takes::kDefaultOnly) {
    throw InputError(given + ": " + std::string(flag.why));
  }
  return given + " has no effect in lorapipe: " + std::string(flag.why);
}

}  // namespace lorapipe::kohya
