#pragma once
// Per-parameter state of the optimizers that keep their own (Prodigy, Lion, Adafactor), in one
// LibTorch archive per save: parameter `index` of group `group` keeps each tensor under
// "g<group>_<index>_<name>". For .cpp files that already include LibTorch.

#include <torch/serialize.h>

#include <filesystem>
#include <functional>
#include <string>

namespace lorapipe::trainer {

std::string state_key(size_t group, size_t index, const std::string& name);

// The tensor under `key`, on `param`'s device; with `same_shape`, it must have param's shape.
// Throws c10::Error (load_state_archive turns it into an InputError naming the file).
at::Tensor read_state(torch::serialize::InputArchive& archive, const std::string& key,
                      const at::Tensor& param, bool same_shape);

// Opens `file` and hands it to `read`; any failure, in the file or in `read`, becomes an
// InputError naming the file and `optimizer`.
void load_state_archive(const std::filesystem::path& file, const std::string& optimizer,
                        const std::function<void(torch::serialize::InputArchive&)>& read);

}  // namespace lorapipe::trainer
