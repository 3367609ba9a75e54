#pragma once
// A damaged download, for the stages' tests of what they say about one: a copy of a tiny
// diffusers folder with one float of one weight changed in the file (turned to NaN, or another
// value).

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>

#include "models/safetensors.h"

namespace lorapipe::testing {

// Copies the diffusers folder `from` to `to` and writes `value` over the first element of the
// first fp32 weight whose name starts with `prefix` in the copy's `part` (its folder: "unet",
// "vae", ...), in place in its file; returns that weight's name (diffusers' key).
inline std::string copy_with_a_weight_changed(const std::filesystem::path& from,
                                              const std::filesystem::path& to,
                                              const std::string& part, const std::string& prefix,
                                              float value) {
  std::filesystem::copy(from, to, std::filesystem::copy_options::recursive);
  const std::filesystem::path file = to / part / "diffusion_pytorch_model.safetensors";
  std::string name;
  uint64_t offset = 0;
  {
    const models::SafetensorsFile weights = models::SafetensorsFile::open(file);
    for (const models::TensorInfo& t : weights.tensors()) {
      if (t.name.rfind(prefix, 0) == 0 && t.name.ends_with(".weight") &&
          t.dtype == models::Dtype::kF32) {
        name = t.name;
        offset = t.begin;
        break;
      }
    }
  }
  if (name.empty()) throw std::runtime_error("no fp32 weight under '" + prefix + "' in " + file.string());
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  uint64_t header = 0;  // the header's length: little-endian, as this machine
  f.read(reinterpret_cast<char*>(&header), sizeof header);
  f.seekp(static_cast<std::streamoff>(sizeof header + header + offset));
  f.write(reinterpret_cast<const char*>(&value), sizeof value);
  if (!f.good()) throw std::runtime_error("cannot write " + file.string());
  return name;
}

// A damaged download: a NaN over the first element of the U-Net's first fp32 weight whose name
// starts with `prefix` (copy_with_a_weight_changed).
inline std::string copy_with_a_nan_weight(const std::filesystem::path& from,
                                          const std::filesystem::path& to,
                                          const std::string& prefix) {
  return copy_with_a_weight_changed(from, to, "unet", prefix, std::nanf(""));
}

}  // namespace lorapipe::testing
