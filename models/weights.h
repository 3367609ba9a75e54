#pragma once
// Moving weights between safetensors files and LibTorch modules.
//
// Modules register parameters under the names the reference implementation uses (diffusers /
// transformers), so a diffusers-layout file maps by name; other layouts (the original ldm
// single file) rename keys through an explicit table before calling in here.

#include <torch/types.h>

#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "models/safetensors.h"

namespace torch::nn {
class Module;
}

namespace lorapipe::models {

// A CPU tensor holding a copy of `info`'s bytes (never a view of the mapping), in the file's
// dtype. Throws InputError for dtypes LibTorch cannot hold.
torch::Tensor read_tensor(const SafetensorsFile& file, const TensorInfo& info);

// Every tensor of the file whose name starts with `prefix`, keyed by the name without it.
std::map<std::string, torch::Tensor> read_tensors(const SafetensorsFile& file,
                                                  const std::string& prefix = "");

// Copies `tensors` into `module`'s parameters and buffers by name, converting to each
// parameter's dtype and device. Every parameter must be found with the right shape, and every
// tensor must be used, except names in `optional` (found or not, they are fine). Otherwise
// throws InputError naming `source`, listing missing, unexpected and mis-shaped keys (the first
// few of each, and how many in all).
void load_into(torch::nn::Module& module, const std::map<std::string, torch::Tensor>& tensors,
               const std::string& source, const std::set<std::string>& optional = {});

// The same, straight from `file`, one tensor at a time: each is copied out of the mapping into
// its parameter, converted to its dtype on the way (no temporary copy), and its pages handed back
// (SafetensorsFile::release), so loading adds about one tensor's pages to the resident memory
// rather than the file twice over.
void load_into(torch::nn::Module& module, const SafetensorsFile& file, const std::string& source,
               const std::set<std::string>& optional = {});

// The same, for a file that names its tensors otherwise (the original ldm single file):
// `names` maps each name the module knows to the file's tensor, and `adapt`, when given, turns a
// tensor as read into the shape the module wants. Still one tensor resident at a time.
using AdaptTensor = std::function<torch::Tensor(const TensorInfo&, torch::Tensor)>;
void load_into(torch::nn::Module& module, const SafetensorsFile& file,
               const std::map<std::string, const TensorInfo*>& names, const std::string& source,
               const AdaptTensor& adapt = nullptr, const std::set<std::string>& optional = {});

// The general form: `names` are the tensors the source has, under the module's names; `fetch`
// gives one (called once for each parameter or buffer it has, which it may assemble from several
// of the source's tensors), `done` is told when it has been copied in (to release its pages).
void load_into(torch::nn::Module& module, const std::set<std::string>& names,
               const std::function<torch::Tensor(const std::string&)>& fetch,
               const std::function<void(const std::string&)>& done, const std::string& source,
               const std::set<std::string>& optional = {});

// The module's parameters and buffers as safetensors entries (for writing checkpoints and LoRA
// files), floating-point ones converted to `dtype` when given. `storage` keeps the CPU copies
// alive while the entries are used.
std::vector<TensorToWrite> module_tensors(const torch::nn::Module& module,
                                          std::vector<torch::Tensor>& storage,
                                          const std::string& prefix = "",
                                          std::optional<torch::ScalarType> dtype = std::nullopt);

// A component folder's weights as diffusers and transformers save them: `stem`.safetensors, or
// the shards its `stem`.safetensors.index.json names (FLUX.1's transformer and T5). Throws
// InputError naming the folder when it holds neither.
std::vector<SafetensorsFile> open_weight_files(const std::filesystem::path& folder,
                                               const std::string& stem);

// The safetensors Dtype of a LibTorch scalar type; throws Error for ones the format lacks.
Dtype to_safetensors_dtype(torch::ScalarType type);

}  // namespace lorapipe::models
