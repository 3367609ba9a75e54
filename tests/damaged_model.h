#pragma once
// A damaged download, for the stages' tests of what they say about one: a copy of a tiny
// diffusers folder with one float of one U-Net weight turned to NaN in the file.

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>

#include "models/safetensors.h"

namespace lorapipe::testing {

// Copies the diffusers folder `from` to `to` and writes a NaN over the first element of the
// U-Net's first fp32 weight whose name starts with `prefix`, in place in the copy's file; returns
// that weight's name (diffusers' key).
inline std::string copy_with_a_nan_weight(const std::filesystem::path& from,
                                          const std::filesystem::path& to,
                                          const std::string& prefix) {
  std::filesystem::copy(from, to, std::filesystem::copy_options::recursive);
  const std::filesystem::path unet = to / "unet" / "diffusion_pytorch_model.safetensors";
  std::string name;
  uint64_t offset = 0;
  {
    const models::SafetensorsFile file = models::SafetensorsFile::open(unet);
    for (const models::TensorInfo& t : file.tensors()) {
      if (t.name.rfind(prefix, 0) == 0 && t.name.ends_with(".weight") &&
          t.dtype == models::Dtype::kF32) {
        name = t.name;
        offset = t.begin;
        break;
      }
    }
  }
  if (name.empty()) throw std::runtime_error("no fp32 weight under '" + prefix + "' in " + unet.string());
  std::fstream f(unet, std::ios::in | std::ios::out | std::ios::binary);
  uint64_t header = 0;  // the header's length: little-endian, as this machine
  f.read(reinterpret_cast<char*>(&header), sizeof header);
  const float nan = std::nanf("");
  f.seekp(static_cast<std::streamoff>(sizeof header + header + offset));
  f.write(reinterpret_cast<const char*>(&nan), sizeof nan);
  if (!f.good()) throw std::runtime_error("cannot write " + unet.string());
  return name;
}

}  // namespace lorapipe::testing
