// lorapipe-trainer: kohya's flags in, trainer::train out.
#include <gflags/gflags.h>
#include <fcntl.h>
#include <strings.h>
#include <unistd.h>

#include <csignal>
#include <cmath>
#include <cstdio>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <iterator>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "common/error.h"
#include "common/heap.h"
#include "common/kohya_flags.h"
#include "common/numbers.h"
#include "common/log.h"
#include "common/text.h"
#include "trainer/dataset.h"
#include "trainer/trainer.h"
#include "runtime/exit_code.h"
#include "runtime/flags.h"
#include "models/family.h"
#include "models/tensor_memory.h"

// Model, data and output.
DEFINE_string(pretrained_model_name_or_path, "",
              "Base model: single .safetensors or diffusers folder");
DEFINE_string(model, "", "Alias of --pretrained_model_name_or_path");
DEFINE_string(model_family, "",
              "Load the model as this family (sd15) instead of detecting it from its keys, its "
              "model_index.json or its metadata");
DEFINE_string(tokenizer, "",
              "Another CLIP vocabulary (folder, merges.txt or .gz); CLIP's own is built in");
DEFINE_string(vae, "",
              "The VAE the cacher was given with --vae, in place of the checkpoint's (kohya's)");
DEFINE_string(cache_dir, "",
              "Cache folder (default: $LORAPIPE_CACHE_DIR or ~/.cache/lorapipe/cache)");
DEFINE_string(cacher, "", "Read records from a remote lorapipe-cacher --serve (tcp://host:port)");
DEFINE_string(dataset_id, "", "The manifest preprocess and the cacher wrote");
DEFINE_string(output_dir, "", "Run folder: lora/, state/, tensorboard/");
DEFINE_string(output_name, "",
              "LoRA file name (kohya's --output_name; default: at-step…, epoch-… and last, as kohya)");
DEFINE_string(save_precision, "float", "float, fp16 or bf16");
DEFINE_int64(save_every_n_steps, 0, "Save a LoRA every N steps (NAME-step00000100.safetensors)");
DEFINE_int64(save_every_n_epochs, 0, "Save a LoRA every N epochs (NAME-000002.safetensors)");
DEFINE_int64(save_last_n_steps, 0, "Keep only the step saves of the last N steps");
DEFINE_int64(save_last_n_epochs, 0, "Keep only the last N epoch saves");
DEFINE_int64(save_n_epoch_ratio, 0,
             "Save about N times over the run: every max(1, epochs / N) epochs (kohya's)");
DEFINE_bool(save_state, false, "Also save the full training state with each LoRA save");
DEFINE_int64(save_last_n_steps_state, 0,
             "Keep only the states of the last N steps (0: as --save_last_n_steps)");
DEFINE_int64(save_last_n_epochs_state, 0,
             "Keep only the last N epoch states (0: as --save_last_n_epochs)");
DEFINE_bool(save_state_on_train_end, false, "Save the final state even without --save_state");
DEFINE_bool(no_metadata, false,
            "Write only kohya's minimum ss_* metadata (and modelspec.*) into the LoRA");
// kohya's ModelSpec flags: each becomes modelspec.<field> in the LoRA file.
DEFINE_string(metadata_title, "", "modelspec.title (default: --output_name)");
DEFINE_string(metadata_author, "", "modelspec.author");
DEFINE_string(metadata_description, "", "modelspec.description");
DEFINE_string(metadata_license, "", "modelspec.license");
DEFINE_string(metadata_tags, "", "modelspec.tags (comma-separated)");
DEFINE_string(metadata_trigger_phrase, "", "modelspec.trigger_phrase");
DEFINE_string(metadata_usage_hint, "", "modelspec.usage_hint");
DEFINE_string(metadata_thumbnail, "", "modelspec.thumbnail: a data: URL, or an image file");
DEFINE_string(metadata_merged_from, "", "modelspec.merged_from");
DEFINE_string(metadata_preprocessor, "", "modelspec.preprocessor");
DEFINE_string(metadata_is_negative_embedding, "", "modelspec.is_negative_embedding");
DEFINE_string(console_log_level, "", "DEBUG, INFO, WARNING, ERROR or CRITICAL (default INFO)");
DEFINE_string(console_log_file, "", "Write the log to this file instead of stderr");
DEFINE_string(resume, "", "Continue from a state folder written with --save_state");
DEFINE_string(pub, "", "Bind a PUB endpoint for TrainProgress and CheckpointReady");
DEFINE_double(checkpoint_reannounce_s, 5.0,
              "Send the newest CheckpointReady again this often, for samplers that join late");
DEFINE_string(training_comment, "", "Written into the LoRA's metadata");
DEFINE_string(device, "auto", "auto, cpu, cuda or cuda:N");
DEFINE_string(mixed_precision, "no", "no, fp16 or bf16: the frozen base's dtype");
DEFINE_bool(fp8_base, false,
            "Store the U-Net's and text encoder's Linear/Conv2d weights in float8, computing in "
            "--mixed_precision's dtype");
DEFINE_bool(fp8_base_unet, false, "--fp8_base for the U-Net alone (the text encoder stays in "
                                  "--mixed_precision's dtype)");
DEFINE_bool(cpu_offload_checkpointing, false,
            "FLUX.1: the checkpointed blocks' inputs wait for backward in pinned host memory "
            "(turns --gradient_checkpointing on)");
DEFINE_bool(split_mode, false,
            "kohya's deprecated FLUX.1 option: --blocks_to_swap=18 where --blocks_to_swap is not "
            "given (as kohya sets it)");
DEFINE_int32(blocks_to_swap, 0,
             "Keep the frozen weights of this many of the denoiser's blocks in host memory, "
             "copied to the device one block ahead of compute (FLUX.1: n/2 double and "
             "(n - n/2)*2 single blocks, as kohya's); turns --gradient_checkpointing on");
DEFINE_bool(map_weights, false,
            "On the CPU: base weights the model file holds in their dtype are the file's mapped "
            "pages, not a copy; a sampler with --map_weights on the same machine shares them "
            "(lorapipe run sets it on both when they share the CPU)");
DEFINE_string(share_weights, "",
              "Publish the placed denoiser's frozen weights in this manifest file for a sampler "
              "on the same device (its --shared_weights), which then holds no copy of them: CUDA "
              "IPC on a GPU, shared memory on the CPU (lorapipe run sets both when the sampler "
              "shares the trainer's GPU); at its end the trainer waits for that sampler to finish");
DEFINE_bool(fp8_scaled, false,
            "With --fp8_base(_unet): float8 with a scale per 64 input features of each output "
            "row (musubi-tuner's), closer to the weights than the plain cast");
DEFINE_bool(fp8_fast, false,
            "With --fp8_scaled: the denoiser's Linear layers multiply in float8 (at::_scaled_mm; "
            "musubi-tuner's name), their weights and inputs scaled per row; needs float8 matrix "
            "units (CUDA compute capability 8.9 and above); faster, slightly less exact");
DEFINE_int32(threads, 0, "CPU threads for compute (0: one per core)");
// Length and data.
DEFINE_int64(max_train_steps, 1600, "Optimizer steps");
DEFINE_int64(max_train_epochs, 0, "Epochs (wins over --max_train_steps when set)");
DEFINE_int32(train_batch_size, 1, "Samples per batch (a dataset TOML's batch_size wins)");
DEFINE_string(bucket_batch_sizes, "",
              "WxH:B,... a batch size per rank for each bucket, the samples per optimizer step "
              "kept at --train_batch_size x --gradient_accumulation_steps (lorapipe run "
              "--auto_batch writes it)");
DEFINE_bool(fill_last_batch, false, "Top up each bucket's short last batch from the same bucket");
DEFINE_uint64(seed, 42, "Seed of every random choice");
DEFINE_double(prior_loss_weight, 1.0, "Loss weight of regularization images");
DEFINE_int32(clip_skip, 1, "Text-encoder layer from the end (1: last)");
DEFINE_int32(max_token_length, 75,
             "kohya's caption length: 75, or 150 / 225 tokens encoded in chunks of 75");
DEFINE_double(validation_split, 0, "Share of the images held out for validation loss");
DEFINE_int64(validation_seed, -1,
             "Seed of the validation split and noise (default: --seed, as kohya)");
DEFINE_int64(validate_every_n_steps, 0, "Validation loss every N steps (also at start and end)");
DEFINE_int64(validate_every_n_epochs, 0,
             "Validation loss at the end of every N epochs (0: every epoch, as kohya)");
DEFINE_int64(max_validation_steps, 0,
             "Validate on the first N held-out images only (0: all of them)");
DEFINE_int32(max_bad_steps, 10, "Stop after this many non-finite steps in a row");
DEFINE_double(timeout_s, 300, "Give up on a silent remote cacher after this long");
// Network.
DEFINE_int64(network_dim, 4, "LoRA rank");
DEFINE_double(network_alpha, 1, "LoRA alpha (scale alpha/dim; 0 means dim)");
DEFINE_double(network_dropout, 0, "Dropout on the LoRA's down output");
DEFINE_string(
    network_args, "",
    "key=value ... (conv_dim, conv_alpha, rank_dropout, module_dropout, loraplus_lr_ratio)");
DEFINE_string(network_weights, "", "Continue from this LoRA file");
DEFINE_string(base_weights, "", "LoRA files merged into the base model before training (kohya's)");
DEFINE_string(base_weights_multiplier, "", "Their multipliers, in order (1 for those not given)");
DEFINE_bool(dim_from_weights, false,
            "Build the network as --network_weights is: its modules, ranks and alphas");
DEFINE_bool(network_train_unet_only, false, "Train no text-encoder LoRA");
DEFINE_bool(network_train_text_encoder_only, false, "Train the text encoder's LoRA alone");
DEFINE_double(network_multiplier, 1.0, "LoRA multiplier while training");
// Optimizer and schedule.
DEFINE_string(optimizer_type, "AdamW",
              "AdamW, AdamW8bit, PagedAdamW8bit, Prodigy, DAdaptAdam, Lion or "
              "Adafactor (case-insensitive)");
DEFINE_bool(use_8bit_adam, false, "kohya's older spelling of --optimizer_type=AdamW8bit");
DEFINE_bool(use_lion_optimizer, false, "kohya's older spelling of --optimizer_type=Lion");
DEFINE_string(optimizer_args, "",
              "key=value ... (weight_decay, betas=b1,b2, eps; min_8bit_size for the 8-bit ones; "
              "decouple, use_bias_correction, safeguard_warmup, d0, d_coef, growth_rate, beta3, "
              "slice_p for Prodigy; eps=a,b, clip_threshold, decay_rate, beta1, scale_parameter, "
              "relative_step, warmup_init for Adafactor)");
DEFINE_double(learning_rate, 1e-4, "Learning rate");
DEFINE_double(unet_lr, -1, "UNet learning rate (default: --learning_rate)");
DEFINE_string(text_encoder_lr, "",
              "Text-encoder learning rate (default: --learning_rate); two values (kohya's list) "
              "give SDXL's two encoders theirs");
DEFINE_string(lr_scheduler, "constant",
              "constant, constant_with_warmup, linear, cosine, cosine_with_restarts, polynomial, "
              "cosine_with_min_lr, warmup_stable_decay, inverse_sqrt or piecewise_constant");
DEFINE_string(lr_warmup_steps, "0", "Warmup steps, or a ratio of the steps below 1 (or N%)");
DEFINE_int32(lr_scheduler_num_cycles, 1,
             "Restarts of cosine_with_restarts; twice the half-cycles of cosine_with_min_lr and "
             "of warmup_stable_decay's cosine decay (kohya halves it)");
DEFINE_double(lr_scheduler_power, 1.0, "Power of polynomial");
DEFINE_double(lr_scheduler_min_lr_ratio, -1,
              "cosine_with_min_lr's floor and warmup_stable_decay's, a ratio of the rate");
DEFINE_string(lr_decay_steps, "0",
              "warmup_stable_decay's decay steps, or a ratio of the steps below 1 (or N%)");
DEFINE_int64(lr_scheduler_timescale, 0, "inverse_sqrt's timescale (0: the warmup steps)");
DEFINE_string(lr_scheduler_args, "",
              "key=value ... (lr_end for polynomial, min_lr for cosine_with_min_lr, warmup_type "
              "and decay_type for warmup_stable_decay, step_rules for piecewise_constant)");
DEFINE_double(max_grad_norm, 1.0, "Gradient clipping (0: none)");
DEFINE_int32(gradient_accumulation_steps, 1, "Micro-batches per optimizer step");
DEFINE_bool(gradient_checkpointing, false, "Recompute UNet blocks in backward to save memory");
// Noise and loss.
DEFINE_bool(v_parameterization, false, "v-prediction target");
DEFINE_double(min_snr_gamma, 0, "Min-SNR weighting gamma (0: off)");
DEFINE_bool(scale_v_pred_loss_like_noise_pred, false,
            "Weigh the loss by snr / (snr + 1), as an epsilon loss weighs (kohya)");
DEFINE_double(v_pred_like_loss, 0, "Add this much of a v-prediction-like loss (kohya)");
DEFINE_bool(debiased_estimation_loss, false, "Weigh the loss by 1 / sqrt(snr) (kohya)");
DEFINE_bool(debug_dataset, false,
            "Print every batch of the run (images, buckets, flips, captions as drawn) and stop "
            "without training (kohya's)");
DEFINE_bool(masked_loss, false,
            "Mask the loss with the images' alpha (preprocess --alpha_mask); kohya's");
DEFINE_bool(weighted_captions, false,
            "Read A1111 attention syntax in captions, (word:1.2), and weigh those tokens (kohya)");
DEFINE_bool(zero_terminal_snr, false,
            "Rescale the noise schedule to zero SNR at the last timestep (kohya; with "
            "--v_parameterization)");
DEFINE_double(scale_weight_norms, 0,
              "Max-norm regularization: scale down each LoRA module whose update's norm exceeds "
              "this (kohya; 1.0 is typical, 0: off)");
DEFINE_double(noise_offset, 0, "Noise offset");
DEFINE_double(ip_noise_gamma, 0, "Input perturbation noise strength (kohya; 0.1 is typical)");
DEFINE_bool(ip_noise_gamma_random_strength, false, "Draw the strength in [0, ip_noise_gamma)");
DEFINE_bool(noise_offset_random_strength, false, "Draw the offset in [0, noise_offset)");
DEFINE_double(adaptive_noise_scale, 0, "Grow the offset with the latent mean");
DEFINE_int32(multires_noise_iterations, 0, "Pyramid (multi-resolution) noise levels");
DEFINE_double(multires_noise_discount, 0.3, "Pyramid noise discount");
DEFINE_int64(min_timestep, 0, "Lowest timestep drawn");
DEFINE_int64(max_timestep, 1000, "Highest timestep drawn (exclusive)");
DEFINE_string(loss_type, "l2", "l2, l1, huber or smooth_l1");
DEFINE_string(huber_schedule, "snr", "constant, exponential or snr");
DEFINE_double(huber_c, 0.1, "Huber loss parameter");
DEFINE_double(huber_scale, 1.0, "Huber loss scale");
// Flow matching (Flux.1), kohya's flux_train_network.py options and defaults; a Stable Diffusion
// model refuses them by name.
DEFINE_string(timestep_sampling, "sigma", "flow matching: sigma, uniform, sigmoid, shift or "
              "flux_shift (kohya's; its docs recommend shift with --discrete_flow_shift 3.1582)");
DEFINE_double(discrete_flow_shift, 3.0, "flow matching: shift of the sigma schedule and of "
              "--timestep_sampling shift");
DEFINE_double(sigmoid_scale, 1.0, "flow matching: scale of the normal draw sigmoid, shift and "
              "flux_shift take the sigmoid of");
DEFINE_string(weighting_scheme, "uniform", "flow matching: uniform (kohya's default; none is the "
              "same), sigma_sqrt, logit_normal, mode or cosmap (how --timestep_sampling sigma "
              "draws; the loss weighting of sigma_scaled)");
DEFINE_double(logit_mean, 0.0, "flow matching: mean of the logit_normal weighting scheme");
DEFINE_double(logit_std, 1.0, "flow matching: std of the logit_normal weighting scheme");
DEFINE_double(mode_scale, 1.29, "flow matching: scale of the mode weighting scheme");
DEFINE_string(model_prediction_type, "sigma_scaled", "flow matching: raw, additive or "
              "sigma_scaled (kohya's default; its docs recommend raw)");
DEFINE_double(guidance_scale, 3.5, "FLUX.1 [dev]: the distilled guidance the transformer is "
              "given in training (kohya's default; kohya's docs advise 1.0 for dev)");
DEFINE_int64(sample_every_n_steps, 0,
             "Announce a checkpoint for lorapipe-sampler every N steps (a sample-only save "
             "between saves)");
DEFINE_int64(sample_every_n_epochs, 0, "The same every N epochs");
DEFINE_bool(sample_at_first, false, "Announce the untrained network before the first step");
// kohya flags that lorapipe always does its own way, accepted so commands carry over.
DEFINE_string(network_module, "networks.lora",
              "kohya's network module; lorapipe trains networks.lora (LoRA, LoCon with conv_dim)");
DEFINE_string(save_model_as, "safetensors", "LoRA file format: safetensors (the only one)");
DEFINE_string(log_with, "tensorboard", "tensorboard (wandb and all: TensorBoard alone is written)");
DEFINE_string(logging_dir, "",
              "TensorBoard under DIR/<log_prefix><time>/network_train, as kohya "
              "(default: OUT/tensorboard)");
DEFINE_string(log_prefix, "", "Prefix of the --logging_dir run folder");
DEFINE_string(log_tracker_name, "",
              "The --logging_dir run's folder inside <log_prefix><time> (kohya's tracker name; "
              "default network_train)");
DEFINE_bool(no_half_vae, false, "Accepted: the trainer never runs the VAE (latents are cached)");
DEFINE_string(train_data_dir, "",
              "Refused with a pointer: the trainer trains from the cache that preprocess and the "
              "cacher fill (kohya's --train_data_dir is preprocess's)");
DEFINE_bool(check_flags, false,
            "Check the flags (all that needs no model or data) and exit: 0 when they are fine, 2 "
            "naming what is not. lorapipe run does this before it starts any stage");
DEFINE_bool(lowram, false, "Accepted: weights stream from the file, one tensor at a time");
DEFINE_bool(highvram, false, "Accepted: no effect");
DEFINE_bool(cache_latents, true, "Accepted: lorapipe always trains from the cache");
DEFINE_bool(cache_latents_to_disk, true, "Accepted: lorapipe always trains from the cache");
DEFINE_bool(cache_text_encoder_outputs, false,
            "Accepted: the cacher always caches the text, and the trainer reads what no "
            "text-encoder LoRA trains (all with --network_train_unet_only, as kohya requires "
            "with it for SD and SDXL; FLUX.1's T5 while CLIP-L's LoRA trains)");
DEFINE_bool(cache_text_encoder_outputs_to_disk, false,
            "Accepted: the cache is on disk (kohya's FLUX.1 and SDXL flag)");
DEFINE_bool(sdpa, true, "Accepted: attention is always scaled_dot_product_attention");
DEFINE_bool(xformers, false, "Accepted: attention is always scaled_dot_product_attention");
DEFINE_bool(mem_eff_attn, false, "Accepted: attention is always scaled_dot_product_attention");
DEFINE_int32(max_data_loader_n_workers, 0, "Accepted: one prefetch thread reads the cache");
DEFINE_bool(persistent_data_loader_workers, false, "Accepted: the prefetch thread lives all run");

namespace {

// kohya's --network_args and --optimizer_args take several values (`--network_args "a=1" "b=2"`);
// gflags takes one. Words that follow one of them up to the next flag are joined into its value.
// kohya's flags that lorapipe does not act on (common/kohya_flags.h) are taken out here: at
// kohya's default they ask for nothing, otherwise they are refused, naming the flag and why.
std::vector<std::string> join_multi_value_flags(int argc, char** argv) {
  const std::vector<std::string> given(argv, argv + argc);
  std::vector<std::string> out;
  for (size_t i = 0; i < given.size(); ++i) {
    const std::string& arg = given[i];
    if (i > 0 && arg.rfind("--", 0) == 0) {
      const size_t eq = arg.find('=');
      const std::string name = arg.substr(2, eq == std::string::npos ? eq : eq - 2);
      if (const auto* foreign = lorapipe::kohya::find_foreign_flag(name)) {
        const std::string value = lorapipe::kohya::foreign_flag_value(*foreign, given, i);
        const std::string note = lorapipe::kohya::check_foreign_flag(*foreign, value);
        if (!note.empty()) {
          LP_LOG(kWarning, "trainer") << note;
        }
        continue;
      }
    }
    const bool multi = arg == "--network_args" || arg == "--optimizer_args" ||
                       arg == "--lr_scheduler_args" || arg == "--base_weights" ||
                       arg == "--base_weights_multiplier" || arg == "--text_encoder_lr";
    if (!multi) {
      out.push_back(arg);
      continue;
    }
    std::string joined;  // each word marked, so a path with a space stays one word
    while (i + 1 < given.size() && given[i + 1].rfind("--", 0) != 0) {
      lorapipe::append_word(joined, given[++i]);
    }
    out.push_back(arg + "=" + joined);
  }
  return out;
}

// A file as a data: URL (kohya's --metadata_thumbnail takes either).
std::string data_url(const std::filesystem::path& file) {
  std::ifstream in(file, std::ios::binary);
  if (!in) throw lorapipe::InputError("--metadata_thumbnail=" + file.string() + ": cannot read it");
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::string ext = file.extension().string();
  for (char& c : ext) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  const std::string mime = ext == ".png"                     ? "image/png"
                           : ext == ".jpg" || ext == ".jpeg" ? "image/jpeg"
                           : ext == ".webp"                  ? "image/webp"
                           : ext == ".gif"                   ? "image/gif"
                                                             : "application/octet-stream";
  static const char* kDigits = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out = "data:" + mime + ";base64,";
  for (size_t i = 0; i < bytes.size(); i += 3) {
    uint32_t chunk = static_cast<uint8_t>(bytes[i]) << 16;
    if (i + 1 < bytes.size()) chunk |= static_cast<uint8_t>(bytes[i + 1]) << 8;
    if (i + 2 < bytes.size()) chunk |= static_cast<uint8_t>(bytes[i + 2]);
    out += kDigits[(chunk >> 18) & 63];
    out += kDigits[(chunk >> 12) & 63];
    out += i + 1 < bytes.size() ? kDigits[(chunk >> 6) & 63] : '=';
    out += i + 2 < bytes.size() ? kDigits[chunk & 63] : '=';
  }
  return out;
}

// A number given as `flag`'s value; InputError naming both otherwise.
double flag_number(const std::string& flag, const std::string& text) {
  if (const auto value = lorapipe::parse_double(text)) return *value;
  throw lorapipe::InputError(flag + "=" + text + ": not a number");
}

// kohya's int_or_float: a count of steps, a ratio of them below 1, or "N%" (N / 100).
double steps_or_ratio(const std::string& flag, const std::string& text) {
  const bool percent = !text.empty() && text.back() == '%';
  const double value = flag_number(flag, percent ? text.substr(0, text.size() - 1) : text);
  // A ratio is below 1 (100% would read as one step): kohya's own percentages are of the steps.
  // kohya's int_or_float refuses a count that is not whole (1.5); so does lorapipe rather than
  // cut it to 1.
  if (value < 0 || (percent && value >= 100) ||
      (!percent && value >= 1 && value != std::floor(value))) {
    throw lorapipe::InputError(flag + "=" + text + ": expected a count of steps, a ratio below 1 "
                                                   "or a percentage below 100%");
  }
  return percent ? value / 100.0 : value;
}

std::vector<std::string> words(const std::string& text) { return lorapipe::split_words(text); }

}  // namespace

int main(int argc, char** argv) {
  lorapipe::keep_freed_memory_for_reuse();
  // The CPU's tensor memory counted from the start, so a CPU run reports the peak of allocated
  // tensors as a CUDA run does (memory/peak_allocated_bytes), not the process's resident set.
  (void)lorapipe::models::TensorMemoryCounter::install();
  gflags::SetUsageMessage(
      "lorapipe-trainer --pretrained_model_name_or_path=MODEL --dataset_id=ID --output_dir=OUT "
      "[kohya flags]");
  std::vector<std::string> args;
  try {
    args = join_multi_value_flags(argc, argv);
  } catch (const lorapipe::InputError& e) {
    LP_LOG(kError, "trainer") << e.what();
    return lorapipe::runtime::kExitError;
  }
  std::vector<char*> arg_pointers;
  for (std::string& a : args) arg_pointers.push_back(a.data());
  int count = static_cast<int>(arg_pointers.size());
  char** pointer = arg_pointers.data();
  // A pasted kohya command carries the dataset's, the cache's and the previews' flags too.
  lorapipe::runtime::parse_flags(
      &count, &pointer,
      " (the trainer trains from the cache: kohya's dataset, bucket, caption, caching and sample "
      "flags go to `lorapipe run`, which gives each stage its own)");
  if (count > 1) {
    LP_LOG(kError, "trainer") << "unexpected argument '" << pointer[1] << "'";
    return lorapipe::runtime::kExitError;
  }
  if (!FLAGS_console_log_level.empty()) {  // kohya's (Python logging's) level names
    std::string level = FLAGS_console_log_level;
    for (char& c : level) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
    const std::map<std::string, lorapipe::LogLevel> levels = {
        {"DEBUG", lorapipe::LogLevel::kDebug},     {"INFO", lorapipe::LogLevel::kInfo},
        {"WARNING", lorapipe::LogLevel::kWarning}, {"ERROR", lorapipe::LogLevel::kError},
        {"CRITICAL", lorapipe::LogLevel::kError}};
    if (!levels.count(level)) {
      LP_LOG(kError, "trainer") << "--console_log_level=" << FLAGS_console_log_level
                                << ": expected DEBUG, INFO, WARNING, ERROR or CRITICAL";
      return lorapipe::runtime::kExitError;
    }
    lorapipe::set_log_level(levels.at(level));
  }
  if (!FLAGS_console_log_file.empty()) {
    // Opened before stderr is touched, so a file that cannot be written is reported where the
    // user looks; truncated, as kohya's logging FileHandler (mode "w") starts it.
    const int fd = ::open(FLAGS_console_log_file.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0 || ::dup2(fd, STDERR_FILENO) < 0) {
      LP_LOG(kError, "trainer") << "--console_log_file=" << FLAGS_console_log_file
                                << ": cannot open it for writing: " << std::strerror(errno);
      return lorapipe::runtime::kExitError;
    }
    ::close(fd);
  }
  namespace t = lorapipe::trainer;
  try {
    t::Options o;
    // Data-parallel ranks, as torchrun, Slurm and Kubernetes start them (trainer/ranks.h).
    o.ranks = t::rank_environment();
    o.model = FLAGS_pretrained_model_name_or_path.empty() ? FLAGS_model
                                                          : FLAGS_pretrained_model_name_or_path;
    o.model_family = FLAGS_model_family;
    o.tokenizer = FLAGS_tokenizer;
    o.vae = FLAGS_vae;
    o.model_parts = lorapipe::models::model_parts_from_flags();
    o.cache_dir = FLAGS_cache_dir;
    o.cacher_endpoint = FLAGS_cacher;
    o.dataset_id = FLAGS_dataset_id;
    o.device = FLAGS_device;
    o.threads = FLAGS_threads;
    o.mixed_precision = FLAGS_mixed_precision;
    o.fp8_base = FLAGS_fp8_base;
    o.fp8_base_unet = FLAGS_fp8_base_unet;
    o.fp8_scaled = FLAGS_fp8_scaled;
    o.fp8_fast = FLAGS_fp8_fast;
    if (FLAGS_split_mode) {
      if (gflags::GetCommandLineFlagInfoOrDie("blocks_to_swap").is_default) {
        FLAGS_blocks_to_swap = 18;
        LP_LOG(kWarning, "trainer") << "--split_mode is kohya's deprecated form of "
                                       "--blocks_to_swap: --blocks_to_swap=18, as kohya sets it";
      } else {
        LP_LOG(kWarning, "trainer") << "--split_mode is kohya's deprecated form of "
                                       "--blocks_to_swap, which is given: --split_mode is "
                                       "ignored, as kohya ignores it";
      }
    }
    o.blocks_to_swap = FLAGS_blocks_to_swap;
    o.map_weights = FLAGS_map_weights;
    o.share_weights = FLAGS_share_weights;
    o.output_dir = FLAGS_output_dir;
    o.output_name = FLAGS_output_name;
    o.save_precision = FLAGS_save_precision;
    o.save_every_n_steps = FLAGS_save_every_n_steps;
    o.save_every_n_epochs = FLAGS_save_every_n_epochs;
    o.save_last_n_steps = FLAGS_save_last_n_steps;
    o.save_last_n_epochs = FLAGS_save_last_n_epochs;
    o.save_n_epoch_ratio = FLAGS_save_n_epoch_ratio;
    o.sample_every_n_steps = FLAGS_sample_every_n_steps;
    o.sample_every_n_epochs = FLAGS_sample_every_n_epochs;
    o.sample_at_first = FLAGS_sample_at_first;
    o.save_state = FLAGS_save_state;
    o.save_last_n_steps_state = FLAGS_save_last_n_steps_state;
    o.save_last_n_epochs_state = FLAGS_save_last_n_epochs_state;
    o.save_state_on_train_end = FLAGS_save_state_on_train_end;
    o.no_metadata = FLAGS_no_metadata;
    for (const auto& [field, value] :
         std::vector<std::pair<std::string, std::string>>{
             {"title", FLAGS_metadata_title},
             {"author", FLAGS_metadata_author},
             {"description", FLAGS_metadata_description},
             {"license", FLAGS_metadata_license},
             {"tags", FLAGS_metadata_tags},
             {"trigger_phrase", FLAGS_metadata_trigger_phrase},
             {"usage_hint", FLAGS_metadata_usage_hint},
             {"thumbnail", FLAGS_metadata_thumbnail},
             {"merged_from", FLAGS_metadata_merged_from},
             {"preprocessor", FLAGS_metadata_preprocessor},
             {"is_negative_embedding", FLAGS_metadata_is_negative_embedding}}) {
      if (value.empty()) continue;
      // kohya turns a thumbnail file into a data: URL (and skips a missing one with a warning;
      // here a file that cannot be read stops the run before any compute).
      o.modelspec[field] = field == "thumbnail" && value.rfind("data:", 0) != 0 ? data_url(value)
                                                                                : value;
    }
    o.resume = FLAGS_resume;
    o.pub_endpoint = FLAGS_pub;
    o.checkpoint_reannounce_s = FLAGS_checkpoint_reannounce_s;
    o.training_comment = FLAGS_training_comment;
    o.lowram = FLAGS_lowram;
    o.max_token_length = FLAGS_max_token_length;
    o.weighted_captions = FLAGS_weighted_captions;
    // kohya: caching to disk caches.
    o.cache_text_encoder_outputs =
        FLAGS_cache_text_encoder_outputs || FLAGS_cache_text_encoder_outputs_to_disk;
    o.masked_loss = FLAGS_masked_loss;
    o.debug_dataset = FLAGS_debug_dataset;
    if (!FLAGS_train_data_dir.empty()) {
      throw lorapipe::InputError(
          "--train_data_dir=" + FLAGS_train_data_dir +
          ": the trainer trains from the cache, not from the images: lorapipe-preprocess "
          "--train_data_dir=" + FLAGS_train_data_dir + " and lorapipe-cacher fill it, then "
          "--dataset_id names their manifest here (`lorapipe run --train_data_dir=...` runs every "
          "stage)");
    }
    // kohya's choices that have one answer here: anything else is refused by name.
    // networks.lora_flux is kohya's module for FLUX.1: the family picks its own targets.
    if (FLAGS_network_module != "networks.lora" && FLAGS_network_module != "networks.lora_flux") {
      throw lorapipe::InputError("--network_module=" + FLAGS_network_module +
                                 ": lorapipe trains kohya's networks.lora (LoRA; LoCon with "
                                 "--network_args conv_dim=R; networks.lora_flux for FLUX.1) "
                                 "and no other module");
    }
    if (FLAGS_save_model_as != "safetensors") {
      throw lorapipe::InputError("--save_model_as=" + FLAGS_save_model_as +
                                 ": LoRA files are written as safetensors only");
    }
    if (FLAGS_log_with != "tensorboard" && FLAGS_log_with != "wandb" && FLAGS_log_with != "all") {
      throw lorapipe::InputError("--log_with=" + FLAGS_log_with +
                                 ": expected tensorboard, wandb or all");
    }
    if (FLAGS_log_with != "tensorboard") {
      LP_LOG(kWarning, "trainer") << "--log_with=" << FLAGS_log_with
                                  << ": lorapipe writes TensorBoard logs only";
    }
    if (FLAGS_zero_terminal_snr && !FLAGS_v_parameterization) {
      // kohya's warning: an epsilon model cannot predict the noise at zero SNR, where the input
      // is nothing but that noise, so the paper pairs the rescale with v-prediction.
      LP_LOG(kWarning, "trainer") << "--zero_terminal_snr without --v_parameterization: the "
                                     "last timesteps teach an epsilon model little";
    }
    if (!FLAGS_logging_dir.empty()) {
      char stamp[32];
      const std::time_t now = std::time(nullptr);
      std::strftime(stamp, sizeof stamp, "%Y%m%d%H%M%S", std::localtime(&now));
      o.tensorboard_dir = std::filesystem::path(FLAGS_logging_dir) /
                          (FLAGS_log_prefix + stamp) /
                          (FLAGS_log_tracker_name.empty() ? "network_train"
                                                          : FLAGS_log_tracker_name);
    }
    o.max_train_steps = FLAGS_max_train_steps;
    o.max_train_epochs = FLAGS_max_train_epochs;
    o.train_batch_size = FLAGS_train_batch_size;
    o.fill_last_batch = FLAGS_fill_last_batch;
    if (!FLAGS_bucket_batch_sizes.empty()) {
      o.bucket_batch_sizes = lorapipe::trainer::parse_bucket_batch_sizes(FLAGS_bucket_batch_sizes);
    }
    o.seed = FLAGS_seed;
    o.prior_loss_weight = FLAGS_prior_loss_weight;
    o.max_bad_steps = FLAGS_max_bad_steps;
    o.timeout_s = FLAGS_timeout_s;
    o.validation_split = FLAGS_validation_split;
    o.validation_seed =
        FLAGS_validation_seed < 0 ? o.seed : static_cast<uint64_t>(FLAGS_validation_seed);
    o.validate_every_n_steps = FLAGS_validate_every_n_steps;
    o.validate_every_n_epochs = FLAGS_validate_every_n_epochs;
    o.max_validation_steps = FLAGS_max_validation_steps;
    if (o.validate_every_n_epochs < 0 || o.max_validation_steps < 0 ||
        o.validate_every_n_steps < 0) {
      throw lorapipe::InputError("--validate_every_n_steps, --validate_every_n_epochs and "
                                 "--max_validation_steps must be >= 0");
    }
    o.network.dim = FLAGS_network_dim;
    o.network.alpha = FLAGS_network_alpha;
    o.network.dropout = FLAGS_network_dropout;
    o.network.multiplier = FLAGS_network_multiplier;
    o.network.train_text_encoder = !FLAGS_network_train_unet_only;
    o.network.train_unet = !FLAGS_network_train_text_encoder_only;
    if (FLAGS_network_train_unet_only && FLAGS_network_train_text_encoder_only) {
      throw lorapipe::InputError("--network_train_unet_only and --network_train_text_encoder_only: "
                                 "together they leave nothing to train");
    }
    o.network_args = words(FLAGS_network_args);
    o.network_weights = FLAGS_network_weights;
    o.dim_from_weights = FLAGS_dim_from_weights;
    for (const auto& [file, multiplier] :
         lorapipe::kohya::parse_base_weights(FLAGS_base_weights, FLAGS_base_weights_multiplier)) {
      o.base_weights.emplace_back(file, multiplier);
    }
    o.lr_warmup_steps = steps_or_ratio("--lr_warmup_steps", FLAGS_lr_warmup_steps);
    auto& s = o.step;
    s.clip_skip = FLAGS_clip_skip;
    o.clip_skip_given = !gflags::GetCommandLineFlagInfoOrDie("clip_skip").is_default;
    s.base_dtype = FLAGS_mixed_precision == "fp16"   ? c10::kHalf
                   : FLAGS_mixed_precision == "bf16" ? c10::kBFloat16
                                                     : c10::kFloat;
    s.optimizer.type = FLAGS_optimizer_type;
    // As kohya: the old switches stand alone, never beside another choice of optimizer.
    const bool optimizer_typed = !gflags::GetCommandLineFlagInfoOrDie("optimizer_type").is_default;
    if (FLAGS_use_8bit_adam) {
      if (optimizer_typed && strcasecmp(FLAGS_optimizer_type.c_str(), "adamw8bit") != 0 &&
          !FLAGS_use_lion_optimizer) {
        throw lorapipe::InputError("--use_8bit_adam with --optimizer_type=" + FLAGS_optimizer_type +
                                   ": choose one optimizer");
      }
      s.optimizer.type = "AdamW8bit";
    }
    if (FLAGS_use_lion_optimizer) {
      const bool typed =
          optimizer_typed && strcasecmp(FLAGS_optimizer_type.c_str(), "lion") != 0;
      if (FLAGS_use_8bit_adam || typed) {
        throw lorapipe::InputError("--use_lion_optimizer with --" +
                                   std::string(FLAGS_use_8bit_adam ? "use_8bit_adam"
                                                                   : "optimizer_type=" +
                                                                         FLAGS_optimizer_type) +
                                   ": choose one optimizer");
      }
      s.optimizer.type = "Lion";
    }
    t::apply_optimizer_args(s.optimizer, words(FLAGS_optimizer_args));
    // kohya's --learning_rate defaults to 2e-6, lorapipe's to 1e-4 (a LoRA's rate): a kohya
    // command that gives --unet_lr and no --learning_rate trains its text encoders at 2e-6 there
    // (their group falls back to --learning_rate, as the schedule's reference does), and so it
    // does here, rather than 50 times faster.
    if (gflags::GetCommandLineFlagInfoOrDie("learning_rate").is_default &&
        !gflags::GetCommandLineFlagInfoOrDie("unet_lr").is_default) {
      FLAGS_learning_rate = 2e-6;
      if (FLAGS_text_encoder_lr.empty() && !FLAGS_network_train_unet_only) {
        LP_LOG(kInfo, "trainer") << "--unet_lr without --learning_rate or --text_encoder_lr: the "
                                    "text encoders train at kohya's default --learning_rate, "
                                    "2e-6, as that command trains them in kohya";
      }
    }
    s.optimizer_groups.learning_rate = FLAGS_learning_rate;
    const bool adaptive = strcasecmp(s.optimizer.type.c_str(), "prodigy") == 0 ||
                          strncasecmp(s.optimizer.type.c_str(), "dadapt", 6) == 0;
    if (adaptive && FLAGS_learning_rate <= 0.1) {
      // kohya's warning: the rate scales the step size these find, 1.0 is the usual one.
      LP_LOG(kWarning, "trainer") << "--learning_rate=" << FLAGS_learning_rate << " is low for "
                                  << s.optimizer.type << ", which is run with about 1.0";
    }
    // -1 stands for "not given" (the --learning_rate); a given rate below 0 or not a number is
    // refused as torch's optimizers refuse it in kohya, not taken for "not given".
    const auto check_rate = [](const std::string& flag, const std::string& given, double rate) {
      if (!(rate >= 0 && std::isfinite(rate))) {
        throw lorapipe::InputError(flag + "=" + given +
                                   ": a learning rate must be a finite number, 0 or more");
      }
    };
    if (const auto unet_lr = gflags::GetCommandLineFlagInfoOrDie("unet_lr"); !unet_lr.is_default) {
      check_rate("--unet_lr", unet_lr.current_value, FLAGS_unet_lr);
    }
    s.optimizer_groups.unet_lr = FLAGS_unet_lr;
    {
      std::vector<std::string> rates;
      for (const std::string& word : lorapipe::split_words(FLAGS_text_encoder_lr)) {
        std::stringstream items(word);
        for (std::string item; std::getline(items, item, ',');) {
          if (!item.empty()) rates.push_back(item);
        }
      }
      if (rates.size() > 2) {
        throw lorapipe::InputError("--text_encoder_lr takes one rate, or one per text encoder "
                                   "(two), not " + std::to_string(rates.size()));
      }
      std::vector<double> values;
      for (const std::string& rate : rates) {
        try {
          size_t used = 0;
          values.push_back(std::stod(rate, &used));
          if (used != rate.size()) throw std::invalid_argument(rate);
        } catch (const std::exception&) {
          throw lorapipe::InputError("--text_encoder_lr: '" + rate + "' is not a number");
        }
        check_rate("--text_encoder_lr", rate, values.back());
      }
      if (!values.empty()) s.optimizer_groups.text_encoder_lr = values[0];
      if (values.size() == 2) s.optimizer_groups.text_encoder_2_lr = values[1];
    }
    s.schedule.name = FLAGS_lr_scheduler;
    s.schedule.num_cycles = FLAGS_lr_scheduler_num_cycles;
    s.schedule.power = FLAGS_lr_scheduler_power;
    s.schedule.initial_lr = FLAGS_learning_rate;
    if (FLAGS_lr_scheduler_min_lr_ratio >= 0) s.schedule.min_lr_ratio = FLAGS_lr_scheduler_min_lr_ratio;
    s.schedule.decay_steps = steps_or_ratio("--lr_decay_steps", FLAGS_lr_decay_steps);
    if (s.schedule.name == "piecewise_constant" && o.lr_warmup_steps > 0) {
      LP_LOG(kWarning, "trainer") << "--lr_warmup_steps is not used by piecewise_constant, whose "
                                     "step_rules set every step's rate (kohya ignores it too)";
    }
    s.schedule.timescale = FLAGS_lr_scheduler_timescale;
    t::apply_lr_scheduler_args(s.schedule, words(FLAGS_lr_scheduler_args));
    // kohya's Adafactor with relative_step (its default; warmup_init implies it) takes its own
    // step size, and kohya swaps the schedule for transformers' AdafactorSchedule, which only
    // reports it: named "adafactor:<lr>" (ss_lr_scheduler), refusing a warmup as it does.
    const bool adafactor_steps_itself =
        (strcasecmp(s.optimizer.type.c_str(), "adafactor") == 0 ||
         strcasecmp(s.optimizer.type.c_str(), "transformers.optimization.adafactor") == 0) &&
        (s.optimizer.adafactor.relative_step || s.optimizer.adafactor.warmup_init);
    if (s.schedule.name.starts_with("adafactor") && !adafactor_steps_itself) {
      throw lorapipe::InputError(
          "--lr_scheduler=" + s.schedule.name + " is transformers' AdafactorSchedule, which "
          "reports the step size Adafactor takes itself: it needs --optimizer_type=Adafactor "
          "with relative_step (its default), as in kohya");
    }
    if (adafactor_steps_itself) {
      if (o.lr_warmup_steps > 0) {
        throw lorapipe::InputError(
            "--lr_warmup_steps=" + FLAGS_lr_warmup_steps + ": Adafactor with relative_step takes "
            "its own step size under kohya's adafactor schedule, which takes no warmup (kohya "
            "refuses it); leave it out, or give --optimizer_args relative_step=False to schedule "
            "--learning_rate");
      }
      if (!s.schedule.name.starts_with("adafactor")) {
        LP_LOG(kInfo, "trainer") << "Adafactor with relative_step: --lr_scheduler="
                                 << s.schedule.name << " gives way to its own, as kohya's does";
      }
      s.schedule.name = "adafactor:" + lorapipe::python_float_repr(FLAGS_learning_rate);
    }
    s.max_grad_norm = FLAGS_max_grad_norm;
    s.gradient_accumulation_steps = FLAGS_gradient_accumulation_steps;
    s.gradient_checkpointing = FLAGS_gradient_checkpointing;
    s.cpu_offload_checkpointing = FLAGS_cpu_offload_checkpointing;
    if (s.cpu_offload_checkpointing && !s.gradient_checkpointing) {
      // kohya's: what it offloads is what checkpointing keeps.
      LP_LOG(kInfo, "trainer") << "--cpu_offload_checkpointing: gradient checkpointing on";
      s.gradient_checkpointing = true;
    }
    if (FLAGS_blocks_to_swap > 0 && !s.gradient_checkpointing) {
      // The recompute in backward is when a swapped block's weights are back on the device.
      LP_LOG(kInfo, "trainer") << "--blocks_to_swap=" << FLAGS_blocks_to_swap
                               << ": gradient checkpointing on, as block swap trains with it";
      s.gradient_checkpointing = true;
    }
    s.objective.v_prediction = FLAGS_v_parameterization;
    s.objective.min_snr_gamma = FLAGS_min_snr_gamma;
    s.objective.scale_v_pred_loss_like_noise_pred = FLAGS_scale_v_pred_loss_like_noise_pred;
    s.objective.v_pred_like_loss = FLAGS_v_pred_like_loss;
    s.objective.debiased_estimation_loss = FLAGS_debiased_estimation_loss;
    s.objective.zero_terminal_snr = FLAGS_zero_terminal_snr;
    s.scale_weight_norms = FLAGS_scale_weight_norms;
    s.noise.noise_offset = FLAGS_noise_offset;
    s.noise.ip_noise_gamma = FLAGS_ip_noise_gamma;
    s.noise.ip_noise_gamma_random_strength = FLAGS_ip_noise_gamma_random_strength;
    s.noise.noise_offset_random_strength = FLAGS_noise_offset_random_strength;
    s.noise.adaptive_noise_scale = FLAGS_adaptive_noise_scale;
    s.noise.multires_noise_iterations = FLAGS_multires_noise_iterations;
    s.noise.multires_noise_discount = FLAGS_multires_noise_discount;
    s.objective.min_timestep = FLAGS_min_timestep;
    s.objective.max_timestep = FLAGS_max_timestep;
    s.loss_type = FLAGS_loss_type;
    s.objective.huber_schedule = FLAGS_huber_schedule;
    s.objective.huber_c = FLAGS_huber_c;
    s.objective.huber_scale = FLAGS_huber_scale;
    s.objective.timestep_sampling = FLAGS_timestep_sampling;
    s.objective.discrete_flow_shift = FLAGS_discrete_flow_shift;
    s.objective.sigmoid_scale = FLAGS_sigmoid_scale;
    s.objective.weighting_scheme = FLAGS_weighting_scheme;
    s.objective.logit_mean = FLAGS_logit_mean;
    s.objective.logit_std = FLAGS_logit_std;
    s.objective.mode_scale = FLAGS_mode_scale;
    s.objective.model_prediction_type = FLAGS_model_prediction_type;
    s.objective.guidance_scale = FLAGS_guidance_scale;
    t::apply_network_args(o);
    if (FLAGS_check_flags) {
      t::check_options(o);
      std::printf("trainer: the flags are fine\n");
      return lorapipe::runtime::kExitOk;
    }
    // Ctrl-C or a launcher's SIGTERM: finish the step, save the LoRA and a state, exit 130.
    std::signal(SIGINT, [](int) { lorapipe::trainer::request_stop(); });
    std::signal(SIGTERM, [](int) { lorapipe::trainer::request_stop(); });
    // Refused before the data and the model load (the launcher's --check_flags says it sooner).
    if (!o.model.empty()) {
      t::check_family_options(
          o, lorapipe::models::model_family(
                 lorapipe::models::detect_family(o.model, o.model_family).family));
    }
    const t::Summary summary = t::train(o);
    if (summary.dataset_only) {
      std::printf("trainer: --debug_dataset: %lld steps of %lld epochs shown; nothing trained\n",
                  static_cast<long long>(summary.steps), static_cast<long long>(summary.epochs));
      return 0;
    }
    if (summary.interrupted) {
      std::printf("trainer: interrupted after %lld steps; LoRA %s; state %s\n",
                  static_cast<long long>(summary.steps), summary.lora.c_str(),
                  summary.state.c_str());
      return lorapipe::runtime::kExitInterrupted;
    }
    std::printf("trainer: %lld steps, %lld epochs, %lld skipped; last loss %.6f; LoRA %s\n",
                static_cast<long long>(summary.steps), static_cast<long long>(summary.epochs),
                static_cast<long long>(summary.skipped_steps), summary.last_loss,
                summary.lora.c_str());
    if (summary.first_validation_loss >= 0) {
      std::printf("validation loss: %.6f at the start, %.6f at the end\n",
                  summary.first_validation_loss, summary.last_validation_loss);
    }
    return lorapipe::runtime::kExitOk;
  } catch (const std::exception& e) {
    LP_LOG(kError, "trainer") << e.what();
    return lorapipe::runtime::kExitError;
  }
}
