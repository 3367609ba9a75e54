#pragma once
// Writing LoRA files as kohya sd-scripts writes them, so ComfyUI, A1111/Forge and diffusers load
// them as written: safetensors, tensors ordered by name (the order the Python safetensors writer
// gives same-dtype tensors), kohya's ss_* metadata, and the hash the web UIs index files by.

#include <ATen/core/Tensor.h>

#include <filesystem>
#include <map>
#include <string>

namespace lorapipe::trainer {

struct WrittenLora {
  std::string sha256;           // of the whole file as written
  std::string sshs_model_hash;  // of its data section (kohya precalculate_safetensors_hashes)
};

// Writes `tensors` (CPU or not; written in their dtype) with `metadata` plus sshs_model_hash to a
// temporary name beside `path`, then renames it over `path`: a crash leaves the old file or none,
// never half of one. Throws Error naming the file.
WrittenLora write_lora_file(const std::filesystem::path& path,
                            const std::map<std::string, at::Tensor>& tensors,
                            std::map<std::string, std::string> metadata);

// Every tensor of a safetensors file, as CPU tensors in the file's dtype; InputError naming the
// file when it is not a sound safetensors file.
std::map<std::string, at::Tensor> read_tensor_file(const std::filesystem::path& path);

}  // namespace lorapipe::trainer
