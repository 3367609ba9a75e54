// kohya's metadata of a LoRA file (ss_* and modelspec.*), with the family's names from its
// ModelFamily and the keys common to every family here.
#include "trainer/run.h"

#include <algorithm>
#include <ctime>
#include <fstream>
#include <iomanip>
#include <sstream>

#include "common/numbers.h"
#include "common/sha256.h"

namespace lorapipe::trainer::detail {

using nlohmann::json;

namespace {

// kohya's modelspec.date: datetime.fromtimestamp(int(time)).isoformat(), the local time.
std::string iso_now() {
  const std::time_t now = std::time(nullptr);
  char buffer[32];
  std::strftime(buffer, sizeof buffer, "%Y-%m-%dT%H:%M:%S", std::localtime(&now));
  return buffer;
}

}  // namespace

// kohya's legacy model hash (train_util.model_hash): 64 KiB at 1 MiB into the file.
std::string legacy_model_hash(const fs::path& file) {
  std::ifstream in(file, std::ios::binary);
  if (!in) return "NOFILE";
  in.seekg(0x100000);
  std::string bytes(0x10000, '\0');
  in.read(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  bytes.resize(static_cast<size_t>(in.gcount()));
  return sha256_hex(bytes).substr(0, 8);
}

// kohya's str(time.time()): seconds since the epoch as a Python float. Web UIs read the
// training timestamps back with float() (A1111's metadata editor shows them as dates).
std::string unix_time_now() {
  const auto now = std::chrono::system_clock::now().time_since_epoch();
  return python_float_repr(std::chrono::duration<double>(now).count());
}

std::string number(double v) {
  std::ostringstream out;
  out << std::setprecision(17) << v;
  return out.str();
}

std::map<std::string, std::string> Run::metadata(int64_t step, int64_t epoch) const {
  const auto& s = o_.step;
  std::map<std::string, std::string> m;
  const int64_t batches = static_cast<int64_t>(scheduler_->batches_per_epoch());
  m["ss_session_id"] = run_id_;
  m["ss_training_started_at"] = training_started_at_;
  m["ss_output_name"] = o_.output_name.empty() ? "None" : o_.output_name;  // kohya's argument
  // Floats as kohya's str() writes them (Python's repr); None for an option not given.
  auto float_or_none = [](double v) { return v > 0 ? python_float_repr(v) : std::string("None"); };
  const auto& lr = s.optimizer_groups;
  m["ss_learning_rate"] = python_float_repr(lr.learning_rate);
  // kohya writes its arguments: None for a rate not given (the learning rate then applies).
  m["ss_unet_lr"] = lr.unet_lr >= 0 ? python_float_repr(lr.unet_lr) : "None";
  // kohya writes its list as Python prints it where two rates were given.
  m["ss_text_encoder_lr"] =
      lr.text_encoder_2_lr >= 0
          ? "[" + python_float_repr(lr.text_encoder_lr >= 0 ? lr.text_encoder_lr : lr.learning_rate) +
                ", " + python_float_repr(lr.text_encoder_2_lr) + "]"
      : lr.text_encoder_lr >= 0 ? python_float_repr(lr.text_encoder_lr)
                                : "None";
  m["ss_num_train_images"] = std::to_string(scheduler_->train_images());
  m["ss_num_reg_images"] = std::to_string(scheduler_->reg_images());
  uint64_t validation_images = 0;  // kohya's: repeats included
  for (const auto& e : validation_manifest_.entries()) {
    if (!e.is_reg()) validation_images += std::max<uint32_t>(1, e.repeats());
  }
  m["ss_num_validation_images"] = std::to_string(validation_images);
  m["ss_num_batches_per_epoch"] = std::to_string(batches);
  // Epochs end on steps (an epoch's last batch ends its step): ceil(batches / accumulation) each,
  // or with bucket batch sizes a step per bucket's batch of samples (BatchScheduler).
  const int64_t steps_per_epoch =
      std::max<int64_t>(1, static_cast<int64_t>(scheduler_->steps_per_epoch()));
  m["ss_num_epochs"] = std::to_string((max_steps_ + steps_per_epoch - 1) / steps_per_epoch);
  if (!dataset_metadata_.dataset_config) {  // kohya's, for a dataset without a TOML
    m["ss_batch_size_per_device"] =
        std::to_string(scheduler_->batch_size() / std::max(1, o_.ranks.world_size));
    m["ss_total_batch_size"] =
        std::to_string(scheduler_->batch_size() * s.gradient_accumulation_steps);
  }
  m["ss_gradient_checkpointing"] = s.gradient_checkpointing ? "True" : "False";
  m["ss_gradient_accumulation_steps"] = std::to_string(s.gradient_accumulation_steps);
  m["ss_max_train_steps"] = std::to_string(max_steps_);
  // kohya writes its argument as int_or_float read it: a count, or a ratio (5% is 0.05).
  m["ss_lr_warmup_steps"] = o_.lr_warmup_steps >= 1 || o_.lr_warmup_steps == 0
                                ? std::to_string(static_cast<int64_t>(o_.lr_warmup_steps))
                                : python_float_repr(o_.lr_warmup_steps);
  m["ss_lr_scheduler"] = s.schedule.name;
  const models::KohyaFamilyNames& kohya = model_->model_family().kohya;
  m["ss_network_module"] = kohya.network_module;
  m["ss_network_dim"] = std::to_string(o_.network.dim);
  // kohya's --network_alpha is a float: str() writes 8.0. Alpha 0 trains at alpha = dim.
  m["ss_network_alpha"] = python_float_repr(
      o_.network.alpha == 0 ? static_cast<double>(o_.network.dim) : o_.network.alpha);
  if (o_.dim_from_weights) {
    // The network is the file's, not the flags': its largest rank and that module's alpha (kohya
    // writes the flags' here, which then describe no module of the file).
    const LoraNetwork::Module* widest = nullptr;
    for (const auto& module : network_->modules()) {
      if (widest == nullptr || module.adapter->rank() > widest->adapter->rank()) widest = &module;
    }
    if (widest != nullptr) {
      m["ss_network_dim"] = std::to_string(widest->adapter->rank());
      m["ss_network_alpha"] = python_float_repr(widest->alpha);
    }
  }
  m["ss_network_dropout"] = float_or_none(o_.network.dropout);
  // kohya writes its net_kwargs with json.dumps, and only when --network_args is given: the
  // arguments in their order as strings (a repeated key keeps its first place and its last
  // value), then the "dropout" train_network adds for LyCORIS unless one was given (null without
  // --network_dropout), left out with --dim_from_weights as kohya leaves it.
  if (!o_.network_args.empty()) {
    std::vector<std::pair<std::string, std::string>> args;  // key, its value as JSON
    auto quoted = [](const std::string& text) {
      return json(text).dump(-1, ' ', /*ensure_ascii=*/true, json::error_handler_t::replace);
    };
    auto set = [&](const std::string& key, const std::string& value) {
      for (auto& [k, v] : args) {
        if (k == key) {
          v = value;
          return;
        }
      }
      args.emplace_back(key, value);
    };
    for (const std::string& a : o_.network_args) {
      const size_t eq = a.find('=');
      set(a.substr(0, eq), quoted(a.substr(eq + 1)));
    }
    const bool has_dropout = std::any_of(args.begin(), args.end(),
                                         [](const auto& kv) { return kv.first == "dropout"; });
    if (!o_.dim_from_weights && !has_dropout) {
      set("dropout", o_.network.dropout > 0 ? python_float_repr(o_.network.dropout) : "null");
    }
    std::string text = "{";
    for (const auto& [key, value] : args) {
      text += (text.size() > 1 ? ", " : "") + quoted(key) + ": " + value;
    }
    m["ss_network_args"] = text + "}";
  }
  m["ss_mixed_precision"] = o_.mixed_precision;
  m["ss_full_fp16"] = "False";
  m["ss_v2"] = kohya.v2 ? "True" : "False";
  m["ss_base_model_version"] = kohya.base_model_version;
  // kohya writes its argument: None when --clip_skip was not given.
  m["ss_clip_skip"] = o_.clip_skip_given ? std::to_string(s.clip_skip) : "None";
  // kohya writes its argument: None when not given, which is 75.
  m["ss_max_token_length"] = o_.max_token_length == 75 ? "None" : std::to_string(o_.max_token_length);
  if (model_->model_family().objective == models::ObjectiveKind::kFlowMatching) {
    // FluxNetworkTrainer.update_metadata's own key; the objective writes the others.
    m["ss_apply_t5_attn_mask"] = o_.model_parts.apply_t5_attn_mask ? "True" : "False";
  }
  m["ss_cache_latents"] = "True";
  m["ss_seed"] = std::to_string(o_.seed);
  m["ss_lowram"] = o_.lowram ? "True" : "False";
  m["ss_noise_offset"] = float_or_none(s.noise.noise_offset);
  m["ss_noise_offset_random_strength"] = s.noise.noise_offset_random_strength ? "True" : "False";
  m["ss_adaptive_noise_scale"] =
      s.noise.adaptive_noise_scale != 0 ? python_float_repr(s.noise.adaptive_noise_scale) : "None";
  m["ss_multires_noise_iterations"] = s.noise.multires_noise_iterations > 0
                                          ? std::to_string(s.noise.multires_noise_iterations)
                                          : "None";
  m["ss_multires_noise_discount"] = python_float_repr(s.noise.multires_noise_discount);
  m["ss_masked_loss"] = o_.masked_loss ? "True" : "False";
  m["ss_scale_weight_norms"] = float_or_none(s.scale_weight_norms);
  m["ss_ip_noise_gamma"] = float_or_none(s.noise.ip_noise_gamma);
  m["ss_ip_noise_gamma_random_strength"] =
      s.noise.ip_noise_gamma_random_strength ? "True" : "False";
  m["ss_prior_loss_weight"] = python_float_repr(o_.prior_loss_weight);
  m["ss_max_grad_norm"] = python_float_repr(s.max_grad_norm);
  m["ss_loss_type"] = s.loss_type;
  m["ss_fp8_base"] = o_.fp8_base ? "True" : "False";
  m["ss_fp8_base_unet"] = o_.fp8_base_unet ? "True" : "False";
  m["ss_fp8_scaled"] = o_.fp8_scaled ? "True" : "False";
  m["ss_fp8_fast"] = o_.fp8_fast ? "True" : "False";
  m["ss_blocks_to_swap"] = std::to_string(o_.blocks_to_swap);
  m["ss_cpu_offload_checkpointing"] = s.cpu_offload_checkpointing ? "True" : "False";
  m["ss_optimizer"] = step_->optimizer().describe();
  // The family's objective: its parametrisation, weightings, Huber schedule and point range.
  step_->objective().write_metadata(m);
  m["ss_training_comment"] = o_.training_comment.empty() ? "None" : o_.training_comment;
  m["ss_sd_model_name"] = o_.model.filename().string();
  m["ss_sd_model_hash"] = model_hash_;
  m["ss_new_sd_model_hash"] = model_sha256_;
  if (!o_.vae.empty()) {  // kohya's: the file's name and hashes (a folder: its path alone)
    const fs::path name = o_.vae.has_filename() ? o_.vae.filename() : o_.vae.parent_path().filename();
    m["ss_vae_name"] = name.string();
    if (!vae_hash_.empty()) {
      m["ss_vae_hash"] = vae_hash_;
      m["ss_new_vae_hash"] = vae_sha256_;
    }
  }
  m.insert(dataset_metadata_.keys.begin(), dataset_metadata_.keys.end());
  m["ss_steps"] = std::to_string(step);
  m["ss_epoch"] = std::to_string(epoch);
  m["ss_training_finished_at"] = unix_time_now();
  m["ss_validation_split"] = python_float_repr(o_.validation_split);
  m["ss_validation_seed"] = std::to_string(o_.validation_seed);
  m["ss_validate_every_n_steps"] = std::to_string(o_.validate_every_n_steps);
  m["ss_validate_every_n_epochs"] =
      o_.validate_every_n_epochs > 0 ? std::to_string(o_.validate_every_n_epochs) : "None";
  m["ss_max_validation_steps"] =
      o_.max_validation_steps > 0 ? std::to_string(o_.max_validation_steps) : "None";
  if (o_.no_metadata) {
    // kohya's minimum metadata (SS_METADATA_MINIMUM_KEYS): what a loader needs to apply the file.
    std::map<std::string, std::string> minimum;
    for (const char* key : {"ss_v2", "ss_base_model_version", "ss_network_module", "ss_network_dim",
                            "ss_network_alpha"}) {
      minimum[key] = m.at(key);
    }
    if (!o_.network_args.empty()) minimum["ss_network_args"] = m.at("ss_network_args");
    // The ModelSpec keys stay (kohya writes them either way): the objective's are in already.
    for (const auto& [key, value] : m) {
      if (key.rfind("modelspec.", 0) == 0) minimum[key] = value;
    }
    m = std::move(minimum);
  }
  // ModelSpec 1.0.1, as kohya's sai_model_spec writes it for a LoRA of the family.
  m["modelspec.sai_model_spec"] = "1.0.1";
  m["modelspec.architecture"] = kohya.modelspec_architecture + "/lora";
  m["modelspec.implementation"] = kohya.modelspec_implementation;
  // kohya's: --metadata_title (below), else --output_name, else "LoRA@" and the time.
  m["modelspec.title"] = o_.output_name.empty() ? "LoRA@" + unix_time_now() : o_.output_name;
  m["modelspec.date"] = iso_now().substr(0, 19);
  m["modelspec.resolution"] =
      std::to_string(dataset_metadata_.width) + "x" + std::to_string(dataset_metadata_.height);
  // kohya's: --clip_skip as given, 1 included; nothing without it.
  if (o_.clip_skip_given) m["modelspec.encoder_layer"] = std::to_string(s.clip_skip);
  for (const auto& [field, value] : o_.modelspec) m["modelspec." + field] = value;
  return m;
}

}  // namespace lorapipe::trainer::detail
