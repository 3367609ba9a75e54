#include "models/inspect.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <set>
#include <sstream>

#include "common/error.h"
#include "models/family.h"
#include "models/safetensors.h"

namespace lorapipe::models {
namespace fs = std::filesystem;
namespace {

bool starts_with(std::string_view s, std::string_view prefix) {
  return s.substr(0, prefix.size()) == prefix;
}
bool ends_with(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

std::string human_count(double n) {
  char buffer[32];
  if (n >= 1e9) {
    std::snprintf(buffer, sizeof(buffer), "%.2f B", n / 1e9);
  } else if (n >= 1e6) {
    std::snprintf(buffer, sizeof(buffer), "%.1f M", n / 1e6);
  } else if (n >= 1e3) {
    std::snprintf(buffer, sizeof(buffer), "%.1f K", n / 1e3);
  } else {
    std::snprintf(buffer, sizeof(buffer), "%.0f", n);
  }
  return buffer;
}

// IEEE half / bfloat16 to float, for reading LoRA alpha scalars.
float half_to_float(uint16_t h) {
  const uint32_t sign = (h >> 15) & 1;
  const int exponent = (h >> 10) & 0x1f;
  const uint32_t mantissa = h & 0x3ff;
  float value = 0;
  if (exponent == 0) {
    value = std::ldexp(static_cast<float>(mantissa), -24);
  } else if (exponent == 31) {
    value = mantissa ? NAN : INFINITY;
  } else {
    value = std::ldexp(static_cast<float>(mantissa | 0x400), exponent - 25);
  }
  return sign ? -value : value;
}

std::optional<double> read_scalar(const SafetensorsFile& file, const TensorInfo& t) {
  if (t.numel() != 1) return std::nullopt;
  const std::string_view b = file.bytes(t);
  switch (t.dtype) {
    case Dtype::kF32: {
      float v;
      std::memcpy(&v, b.data(), 4);
      return v;
    }
    case Dtype::kF64: {
      double v;
      std::memcpy(&v, b.data(), 8);
      return v;
    }
    case Dtype::kF16: {
      uint16_t v;
      std::memcpy(&v, b.data(), 2);
      return half_to_float(v);
    }
    case Dtype::kBF16: {
      uint16_t v;
      std::memcpy(&v, b.data(), 2);
      const uint32_t bits = uint32_t{v} << 16;
      float f;
      std::memcpy(&f, &bits, 4);
      return f;
    }
    default:
      return std::nullopt;
  }
}

// Which part of a model a key belongs to, by layout.
std::string component_of(const std::string& key) {
  static const std::pair<std::string_view, std::string_view> kPrefixes[] = {
      {"model.diffusion_model.", "unet"},
      {"first_stage_model.", "vae"},
      {"cond_stage_model.", "text_encoder"},
      {"conditioner.embedders.0.", "text_encoder"},
      {"conditioner.embedders.1.", "text_encoder_2"},
      {"lora_unet_", "unet"},
      {"lora_te1_", "text_encoder"},
      {"lora_te2_", "text_encoder_2"},
      {"lora_te_", "text_encoder"},
      {"text_model.", "text_encoder"},
      {"text_encoders.clip_l.", "text_encoder"},  // ComfyUI's all-in-one FLUX.1 file
      {"text_encoders.t5xxl.", "text_encoder_2"},
      {"vae.", "vae"},
      {"encoder.block.", "text_encoder"},  // T5 (transformers' names)
      {"encoder.final_layer_norm.", "text_encoder"},
      {"shared.", "text_encoder"},
      {"decoder.block.", "other"},  // a whole T5's decoder, which no stage reads
      {"decoder.final_layer_norm.", "other"},
      {"encoder.", "vae"},
      {"decoder.", "vae"},
      {"quant_conv.", "vae"},
      {"post_quant_conv.", "vae"},
      {"double_blocks.", "transformer"},
      {"single_blocks.", "transformer"},
  };
  for (const auto& [prefix, component] : kPrefixes) {
    if (starts_with(key, prefix)) return std::string(component);
  }
  if (starts_with(key, "down_blocks.") || starts_with(key, "up_blocks.") ||
      starts_with(key, "mid_block.") || starts_with(key, "time_embedding.") ||
      starts_with(key, "conv_in.") || starts_with(key, "conv_out.") ||
      starts_with(key, "conv_norm_out.")) {
    return "unet";
  }
  return "other";
}

// "family: sdxl (Stable Diffusion XL), told by ...": what the stages would load `path` as.
std::string family_line(const fs::path& path) {
  try {
    const FamilyDetection family = detect_family(path);
    return "family: " + family.family + " (" + model_family(family.family).display_name +
           "), told by " + family.reason + "\n";
  } catch (const InputError&) {
    return "family: none lorapipe loads\n";
  }
}

std::string guess_kind(const SafetensorsFile& file) {
  bool kohya_lora = false, peft_lora = false, comfy_lora = false, ldm_unet = false, sdxl = false, flux = false;
  bool flux_guidance = false, diffusers_unet = false, diffusers_vae = false, clip_text = false;
  bool t5 = false;
  int64_t context_dim = 0;
  for (const TensorInfo& t : file.tensors()) {
    const std::string& k = t.name;
    kohya_lora |= starts_with(k, "lora_unet_") || starts_with(k, "lora_te");
    peft_lora |= k.find(".lora_A.") != std::string::npos || k.find(".lora.down.") != std::string::npos;
    comfy_lora |= (starts_with(k, "diffusion_model.") || starts_with(k, "text_encoders.")) &&
                  (ends_with(k, ".lora_down.weight") || ends_with(k, ".lora_A.weight"));
    ldm_unet |= starts_with(k, "model.diffusion_model.");
    sdxl |= starts_with(k, "conditioner.embedders.");
    // Flux.1's transformer with or without the original checkpoint's prefix; dev has the
    // guidance embedding schnell lacks.
    flux |= starts_with(k, "double_blocks.") ||
            starts_with(k, "model.diffusion_model.double_blocks.");
    flux_guidance |= k.find("guidance_in.in_layer.") != std::string::npos;
    t5 |= starts_with(k, "encoder.block.") && k.find(".SelfAttention.") != std::string::npos;
    diffusers_unet |= starts_with(k, "down_blocks.") && k.find("attentions") != std::string::npos;
    diffusers_vae |= starts_with(k, "encoder.down_blocks.");
    clip_text |= starts_with(k, "text_model.encoder.layers.");
    if (ends_with(k, "transformer_blocks.0.attn2.to_k.weight") && t.shape.size() == 2 &&
        context_dim == 0) {
      context_dim = t.shape[1];
    }
  }
  if (comfy_lora) return "LoRA (ComfyUI names)";
  if (kohya_lora) return "LoRA (kohya names)";
  if (peft_lora) return "LoRA (diffusers/PEFT names)";
  if (flux) {
    return flux_guidance ? "Flux.1 [dev] transformer (original layout)"
                         : "Flux.1 [schnell] transformer (original layout)";
  }
  if (sdxl) return "SDXL checkpoint (single-file original layout)";
  if (ldm_unet) {
    if (context_dim == 1024) return "SD2.x checkpoint (single-file original layout)";
    return "SD1.x checkpoint (single-file original layout)";
  }
  if (diffusers_unet) return "UNet (diffusers layout)";
  if (diffusers_vae) return "AutoencoderKL (diffusers layout)";
  if (clip_text) return "CLIP text model (transformers layout)";
  if (t5) return "T5 encoder (transformers layout)";
  return "unknown model (no family recognised from its keys)";
}

std::string describe_file(const fs::path& path) {
  const SafetensorsFile file = SafetensorsFile::open(path);
  std::ostringstream out;
  std::error_code ec;
  out << "file: " << path.string() << " (" << fs::file_size(path, ec) << " bytes)\n";
  out << "kind: " << guess_kind(file) << "\n";
  // The family the stages would load it as (models/family.h), for checkpoints.
  if (guess_kind(file).find("LoRA") == std::string::npos) {
    out << family_line(path);
    // What the file declares of its objective (ComfyUI's markers): the flags the stages will
    // ask for.
    ModelFamily declared;
    try {
      read_declared_objective(path, declared);
    } catch (const InputError& e) {
      out << "prediction: " << e.what() << "\n";
    }
    if (!declared.declared_by.empty()) {
      const bool zsnr = declared.declares_zero_terminal_snr;
      out << "prediction: v-prediction" << (zsnr ? ", zero terminal SNR" : "") << " ("
          << declared.declared_by << "): train with --v_parameterization"
          << (zsnr ? " --zero_terminal_snr" : "") << "\n";
    }
    // A FLUX.1 transformer's file holds its other parts (ComfyUI's all-in-one) or not (kohya's).
    if (guess_kind(file).starts_with("Flux.1")) {
      bool clip = false, t5 = false, ae = false;
      for (const TensorInfo& t : file.tensors()) {
        clip = clip || starts_with(t.name, "text_encoders.clip_l.transformer.");
        t5 = t5 || starts_with(t.name, "text_encoders.t5xxl.transformer.");
        ae = ae || starts_with(t.name, "vae.");
      }
      std::string missing;
      for (const auto& [has, flag] : {std::pair{clip, "--clip_l"}, {t5, "--t5xxl"}, {ae, "--ae"}}) {
        if (!has) missing += std::string(missing.empty() ? "" : " ") + flag;
      }
      out << "parts: " << (missing.empty() ? "CLIP-L, T5 and the AE are in the file (ComfyUI's "
                                             "all-in-one); give --t5_tokenizer"
                                           : "give " + missing + " and --t5_tokenizer")
          << "\n";
    }
  }
  double parameters = 0;
  std::map<std::string, int> dtypes;
  std::map<std::string, double> components;
  for (const TensorInfo& t : file.tensors()) {
    parameters += static_cast<double>(t.numel());
    ++dtypes[std::string(dtype_name(t.dtype))];
    components[component_of(t.name)] += static_cast<double>(t.numel());
  }
  out << "tensors: " << file.tensors().size() << ", parameters: " << human_count(parameters)
      << "\n";
  out << "dtypes:";
  for (const auto& [name, count] : dtypes) out << " " << name << " x" << count;
  out << "\ncomponents:";
  for (const auto& [name, count] : components) out << " " << name << " " << human_count(count);
  out << "\n";

  // LoRA rank and alpha: kohya stores lora_down [rank, in] and a scalar `.alpha` per module.
  std::set<int64_t> ranks;
  std::set<double> alphas;
  int modules = 0;
  for (const TensorInfo& t : file.tensors()) {
    if ((ends_with(t.name, ".lora_down.weight") || ends_with(t.name, ".lora_A.weight")) &&
        !t.shape.empty()) {
      ranks.insert(t.shape[0]);
      ++modules;
    }
    if (ends_with(t.name, ".alpha")) {
      if (auto v = read_scalar(file, t)) alphas.insert(*v);
    }
  }
  if (modules > 0) {
    out << "lora: " << modules << " modules, rank";
    for (int64_t r : ranks) out << " " << r;
    if (!alphas.empty()) {
      out << ", alpha";
      for (double a : alphas) out << " " << a;
    }
    out << "\n";
  }
  for (const auto& [key, value] : file.metadata()) {
    std::string shown = value.size() > 200 ? value.substr(0, 200) + "..." : value;
    std::replace(shown.begin(), shown.end(), '\n', ' ');
    out << "metadata: " << key << " = " << shown << "\n";
  }
  return out.str();
}

void refuse_pickle(const fs::path& path) {
  static const std::set<std::string> kPickle{".ckpt", ".pt", ".pth", ".bin", ".pkl"};
  std::string ext = path.extension().string();
  std::transform(ext.begin(), ext.end(), ext.begin(), ::tolower);
  if (kPickle.count(ext)) {
    throw InputError(path.string() + ": a pickle checkpoint (" + ext +
                     "); lorapipe never loads pickles, which can run code: convert it to "
                     ".safetensors first");
  }
}

}  // namespace

std::string inspect_checkpoint(const fs::path& path) {
  std::error_code ec;
  if (!fs::exists(path, ec)) throw InputError(path.string() + ": no such file or folder");
  if (!fs::is_directory(path, ec)) {
    refuse_pickle(path);
    return describe_file(path);
  }
  // A diffusers folder: one safetensors file per component folder.
  std::ostringstream out;
  out << "folder: " << path.string()
      << (fs::exists(path / "model_index.json") ? " (diffusers pipeline)\n" : "\n");
  out << family_line(path);
  std::vector<fs::path> files;
  for (const auto& entry : fs::recursive_directory_iterator(path, ec)) {
    if (!entry.is_regular_file()) continue;
    const std::string ext = entry.path().extension().string();
    if (ext == ".safetensors") files.push_back(entry.path());
  }
  std::sort(files.begin(), files.end());
  if (files.empty()) {
    for (const auto& entry : fs::recursive_directory_iterator(path, ec)) {
      if (entry.is_regular_file()) refuse_pickle(entry.path());
    }
    throw InputError(path.string() + ": no .safetensors file in this folder");
  }
  for (const fs::path& file : files) out << "\n" << describe_file(file);
  return out.str();
}

}  // namespace lorapipe::models
