#pragma once
// Writing LoRA files as kohya sd-scripts writes them, so ComfyUI, A1111/Forge and diffusers load
// them as written: safetensors, tensors ordered by name (the order the Python safetensors writer
// gives same-dtype tensors), kohya's ss_* metadata, and the hash the web UIs index files by.

#include <ATen/core/Tensor.h>

#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "models/safetensors.h"

namespace lorapipe::trainer {

struct WrittenLora {
  std::string sha256;           // of the whole file as written
  std::string sshs_model_hash;  // of its data section (kohya precalculate_safetensors_hashes)
  std::string sshs_legacy_hash;  // kohya's addnet_hash_legacy of the same tensors and ss_* keys
};

// kohya's sshs_model_hash and sshs_legacy_hash (train_util.precalculate_safetensors_hashes) of
// what safetensors.torch.save would write for `tensors` with the ss_* keys of `metadata` alone:
// the sha256 of its data section (addnet_hash_safetensors), and the first 8 hex digits of the
// sha256 of the 64 KiB at 1 MiB into it (addnet_hash_legacy; e3b0c442, the hash of no bytes, for
// a file under 1 MiB, as kohya's).
struct KohyaHashes {
  std::string model_hash;
  std::string legacy_hash;
};
KohyaHashes kohya_hashes(const std::vector<models::TensorToWrite>& tensors,
                         const std::map<std::string, std::string>& metadata);

// Writes `tensors` (CPU or not; written in their dtype) with `metadata` plus kohya's
// sshs_model_hash and sshs_legacy_hash to a
// temporary name beside `path`, then renames it over `path`: a crash leaves the old file or none,
// never half of one. Throws Error naming the file.
WrittenLora write_lora_file(const std::filesystem::path& path,
                            const std::map<std::string, at::Tensor>& tensors,
                            std::map<std::string, std::string> metadata);

// Every tensor of a safetensors file, as CPU tensors in the file's dtype; InputError naming the
// file when it is not a sound safetensors file.
std::map<std::string, at::Tensor> read_tensor_file(const std::filesystem::path& path);

}  // namespace lorapipe::trainer
