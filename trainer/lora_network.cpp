#include "trainer/lora_network.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <numbers>
#include <regex>
#include <set>
#include <sstream>

#include "common/error.h"
#include "common/log.h"
#include "models/flux_lora.h"
#include "models/comfy_lora.h"
#include "models/peft_lora.h"
#include "models/safetensors.h"
#include "models/weights.h"
#include "trainer/device_scalars.h"

namespace lorapipe::trainer {
namespace {

// nn.init.kaiming_uniform_(w, a=sqrt(5)) from `generator`: bound = sqrt(6 / ((1 + a^2) fan_in)),
// i.e. 1 / sqrt(fan_in), fan_in = in * kernel area (the default init of nn.Linear / nn.Conv2d
// that kohya's lora_down keeps).
// split_qkv's up: 1 on each part's diagonal block (its rows, its rank's columns), 0 elsewhere.
at::Tensor split_mask(const std::vector<int64_t>& split_dims, int64_t part_rank,
                      const at::TensorOptions& options) {
  int64_t rows = 0;
  for (int64_t d : split_dims) rows += d;
  at::Tensor mask = at::zeros({rows, part_rank * static_cast<int64_t>(split_dims.size())},
                              options.requires_grad(false));
  int64_t row = 0;
  for (size_t j = 0; j < split_dims.size(); ++j) {
    mask.narrow(0, row, split_dims[j])
        .narrow(1, static_cast<int64_t>(j) * part_rank, part_rank)
        .fill_(1);
    row += split_dims[j];
  }
  return mask;
}

void kaiming_uniform_sqrt5(at::Tensor& w, at::Generator generator) {
  const double fan_in = static_cast<double>(w.numel() / w.size(0));
  const double bound = std::sqrt(6.0 / ((1.0 + 5.0) * fan_in));
  torch::NoGradGuard no_grad;
  w.uniform_(-bound, bound, generator);
}

std::string list_some(const std::vector<std::string>& names) {
  std::string out;
  for (size_t i = 0; i < names.size() && i < 5; ++i) out += (i ? ", " : "") + names[i];
  if (names.size() > 5) out += ", ... (" + std::to_string(names.size()) + " in all)";
  return out;
}

std::vector<std::string> split_commas(const std::string& text) {
  std::vector<std::string> out;
  size_t start = 0;
  for (;;) {
    const size_t comma = text.find(',', start);
    out.push_back(text.substr(start, comma == std::string::npos ? std::string::npos : comma - start));
    if (comma == std::string::npos) return out;
    start = comma + 1;
  }
}

double parse_number(const std::string& key, const std::string& item, const std::string& whole) {
  try {
    size_t used = 0;
    const double v = std::stod(item, &used);
    if (used == item.size()) return v;
  } catch (const std::exception&) {
  }
  throw InputError("--network_args '" + key + "=" + whole + "': '" + item + "' is not a number");
}

// A per-block list (block_dims and kin): exactly one number per block of the table.
std::vector<double> block_list(const std::string& key, const std::string& value,
                               const models::KohyaBlocks& table) {
  std::vector<double> out;
  for (const std::string& item : split_commas(value)) out.push_back(parse_number(key, item, value));
  if (out.size() != table.count()) {
    throw InputError("--network_args '" + key + "=" + value + "': " + std::to_string(out.size()) +
                     " values, where the model's denoiser has " + std::to_string(table.count()) +
                     " blocks (" + table.describe() + ")");
  }
  return out;
}

}  // namespace

std::vector<std::string> resolve_block_args(const BlockArgs& args, const models::KohyaBlocks& table,
                                            NetworkOptions& options) {
  const size_t blocks = table.count();
  std::vector<std::string> warnings;
  const auto given = [&](const char* key) { return args.values.count(key) > 0; };
  // The learning-rate weights: down (SD1.x: 12; SDXL: 9) + mid (1; 3) + up (12; 9).
  std::vector<double> lr_weight;
  if (given("down_lr_weight") || given("mid_lr_weight") || given("up_lr_weight")) {
    const size_t side_blocks = static_cast<size_t>(table.side);
    const size_t mid_blocks = static_cast<size_t>(table.mid);
    auto side = [&](const char* key, size_t length) -> std::vector<double> {
      if (!given(key)) return std::vector<double>(length, 1.0);
      const std::string& value = args.values.at(key);
      std::vector<double> w;
      if (value.find(',') != std::string::npos || key == std::string("mid_lr_weight")) {
        for (const std::string& item : split_commas(value)) {
          w.push_back(item.empty() ? 0.0 : parse_number(key, item, value));  // kohya: empty is 0
        }
      } else {
        // A curve over the side's blocks, shallow to deep (kohya's get_list).
        const size_t plus = value.find('+');
        const std::string name = value.substr(0, plus);
        const double base =
            plus == std::string::npos ? 0.0 : parse_number(key, value.substr(plus + 1), value);
        for (size_t i = 0; i < length; ++i) {
          const double x = static_cast<double>(i) / static_cast<double>(length - 1);
          const double r = static_cast<double>(length - 1 - i) / static_cast<double>(length - 1);
          if (name == "cosine") {
            w.push_back(std::sin(std::numbers::pi * r / 2) + base);
          } else if (name == "sine") {
            w.push_back(std::sin(std::numbers::pi * x / 2) + base);
          } else if (name == "linear") {
            w.push_back(x + base);
          } else if (name == "reverse_linear") {
            w.push_back(r + base);
          } else if (name == "zeros") {
            w.push_back(0.0 + base);
          } else {
            throw InputError("--network_args '" + std::string(key) + "=" + value +
                             "': expected comma-separated weights, or cosine, sine, linear, "
                             "reverse_linear or zeros (with an optional +base)");
          }
        }
      }
      if (w.size() != length) {
        warnings.push_back(std::string(key) + " has " + std::to_string(w.size()) +
                           " weights for " + std::to_string(length) + " blocks: " +
                           (w.size() > length ? "the rest are ignored" : "the missing ones are 1") +
                           ", as kohya does");
        w.resize(length, 1.0);
      }
      for (double& x : w) {
        if (!(x > args.zero_threshold)) x = 0;  // kohya: at most block_lr_zero_threshold is 0
      }
      return w;
    };
    // kohya's order: head (SDXL's BASE, weight 1), down, mid, up, tail (SDXL's OUT, weight 1).
    lr_weight.assign(static_cast<size_t>(table.head), 1.0);
    const std::vector<double> down = side("down_lr_weight", side_blocks);
    const std::vector<double> mid = side("mid_lr_weight", mid_blocks);
    const std::vector<double> up = side("up_lr_weight", side_blocks);
    lr_weight.insert(lr_weight.end(), down.begin(), down.end());
    lr_weight.insert(lr_weight.end(), mid.begin(), mid.end());
    lr_weight.insert(lr_weight.end(), up.begin(), up.end());
    lr_weight.insert(lr_weight.end(), static_cast<size_t>(table.tail), 1.0);
  }
  if (!given("block_dims") && lr_weight.empty()) {
    for (const char* key : {"block_alphas", "conv_block_dims", "conv_block_alphas"}) {
      if (given(key)) {
        warnings.push_back(std::string(key) +
                           " is ignored without block_dims or a *_lr_weight, as kohya ignores it");
      }
    }
    return warnings;
  }
  auto ranks = [](const std::string& key, const std::vector<double>& values) {
    std::vector<int64_t> out;
    for (double v : values) {
      if (v < 0 || v != std::floor(v)) {
        throw InputError("--network_args " + key + ": ranks are whole numbers >= 0, not " +
                         std::to_string(v));
      }
      out.push_back(static_cast<int64_t>(v));
    }
    return out;
  };
  options.block_dims = given("block_dims")
                           ? ranks("block_dims", block_list("block_dims", args.values.at("block_dims"), table))
                           : std::vector<int64_t>(blocks, options.dim);
  options.block_alphas = given("block_alphas")
                             ? block_list("block_alphas", args.values.at("block_alphas"), table)
                             : std::vector<double>(blocks, options.alpha);
  if (given("conv_block_dims")) {
    options.conv_block_dims =
        ranks("conv_block_dims", block_list("conv_block_dims", args.values.at("conv_block_dims"), table));
    options.conv_block_alphas =
        given("conv_block_alphas")
            ? block_list("conv_block_alphas", args.values.at("conv_block_alphas"), table)
            : std::vector<double>(blocks, options.conv_alpha);
  } else if (options.conv_dim > 0) {
    options.conv_block_dims.assign(blocks, options.conv_dim);
    options.conv_block_alphas.assign(blocks, options.conv_alpha);
  } else if (given("conv_block_alphas")) {
    warnings.push_back("conv_block_alphas is ignored without conv_block_dims or conv_dim, as kohya "
                       "ignores it");
  }
  for (const std::vector<double>* alphas : {&options.block_alphas, &options.conv_block_alphas}) {
    for (double a : *alphas) {
      if (a < 0) throw InputError("--network_args block alphas must be >= 0, not " + std::to_string(a));
    }
  }
  // kohya's remove_block_dims_and_alphas: a block that does not learn has no module.
  for (size_t i = 0; i < lr_weight.size(); ++i) {
    if (lr_weight[i] != 0) continue;
    options.block_dims[i] = 0;
    if (!options.conv_block_dims.empty()) options.conv_block_dims[i] = 0;
  }
  options.block_lr_weight = std::move(lr_weight);
  return warnings;
}

void LoraNetwork::check(const NetworkOptions& options) {
  if (options.dim < 1) {
    throw InputError("--network_dim=" + std::to_string(options.dim) + ": must be at least 1");
  }
  if (options.alpha < 0) throw InputError("--network_alpha must be >= 0");
  if (options.conv_alpha < 0) throw InputError("--network_args conv_alpha must be >= 0");
  if (options.conv_dim < 0) throw InputError("--network_args conv_dim must be >= 0");
  for (const auto& [name, p] : {std::pair<const char*, double>{"--network_dropout", options.dropout},
                               {"--network_args rank_dropout", options.rank_dropout},
                               {"--network_args module_dropout", options.module_dropout}}) {
    if (p < 0 || p >= 1) {
      throw InputError(std::string(name) + "=" + std::to_string(p) + ": must be in [0, 1)");
    }
  }
}

namespace {

// The rank kohya's networks.lora_flux gives a double or single block module `name` under the
// type dims and block indices of `options`; 0: no module.
int64_t flux_module_rank(const std::string& name, const NetworkOptions& options) {
  // kohya's create_modules: the first kind given whose words the name holds, in this order.
  static const std::vector<std::pair<std::string, std::vector<std::string>>> kinds = {
      {"img_attn_dim", {"img_attn"}},   {"txt_attn_dim", {"txt_attn"}},
      {"img_mlp_dim", {"img_mlp"}},     {"txt_mlp_dim", {"txt_mlp"}},
      {"img_mod_dim", {"img_mod"}},     {"txt_mod_dim", {"txt_mod"}},
      {"single_dim", {"single_blocks", "linear"}}, {"single_mod_dim", {"modulation"}}};
  int64_t rank = options.dim;
  for (const auto& [kind, words] : kinds) {
    const auto given = std::find_if(options.type_dims.begin(), options.type_dims.end(),
                                    [&](const auto& d) { return d.first == kind; });
    if (given == options.type_dims.end()) continue;
    if (std::all_of(words.begin(), words.end(),
                    [&](const std::string& w) { return name.find(w) != std::string::npos; })) {
      rank = given->second;
      break;
    }
  }
  // The block's index is the name's fifth word ("lora_unet_double_blocks_3_..."), as kohya reads it.
  const bool is_double = name.find("double") != std::string::npos;
  const bool is_single = !is_double && name.find("single") != std::string::npos;
  const std::vector<bool>& chosen = is_double ? options.double_blocks : options.single_blocks;
  if (rank != 0 && (is_double || is_single) && !chosen.empty()) {
    std::vector<std::string> words;
    std::stringstream parts(name);
    for (std::string w; std::getline(parts, w, '_');) words.push_back(w);
    const size_t index = words.size() > 4 ? std::stoul(words[4]) : 0;
    if (index >= chosen.size() || !chosen[index]) rank = 0;
  }
  return rank;
}

}  // namespace

LoraNetwork::LoraNetwork(const models::DiffusionModel& model, const NetworkOptions& options,
                         at::Generator generator)
    : options_(options) {
  check(options);
  const auto& from_weights = options.ranks_from_weights;
  const bool blocks = !options.block_dims.empty();
  if (blocks && !from_weights.empty()) {
    throw InputError("block-wise network_args (block_dims, *_lr_weight) shape a new network; "
                     "--dim_from_weights takes the ranks of --network_weights instead");
  }
  std::vector<models::LoraTarget> targets = model.lora_targets(
      /*with_text_encoder=*/true,
      options.conv_dim > 0 || !options.conv_block_dims.empty() || !from_weights.empty());
  // kohya's train_blocks: the denoiser's modules under the chosen blocks' prefix alone.
  std::string keep_prefix;
  if (options.train_blocks != "all") {
    const models::KohyaFamilyNames& kohya = model.model_family().kohya;
    std::string choices;
    for (const auto& [choice, prefix] : kohya.train_blocks) {
      if (choice == options.train_blocks) keep_prefix = prefix;
      choices += ", " + choice;
    }
    if (kohya.train_blocks.empty()) {
      throw InputError("--network_args train_blocks=" + options.train_blocks + ": " +
                       model.model_family().display_name + "'s network (" +
                       kohya.network_module + ") has no train_blocks");
    }
    if (keep_prefix.empty()) {
      throw InputError("--network_args train_blocks=" + options.train_blocks + ": use all" +
                       choices);
    }
  }
  if (options.split_qkv && model.model_family().kohya.network_module != "networks.lora_flux") {
    throw InputError("--network_args split_qkv=True: " + model.model_family().display_name +
                     "'s network (" + model.model_family().kohya.network_module +
                     ") has no fused q/k/v layers");
  }
  const std::vector<std::string>& in_groups = model.model_family().kohya.in_dims;
  if (!options.in_dims.empty()) {
    if (in_groups.empty()) {
      throw InputError("--network_args in_dims: " + model.model_family().display_name +
                       "'s network (" + model.model_family().kohya.network_module +
                       ") has no in_dims");
    }
    if (options.in_dims.size() != in_groups.size()) {
      std::string groups;
      for (const std::string& g : in_groups) groups += (groups.empty() ? "" : ", ") + g;
      throw InputError("--network_args in_dims: " + std::to_string(options.in_dims.size()) +
                       " ranks given; it takes " + std::to_string(in_groups.size()) + " (" +
                       groups + ")");
    }
  }
  const bool flux_rules = !options.type_dims.empty() || !options.double_blocks.empty() ||
                          !options.single_blocks.empty();
  if (flux_rules && model.model_family().kohya.network_module != "networks.lora_flux") {
    throw InputError("--network_args " +
                     std::string(options.type_dims.empty() ? "train_*_block_indices"
                                                           : options.type_dims.front().first) +
                     ": " + model.model_family().display_name + "'s network (" +
                     model.model_family().kohya.network_module +
                     ") has no double and single blocks (networks.lora_flux's arguments)");
  }
  // A layer without a module: a file's module for it (by either of its names) is not loaded, as
  // kohya's non-strict load leaves it.
  const auto leave_out = [this](const models::LoraTarget& t) {
    untrained_.insert(t.name);
    if (!t.alias.empty()) untrained_.insert(t.alias);
  };
  for (models::LoraTarget& target : targets) {
    // kohya's apply_to drops the modules of a side that does not train.
    if (!(target.text_encoder ? options.train_text_encoder : options.train_unet)) {
      leave_out(target);
      continue;
    }
    const bool input_layer = target.in_dims >= 0;
    if (!keep_prefix.empty() && !target.text_encoder && !input_layer &&
        target.name.rfind(keep_prefix, 0) != 0) {
      // Not among the trained blocks: no module, as in kohya, and a --network_weights file's
      // module for it is not loaded (kohya's load is not strict).
      leave_out(target);
      continue;
    }
    const bool kxk = target.is_conv_kxk();
    int64_t rank = kxk ? options.conv_dim : options.dim;
    double alpha = kxk ? options.conv_alpha : options.alpha;
    if (input_layer && from_weights.empty()) {
      // kohya's in_dims: a module at its group's rank and --network_alpha; none at rank 0 or
      // without in_dims, and then a --network_weights file's module for it is not loaded (kohya's
      // load is not strict).
      rank = options.in_dims.empty() ? 0 : options.in_dims[static_cast<size_t>(target.in_dims)];
      if (rank == 0) {
        leave_out(target);
        continue;
      }
    } else if (blocks && !target.text_encoder) {
      // kohya's block-wise ranks; a name outside every block is Python's index -1, the last.
      const int index = target.block;
      const size_t table = options.block_dims.size();
      const size_t b = index < 0 ? table - 1 : static_cast<size_t>(index);
      if (b >= table) {
        throw Error(target.name + ": block " + std::to_string(b) + " of " + std::to_string(table));
      }
      if (!kxk) {
        rank = options.block_dims[b], alpha = options.block_alphas[b];
      } else if (!options.conv_block_dims.empty()) {
        rank = options.conv_block_dims[b], alpha = options.conv_block_alphas[b];
      } else {
        rank = 0;
      }
      if (rank == 0) {  // kohya builds no module for a block of rank 0 (or weight 0)
        leave_out(target);  // a --network_weights file's module for it is not loaded
        continue;
      }
    } else if (flux_rules && !target.text_encoder && !kxk && from_weights.empty()) {
      rank = flux_module_rank(target.name, options);
      if (rank == 0) {  // kohya builds no module of rank 0, nor in a block left out
        leave_out(target);
        continue;
      }
    }
    if (!from_weights.empty()) {
      auto it = from_weights.find(target.name);
      // Another trainer's name for the layer (SDXL's diffusers module names): kohya's
      // create_network_from_weights converts them to its own.
      if (it == from_weights.end() && !target.alias.empty()) it = from_weights.find(target.alias);
      if (it == from_weights.end()) continue;  // not in the file: kohya builds no module
      rank = it->second;
      alpha = static_cast<double>(rank);  // until load() reads the file's
      if (rank < 1) throw InputError(target.name + ": a LoRA module of rank 0 in the file");
    }
    if (alpha == 0) alpha = static_cast<double>(rank);  // kohya: alpha 0 or None means dim
    // split_qkv: kohya's rule by name, with the widths the layer has (kohya writes FLUX.1's
    // 3072 and 12288): q, k, v of a double block's qkv; q, k, v and the MLP of linear1.
    std::vector<int64_t> split_dims;
    if (options.split_qkv) {
      split_dims = models::flux_split_qkv_dims(target);
      if (!from_weights.empty() && !split_dims.empty()) {
        // A file's merged rank is the parts' rank times their count.
        if (rank % static_cast<int64_t>(split_dims.size()) != 0) {
          throw InputError(target.name + ": rank " + std::to_string(rank) + " in the file is no "
                           "multiple of its " + std::to_string(split_dims.size()) +
                           " split_qkv parts");
        }
      } else if (!split_dims.empty()) {
        rank *= static_cast<int64_t>(split_dims.size());
      }
    }
    const int64_t part_rank =
        split_dims.empty() ? rank : rank / static_cast<int64_t>(split_dims.size());
    if (!from_weights.empty() && !split_dims.empty()) alpha = static_cast<double>(part_rank);
    auto adapter = std::make_shared<models::LoraAdapter>();
    // Built and drawn on the CPU from the CPU generator, as kohya initialises its network
    // before accelerate places it, then moved to the layer's device: the same values on every
    // device (a CPU generator cannot draw into a CUDA tensor).
    const auto fp32 = torch::TensorOptions().dtype(torch::kFloat32).device(torch::kCPU);
    if (target.conv) {
      const auto& o = target.conv->options;
      const auto& k = *o.kernel_size();
      adapter->down = torch::empty({rank, target.in_features(), k[0], k[1]}, fp32);
      adapter->up = torch::zeros({target.out_features(), rank, 1, 1}, fp32);
      adapter->stride = {(*o.stride())[0], (*o.stride())[1]};
      const auto* padding = std::get_if<torch::ExpandingArray<2>>(&o.padding());
      if (padding == nullptr) throw Error(target.name + ": string padding is not supported");
      adapter->padding = {(**padding)[0], (**padding)[1]};
    } else {
      adapter->down = torch::empty({rank, target.in_features()}, fp32);
      adapter->up = torch::zeros({target.out_features(), rank}, fp32);
    }
    kaiming_uniform_sqrt5(adapter->down, generator);
    const c10::Device device = target.weight().device();
    adapter->down = adapter->down.to(device);
    adapter->up = adapter->up.to(device);
    adapter->scale = alpha / static_cast<double>(part_rank);
    adapter->multiplier = options.multiplier;
    adapter->dropout = options.dropout;
    adapter->rank_dropout = options.rank_dropout;
    adapter->module_dropout = options.module_dropout;
    const bool trained = target.text_encoder ? options.train_text_encoder : options.train_unet;
    adapter->down.requires_grad_(trained);
    adapter->up.requires_grad_(trained);
    if (!split_dims.empty() && trained) {
      // Each part's up reads its own down alone: the blocks off the diagonal stay zero (their
      // gradient is masked, and every optimizer leaves a parameter with zero gradient, weight
      // decay included, at zero).
      const at::Tensor mask = split_mask(split_dims, part_rank, adapter->up.options());
      adapter->up.register_hook([mask](const at::Tensor& grad) { return grad * mask; });
    }
    target.slot() = adapter;
    modules_.push_back(Module{std::move(target), std::move(adapter), alpha, split_dims});
  }
}

LoraNetwork::~LoraNetwork() {
  for (Module& m : modules_) {
    if (m.target.slot() == m.adapter) m.target.slot().reset();
  }
}

size_t LoraNetwork::unet_module_count() const {
  size_t n = 0;
  for (const Module& m : modules_) n += !m.target.text_encoder;
  return n;
}

size_t LoraNetwork::text_encoder_module_count() const {
  return modules_.size() - unet_module_count();
}

std::vector<at::Tensor> LoraNetwork::unet_parameters() const {
  std::vector<at::Tensor> out;
  for (const Module& m : modules_) {
    if (!m.target.text_encoder) out.insert(out.end(), {m.adapter->down, m.adapter->up});
  }
  return out;
}

std::vector<at::Tensor> LoraNetwork::text_encoder_parameters(int encoder) const {
  std::vector<at::Tensor> out;
  for (const Module& m : modules_) {
    if (m.target.text_encoder && (encoder < 0 || m.target.encoder == encoder)) {
      out.insert(out.end(), {m.adapter->down, m.adapter->up});
    }
  }
  return out;
}

std::map<std::string, at::Tensor> LoraNetwork::named_parameters() const {
  std::map<std::string, at::Tensor> out;
  for (const Module& m : modules_) {
    out[m.target.name + ".lora_down.weight"] = m.adapter->down;
    out[m.target.name + ".lora_up.weight"] = m.adapter->up;
  }
  return out;
}

void LoraNetwork::set_training(bool training) {
  for (Module& m : modules_) m.adapter->training = training;
}

void LoraNetwork::set_multiplier(double multiplier) {
  for (Module& m : modules_) m.adapter->multiplier = multiplier;
}

MaxNormResult LoraNetwork::apply_max_norm(double max_norm) {
  torch::NoGradGuard no_grad;
  MaxNormResult result;
  // Nothing is read back inside the loop (kohya's `if ratio != 1` and `.item()` per module would
  // wait for the device twice per module): a ratio of 1 scales by sqrt(1) = 1, which leaves the
  // weights' bits as they are, and the counts and norms come back in one copy at the end.
  std::vector<at::Tensor> scaled_norms, scaled_flags;
  for (Module& m : modules_) {
    at::Tensor& down = m.adapter->down;
    at::Tensor& up = m.adapter->up;
    at::Tensor update;
    if (down.dim() == 2) {
      update = up.matmul(down);
    } else if (down.size(2) == 1 && down.size(3) == 1) {
      update = up.flatten(1).matmul(down.flatten(1)).unsqueeze(2).unsqueeze(3);
    } else {  // kxk: up (1x1) applied to down's kernels, [out, in, k, k]
      update = torch::conv2d(down.permute({1, 0, 2, 3}), up).permute({1, 0, 2, 3});
    }
    // kohya: its fp32 alpha buffer over the rank, a 0-d tensor
    const at::Tensor scale =
        torch::scalar_tensor(m.alpha, update.options()) / static_cast<double>(m.scale_rank());
    update = update * scale;
    const at::Tensor norm = update.norm().clamp_min(max_norm / 2);
    const at::Tensor ratio = norm.clamp_max(max_norm) / norm;
    const at::Tensor root = ratio.pow(0.5);
    up.mul_(root);
    down.mul_(root);
    scaled_flags.push_back(ratio.ne(1.0f).to(ratio.scalar_type()));
    scaled_norms.push_back(update.norm() * ratio);
  }
  double sum = 0;
  for (const double flag : read_scalars(scaled_flags)) result.keys_scaled += flag != 0;
  for (const double scaled : read_scalars(scaled_norms)) {
    sum += scaled;
    result.max_norm = std::max(result.max_norm, scaled);
  }
  if (!modules_.empty()) result.mean_norm = sum / static_cast<double>(modules_.size());
  return result;
}

std::map<std::string, at::Tensor> LoraNetwork::state_dict(c10::ScalarType dtype) const {
  std::map<std::string, at::Tensor> out;
  for (const Module& m : modules_) {
    out[m.target.name + ".lora_down.weight"] = m.adapter->down.detach().to(torch::kCPU, dtype);
    out[m.target.name + ".lora_up.weight"] = m.adapter->up.detach().to(torch::kCPU, dtype);
    out[m.target.name + ".alpha"] = torch::tensor(m.alpha, torch::kFloat64).to(dtype);
  }
  return out;
}

std::map<std::string, int64_t> lora_file_ranks(const std::filesystem::path& file) {
  const models::SafetensorsFile weights = models::SafetensorsFile::open(file);
  std::map<std::string, int64_t> ranks;
  const std::string suffix = ".lora_down.weight";
  for (const auto& [name, tensor] : models::read_tensors(weights)) {
    if (name.size() > suffix.size() && name.ends_with(suffix) && tensor.dim() >= 2) {
      ranks[name.substr(0, name.size() - suffix.size())] = tensor.size(0);
    }
  }
  if (ranks.empty()) {
    throw InputError(file.string() + ": --dim_from_weights found no NAME.lora_down.weight in it");
  }
  return ranks;
}

void LoraNetwork::load(const std::filesystem::path& file) {
  const models::SafetensorsFile weights = models::SafetensorsFile::open(file);
  load(models::read_tensors(weights), file.string());
}

void LoraNetwork::load(const std::map<std::string, at::Tensor>& tensors, const std::string& source) {
  if (models::is_comfy_lora(tensors)) {
    throw InputError(source +
                     ": a LoRA in ComfyUI's naming (diffusion_model.<layer>, text_encoders.<...>): "
                     "training continues from kohya's naming alone (lora_unet_... / lora_te_...); "
                     "previews, --base_weights and lorapipe-sampler read this one");
  }
  if (models::is_peft_lora(tensors)) {
    // Its fused layers would come out at the parts' summed rank, which is no --network_dim.
    throw InputError(source +
                     ": a LoRA in diffusers' PEFT naming (lora_A / lora_B): training continues "
                     "from kohya's naming alone (lora_down / lora_up / alpha); previews, "
                     "--base_weights and lorapipe-sampler read this one");
  }
  std::set<std::string> unused;
  for (const auto& [name, tensor] : tensors) unused.insert(name);
  std::vector<std::string> missing, misshaped;
  torch::NoGradGuard no_grad;
  for (Module& m : modules_) {
    // The file's name for the module: kohya's, else another trainer's (the target's alias).
    const std::string& named =
        !tensors.count(m.target.name + ".lora_down.weight") && !m.target.alias.empty() &&
                tensors.count(m.target.alias + ".lora_down.weight")
            ? m.target.alias
            : m.target.name;
    const std::string down_key = named + ".lora_down.weight";
    const std::string up_key = named + ".lora_up.weight";
    const std::string alpha_key = named + ".alpha";
    auto down = tensors.find(down_key);
    auto up = tensors.find(up_key);
    if (down == tensors.end() || up == tensors.end()) {
      missing.push_back(m.target.name);
      continue;
    }
    unused.erase(down_key);
    unused.erase(up_key);
    // A LoRA holding NaN or infinity (a run that overflowed, a broken download) would train
    // only non-finite steps: named now, not after --max_bad_steps of them.
    for (const auto& [key, t] : {std::pair{&down_key, &down->second}, std::pair{&up_key, &up->second}}) {
      if (!torch::isfinite(*t).all().item<bool>()) {
        throw InputError(source + ": '" + *key + "' holds NaN or infinity");
      }
    }
    if (down->second.sizes() != m.adapter->down.sizes() ||
        up->second.sizes() != m.adapter->up.sizes()) {
      misshaped.push_back(m.target.name + " (file " + c10::str(down->second.sizes()) + " / " +
                          c10::str(up->second.sizes()) + ", network " +
                          c10::str(m.adapter->down.sizes()) + " / " +
                          c10::str(m.adapter->up.sizes()) + ")");
      continue;
    }
    m.adapter->down.copy_(down->second);
    m.adapter->up.copy_(up->second);
    if (!m.split_dims.empty()) {
      // kohya's split_qkv load reads each part's diagonal block and nothing else.
      m.adapter->up.mul_(split_mask(m.split_dims, m.scale_rank(), m.adapter->up.options()));
    }
    auto alpha = tensors.find(alpha_key);
    m.alpha = alpha == tensors.end() ? static_cast<double>(m.scale_rank())
                                     : alpha->second.to(torch::kFloat64).item<double>();
    // kohya's LoRAModule: alpha 0 (or none) means the rank, scale 1; not a module that never acts.
    if (m.alpha == 0) m.alpha = static_cast<double>(m.scale_rank());
    unused.erase(alpha_key);
    m.adapter->scale = m.alpha / static_cast<double>(m.scale_rank());
  }
  // A file's modules for the side this network does not train (--network_train_unet_only or
  // --network_train_text_encoder_only), or for a block the block-wise network_args leave out,
  // are left out, as kohya's non-strict load leaves them.
  size_t skipped = 0;
  for (auto it = unused.begin(); it != unused.end();) {
    if (untrained_.count(it->substr(0, it->find('.')))) {
      it = unused.erase(it);
      ++skipped;
    } else {
      ++it;
    }
  }
  if (skipped > 0) {
    LP_LOG(kInfo, "trainer") << source << ": " << skipped
                             << " tensors of modules this network does not train are not loaded";
  }
  if (missing.empty() && misshaped.empty() && unused.empty()) return;
  std::string message = source + ": LoRA does not fit this model (network_dim " +
                        std::to_string(options_.dim) + ")";
  if (!missing.empty()) message += "; missing modules: " + list_some(missing);
  if (!misshaped.empty()) message += "; other shapes: " + list_some(misshaped);
  if (!unused.empty()) {
    message += "; keys that fit no module of this model: " +
               list_some(std::vector<std::string>(unused.begin(), unused.end()));
  }
  throw InputError(message);
}

}  // namespace lorapipe::trainer
