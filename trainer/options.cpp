// The trainer's options checked before anything loads: kohya's network_args read into the
// options, every flag's range, and what kohya refuses at start.
#include "trainer/run.h"

#include <cctype>
#include <sstream>

#include "common/cuda_alloc_conf.h"
#include "common/error.h"
#include "common/log.h"
#include "models/device.h"
#include "models/family.h"
#include "models/placement.h"
#include "trainer/optimizer.h"

namespace lorapipe::trainer {
using detail::kLog;
using detail::number;
namespace fs = std::filesystem;

void apply_network_args(Options& options) {
  BlockArgs blocks;
  for (const std::string& arg : options.network_args) {
    const size_t eq = arg.find('=');
    if (eq == std::string::npos)
      throw InputError("--network_args '" + arg + "': expected key=value");
    const std::string key = arg.substr(0, eq), value = arg.substr(eq + 1);
    if (key == "block_dims" || key == "block_alphas" || key == "conv_block_dims" ||
        key == "conv_block_alphas" || key == "down_lr_weight" || key == "mid_lr_weight" ||
        key == "up_lr_weight") {
      blocks.values[key] = value;  // lists and curves: resolve_block_args reads them
      continue;
    }
    if (key == "train_blocks") {  // kohya's networks.lora_flux: all, single or double
      options.network.train_blocks = value;
      continue;
    }
    if (key == "split_qkv") {  // kohya's reading: "True" is true, anything else false
      options.network.split_qkv = value == "True";
      continue;
    }
    if (key == "in_dims") {  // kohya's networks.lora_flux: "[4,0,0,0,4]" or "4,0,0,0,4"
      std::string list = value;
      if (list.size() >= 2 && list.front() == '[' && list.back() == ']') {
        list = list.substr(1, list.size() - 2);
      }
      options.network.in_dims.clear();
      std::stringstream items(list);
      for (std::string item; std::getline(items, item, ',');) {
        size_t used = 0;
        int64_t rank = -1;
        try {
          rank = std::stoll(item, &used);
          while (used < item.size() && std::isspace(static_cast<unsigned char>(item[used]))) ++used;
        } catch (const std::exception&) {
          used = 0;
        }
        if (used == 0 || used != item.size() || rank < 0) {
          throw InputError("--network_args '" + arg + "': '" + item +
                           "' is not a rank (a whole number, 0 for none)");
        }
        options.network.in_dims.push_back(rank);
      }
      continue;
    }
    if (key == "verbose") continue;  // kohya prints its block-wise ranks with it: nothing here
    if (key == "train_double_block_indices" || key == "train_single_block_indices") {
      // kohya's networks.lora_flux parse_block_selection: all, none (or empty), or indices and
      // inclusive ranges "0,1,8-12" of its 19 double and 38 single blocks.
      const size_t total = key == "train_double_block_indices" ? 19 : 38;
      std::vector<bool> chosen(total, value == "all");
      if (value != "all" && value != "none" && !value.empty()) {
        auto index = [&](std::string text) {
          text.erase(0, text.find_first_not_of(' '));
          text.erase(text.find_last_not_of(' ') + 1);
          size_t used = 0;
          long i = -1;
          try {
            i = std::stol(text, &used);
          } catch (const std::exception&) {
            used = 0;
          }
          if (used == 0 || used != text.size() || i < 0 || static_cast<size_t>(i) >= total) {
            throw InputError("--network_args '" + arg + "': '" + text + "' is not a block index (0 to " +
                             std::to_string(total - 1) + ")");
          }
          return static_cast<size_t>(i);
        };
        std::stringstream items(value);
        for (std::string item; std::getline(items, item, ',');) {
          const size_t dash = item.find('-');
          const size_t first = index(item.substr(0, dash));
          const size_t last = dash == std::string::npos ? first : index(item.substr(dash + 1));
          if (first > last) throw InputError("--network_args '" + arg + "': '" + item + "' runs backwards");
          for (size_t i = first; i <= last; ++i) chosen[i] = true;
        }
      }
      (key == "train_double_block_indices" ? options.network.double_blocks
                                           : options.network.single_blocks) = std::move(chosen);
      continue;
    }
    if (key == "img_attn_dim" || key == "txt_attn_dim" || key == "img_mlp_dim" ||
        key == "txt_mlp_dim" || key == "img_mod_dim" || key == "txt_mod_dim" ||
        key == "single_dim" || key == "single_mod_dim") {
      size_t used = 0;
      long long rank = -1;
      try {
        rank = std::stoll(value, &used);
      } catch (const std::exception&) {
        used = 0;
      }
      if (used == 0 || used != value.size() || rank < 0) {
        throw InputError("--network_args '" + arg + "': '" + value +
                         "' is not a rank (a whole number, 0 for none)");
      }
      auto& dims = options.network.type_dims;
      std::erase_if(dims, [&](const auto& d) { return d.first == key; });
      dims.emplace_back(key, rank);
      continue;
    }
    if (key == "train_t5xxl" && value != "True") continue;  // kohya's reading: only "True" is on
    // networks.lora_flux's ranks and rates by regular expression, and GGPO's perturbation: not
    // in lorapipe yet, said by name (not as a value that is not a number, or a key unknown).
    if (key == "train_t5xxl" || key == "network_reg_dims" || key == "network_reg_lrs" ||
        key.starts_with("ggpo_")) {
      throw InputError("--network_args '" + arg + "': kohya's networks.lora_flux argument " +
                       key + " is not supported yet (lorapipe trains the double and single "
                       "blocks' layers, split_qkv or not, the input layers in_dims names, and "
                       "CLIP-L's with the text encoder)");
    }
    double v = 0;
    try {
      size_t used = 0;
      v = std::stod(value, &used);
      if (used != value.size()) throw std::invalid_argument(value);
    } catch (const std::exception&) {
      throw InputError("--network_args '" + arg + "': '" + value + "' is not a number");
    }
    if (key == "conv_dim") {
      options.network.conv_dim = static_cast<int64_t>(v);
    } else if (key == "conv_alpha") {
      options.network.conv_alpha = v;
    } else if (key == "rank_dropout") {
      options.network.rank_dropout = v;
    } else if (key == "module_dropout") {
      options.network.module_dropout = v;
    } else if (key == "loraplus_lr_ratio") {
      options.step.optimizer_groups.loraplus_lr_ratio = v;
    } else if (key == "loraplus_unet_lr_ratio") {
      options.step.optimizer_groups.loraplus_unet_lr_ratio = v;
    } else if (key == "loraplus_text_encoder_lr_ratio") {
      options.step.optimizer_groups.loraplus_text_encoder_lr_ratio = v;
    } else if (key == "block_lr_zero_threshold") {
      blocks.zero_threshold = v;
    } else {
      throw InputError("--network_args '" + arg + "': unknown argument '" + key +
                       "' (known: conv_dim, conv_alpha, rank_dropout, module_dropout, "
                       "loraplus_lr_ratio, loraplus_unet_lr_ratio, "
                       "loraplus_text_encoder_lr_ratio, block_dims, block_alphas, "
                       "conv_block_dims, conv_block_alphas, down_lr_weight, mid_lr_weight, "
                       "up_lr_weight, block_lr_zero_threshold, train_blocks, split_qkv, in_dims, "
                       "img_attn_dim, txt_attn_dim, img_mlp_dim, txt_mlp_dim, img_mod_dim, "
                       "txt_mod_dim, single_dim, single_mod_dim, train_double_block_indices, "
                       "train_single_block_indices)");
    }
  }
  if (blocks.values.empty()) return;
  // After the loop: conv_dim and conv_alpha may come after the block lists. The lists are read
  // against the block table of the model's family, detected here from the checkpoint (its
  // header or its folder's configs: nothing is loaded).
  const models::ModelFamily& family =
      models::model_family(models::detect_family(options.model, options.model_family).family);
  if (family.kohya.blocks.count() == 0) {  // FLUX.1's networks.lora_flux reads none of them
    std::string given;
    for (const auto& [key, value] : blocks.values) given += (given.empty() ? "" : ", ") + key;
    throw InputError("--network_args " + given + ": " + family.display_name +
                     " has no block table for them (kohya's " + family.kohya.network_module +
                     " reads none of block_dims, block_alphas, conv_block_dims, "
                     "conv_block_alphas, down_lr_weight, mid_lr_weight, up_lr_weight)" +
                     (family.kohya.train_blocks.empty()
                          ? std::string()
                          : "; train_blocks=double or single trains a part of the model"));
  }
  for (const std::string& warning : resolve_block_args(blocks, family.kohya.blocks, options.network)) {
    LP_LOG(kWarning, kLog) << "--network_args: " << warning;
  }
}

void check_family_options(const Options& o, const models::ModelFamily& family) {
  if (o.cache_text_encoder_outputs && o.network.train_text_encoder &&
      family.text.untrained_encoders.empty()) {  // else partial caching
    throw InputError("--cache_text_encoder_outputs with a text-encoder LoRA: cached text cannot "
                     "train " + family.display_name + "'s text encoders (kohya refuses it too); "
                     "add --network_train_unet_only, or leave the flag out to train the text "
                     "encoders' LoRA with the text encoded at every step");
  }
  if (o.weighted_captions && !family.text.weighted_captions) {
    throw InputError("--weighted_captions: " + family.display_name +
                     " captions carry no attention weights (kohya's trainer for it has no such "
                     "option); leave the flag out");
  }
  if (o.step.cpu_offload_checkpointing && !family.cpu_offload_checkpointing) {
    throw InputError("--cpu_offload_checkpointing: " + family.display_name +
                     " has no offloaded checkpoints (kohya offers them for FLUX.1 and SD3 "
                     "alone); --gradient_checkpointing, --fp8_base and --blocks_to_swap fit it");
  }
}

void check_options(const Options& o) {
  validate(o);
  // The files and folders the flags name are there (read only once the data is cached).
  auto there = [](const fs::path& path, const std::string& flag) {
    std::error_code ec;
    if (!path.empty() && !fs::exists(path, ec)) {
      throw InputError(path.string() + " (" + flag + "): no such file or folder");
    }
  };
  there(o.model, "--pretrained_model_name_or_path");
  // A model that declares v-prediction wants its flags before the cacher runs, not at the load.
  if (!o.model.empty()) {
    models::check_declared_objective(o.model, o.step.objective.v_prediction,
                                     o.step.objective.zero_terminal_snr);
  }
  there(o.tokenizer, "--tokenizer");
  there(o.vae, "--vae");
  there(o.network_weights, "--network_weights");
  there(o.resume, "--resume");
  for (const auto& [file, multiplier] : o.base_weights) there(file, "--base_weights");
  LoraNetwork::check(o.network);
  if (o.model.empty()) {
    TrainingStep::check(o.step);
  } else {
    // The family from the checkpoint's header or its folder's configs (nothing is loaded): its
    // objective refuses the other's flags now, not after the caching.
    const models::ModelFamily& family =
        models::model_family(models::detect_family(o.model, o.model_family).family);
    TrainingStep::check(o.step, family);
    check_family_options(o, family);
  }
  // The optimizer's type and arguments, over a stand-in tensor: its real groups come with the
  // model.
  std::vector<ParamGroup> groups;
  groups.push_back(ParamGroup{{torch::zeros({1}).requires_grad_()},
                              o.step.optimizer_groups.learning_rate, "check"});
  (void)make_optimizer(o.step.optimizer, std::move(groups));
  check_optimizer_device(o.step.optimizer, models::resolve_device(o.device));
}

void validate(const Options& o) {
  auto need = [](bool ok, const std::string& message) {
    if (!ok) throw InputError(message);
  };
  need(!o.model.empty(), "--pretrained_model_name_or_path is required");
  need(!o.dataset_id.empty(),
       "--dataset_id is required (the manifest preprocess and the cacher wrote)");
  need(!o.output_dir.empty(), "--output_dir is required");
  need(o.blocks_to_swap >= 0,
       "--blocks_to_swap=" + std::to_string(o.blocks_to_swap) + ": must be 0 or more");
  need(!o.fp8_scaled || o.fp8_base || o.fp8_base_unet,
       "--fp8_scaled scales the float8 weights of --fp8_base or --fp8_base_unet: give one of them");
  need(o.share_weights.empty() || o.ranks.world_size <= 1,
       "--share_weights: one trainer process shares its device with one sampler; ranks have a "
       "device each");
  need(o.share_weights.empty() || o.blocks_to_swap == 0,
       "--share_weights: --blocks_to_swap keeps weights in host memory, where a sampler on the "
       "device cannot share them");
  if (!o.share_weights.empty() && o.device != "cpu") {
    const std::string why = cuda_alloc_conf_blocks_ipc();
    need(why.empty(), "--share_weights: " + why + " (unset it, or render the previews after the "
                      "training)");
  }
  need(!o.fp8_fast || o.fp8_scaled,
       "--fp8_fast multiplies scaled float8 weights in float8: give --fp8_scaled (and --fp8_base)");
  need(o.output_name.find('/') == std::string::npos,
       "--output_name='" + o.output_name + "' must be a plain file name");
  need(!o.dim_from_weights || !o.network_weights.empty(),
       "--dim_from_weights takes the ranks from --network_weights, which is unset");
  need(!o.dim_from_weights || o.network.block_dims.empty(),
       "block-wise network_args (block_dims, *_lr_weight) shape a new network; --dim_from_weights "
       "takes the ranks of --network_weights instead");
  need(o.max_train_steps > 0 || o.max_train_epochs > 0,
       "--max_train_steps=" + std::to_string(o.max_train_steps) + ": must be at least 1");
  need(o.max_train_epochs >= 0, "--max_train_epochs must not be negative");
  need(o.train_batch_size >= 1,
       "--train_batch_size=" + std::to_string(o.train_batch_size) + ": must be at least 1");
  need(o.network.dim >= 1,
       "--network_dim=" + std::to_string(o.network.dim) + ": must be at least 1");
  need(o.network.alpha >= 0, "--network_alpha must not be negative");
  const auto& lr = o.step.optimizer_groups;
  need(lr.learning_rate >= 0,
       "--learning_rate=" + number(lr.learning_rate) + ": must not be negative");
  need(o.step.gradient_accumulation_steps >= 1, "--gradient_accumulation_steps must be at least 1");
  need(o.max_bad_steps >= 1, "--max_bad_steps must be at least 1");
  need(o.validation_split >= 0 && o.validation_split < 1, "--validation_split must be in [0, 1)");
  need(o.save_every_n_steps >= 0 && o.save_every_n_epochs >= 0, "--save_every_n_* must be >= 0");
  need(o.save_n_epoch_ratio >= 0, "--save_n_epoch_ratio must be >= 0");
  need(o.sample_every_n_steps >= 0 && o.sample_every_n_epochs >= 0,
       "--sample_every_n_* must be >= 0");
  need(o.prior_loss_weight >= 0, "--prior_loss_weight must not be negative");
  need(o.threads >= 0, "--threads must not be negative");
  need(o.step.clip_skip >= 1, "--clip_skip must be at least 1");
  need(o.max_token_length == 75 || o.max_token_length == 150 || o.max_token_length == 225,
       "--max_token_length=" + std::to_string(o.max_token_length) +
           ": expected 75, 150 or 225 (kohya's)");
  models::parse_precision(o.mixed_precision, "--mixed_precision");
  models::parse_precision(o.save_precision, "--save_precision");
  LrScheduleOptions schedule = o.step.schedule;
  trainer::validate(schedule);
  // What kohya refuses at start rather than train with silently.
  need(!(schedule.name == "constant" && o.lr_warmup_steps > 0),
       "--lr_scheduler=constant takes no --lr_warmup_steps: use constant_with_warmup");

  need(!(schedule.name == "polynomial" && lr.learning_rate <= schedule.lr_end),
       "--lr_scheduler=polynomial decays to " + number(schedule.lr_end) +
           ": --learning_rate=" + number(lr.learning_rate) + " must be above it");
  need(o.step.noise.adaptive_noise_scale == 0 || o.step.noise.noise_offset > 0,
       "--adaptive_noise_scale needs --noise_offset");
  (void)elementwise_loss(torch::zeros({1}), torch::zeros({1}), o.step.loss_type, torch::ones({1}));
  OptimizerOptions optimizer = o.step.optimizer;
  (void)make_optimizer(optimizer,
                       {ParamGroup{{torch::zeros({1}, torch::requires_grad())}, 1e-4, "x"}});
}

}  // namespace lorapipe::trainer
