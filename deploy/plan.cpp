#include "deploy/plan.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <sstream>
#include <tuple>

#include <unistd.h>

#include "common/error.h"
#include "common/file.h"
#include "models/family.h"
#include "models/safetensors.h"
#include "runtime/process.h"

#if LORAPIPE_PLAN_PNG
#include <vips/vips.h>
#endif

namespace lorapipe::launcher {

// The calibration bench/plan_calibrate.py wrote (deploy/plan_calibration.json, embedded at build).
extern const char* const kPlanCalibration;

namespace {

namespace fs = std::filesystem;
namespace m = lorapipe::models;
using nlohmann::json;

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
// The share of a card's peak bf16 tensor throughput a LoRA step is assumed to reach. A LoRA step
// of these models reaches 30-45% on the data-centre GPUs we have measured (tests/gpu/run.sh,
// bench/results); a consumer card's measured share can replace it through --gpu_mfu.
constexpr double kAssumedMfu = 0.35;
// What a card holds beyond the allocated tensors: the CUDA context and the caching allocator's
// slack (PyTorch's reserved less allocated). A candidate fits when its prediction, raised by the
// model's accuracy goal (10%), stays within the budget less this.
constexpr double kReserveBytes = 0.6e9;
constexpr double kAccuracyMargin = 1.10;
// CUDA's caching allocator rounds every block up to 512 bytes: 256 more per tensor on average.
constexpr double kRoundingPerTensor = 256;

bool starts_with(const std::string& s, const std::string& p) { return s.rfind(p, 0) == 0; }
bool contains(const std::string& s, const std::string& p) { return s.find(p) != std::string::npos; }
bool is_flux(const std::string& family) { return starts_with(family, "flux"); }
// The calibration's name of a family: FLUX.1 [schnell] has [dev]'s transformer less its
// guidance embedding.
std::string calibration_key(const std::string& family) { return is_flux(family) ? "flux" : family; }

struct Tensor {
  std::string name;  // without the single file's denoiser prefix
  std::vector<int64_t> shape;
};

std::vector<fs::path> safetensors_in(const fs::path& folder) {
  std::vector<fs::path> files;
  if (fs::is_directory(folder)) {
    for (const auto& entry : fs::directory_iterator(folder)) {
      if (entry.path().extension() == ".safetensors") files.push_back(entry.path());
    }
  }
  std::sort(files.begin(), files.end());
  return files;
}

// The denoiser's tensors: a diffusers folder's unet/ or transformer/, or the single file's keys
// under model.diffusion_model. (all of them where a Flux transformer file has no prefix).
std::vector<Tensor> denoiser_tensors(const fs::path& model, const std::string& family) {
  std::vector<fs::path> files;
  std::string prefix;
  if (fs::is_directory(model)) {
    files = safetensors_in(model / (is_flux(family) ? "transformer" : "unet"));
    if (files.empty()) {
      throw InputError(model.string() + ": no " + (is_flux(family) ? "transformer" : "unet") +
                       "/*.safetensors (the plan reads the denoiser's shapes from it)");
    }
  } else {
    files = {model};
    prefix = "model.diffusion_model.";
  }
  std::vector<Tensor> tensors;
  for (const fs::path& file : files) {
    const m::SafetensorsFile f = m::SafetensorsFile::open(file);
    bool prefixed = false;
    for (const m::TensorInfo& t : f.tensors()) prefixed = prefixed || starts_with(t.name, prefix);
    for (const m::TensorInfo& t : f.tensors()) {
      if (prefix.empty() || !prefixed) {
        tensors.push_back({t.name, t.shape});
      } else if (starts_with(t.name, prefix)) {
        tensors.push_back({t.name.substr(prefix.size()), t.shape});
      }
    }
  }
  if (tensors.empty()) throw InputError(model.string() + ": no denoiser tensors found");
  return tensors;
}

int64_t numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// The float32 scales --fp8_scaled keeps for a weight (models/float8.h).
uint64_t scale_count(const std::vector<int64_t>& shape) {
  if (shape.size() != 2) return 1;
  return static_cast<uint64_t>(shape[1] % 64 == 0 ? shape[0] * (shape[1] / 64) : shape[0]);
}

// kohya's LoRA targets by key: every Linear and 1x1 Conv2d inside the U-Nets' transformers
// (networks/lora.py's Transformer2DModel), inside Flux's double and single blocks
// (networks/lora_flux.py). Diffusers' split Flux projections are one module in the original
// layout the trainer loads them into: q, k, v (and single blocks' proj_mlp) share the input.
struct LoraGroup {
  int64_t in = 0, out = 0;
};

std::string fused_flux_group(const std::string& name) {
  static const std::regex split(
      R"(^(single_transformer_blocks\.\d+\.)(attn\.to_[qkv]|proj_mlp)\.weight$|)"
      R"(^(transformer_blocks\.\d+\.attn\.)(to_[qkv]|add_[qkv]_proj)\.weight$)");
  std::smatch match;
  if (!std::regex_match(name, match, split)) return "";
  if (match[1].matched) return match[1].str() + "linear1";
  return match[3].str() + (starts_with(match[4].str(), "add") ? "txt_qkv" : "qkv");
}

bool is_lora_target(const std::string& family, const Tensor& t) {
  if (!(t.shape.size() == 2 || (t.shape.size() == 4 && t.shape[2] == 1 && t.shape[3] == 1))) {
    return false;
  }
  if (!t.name.ends_with(".weight")) return false;
  if (is_flux(family)) {
    return starts_with(t.name, "double_blocks.") || starts_with(t.name, "single_blocks.") ||
           starts_with(t.name, "transformer_blocks.") ||
           starts_with(t.name, "single_transformer_blocks.");
  }
  return contains(t.name, "transformer_blocks.") || contains(t.name, ".proj_in.") ||
         contains(t.name, ".proj_out.");
}

// Flux's block of a key in kohya's swap lists: (double?, index), or index -1.
std::pair<bool, int> flux_block(const std::string& name) {
  static const std::regex block(
      R"(^(double_blocks|single_blocks|transformer_blocks|single_transformer_blocks)\.(\d+)\.)");
  std::smatch match;
  if (!std::regex_search(name, match, block)) return {false, -1};
  const std::string list = match[1].str();
  return {list == "double_blocks" || list == "transformer_blocks", std::stoi(match[2].str())};
}

const json& calibration() {
  static const json parsed = json::parse(kPlanCalibration);
  return parsed;
}

const json& calibration_for(const std::string& family, bool checkpointing) {
  const json& families = calibration().at("families");
  const std::string key = calibration_key(family);
  const char* mode = checkpointing ? "checkpointing" : "no_checkpointing";
  if (!families.contains(key) || !families.at(key).contains(mode)) {
    throw InputError("lorapipe plan: no calibration for " + family + " " +
                     (checkpointing ? "with" : "without") +
                     " gradient checkpointing (bench/plan_calibrate.py makes one)");
  }
  return families.at(key).at(mode);
}

bool calibrated(const std::string& family, bool checkpointing) {
  const json& families = calibration().at("families");
  const std::string key = calibration_key(family);
  return families.contains(key) &&
         families.at(key).contains(checkpointing ? "checkpointing" : "no_checkpointing");
}

double dot(const json& coefficients, const std::vector<double>& features) {
  double sum = 0;
  for (size_t i = 0; i < features.size() && i < coefficients.size(); ++i) {
    sum += coefficients[i].get<double>() * features[i];
  }
  return sum;
}

// The optimizer state per LoRA parameter, bytes (trainer/optimizer.cpp's optimizers).
double optimizer_bytes_per_param(const std::string& optimizer) {
  std::string o = optimizer;
  std::transform(o.begin(), o.end(), o.begin(), ::tolower);
  // Two fp32 moments (PagedAdamW and PagedAdamW32bit are AdamW: trainer/optimizer.cpp).
  if (o == "adamw" || o == "adam" || o == "pagedadamw" || o == "pagedadamw32bit") return 8;
  if (o == "prodigy") return 16;    // two moments, its running sum and the starting weights
  if (o == "dadaptadam") return 12;  // two moments and its running sum
  // two uint8 moments and a float32 absmax per 256 of them (bitsandbytes' blockwise layout)
  if (o == "adamw8bit" || o == "pagedadamw8bit") return 2 + 2 * 4.0 / 256;
  if (o == "lion") return 4;
  if (o == "lion8bit") return 1 + 4.0 / 256;
  if (o == "adafactor") return 0.1;  // factored second moments: rows + columns, no first
  // a first moment, and two factored second ones (squared gradient, instability)
  if (o == "came" || o == "came_pytorch.came" || o == "came_pytorch.came.came") return 4.2;
  if (o.ends_with("adamwschedulefree")) return 8;  // z and the second moment
  if (o == "sgdnesterov" || o == "sgd") return 4;
  throw InputError("lorapipe plan: --optimizer_type=" + optimizer +
                   ": the plan knows AdamW, PagedAdamW, PagedAdamW32bit, AdamW8bit, PagedAdamW8bit, "
                   "Lion, Lion8bit, Adafactor, CAME, AdamWScheduleFree, Prodigy, DAdaptAdam and "
                   "SGDNesterov");
}

std::string gib(double bytes, int digits = 2) {
  std::ostringstream s;
  s << std::fixed << std::setprecision(digits) << bytes / kGiB;
  return s.str();
}

double parse_bytes(const std::string& text) {
  size_t used = 0;
  double value = 0;
  try {
    value = std::stod(text, &used);
  } catch (const std::exception&) {
    throw InputError("--vram_budget=" + text + ": expected a size such as 12GB, 6GiB or 8000MB");
  }
  std::string unit = text.substr(used);
  std::transform(unit.begin(), unit.end(), unit.begin(), ::tolower);
  // A card's "12 GB" is its GiB count (a 12 GB RTX 3060 holds 12 GiB): GB and GiB alike.
  if (unit.empty() || unit == "gb" || unit == "gib" || unit == "g") return value * kGiB;
  if (unit == "mb" || unit == "mib" || unit == "m") return value * 1024 * 1024;
  throw InputError("--vram_budget=" + text + ": expected a size such as 12GB, 6GiB or 8000MB");
}

// A run flag's number, or an InputError naming the flag and its value.
double flag_number(const std::string& flag, const std::string& text) {
  size_t used = 0;
  double value = 0;
  try {
    value = std::stod(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != text.size() || value < 0) {
    throw InputError(flag + "=" + text + ": expected a number of at least 0");
  }
  return value;
}
int flag_int(const std::string& flag, const std::string& text) {
  const double value = flag_number(flag, text);
  if (value != std::floor(value)) throw InputError(flag + "=" + text + ": expected a whole number");
  return static_cast<int>(value);
}

std::vector<int> parse_ints(const std::string& flag, const std::string& text) {
  std::vector<int> values;
  std::stringstream s(text);
  std::string item;
  while (std::getline(s, item, ',')) {
    try {
      values.push_back(std::stoi(item));
    } catch (const std::exception&) {
      throw InputError(flag + "=" + text + ": expected comma-separated whole numbers");
    }
    if (values.back() <= 0) throw InputError(flag + "=" + text + ": values must be positive");
  }
  if (values.empty()) throw InputError(flag + " wants at least one value");
  return values;
}

}  // namespace

ModelStructure read_structure(const fs::path& model, const std::string& family_override) {
  const m::FamilyDetection detected = m::detect_family(model, family_override);
  const m::ModelFamily& family = m::model_family(detected.family);
  ModelStructure s;
  s.family = family.name;
  s.display_name = family.display_name;
  const bool flux = is_flux(s.family);
  s.pixels_per_token = family.vae_downsample * (flux ? 2 : 1);
  s.text_tokens = flux ? (s.family == "flux-dev" ? 512 : 256) : 77;
  std::map<std::string, LoraGroup> fused;
  std::map<int, uint64_t> doubles, singles, double_scales, single_scales;
  std::set<std::string> transformer_blocks;
  for (const Tensor& t : denoiser_tensors(model, s.family)) {
    const auto n = static_cast<uint64_t>(numel(t.shape));
    s.params += n;
    ++s.weight_tensors;
    const bool float8 = t.name.ends_with(".weight") && t.shape.size() >= 2;
    if (float8) {
      s.float8_params += n;
      s.float8_scales += scale_count(t.shape);
      s.largest_weight = std::max(s.largest_weight, n);
    }
    if (is_lora_target(s.family, t)) {
      const std::string group = flux ? fused_flux_group(t.name) : "";
      if (group.empty()) {
        s.lora_in_out += static_cast<uint64_t>(t.shape[0] + t.shape[1]);
        ++s.lora_modules;
      } else {
        LoraGroup& g = fused[group];
        g.in = t.shape[1];
        g.out += t.shape[0];
      }
    }
    if (flux) {
      const auto [is_double, index] = flux_block(t.name);
      if (index >= 0 && float8) {
        (is_double ? doubles : singles)[index] += n;
        (is_double ? double_scales : single_scales)[index] += scale_count(t.shape);
      }
    } else {
      static const std::regex block(R"(^(.*transformer_blocks\.\d+)\.)");
      std::smatch match;
      if (std::regex_search(t.name, match, block)) transformer_blocks.insert(match[1].str());
    }
  }
  for (const auto& [name, g] : fused) {
    s.lora_in_out += static_cast<uint64_t>(g.in + g.out);
    ++s.lora_modules;
  }
  for (const auto& [i, n] : doubles) s.double_blocks.push_back(n), s.double_scales.push_back(double_scales[i]);
  for (const auto& [i, n] : singles) s.single_blocks.push_back(n), s.single_scales.push_back(single_scales[i]);
  s.blocks = flux ? static_cast<int>(s.double_blocks.size() + s.single_blocks.size())
                  : static_cast<int>(transformer_blocks.size());
  if (s.lora_modules == 0) {
    throw InputError(model.string() + ": none of kohya's LoRA targets found in its denoiser");
  }
  return s;
}

Card find_card(const std::string& name) {
  // Dense bf16 tensor throughput with fp32 accumulation (what PyTorch's bf16 matmuls use; half
  // the fp16-accumulate figure on GeForce cards), memory bandwidth, and the host bus's practical
  // pinned-copy rate (PCIe 3 x16 ~12 GB/s, 4 x16 ~24, 5 x16 ~50), from the vendors' sheets.
  static const std::vector<Card> cards = {
      {"RTX 3060", 25.6, 360, 24},  {"RTX 3070", 40.6, 448, 24},  {"RTX 3080", 59.5, 760, 24},
      {"RTX 3090", 71.0, 936, 24},  {"RTX 4060", 30.0, 272, 24},  {"RTX 4070", 58.0, 504, 24},
      {"RTX 4080", 97.5, 717, 24},  {"RTX 4090", 165.2, 1008, 24}, {"T4", 65.0, 320, 12},
      {"L4", 121.0, 300, 24},       {"A100", 312.0, 2039, 24},    {"H100", 989.4, 3350, 50},
      {"H200", 989.4, 4800, 50}};
  std::string wanted = name;
  std::transform(wanted.begin(), wanted.end(), wanted.begin(), ::toupper);
  for (const Card& card : cards) {
    std::string upper = card.name;
    std::transform(upper.begin(), upper.end(), upper.begin(), ::toupper);
    if (contains(upper, wanted) || contains(wanted, upper)) return card;
  }
  std::string known;
  for (const Card& card : cards) known += (known.empty() ? "" : ", ") + card.name;
  throw InputError("--gpu=" + name + ": not a card the plan knows (" + known +
                   "); give its throughput with --gpu_tflops instead");
}

double budget_needed(const Prediction& p) { return p.peak() * kAccuracyMargin + kReserveBytes; }

double PreviewShare::budget_needed() const {
  return width > 0 ? bytes() * kAccuracyMargin + kReserveBytes : 0;
}

namespace {

// The family's text encoders' weights in the run's dtype (the calibration's, measured in fp32),
// their Linear weights in float8 where --fp8_base puts them there (not --fp8_base_unet), with a
// float32 scale per 64 under --fp8_scaled. A family without a calibration of them (FLUX.1): 0.
double text_encoder_bytes(const ModelStructure& model, const PlanOptions& o,
                          const std::string& float8) {
  const json& previews = calibration().value("preview", json::object());
  const std::string key = calibration_key(model.family);
  if (!previews.contains(key)) return 0;
  const json& cal = previews.at(key);
  const double scale = o.storage_bytes / cal.value("dtype_bytes", 4.0);
  double bytes = cal.at("text_encoder_bytes").get<double>() * scale;
  if (!float8.empty() && !o.run.has("fp8_base_unet")) {
    const double f8 = cal.at("text_encoder_float8_params").get<double>();
    bytes -= f8 * o.storage_bytes;
    bytes += f8 * (float8 == "fp8_scaled" ? 1 + 4.0 / 64 : 1);
  }
  return bytes;
}

}  // namespace

bool plans_denoiser_alone(const ModelStructure& model, const PlanOptions& o) {
  return is_flux(model.family) && o.trains_text_encoder &&
         !o.run.has("network_train_unet_only") && !o.run.has("network_train_text_encoder_only");
}

bool text_encoders_on_card(const ModelStructure& model, const PlanOptions& o) {
  return o.captions_online || (o.trains_text_encoder && !plans_denoiser_alone(model, o));
}

PreviewShare predict_preview_share(const ModelStructure& model, int width, int height,
                                   const PlanOptions& o, const std::string& float8) {
  const json& previews = calibration().value("preview", json::object());
  const std::string key = calibration_key(model.family);
  if (!previews.contains(key)) {
    throw InputError("lorapipe plan: no preview calibration for " + model.family +
                     " (bench/plan_calibrate.py --preview makes one)");
  }
  const json& cal = previews.at(key);
  // Measured in fp32 (dtype_bytes); the sampler holds its encoders and renders in the run's
  // dtype, and its VAE too except in fp16 (SD's VAE overflows in it: kept in fp32). Under
  // --fp8_base the encoders' Linear weights (the calibration's text_encoder_float8_params,
  // measured) are float8, with a float32 scale per 64 of them under --fp8_scaled.
  const double dtype_bytes = cal.value("dtype_bytes", 4.0);
  const double scale = o.storage_bytes / dtype_bytes;
  const double pixels = static_cast<double>(width) * height;
  PreviewShare p;
  p.width = width, p.height = height;
  p.text_encoders = text_encoder_bytes(model, o, float8);
  const double vae_bytes = o.storage_bytes == 2 && o.run.get("mixed_precision", "") == "fp16"
                               ? dtype_bytes : o.storage_bytes;
  p.vae = cal.at("vae_bytes").get<double>() * vae_bytes / dtype_bytes;
  p.render = std::max(0.0, dot(cal.at("render"), {1, pixels, pixels * pixels})) * scale;
  // The LoRA beside the weights in fp32 (models/lora_merge.h), the denoiser's modules.
  p.lora = 4.0 * o.rank * static_cast<double>(model.lora_in_out);
  return p;
}

Prediction predict(const ModelStructure& model, const Candidate& c, const PlanOptions& o) {
  Prediction p;
  const double store = o.storage_bytes;
  const bool float8 = !c.float8.empty();
  const bool scaled = c.float8 == "fp8_scaled";
  const double weight_byte = float8 ? 1 : store;
  p.weights = static_cast<double>(model.params - model.float8_params) * store +
              static_cast<double>(model.float8_params) * weight_byte +
              (scaled ? 4.0 * static_cast<double>(model.float8_scales) : 0);
  // Block swap (Flux, kohya's split): the last N // 2 double blocks' and (N - N // 2) x 2 single
  // blocks' frozen weights leave for the host; two device slots of the largest swapped block
  // receive them.
  if (c.blocks_to_swap > 0 && is_flux(model.family)) {
    const int swap_double = std::min<int>(c.blocks_to_swap / 2, model.double_blocks.size());
    const int swap_single =
        std::min<int>((c.blocks_to_swap - c.blocks_to_swap / 2) * 2, model.single_blocks.size());
    double moved = 0, largest = 0;
    auto take = [&](const std::vector<uint64_t>& blocks, const std::vector<uint64_t>& scales,
                    int count) {
      for (size_t i = blocks.size() - count; i < blocks.size(); ++i) {
        const double bytes = static_cast<double>(blocks[i]) * weight_byte +
                             (scaled ? 4.0 * static_cast<double>(scales[i]) : 0);
        moved += bytes;
        largest = std::max(largest, bytes);
      }
    };
    take(model.double_blocks, model.double_scales, swap_double);
    take(model.single_blocks, model.single_scales, swap_single);
    p.weights -= moved - 2 * largest;
  }
  const double lora_params = static_cast<double>(o.rank) * static_cast<double>(model.lora_in_out);
  p.lora = lora_params * 4 * 2;  // fp32 parameters and their gradients
  p.optimizer = lora_params * optimizer_bytes_per_param(c.optimizer);
  // One float8 weight upcast at a time, to the compute dtype, alive through its layer's compute
  // (scaled float8's float32 intermediate lives only inside the upcast: measured, it adds nothing
  // at the peak). Whether the largest copy is alive at the activations' peak depends on where
  // each family's peak falls (SD1.5's falls in its small early layers); the calibration fits the
  // share per family from float8 steps, and a family without one counts the whole copy.
  if (float8) {
    p.float8_copy = static_cast<double>(model.largest_weight) * store;
    const json& families = calibration().at("families");
    const std::string key = calibration_key(model.family);
    const double share = families.contains(key) ? families.at(key).value("float8_share", 1.0) : 1.0;
    p.transient = share * p.float8_copy;
  }
  p.rounding = kRoundingPerTensor * static_cast<double>(model.weight_tensors + 6 * model.lora_modules);
  if (text_encoders_on_card(model, o)) p.text_encoders = text_encoder_bytes(model, o, c.float8);

  const double tokens = std::ceil(static_cast<double>(c.width) / model.pixels_per_token) *
                            std::ceil(static_cast<double>(c.height) / model.pixels_per_token) +
                        (is_flux(model.family) ? model.text_tokens : 0);
  const double b = c.batch;
  const double n = model.blocks;
  p.features = {1, b * tokens, b * tokens * tokens, b * tokens * n, b * tokens * tokens * n};
  p.flops_features = p.features;
  p.flops_features[0] = b;
  // The activations are in the compute dtype: the calibration's measured at dtype_bytes (fp32 on
  // a CPU without bf16 matrix units), scaled to the run's. A mode not calibrated yet predicts the
  // analytic parts alone (what `--explain` gives bench/plan_calibrate.py to fit it); the plan
  // never weighs one.
  if (calibrated(model.family, c.checkpointing)) {
    const json& cal = calibration_for(model.family, c.checkpointing);
    const double dtype_scale = store / calibration().value("dtype_bytes", 4.0);
    p.activations = std::max(0.0, dot(cal.at("activations"), p.features)) * dtype_scale;
    p.flops = std::max(0.0, dot(cal.at("flops"), p.flops_features));
  }

  // Time on the card: the FLOPs (checkpointing recomputes the forward: a third more) at the
  // assumed share of its peak; float8's upcasts read the weights and write and read their
  // widened copy on every pass (forward, the recompute, backward); block swap's copies go over
  // the bus in forward and backward, overlapped with compute.
  const double rate = o.card.tflops * 1e12 * kAssumedMfu;
  double compute = p.flops * (c.checkpointing ? 4.0 / 3 : 1.0) / rate;
  const double passes = c.checkpointing ? 3 : 2;
  if (float8) {
    compute += passes * static_cast<double>(model.float8_params) * (1 + 2 * store + (scaled ? 8 : 0)) /
               (o.card.memory_gbps * 1e9);
  }
  double transfer = 0;
  if (c.blocks_to_swap > 0) {
    Candidate none = c;
    none.blocks_to_swap = 0;
    const double moved = predict(model, none, o).weights - p.weights;
    transfer = 2 * std::max(0.0, moved) / (o.card.bus_gbps * 1e9);
  }
  p.s_per_it = std::max(compute, transfer);
  return p;
}

namespace {

std::vector<std::string> candidate_flags(const ModelStructure& model, const Candidate& c,
                                         const PlanOptions& o) {
  std::vector<std::string> flags = {"--pretrained_model_name_or_path=" + o.model.string(),
                                    "--resolution=" + std::to_string(c.width) + "," +
                                        std::to_string(c.height),
                                    "--train_batch_size=" + std::to_string(c.batch),
                                    "--network_dim=" + std::to_string(o.rank),
                                    "--mixed_precision=" +
                                        std::string(o.storage_bytes == 4 ? "no" : "bf16"),
                                    "--optimizer_type=" + c.optimizer};
  if (c.checkpointing) flags.push_back("--gradient_checkpointing");
  if (!c.float8.empty()) flags.push_back("--fp8_base");
  if (c.float8 == "fp8_scaled") flags.push_back("--fp8_scaled");
  if (c.blocks_to_swap > 0) flags.push_back("--blocks_to_swap=" + std::to_string(c.blocks_to_swap));
  if (plans_denoiser_alone(model, o)) flags.push_back("--network_train_unet_only");
  for (const std::string& f : o.run_flags) flags.push_back(f);
  return flags;
}

// The setting a run's own flags ask for (the plan's defaults where they are silent).
Candidate run_candidate(const PlanOptions& options) {
  Candidate c;
  const Settings& run = options.run;
  if (!options.resolutions.empty()) c.width = c.height = options.resolutions[0];
  if (run.has("resolution")) {
    const std::vector<int> wh = parse_ints("--resolution", run.get("resolution"));
    c.width = wh[0], c.height = wh.size() > 1 ? wh[1] : wh[0];
  }
  c.batch = parse_ints("--train_batch_size", run.get("train_batch_size", "1"))[0];
  c.checkpointing = run.has("gradient_checkpointing") && run.get("gradient_checkpointing") != "false";
  // --fp8_fast (float8 matmuls) is scaled float8's, whose memory it keeps.
  c.float8 = run.has("fp8_base") || run.has("fp8_base_unet") || run.has("fp8_fast")
                 ? (run.has("fp8_scaled") || run.has("fp8_fast") ? "fp8_scaled" : "fp8")
                 : "";
  c.blocks_to_swap = flag_int("--blocks_to_swap", run.get("blocks_to_swap", "0"));
  c.optimizer = options.optimizer.empty() ? "AdamW" : options.optimizer;
  return c;
}

std::string describe(const Candidate& c) {
  std::string s = c.checkpointing ? "ckpt" : "no ckpt";
  if (!c.float8.empty()) s += c.float8 == "fp8" ? ", fp8" : ", fp8 scaled";
  if (c.blocks_to_swap > 0) s += ", swap " + std::to_string(c.blocks_to_swap);
  s += ", " + c.optimizer;
  return s;
}

// How much a candidate asks of its user, for ties in speed: fewer memory options first, scaled
// float8 before plain (it is the more accurate).
int burden(const Candidate& c) {
  return (c.checkpointing ? 1 : 0) + (c.float8 == "fp8_scaled" ? 2 : c.float8 == "fp8" ? 3 : 0) +
         (c.blocks_to_swap > 0 ? 4 : 0) + (c.optimizer == "AdamW" ? 0 : 1);
}

}  // namespace

PlanOptions parse_plan_args(const std::vector<std::string>& args) {
  PlanOptions o;
  o.card = find_card("RTX 3060");
  std::vector<std::string> run_args;
  double tflops = 0;
  for (size_t i = 0; i < args.size(); ++i) {
    std::string arg = args[i];
    std::string name = arg, value;
    const size_t eq = arg.find('=');
    if (eq != std::string::npos) name = arg.substr(0, eq), value = arg.substr(eq + 1);
    static const std::set<std::string> valued = {
        "--model", "--pretrained_model_name_or_path", "--model_family", "--vram_budget", "--gpu",
        "--gpu_tflops", "--resolutions", "--batch_sizes"};
    if (valued.count(name)) {
      if (eq == std::string::npos) {
        if (i + 1 >= args.size()) throw InputError(name + " wants a value");
        value = args[++i];
      }
      if (name == "--model" || name == "--pretrained_model_name_or_path") {
        o.model = value;
      } else if (name == "--model_family") {
        o.family = value;
      } else if (name == "--vram_budget") {
        o.budget_bytes = parse_bytes(value);
      } else if (name == "--gpu") {
        o.card = find_card(value);
      } else if (name == "--gpu_tflops") {
        tflops = flag_number("--gpu_tflops", value);
      } else if (name == "--resolutions") {
        o.resolutions = parse_ints(name, value);
      } else if (name == "--batch_sizes") {
        o.batches = parse_ints(name, value);
      }
      continue;
    }
    run_args.push_back(arg);
  }
  if (tflops > 0) o.card.name = "a card of " + std::to_string(tflops) + " TFLOPS", o.card.tflops = tflops;
  if (o.model.empty()) throw InputError("lorapipe plan: --model=FILE_OR_FOLDER is needed");
  // The run's own flags, checked as `lorapipe run` checks them.
  o.run = parse_run_args(run_args);
  const Settings& run = o.run;
  for (const auto& [name, value] : run.flags) {
    if (name == "pretrained_model_name_or_path" || name == "model") {
      o.model = value;
    } else if (name == "data_dir" || name == "dataset_config" || name == "train_data_dir" ||
               name == "in_json") {
      o.dataset = true;
    }
  }
  o.trains_text_encoder = run.get("network_train_unet_only", "false") != "true";
  // What the cache cannot hold (trainer/run_setup.cpp encodes these online; cacher.cpp leaves
  // them out).
  const auto positive = [&](const char* name) {  // a switch given, or a number above 0
    const std::string value = run.get(name, "false");
    return value == "true" || (value != "false" && std::atof(value.c_str()) > 0);
  };
  o.captions_online = positive("weighted_captions") || positive("shuffle_caption") ||
                      positive("caption_dropout_rate") || positive("caption_tag_dropout_rate") ||
                      positive("caption_dropout_every_n_epochs") ||
                      positive("token_warmup_step") || positive("enable_wildcard");
  if (run.has("network_dim")) o.rank = flag_int("--network_dim", run.get("network_dim"));
  if (run.has("mixed_precision")) o.storage_bytes = run.get("mixed_precision") == "no" ? 4 : 2;
  if (run.has("learning_rate")) o.learning_rate = flag_number("--learning_rate", run.get("learning_rate"));
  if (run.has("optimizer_type")) o.optimizer = run.get("optimizer_type");
  const int batch = flag_int("--train_batch_size", run.get("train_batch_size", "0"));
  const int accumulation =
      flag_int("--gradient_accumulation_steps", run.get("gradient_accumulation_steps", "1"));
  if (batch > 0) o.effective_batch = batch * accumulation;
  for (const auto& [name, value] : run.flags) {
    if (name == "network_dim" || name == "mixed_precision" || name == "learning_rate" ||
        name == "optimizer_type" || name == "train_batch_size" || name == "resolution" ||
        name == "gradient_accumulation_steps" || name == "pretrained_model_name_or_path" ||
        name == "model" || name == "gradient_checkpointing" || name == "fp8_base" ||
        name == "fp8_base_unet" || name == "fp8_scaled" || name == "blocks_to_swap" ||
        name == "plan_budget" || name == "output") {
      continue;
    }
    o.run_flags.push_back("--" + name + (value == "true" ? "" : "=" + value));
  }
  return o;
}

namespace {

std::string read_all(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// The dataset's buckets at width x height, as the run's preprocess stage picks them: its report
// (`lorapipe-preprocess --report_only`, which reads and decodes every image as the run will, so
// a broken image is left out here as there) over the run's dataset and bucket flags.
std::vector<DatasetBucket> dataset_buckets(const Settings& run, int width, int height) {
  Settings settings = run;
  settings.set("resolution", std::to_string(width) + "," + std::to_string(height));
  const fs::path bin = fs::read_symlink("/proc/self/exe").parent_path();
  const fs::path dir = fs::temp_directory_path() /
                       ("lorapipe-plan-" + std::to_string(::getpid()) + "-" + std::to_string(width) +
                        "x" + std::to_string(height));
  fs::create_directories(dir);
  std::vector<std::string> argv = {(bin / "lorapipe-preprocess").string(), "--report_only",
                                   "--report_json=" + (dir / "report.json").string()};
  for (const std::string& a : stage_args(settings, Stage::kPreprocess)) argv.push_back(a);
  const int code = runtime::wait_exit(runtime::spawn(argv, dir / "out.txt", dir / "err.txt"));
  std::string report, err;
  if (code == 0) report = read_all(dir / "report.json");
  if (code != 0) err = read_all(dir / "err.txt");
  std::error_code ignored;
  fs::remove_all(dir, ignored);
  if (code != 0) {
    while (!err.empty() && err.back() == '\n') err.pop_back();
    throw InputError("lorapipe plan: the dataset's buckets at " + std::to_string(width) + "x" +
                     std::to_string(height) + ": lorapipe-preprocess exited " +
                     std::to_string(code) + ": " + err);
  }
  std::vector<DatasetBucket> buckets;
  const json parsed = json::parse(report);
  for (const json& b : parsed.at("buckets")) {
    buckets.push_back({b.at("bucket")[0].get<int>(), b.at("bucket")[1].get<int>(),
                       b.at("count_with_repeats").get<int64_t>()});
  }
  if (buckets.empty()) {
    throw InputError("lorapipe plan: the dataset has no image to train on at " +
                     std::to_string(width) + "x" + std::to_string(height) +
                     " (lorapipe-preprocess --report_only says why)");
  }
  return buckets;
}

// A candidate over the dataset's buckets: each bucket trains in batches of the candidate's size,
// its last one short (kohya's bucket batching); the peak is the largest of any bucket's largest
// batch, the step time the epoch's average.
void predict_over_buckets(const ModelStructure& model, const std::vector<DatasetBucket>& buckets,
                          const PlanOptions& options, PlanRow& row) {
  double seconds = 0, steps = 0, samples = 0, peak = -1;
  for (const DatasetBucket& b : buckets) {
    Candidate c = row.candidate;
    c.width = b.width, c.height = b.height;
    c.batch = static_cast<int>(std::min<int64_t>(row.candidate.batch, b.count));
    const Prediction p = predict(model, c, options);
    const int64_t full = b.count / c.batch, rest = b.count % c.batch;
    seconds += static_cast<double>(full) * p.s_per_it;
    steps += static_cast<double>(full);
    if (rest > 0) {
      c.batch = static_cast<int>(rest);
      seconds += predict(model, c, options).s_per_it;
      steps += 1;
    }
    samples += static_cast<double>(b.count);
    if (p.peak() > peak) peak = p.peak(), row.prediction = p;
  }
  row.prediction.s_per_it = seconds / steps;
  row.samples_per_step = samples / steps;
}

// Whether the run's previews render on the training card beside the training, as `lorapipe run`
// decides it (deploy/run.cpp), and at what largest size: the prompt file's, as the sampler reads
// it (`lorapipe-sampler --check_flags`, beside lorapipe, which refuses a bad file as the run
// would). A plan for a card assumes the run has that card alone (a second GPU would take the
// previews: the launcher's spare-GPU rule, on the machine that plans).
PreviewShare previews_on_the_card(const ModelStructure& model, const PlanOptions& o) {
  PreviewShare none;
  const Settings& run = o.run;
  if (!run.has("sample_prompts") || (run.has("debug_dataset") && run.get("debug_dataset") == "true")) {
    return none;
  }
  const m::ModelFamily& family = m::model_family(model.family);
  const std::string device = run.get("device", "auto");
  std::string sampler_device = run.get("sampler_device", "");
  if (sampler_device.empty()) {
    sampler_device = spare_gpu_for_sampler(device, visible_gpus());
    if (sampler_device.empty()) sampler_device = "auto";
  }
  const std::string why_not =
      why_previews_not_shared(run, family.previews_beside_training, family.display_name);
  const PreviewMode mode = preview_mode(device, sampler_device,
                                        run.get("sample_after_training", "auto"), true, why_not);
  if (!mode.share_weights) {
    none.why_none = mode.after_training ? "render after the training"
                    : mode.own_copy_beside ? "render beside the training with the sampler's own "
                                             "copy of the model, which the plan does not weigh "
                                             "(the card must hold both)"
                                           : "render on " + sampler_device;
    if (!why_not.empty() && mode.after_training) none.why_none += " (" + why_not + ")";
    return none;
  }
  const fs::path bin = fs::read_symlink("/proc/self/exe").parent_path();
  const fs::path dir = fs::temp_directory_path() /
                       ("lorapipe-plan-previews-" + std::to_string(::getpid()));
  fs::create_directories(dir);
  std::vector<std::string> argv = {(bin / "lorapipe-sampler").string()};
  for (const std::string& a : stage_args(run, Stage::kSampler)) argv.push_back(a);
  // The plan's --model is the run's; the check reads no weights, on the CPU.
  argv.insert(argv.end(), {"--pretrained_model_name_or_path=" + o.model.string(),
                           "--output_dir=" + dir.string(), "--device=cpu", "--check_flags"});
  const int code = runtime::wait_exit(runtime::spawn(argv, dir / "out.txt", dir / "err.txt"));
  const std::string out = read_all(dir / "out.txt"), err = read_all(dir / "err.txt");
  std::error_code ignored;
  fs::remove_all(dir, ignored);
  std::smatch size;
  if (code != 0 || !std::regex_search(out, size, std::regex(R"(previews up to (\d+)x(\d+))"))) {
    std::string last = err.empty() ? out : err;
    while (!last.empty() && last.back() == '\n') last.pop_back();
    throw InputError("lorapipe plan: the previews' sizes (--sample_prompts=" +
                     run.get("sample_prompts") + "): lorapipe-sampler --check_flags exited " +
                     std::to_string(code) + ": " + last);
  }
  return predict_preview_share(model, std::stoi(size[1].str()), std::stoi(size[2].str()), o);
}

// The resolution each family's models are trained and sampled at.
int native_resolution(const std::string& family) { return family == "sd15" ? 512 : 1024; }

}  // namespace

Plan make_plan(const PlanOptions& options) {
  Plan plan;
  plan.options = options;
  plan.model = read_structure(options.model, options.family);
  const ModelStructure& model = plan.model;
  plan.preview = previews_on_the_card(model, options);
  plan.training_budget = options.budget_bytes - plan.preview.budget_needed();
  // The budget beside the previews for each float8 option (the sampler's encoders follow it).
  std::map<std::string, double> training_budget;
  auto budget_beside_previews = [&](const std::string& f8) {
    if (!training_budget.count(f8)) {
      training_budget[f8] =
          plan.preview.width > 0
              ? options.budget_bytes -
                    predict_preview_share(model, plan.preview.width, plan.preview.height, options, f8)
                        .budget_needed()
              : options.budget_bytes;
    }
    return training_budget[f8];
  };
  std::vector<int> resolutions = options.resolutions;
  if (resolutions.empty()) resolutions = {256, 384, 512, 640, 768, 896, 1024};
  std::vector<int> batches = options.batches;
  if (batches.empty()) batches = {1, 2, 4, 8};
  std::vector<std::string> optimizers = {"AdamW", "AdamW8bit"};
  if (!options.optimizer.empty()) optimizers = {options.optimizer};
  std::vector<int> swaps = {0};
  if (is_flux(model.family)) swaps = {0, 8, 16, 28};  // kohya's tiers for 24, 12, 8 GB
  // What the run's flags fix, the plan keeps.
  const Settings& run = options.run;
  if (run.has("blocks_to_swap")) swaps = {flag_int("--blocks_to_swap", run.get("blocks_to_swap"))};
  std::vector<bool> checkpointing = {false, true};
  if (run.has("gradient_checkpointing") && run.get("gradient_checkpointing") != "false") {
    checkpointing = {true};
  }
  std::vector<std::string> float8 = {"", "fp8", "fp8_scaled"};
  if (run.has("fp8_base") || run.has("fp8_base_unet") || run.has("fp8_fast")) {
    float8 = {run.has("fp8_scaled") || run.has("fp8_fast") ? "fp8_scaled" : "fp8"};
  }
  // --resolution=W,H: that size alone (kohya's spelling; one number is a square).
  std::vector<std::pair<int, int>> sizes;
  if (!options.resolutions.empty()) {
    for (int r : options.resolutions) sizes.emplace_back(r, r);
  }
  if (run.has("resolution") && options.resolutions.empty()) {
    const std::vector<int> wh = parse_ints("--resolution", run.get("resolution"));
    sizes = {{wh[0], wh.size() > 1 ? wh[1] : wh[0]}};
  }
  const bool sizes_given = !sizes.empty();
  if (sizes.empty()) {
    for (int r : resolutions) sizes.emplace_back(r, r);
  }
  if (options.dataset) {
    for (const auto& [width, height] : sizes) {
      plan.buckets[width] = dataset_buckets(run, width, height);
    }
  }
  for (const auto& [width, height] : sizes) {
    for (int b : batches) {
      for (bool ckpt : checkpointing) {
        if (!calibrated(model.family, ckpt)) continue;  // said under the table
        for (const std::string& f8 : float8) {
          for (int swap : swaps) {
            for (const std::string& opt : optimizers) {
              PlanRow row;
              row.candidate = {width, height, b, ckpt, f8, swap, opt};
              row.prediction = predict(model, row.candidate, options);
              row.samples_per_step = b;
              if (options.dataset) predict_over_buckets(model, plan.buckets[width], options, row);
              row.training_budget = budget_beside_previews(f8);
              row.fits = budget_needed(row.prediction) <= row.training_budget;
              row.flags = candidate_flags(model, row.candidate, options);
              plan.rows.push_back(std::move(row));
            }
          }
        }
      }
    }
  }
  if (plan.rows.empty()) {
    throw InputError("lorapipe plan: no setting to weigh for " + model.family +
                     " with these flags (the family is calibrated with gradient checkpointing)");
  }
  // The fastest in samples per second among those that fit, at the largest resolution that has
  // one (what a user trains at is the detail the card can afford; speed decides within it). The
  // default sweep recommends no more than the family's training resolution (SD1.5 512, SDXL and
  // FLUX.1 1024): SD1.5 at 1024 fits many cards and is not what its users train at.
  const int cap = sizes_given ? std::numeric_limits<int>::max()
                              : native_resolution(model.family) * native_resolution(model.family);
  plan.resolution_cap = sizes_given ? 0 : native_resolution(model.family);
  int best_resolution = 0;
  for (const PlanRow& row : plan.rows) {
    const int area = row.candidate.width * row.candidate.height;
    if (row.fits && area <= cap) best_resolution = std::max(best_resolution, area);
  }
  for (size_t i = 0; i < plan.rows.size(); ++i) {
    const PlanRow& row = plan.rows[i];
    if (!row.fits || row.candidate.width * row.candidate.height != best_resolution) continue;
    if (plan.recommended < 0) {
      plan.recommended = static_cast<int>(i);
      continue;
    }
    const PlanRow& best = plan.rows[plan.recommended];
    const double speed = row.samples_per_s();
    const double best_speed = best.samples_per_s();
    if (speed > best_speed * 1.02 ||
        (speed > best_speed / 1.02 && burden(row.candidate) < burden(best.candidate))) {
      plan.recommended = static_cast<int>(i);
    }
  }
  if (plan.recommended >= 0) {
    // Gradient accumulation keeps the samples per optimizer step the user asked for (kohya's
    // train_batch_size x gradient_accumulation_steps); a batch past it raises them, and the
    // learning rate follows by the square-root rule, the one that keeps Adam's update noise the
    // same as the batch grows (Malladi et al. 2022, "On the SDEs and scaling rules for adaptive
    // gradient algorithms"); kohya scales nothing by itself.
    const int batch = plan.rows[plan.recommended].candidate.batch;
    const int target = options.effective_batch > 0 ? options.effective_batch : batch;
    plan.accumulation = std::max(1, (target + batch - 1) / batch);
    const double effective = static_cast<double>(batch * plan.accumulation);
    plan.learning_rate = options.learning_rate * std::sqrt(effective / target);
    plan.learning_rate_rule =
        effective == target
            ? "unchanged: " + std::to_string(batch) + " x " + std::to_string(plan.accumulation) +
                  " samples per step, as asked"
            : "x sqrt(" + std::to_string(static_cast<int>(effective)) + "/" +
                  std::to_string(target) +
                  ") for the larger samples per step (square-root rule for Adam-type optimizers)";
    PlanRow& best = plan.rows[plan.recommended];
    best.flags.push_back("--gradient_accumulation_steps=" + std::to_string(plan.accumulation));
    std::ostringstream lr;
    lr << plan.learning_rate;
    best.flags.push_back("--learning_rate=" + lr.str());
  }
  return plan;
}

namespace {

// Each resolution x batch: its fastest setting that fits, else its lightest one (the table's).
std::map<std::pair<int, int>, int> shown_rows(const Plan& plan) {
  std::map<std::pair<int, int>, int> shown;
  for (size_t i = 0; i < plan.rows.size(); ++i) {
    const PlanRow& row = plan.rows[i];
    const auto key = std::make_pair(row.candidate.width, row.candidate.batch);
    auto it = shown.find(key);
    if (it == shown.end()) {
      shown[key] = static_cast<int>(i);
      continue;
    }
    const PlanRow& held = plan.rows[it->second];
    const bool better =
        row.fits ? (!held.fits || row.samples_per_s() > 1.02 * held.samples_per_s())
                 : (!held.fits && row.prediction.peak() < held.prediction.peak());
    if (better) it->second = static_cast<int>(i);
  }
  return shown;
}

}  // namespace

void print_plan(const Plan& plan, std::ostream& out) {
  const PlanOptions& o = plan.options;
  const ModelStructure& m = plan.model;
  out << "lorapipe plan: " << m.display_name << " (" << o.model.string() << "), "
      << std::fixed << std::setprecision(2) << static_cast<double>(m.params) / 1e9
      << " B parameters; LoRA rank " << o.rank << " on " << m.lora_modules << " modules\n"
      << "budget " << gib(o.budget_bytes) << " GiB on " << o.card.name << ": a setting fits when "
      << "its predicted peak +10% stays under the budget less " << gib(kReserveBytes)
      << " GiB (CUDA context and allocator slack)\n";
  const PreviewShare& p = plan.preview;
  if (p.width > 0) {
    out << "previews on this card, up to " << p.width << "x" << p.height << ", over the "
        << "trainer's weights: " << gib(p.bytes()) << " GiB predicted (text encoders "
        << gib(p.text_encoders) << ", VAE " << gib(p.vae) << ", LoRA " << gib(p.lora)
        << ", one render " << gib(p.render) << "); with 10% and the sampler's own "
        << gib(kReserveBytes) << " GiB, the training has " << gib(plan.training_budget)
        << " GiB of the budget (more with float8: the sampler's text encoders follow "
        << "--fp8_base; --sampler_device or --sample_after_training keeps it whole)\n";
  } else if (!p.why_none.empty()) {
    out << "previews " << p.why_none
        << (contains(p.why_none, "must hold both") ? "\n" : ": the training has the whole budget\n");
  }
  out
      << std::defaultfloat << std::setprecision(4)
      << "times: the step's FLOPs at " << static_cast<int>(kAssumedMfu * 100) << "% of "
      << o.card.tflops << " TFLOPS, float8 upcasts at " << o.card.memory_gbps
      << " GB/s, swap copies at " << o.card.bus_gbps << " GB/s (estimates)\n";
  if (plan.resolution_cap > 0) {
    out << "recommends up to " << plan.resolution_cap << "x" << plan.resolution_cap
        << ", the family's training resolution (--resolution or --resolutions to weigh others)\n";
  }
  for (const auto& [side, buckets] : plan.buckets) {
    int64_t samples = 0;
    const DatasetBucket* largest = &buckets.front();
    for (const DatasetBucket& b : buckets) {
      samples += b.count;
      if (b.width * b.height > largest->width * largest->height) largest = &b;
    }
    out << "dataset at " << side << ": " << samples << " samples per epoch in " << buckets.size()
        << " buckets, the largest " << largest->width << "x" << largest->height << " ("
        << largest->count << "); a batch is a bucket's, its last one short\n";
  }
  if (!calibrated(m.family, false)) {
    out << "without gradient checkpointing: not calibrated for this family yet, not shown\n";
  }
  const std::string why_online = o.captions_online
                                     ? "its captions change every step (weighted, shuffled, "
                                       "dropped or warmed up)"
                                     : "the run trains a text-encoder LoRA, kohya's default; "
                                       "--network_train_unet_only leaves them off";
  if (text_encoders_on_card(m, o) && is_flux(m.family) && !o.captions_online) {
    out << "CLIP-L stays on the card, encoding every step (" << why_online
        << "; T5-XXL's states come from the cache): NOT in the peaks below\n";
  } else if (text_encoders_on_card(m, o) && is_flux(m.family)) {
    out << "T5-XXL (4.8 B parameters) and CLIP-L stay on the card, encoding every step ("
        << why_online << "): NOT in the peaks below\n";
  } else if (text_encoders_on_card(m, o)) {
    out << "the text encoders stay on the card (" << gib(text_encoder_bytes(m, o, ""))
        << " GiB, in the peaks below): " << why_online << "\n";
  }
  if (plans_denoiser_alone(m, o)) {
    out << "the transformer alone trains (--network_train_unet_only, as kohya's small-card "
           "FLUX.1 recipes): a CLIP-L LoRA would keep CLIP-L on the card, encoding every "
           "caption at every step (T5-XXL's states still come from the cache)\n";
  }
  out << "\n";
  // Each resolution x batch: its fastest setting that fits, else its lightest one.
  out << "  res  batch  setting                                  peak GiB  fits   s/it  samples/s\n";
  for (const auto& [key, index] : shown_rows(plan)) {
    const PlanRow& row = plan.rows[index];
    char line[256];
    std::snprintf(line, sizeof line, "%5d  %5d  %-40s %8s  %-4s %6.2f  %9.2f%s\n", key.first,
                  key.second, describe(row.candidate).c_str(), gib(row.prediction.peak()).c_str(),
                  row.fits ? "yes" : "no", row.prediction.s_per_it,
                  row.samples_per_s(),
                  index == plan.recommended ? "  <- recommended" : "");
    out << line;
  }
  out << "\n";
  if (plan.recommended < 0) {
    out << "nothing fits " << gib(o.budget_bytes) << " GiB; the lightest setting above is the "
        << "closest\n";
    if (plan.preview.width > 0) {
      out << "(beside previews up to " << plan.preview.width << "x" << plan.preview.height
          << " on the card: smaller previews (--w, --h), --sample_after_training or "
          << "--sampler_device=another device leave the training more)\n";
    }
    return;
  }
  const PlanRow& best = plan.rows[plan.recommended];
  out << "recommended: " << best.candidate.width << "x" << best.candidate.height << ", batch "
      << best.candidate.batch << " x " << plan.accumulation << " accumulation, "
      << describe(best.candidate) << ": " << gib(best.prediction.peak()) << " GiB, "
      << std::fixed << std::setprecision(2) << best.prediction.s_per_it << " s/it\n"
      << std::defaultfloat << std::setprecision(6) << "learning rate " << plan.learning_rate << " (" << plan.learning_rate_rule << ")\n"
      << "  lorapipe run";
  for (const std::string& f : best.flags) out << " " << f;
  out << "\n";
}

std::string explain_json(const ModelStructure& model, const Candidate& c, const PlanOptions& o) {
  const Prediction p = predict(model, c, o);
  json j = {{"family", model.family},
            {"params", model.params},
            {"lora_modules", model.lora_modules},
            {"lora_params", static_cast<double>(o.rank) * static_cast<double>(model.lora_in_out)},
            {"weights", p.weights},
            {"lora", p.lora},
            {"optimizer", p.optimizer},
            {"transient", p.transient},
            {"float8_copy", p.float8_copy},
            {"rounding", p.rounding},
            {"activations", p.activations},
            {"text_encoders", p.text_encoders},
            {"predicted_peak_bytes", p.peak()},
            {"flops", p.flops},
            {"features", p.features},
            {"flops_features", p.flops_features}};
  return j.dump();
}

namespace {

// The plot: predicted peak against resolution, one line per batch size, for the recommended
// setting's options (and dashed, for the lightest ones), the budget line and the recommended
// point.
std::string plot_svg(const Plan& plan) {
  const int w = 760, h = 460, left = 70, right = 170, top = 40, bottom = 60;
  const PlanOptions& o = plan.options;
  Candidate shape = plan.recommended >= 0 ? plan.rows[plan.recommended].candidate
                                          : plan.rows.front().candidate;
  std::set<int> resolutions, batches;
  double ymax = o.budget_bytes;
  for (const PlanRow& row : plan.rows) {
    resolutions.insert(row.candidate.width);
    batches.insert(row.candidate.batch);
  }
  auto same_options = [&](const Candidate& a) {
    return a.checkpointing == shape.checkpointing && a.float8 == shape.float8 &&
           a.blocks_to_swap == shape.blocks_to_swap && a.optimizer == shape.optimizer;
  };
  for (const PlanRow& row : plan.rows) {
    if (same_options(row.candidate)) ymax = std::max(ymax, row.prediction.peak());
  }
  ymax = std::min(ymax * 1.08, o.budget_bytes * 3);
  // Grid lines at a round step of GiB (1, 2 or 5 times a power of ten), about five of them.
  const double gib_max = ymax / (1024.0 * 1024 * 1024);
  double tick = std::pow(10.0, std::floor(std::log10(gib_max / 5)));
  for (double m : {1.0, 2.0, 5.0, 10.0}) {
    if (gib_max / (tick * m) <= 6) {
      tick *= m;
      break;
    }
  }
  const int ticks = static_cast<int>(std::ceil(gib_max / tick - 1e-9));
  ymax = ticks * tick * 1024.0 * 1024 * 1024;
  const double xmin = *resolutions.begin(), xmax = std::max(*resolutions.rbegin(), *resolutions.begin() + 1);
  auto X = [&](double r) { return left + (r - xmin) / (xmax - xmin) * (w - left - right); };
  auto Y = [&](double bytes) {
    return top + (1 - std::min(bytes, ymax) / ymax) * (h - top - bottom);
  };
  static const char* colours[] = {"#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
                                  "#8c564b"};
  std::ostringstream s;
  s << std::fixed << std::setprecision(1);
  s << "<svg xmlns='http://www.w3.org/2000/svg' width='" << w << "' height='" << h
    << "' font-family='DejaVu Sans, sans-serif' font-size='13'>\n"
    << "<rect width='100%' height='100%' fill='white'/>\n"
    << "<text x='" << left << "' y='24' font-size='15'>" << plan.model.display_name
    << ": predicted peak memory, " << describe(shape) << ", rank " << o.rank << "</text>\n";
  // axes and grid
  for (int i = 0; i <= ticks; ++i) {
    const double bytes = ymax * i / ticks;
    s << "<line x1='" << left << "' x2='" << w - right << "' y1='" << Y(bytes) << "' y2='"
      << Y(bytes) << "' stroke='#ddd'/>\n<text x='" << left - 8 << "' y='" << Y(bytes) + 4
      << "' text-anchor='end'>" << gib(bytes, tick < 1 ? 1 : 0) << "</text>\n";
  }
  for (int r : resolutions) {
    s << "<text x='" << X(r) << "' y='" << h - bottom + 20 << "' text-anchor='middle'>" << r
      << "</text>\n";
  }
  s << "<text x='" << (left + w - right) / 2 << "' y='" << h - 15
    << "' text-anchor='middle'>resolution (square, pixels)</text>\n"
    << "<text transform='translate(18," << (top + h - bottom) / 2
    << ") rotate(-90)' text-anchor='middle'>peak allocated, GiB</text>\n";
  // the budget
  // What the training has beside previews on the card: the recommended setting's (its float8
  // decides the sampler's encoders).
  const double training = plan.recommended >= 0 ? plan.rows[plan.recommended].training_budget
                                                : plan.training_budget;
  const double usable = (training - kReserveBytes) / kAccuracyMargin;
  s << "<line x1='" << left << "' x2='" << w - right << "' y1='" << Y(o.budget_bytes) << "' y2='"
    << Y(o.budget_bytes) << "' stroke='black' stroke-width='2'/>\n<text x='" << w - right + 6
    << "' y='" << Y(o.budget_bytes) + 4 << "'>budget " << gib(o.budget_bytes, 0) << " GiB</text>\n"
    << "<line x1='" << left << "' x2='" << w - right << "' y1='" << Y(usable) << "' y2='"
    << Y(usable) << "' stroke='black' stroke-dasharray='4 4'/>\n<text x='" << w - right + 6
    << "' y='" << Y(usable) + 4 << "'>fits below"
    << (plan.preview.width > 0 ? " (previews beside)" : "") << "</text>\n";
  int colour = 0;
  for (int b : batches) {
    s << "<polyline fill='none' stroke-width='2' stroke='" << colours[colour % 6] << "' points='";
    for (const PlanRow& row : plan.rows) {
      if (row.candidate.batch == b && same_options(row.candidate)) {
        s << X(row.candidate.width) << "," << Y(row.prediction.peak()) << " ";
      }
    }
    s << "'/>\n<text x='" << w - right + 6 << "' y='" << top + 40 + 18 * colour << "' fill='"
      << colours[colour % 6] << "'>batch " << b << "</text>\n";
    ++colour;
  }
  if (plan.recommended >= 0) {
    const PlanRow& best = plan.rows[plan.recommended];
    s << "<circle cx='" << X(best.candidate.width) << "' cy='" << Y(best.prediction.peak())
      << "' r='7' fill='none' stroke='black' stroke-width='2.5'/>\n<text x='"
      << X(best.candidate.width) - 10 << "' y='" << Y(best.prediction.peak()) - 12
      << "' text-anchor='end'>recommended: batch " << best.candidate.batch << "</text>\n";
  }
  s << "</svg>\n";
  return s.str();
}

}  // namespace

std::vector<fs::path> write_plan(const Plan& plan, const fs::path& dir) {
  fs::create_directories(dir);
  json candidates = json::array();
  for (const PlanRow& row : plan.rows) {
    const Candidate& c = row.candidate;
    candidates.push_back({{"resolution", {c.width, c.height}},
                          {"batch_size", c.batch},
                          {"gradient_checkpointing", c.checkpointing},
                          {"fp8", c.float8.empty() ? "none" : c.float8},
                          {"blocks_to_swap", c.blocks_to_swap},
                          {"optimizer_type", c.optimizer},
                          {"flags", row.flags},
                          {"predicted_peak_bytes", std::llround(row.prediction.peak())},
                          {"fits", row.fits},
                          {"training_budget_bytes", std::llround(row.training_budget)},
                          {"predicted_s_per_it", row.prediction.s_per_it},
                          {"predicted_samples_per_s", row.samples_per_s()}});
    if (row.probe) {
      const ProbeResult& p = *row.probe;
      json probe = {{"out_of_memory", p.out_of_memory}, {"skipped", p.skipped},
                    {"predicted_peak_bytes", std::llround(p.predicted_peak)}};
      if (!p.failed.empty()) probe["failed"] = p.failed;
      if (!p.out_of_memory && !p.skipped && p.failed.empty()) {
        probe["measured_peak_bytes"] = std::llround(p.peak_bytes);
        probe["s_per_it"] = p.s_per_it;
        probe["samples_per_s"] = p.samples_per_s;
        if (p.mfu >= 0) probe["mfu"] = p.mfu;
      }
      candidates.back()["probe"] = std::move(probe);
    }
  }
  json dataset = json::object();
  for (const auto& [side, buckets] : plan.buckets) {
    json list = json::array();
    for (const DatasetBucket& b : buckets) {
      list.push_back({{"resolution", {b.width, b.height}}, {"count", b.count}});
    }
    dataset[std::to_string(side)] = std::move(list);
  }
  json j = {{"model", plan.options.model.string()},
            {"dataset_buckets", std::move(dataset)},
            {"family", plan.model.family},
            {"budget_bytes", std::llround(plan.options.budget_bytes)},
            {"training_budget_bytes", std::llround(plan.training_budget)},
            {"preview", plan.preview.width > 0
                            ? json{{"width", plan.preview.width},
                                   {"height", plan.preview.height},
                                   {"predicted_bytes", std::llround(plan.preview.bytes())},
                                   {"text_encoder_bytes", std::llround(plan.preview.text_encoders)},
                                   {"vae_bytes", std::llround(plan.preview.vae)},
                                   {"lora_bytes", std::llround(plan.preview.lora)},
                                   {"render_bytes", std::llround(plan.preview.render)}}
                            : json(nullptr)},
            {"card", plan.options.card.name},
            {"candidates", candidates},
            {"recommended", plan.recommended >= 0 ? json(plan.recommended) : json(nullptr)},
            {"recommended_resolution_cap", plan.resolution_cap > 0 ? json(plan.resolution_cap) : json(nullptr)},
            {"gradient_accumulation_steps", plan.accumulation},
            {"learning_rate", plan.learning_rate},
            {"learning_rate_rule", plan.learning_rate_rule}};
  std::vector<fs::path> written = {dir / "plan.json", dir / "plan.svg"};
  write_file(written[0], j.dump(1) + "\n", false);
  const std::string svg = plot_svg(plan);
  write_file(written[1], svg, false);
#if LORAPIPE_PLAN_PNG
  if (VIPS_INIT("lorapipe")) throw Error("libvips would not start: " + std::string(vips_error_buffer()));
  VipsImage* image = nullptr;
  if (vips_svgload_buffer(const_cast<char*>(svg.data()), svg.size(), &image, "dpi", 144.0,
                          nullptr) != 0 ||
      vips_pngsave(image, (dir / "plan.png").c_str(), nullptr) != 0) {
    const std::string why = vips_error_buffer();
    vips_error_clear();
    if (image != nullptr) g_object_unref(image);
    throw Error("lorapipe plan: the plot would not render to PNG: " + why);
  }
  g_object_unref(image);
  written.push_back(dir / "plan.png");
#endif
  return written;
}

int probe_plan(Plan& plan, const ProbeOptions& probe, std::ostream& progress) {
  const fs::path bench = fs::read_symlink("/proc/self/exe").parent_path() / "trainer_bench";
  if (!fs::exists(bench)) {
    throw InputError("lorapipe plan --probe runs its steps with " + bench.string() +
                     ", which is not there (it is built with lorapipe's benches)");
  }
  std::string size = probe.size;
  if (size.empty()) {
    size = plan.model.family == "sd15" ? "full" : plan.model.family == "sdxl" ? "sdxl" : "flux";
  }
  const PlanOptions& o = plan.options;
  // One process per memory option, its settings by size and rising batch.
  std::map<std::string, std::vector<int>> groups;
  for (const auto& [key, index] : shown_rows(plan)) {
    const Candidate& c = plan.rows[index].candidate;
    groups[describe(c)].push_back(index);
  }
  const fs::path dir = fs::temp_directory_path() / ("lorapipe-probe-" + std::to_string(::getpid()));
  fs::create_directories(dir);
  int failed_groups = 0;
  for (auto& [name, rows] : groups) {
    std::sort(rows.begin(), rows.end(), [&](int a, int b) {
      const Candidate &x = plan.rows[a].candidate, &y = plan.rows[b].candidate;
      return std::make_tuple(x.width, x.height, x.batch) < std::make_tuple(y.width, y.height, y.batch);
    });
    const Candidate& c = plan.rows[rows.front()].candidate;
    // Held to what the training's denoiser has beside previews on the card (their share by its
    // float8) and the text encoders the run keeps there (trainer_bench steps the denoiser alone).
    const double limit = std::max(0.0, plan.rows[rows.front()].training_budget - kReserveBytes -
                                           predict(plan.model, c, o).text_encoders);
    std::string settings;
    for (int r : rows) {
      const Candidate& x = plan.rows[r].candidate;
      settings += (settings.empty() ? "" : ",") + std::to_string(x.width) + "x" +
                  std::to_string(x.height) + ":" + std::to_string(x.batch);
    }
    std::vector<std::string> argv = {bench.string(), "solo", size, "--device", probe.device,
                                     "--dtype", o.storage_bytes == 4 ? "fp32" : "bf16",
                                     "--steps", std::to_string(probe.steps), "--settings", settings,
                                     "--memory_limit", std::to_string(std::llround(limit)),
                                     "--network_dim", std::to_string(o.rank),
                                     "--optimizer_type", c.optimizer};
    if (c.checkpointing) argv.push_back("--gradient_checkpointing");
    if (!c.float8.empty()) argv.push_back("--fp8_base");
    if (c.float8 == "fp8_scaled") argv.push_back("--fp8_scaled");
    if (std::find(o.run_flags.begin(), o.run_flags.end(), "--fp8_fast") != o.run_flags.end()) {
      argv.push_back("--fp8_fast");  // its float8 matmuls: the time the run will see
    }
    if (c.blocks_to_swap > 0) {
      argv.push_back("--blocks_to_swap");
      argv.push_back(std::to_string(c.blocks_to_swap));
    }
    progress << "probing " << rows.size() << " setting(s) of " << name << " on " << probe.device
             << " (" << size << ", " << argv[6] << ")\n"
             << std::flush;
    const int code = runtime::wait_exit(runtime::spawn(argv, dir / "out.txt", dir / "err.txt"));
    const std::string out = read_all(dir / "out.txt");
    const std::regex line(R"re(batch (\d+) (\d+)x(\d+)(, checkpointing)?: (.*))re");
    for (auto it = std::sregex_iterator(out.begin(), out.end(), line); it != std::sregex_iterator();
         ++it) {
      const int batch = std::stoi((*it)[1]), width = std::stoi((*it)[2]),
                height = std::stoi((*it)[3]);
      const std::string rest = (*it)[5];
      for (int r : rows) {
        PlanRow& row = plan.rows[r];
        const Candidate& x = row.candidate;
        if (x.batch != batch || x.width != width || x.height != height) continue;
        ProbeResult result;
        // trainer_bench steps the denoiser alone: against its part of the prediction.
        result.predicted_peak = predict(plan.model, x, o).denoiser_peak();
        result.out_of_memory = rest.rfind("out of memory", 0) == 0;
        result.skipped = rest.rfind("skipped", 0) == 0;
        std::smatch m;
        if (std::regex_search(rest, m, std::regex(R"(([0-9.]+) s/it, ([0-9.]+) samples/s, peak allocated ([0-9.]+) MiB)"))) {
          result.s_per_it = std::stod(m[1]);
          result.samples_per_s = std::stod(m[2]);
          result.peak_bytes = std::stod(m[3]) * (1 << 20);
        }
        if (std::regex_search(rest, m, std::regex(R"(MFU ([0-9.]+)%)"))) {
          result.mfu = std::stod(m[1]) / 100;
        }
        row.probe = result;
      }
    }
    if (code != 0) {
      // What it measured before it failed stays; the rest of this group is marked, and the
      // other groups still run.
      std::string err = read_all(dir / "err.txt");
      while (!err.empty() && err.back() == '\n') err.pop_back();
      const std::string last = err.substr(err.rfind('\n') == std::string::npos ? 0 : err.rfind('\n') + 1);
      progress << "lorapipe plan --probe: trainer_bench exited " << code << " on " << name << ": "
               << err.substr(err.size() > 2000 ? err.size() - 2000 : 0) << "\n" << std::flush;
      ++failed_groups;
      for (int r : rows) {
        PlanRow& row = plan.rows[r];
        if (row.probe) continue;
        ProbeResult result;
        result.predicted_peak = predict(plan.model, row.candidate, o).denoiser_peak();
        result.failed = "trainer_bench exited " + std::to_string(code) + ": " + last;
        row.probe = result;
      }
    }
  }
  std::error_code ignored;
  fs::remove_all(dir, ignored);
  return failed_groups;
}

void print_probe(const Plan& plan, std::ostream& out) {
  out << "probe: real steps (peak allocated over the timed steps; predicted: the plan's model of "
         "the same setting)\n"
      << "  res  batch  setting                                  predicted  measured    error"
         "   s/it  samples/s    MFU\n";
  double worst = 0;
  for (const auto& [key, index] : shown_rows(plan)) {
    const PlanRow& row = plan.rows[index];
    if (!row.probe) continue;
    const ProbeResult& p = *row.probe;
    char line[320];
    if (p.out_of_memory || p.skipped || !p.failed.empty()) {
      std::snprintf(line, sizeof line, "%5d  %5d  %-40s %9s  %s\n", key.first, key.second,
                    describe(row.candidate).c_str(), gib(p.predicted_peak).c_str(),
                    !p.failed.empty() ? ("failed: " + p.failed.substr(0, 200)).c_str()
                    : p.out_of_memory ? "out of memory"
                                      : "skipped (a smaller batch ran out)");
    } else {
      const double error = (p.predicted_peak - p.peak_bytes) / p.peak_bytes;
      worst = std::max(worst, std::abs(error));
      std::snprintf(line, sizeof line, "%5d  %5d  %-40s %9s  %8s  %+6.1f%%  %5.2f  %9.2f  %5s\n",
                    key.first, key.second, describe(row.candidate).c_str(),
                    gib(p.predicted_peak).c_str(), gib(p.peak_bytes).c_str(), 100 * error,
                    p.s_per_it, p.samples_per_s,
                    p.mfu >= 0 ? (std::to_string(static_cast<int>(std::lround(p.mfu * 100))) + "%").c_str()
                               : "-");
    }
    out << line;
  }
  char summary[96];
  std::snprintf(summary, sizeof summary, "worst peak error %.1f%%\n", 100 * worst);
  out << summary;
}

std::string apply_plan_budget(Settings& settings) {
  std::vector<std::string> args = {"--vram_budget=" + settings.get("plan_budget")};
  for (const auto& [name, value] : settings.flags) {
    if (name == "plan_budget") continue;
    args.push_back("--" + name + (value == "true" ? "" : "=" + value));
  }
  if (!settings.has("pretrained_model_name_or_path")) {
    throw InputError("--plan_budget needs the model (--pretrained_model_name_or_path or --model)");
  }
  const Plan plan = make_plan(parse_plan_args(args));
  if (plan.recommended < 0) {
    throw InputError("--plan_budget=" + settings.get("plan_budget") +
                     ": no setting of this model is predicted to fit (lorapipe plan shows the "
                     "closest)" +
                     (plan.preview.width > 0
                          ? std::string(" beside previews up to ") +
                                std::to_string(plan.preview.width) + "x" +
                                std::to_string(plan.preview.height) +
                                " on the card: smaller previews, --sample_after_training or "
                                "--sampler_device=another device leave the training more"
                          : std::string()));
  }
  const PlanRow& best = plan.rows[plan.recommended];
  const Candidate& c = best.candidate;
  settings.set("resolution", std::to_string(c.width) + "," + std::to_string(c.height));
  settings.set("train_batch_size", std::to_string(c.batch));
  settings.set("gradient_accumulation_steps", std::to_string(plan.accumulation));
  std::ostringstream lr;
  lr << plan.learning_rate;
  settings.set("learning_rate", lr.str());
  settings.set("optimizer_type", c.optimizer);
  // The plan weighs a bf16 base unless the run names its precision (kohya's default is fp32,
  // which no small card wants): the run trains as planned.
  if (!settings.has("mixed_precision")) settings.set("mixed_precision", "bf16");
  if (c.checkpointing) settings.set("gradient_checkpointing", "true");
  if (!c.float8.empty()) settings.set("fp8_base", "true");
  if (c.float8 == "fp8_scaled") settings.set("fp8_scaled", "true");
  if (c.blocks_to_swap > 0) settings.set("blocks_to_swap", std::to_string(c.blocks_to_swap));
  if (plans_denoiser_alone(plan.model, plan.options)) {
    settings.set("network_train_unet_only", "true");
  }
  std::ostringstream line;
  if (plan.preview.width > 0) {
    line << "lorapipe: --plan_budget: previews up to " << plan.preview.width << "x"
         << plan.preview.height << " render on the training card beside the training, which has "
         << gib(best.training_budget) << " GiB of " << gib(plan.options.budget_bytes)
         << " (--sample_after_training leaves it all)\n";
  }
  line << "lorapipe: --plan_budget " << gib(plan.options.budget_bytes) << " GiB: " << c.width
       << "x" << c.height << ", batch " << c.batch << " x " << plan.accumulation << ", "
       << describe(c) << ", learning rate " << lr.str()
       << (plans_denoiser_alone(plan.model, plan.options)
               ? ", the transformer alone (--network_train_unet_only: a CLIP-L LoRA would keep "
                 "CLIP-L on the card)"
               : "")
       << " (predicted peak " << gib(best.prediction.peak()) << " GiB)";
  return line.str();
}

std::string apply_auto_batch(Settings& settings, const std::vector<std::string>& plan_args) {
  const std::string budget = settings.has("plan_budget") ? settings.get("plan_budget")
                                                         : settings.get("vram_budget");
  if (budget.empty()) {
    throw InputError("--auto_batch sizes each bucket's batch to the card's memory: give it with "
                     "--vram_budget=12GB (or take the plan's whole setting with "
                     "--plan_budget=12GB)");
  }
  if (!settings.has("pretrained_model_name_or_path")) {
    throw InputError("--auto_batch needs the model (--pretrained_model_name_or_path or --model): "
                     "the batches are sized from its weights");
  }
  std::vector<std::string> args = {"--vram_budget=" + budget};
  for (const auto& [name, value] : settings.flags) {
    if (name == "plan_budget" || name == "vram_budget" || name == "auto_batch" ||
        name == "bucket_batch_sizes") {
      continue;
    }
    args.push_back("--" + name + (value == "true" ? "" : "=" + value));
  }
  args.insert(args.end(), plan_args.begin(), plan_args.end());
  const PlanOptions options = parse_plan_args(args);
  if (!options.dataset) {
    throw InputError("--auto_batch sizes the batches of a dataset's buckets: give --data_dir or "
                     "--dataset_config");
  }
  const ModelStructure model = read_structure(options.model, options.family);
  Candidate run = run_candidate(options);
  if (!options.run.has("resolution")) {  // lorapipe plan: the family's, as a run defaults to
    run.width = run.height = native_resolution(model.family);
  }
  const int accumulation =
      parse_ints("--gradient_accumulation_steps", settings.get("gradient_accumulation_steps", "1"))[0];
  const int step = run.batch * accumulation;  // samples per step and rank, as the run asks
  const std::vector<DatasetBucket> buckets = dataset_buckets(options.run, run.width, run.height);
  PreviewShare preview = previews_on_the_card(model, options);
  if (preview.width > 0) {  // the sampler's encoders follow the run's float8
    preview = predict_preview_share(model, preview.width, preview.height, options, run.float8);
  }
  const double training_budget = options.budget_bytes - preview.budget_needed();
  auto fits = [&](const Prediction& p) { return budget_needed(p) <= training_budget; };
  auto predicted = [&](const DatasetBucket& b, int batch) {
    Candidate c = run;
    c.width = b.width, c.height = b.height, c.batch = batch;
    return predict(model, c, options);
  };
  // The epoch as the trainer's scheduler cuts it (trainer/dataset.h): fixed batches of the
  // run's size, or steps of `step` samples in as few even micro-batches as the bucket's size
  // allows. Its predicted time compares the two.
  auto epoch_seconds = [&](const DatasetBucket& b, int size, int samples_per_unit) {
    double seconds = 0;
    for (int64_t start = 0; start < b.count; start += samples_per_unit) {
      const auto n = static_cast<int>(std::min<int64_t>(samples_per_unit, b.count - start));
      const int micro = (n + size - 1) / size;
      for (int k = 0; k < micro; ++k) {
        seconds += predicted(b, n / micro + (k < n % micro ? 1 : 0)).s_per_it;
      }
    }
    return seconds;
  };
  std::ostringstream line, sizes;
  double fixed_s = 0, sized_s = 0;
  int tight = 0;
  line << "lorapipe: --auto_batch for " << gib(options.budget_bytes) << " GiB";
  if (preview.width > 0) {
    line << " (" << gib(training_budget) << " GiB beside previews up to " << preview.width << "x"
         << preview.height << ", predicted " << gib(preview.bytes()) << " GiB)";
  }
  if (plans_denoiser_alone(model, options)) {
    settings.set("network_train_unet_only", "true");
    line << ", the transformer alone (--network_train_unet_only: a CLIP-L LoRA would keep CLIP-L "
            "on the card)";
  }
  line << ": " << step
       << " samples per optimizer step (--train_batch_size " << run.batch
       << " x --gradient_accumulation_steps " << accumulation
       << "), each bucket in the largest batch predicted to fit:";
  for (const DatasetBucket& b : buckets) {
    int batch = 0;
    for (int n = 1; n <= step; ++n) {
      if (!fits(predicted(b, n))) break;  // peaks grow with the batch
      batch = n;
    }
    if (batch == 0) ++tight;
    batch = std::max(batch, 1);
    if (!sizes.str().empty()) sizes << ",";
    sizes << b.width << "x" << b.height << ":" << batch;
    fixed_s += epoch_seconds(b, run.batch, run.batch);
    sized_s += epoch_seconds(b, batch, step);
    // A full step of `step` samples runs in `micro` even micro-batches of at most `batch`.
    const int micro = (step + batch - 1) / batch, even = (step + micro - 1) / micro;
    line << "\n  " << b.width << "x" << b.height << " (" << b.count << " samples): batch up to "
         << batch << ", a step in " << micro << " x " << even << ", predicted peak "
         << gib(predicted(b, batch).peak()) << " GiB"
         << (fits(predicted(b, 1)) ? "" : " -- over the budget even at batch 1");
  }
  settings.set("bucket_batch_sizes", sizes.str());
  line << "\n  the learning rate is unchanged: every step still averages " << step
       << " samples, and an epoch has one step per " << step
       << " samples of a bucket (each bucket's last step holds the rest); predicted epoch "
       << std::fixed << std::setprecision(0) << sized_s << " s against " << fixed_s
       << " s in fixed batches of " << run.batch << std::setprecision(2) << " (x"
       << (sized_s > 0 ? fixed_s / sized_s : 1.0) << ")";
  if (tight > 0) {
    line << "\n  " << tight << " bucket(s) are predicted over the budget even at batch 1: lower "
         << "--max_bucket_reso or add memory options (lorapipe plan shows which fit)";
  }
  return line.str();
}

int plan_command(const std::vector<std::string>& args, std::ostream& out) {
  std::vector<std::string> rest;
  fs::path output = ".";
  bool explain = false;
  bool probing = false;  // --probe: the table's settings as real steps
  ProbeOptions probe;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (starts_with(a, "--output=") || starts_with(a, "--output_dir=")) {
      output = a.substr(a.find('=') + 1);
    } else if (a == "--output" || a == "--output_dir") {
      if (i + 1 >= args.size()) throw InputError(a + " wants a folder");
      output = args[++i];
    } else if (a == "--explain") {
      explain = true;  // one candidate's breakdown as JSON: the run flags say which
    } else if (a == "--probe") {
      probing = true;
    } else if (starts_with(a, "--probe_device=") || starts_with(a, "--probe_size=") ||
               starts_with(a, "--probe_steps=")) {
      const std::string name = a.substr(2, a.find('=') - 2), value = a.substr(a.find('=') + 1);
      if (name == "probe_device") probe.device = value;
      if (name == "probe_size") probe.size = value;
      if (name == "probe_steps") probe.steps = parse_ints("--probe_steps", value)[0];
    } else {
      rest.push_back(a);
    }
  }
  // --auto_batch: the batch each of the dataset's buckets would get in `lorapipe run` with these
  // flags (its other plan flag, --gpu, only times it).
  if (std::find(rest.begin(), rest.end(), "--auto_batch") != rest.end()) {
    std::vector<std::string> run_args, plan_args;
    for (size_t i = 0; i < rest.size(); ++i) {
      if (starts_with(rest[i], "--gpu")) {
        plan_args.push_back(rest[i]);
        if (rest[i].find('=') == std::string::npos && i + 1 < rest.size()) {
          plan_args.push_back(rest[++i]);
        }
      } else {
        run_args.push_back(rest[i]);
      }
    }
    Settings settings = parse_run_args(run_args);
    out << apply_auto_batch(settings, plan_args) << "\n--bucket_batch_sizes="
        << settings.get("bucket_batch_sizes") << "\n";
    return kExitOk;
  }
  PlanOptions options = parse_plan_args(rest);
  if (explain) {
    const ModelStructure model = read_structure(options.model, options.family);
    out << explain_json(model, run_candidate(options), options) << "\n";
    return kExitOk;
  }
  Plan plan = make_plan(options);
  print_plan(plan, out);
  out << "\n";
  int failed_groups = 0;
  if (probing) {
    failed_groups = probe_plan(plan, probe, out);
    print_probe(plan, out);
    out << "\n";
  }
  for (const fs::path& p : write_plan(plan, output)) out << "wrote " << p.string() << "\n";
  if (failed_groups > 0) {
    throw InputError("lorapipe plan --probe: " + std::to_string(failed_groups) +
                     " group(s) of settings failed (above, and `failed` in plan.json); what the "
                     "others measured is written");
  }
  return kExitOk;
}

}  // namespace lorapipe::launcher
