#include "models/weights.h"

#include <torch/torch.h>

#include <functional>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "common/error.h"
#include "models/loading.h"
#include "models/mapped_weights.h"

namespace lorapipe::models {
namespace {

torch::ScalarType to_scalar_type(Dtype dtype, const std::string& name) {
  switch (dtype) {
    case Dtype::kF64: return torch::kFloat64;
    case Dtype::kF32: return torch::kFloat32;
    case Dtype::kF16: return torch::kFloat16;
    case Dtype::kBF16: return torch::kBFloat16;
    case Dtype::kF8E4M3: return torch::kFloat8_e4m3fn;
    case Dtype::kF8E5M2: return torch::kFloat8_e5m2;
    case Dtype::kI64: return torch::kInt64;
    case Dtype::kI32: return torch::kInt32;
    case Dtype::kI16: return torch::kInt16;
    case Dtype::kI8: return torch::kInt8;
    case Dtype::kU8: return torch::kUInt8;
    case Dtype::kBool: return torch::kBool;
  }
  throw InputError("tensor '" + name + "' has a dtype LibTorch cannot hold");
}

std::string list_some(const std::vector<std::string>& names) {
  std::ostringstream out;
  for (size_t i = 0; i < names.size() && i < 8; ++i) out << (i ? ", " : "") << names[i];
  if (names.size() > 8) out << ", ... (" << names.size() << " in all)";
  return out.str();
}

}  // namespace

Dtype to_safetensors_dtype(torch::ScalarType type) {
  switch (type) {
    case torch::kFloat64: return Dtype::kF64;
    case torch::kFloat32: return Dtype::kF32;
    case torch::kFloat16: return Dtype::kF16;
    case torch::kBFloat16: return Dtype::kBF16;
    case torch::kFloat8_e4m3fn: return Dtype::kF8E4M3;
    case torch::kFloat8_e5m2: return Dtype::kF8E5M2;
    case torch::kInt64: return Dtype::kI64;
    case torch::kInt32: return Dtype::kI32;
    case torch::kInt16: return Dtype::kI16;
    case torch::kInt8: return Dtype::kI8;
    case torch::kUInt8: return Dtype::kU8;
    case torch::kBool: return Dtype::kBool;
    default: throw Error(std::string("no safetensors dtype for ") + c10::toString(type));
  }
}

torch::Tensor read_tensor(const SafetensorsFile& file, const TensorInfo& info) {
  const torch::ScalarType type = to_scalar_type(info.dtype, info.name);
  const std::string_view bytes = file.bytes(info);
  torch::Tensor out = torch::empty(info.shape, torch::TensorOptions().dtype(type));
  if (!bytes.empty()) std::memcpy(out.data_ptr(), bytes.data(), bytes.size());
  return out;
}

namespace {

// A view of `info`'s bytes in the mapping, not a copy: valid only while `file` is, and used here
// only for the copy into a parameter, which converts the dtype on the way (no temporary in the
// file's dtype, none in the parameter's).
torch::Tensor view_tensor(const SafetensorsFile& file, const TensorInfo& info) {
  const torch::ScalarType type = to_scalar_type(info.dtype, info.name);
  const std::string_view bytes = file.bytes(info);
  if (bytes.empty()) return torch::empty(info.shape, torch::TensorOptions().dtype(type));
  return torch::from_blob(const_cast<char*>(bytes.data()), info.shape,
                          torch::TensorOptions().dtype(type));
}

}  // namespace

std::map<std::string, torch::Tensor> read_tensors(const SafetensorsFile& file,
                                                  const std::string& prefix) {
  std::map<std::string, torch::Tensor> out;
  for (const TensorInfo& info : file.tensors()) {
    if (info.name.compare(0, prefix.size(), prefix) != 0) continue;
    out[info.name.substr(prefix.size())] = read_tensor(file, info);
  }
  return out;
}

namespace {

// A parameter's own tensor in place of the copy, or undefined (models/mapped_weights.h).
using ShareTensor = std::function<torch::Tensor(const torch::Tensor& fetched,
                                                const torch::Tensor& target)>;

// The general load_into, with `share` (from a file's loader under a MappedWeights) offering the
// file's pages themselves for each tensor that needs no conversion.
void load_into_sharing(torch::nn::Module& module, const std::set<std::string>& names,
                       const std::function<torch::Tensor(const std::string&)>& fetch,
                       const std::function<void(const std::string&)>& done,
                       const std::string& source, const std::set<std::string>& optional,
                       const ShareTensor& share) {
  std::vector<std::string> missing;
  std::vector<std::string> misshaped;
  std::set<std::string> used;
  torch::NoGradGuard no_grad;
  auto assign = [&](const std::string& name, torch::Tensor& target) {
    if (!names.count(name)) {
      if (!optional.count(name)) missing.push_back(name);
      return;
    }
    used.insert(name);
    const torch::Tensor tensor = fetch(name);
    if (tensor.sizes() != target.sizes()) {
      std::ostringstream why;
      why << name << " " << tensor.sizes() << " (model wants " << target.sizes() << ")";
      misshaped.push_back(why.str());
      return;
    }
    // copy_ would convert integers silently: a weight stored as int32 is a broken file.
    if (target.is_floating_point() && !tensor.is_floating_point()) {
      misshaped.push_back(name + " " + std::string(c10::toString(tensor.scalar_type())) +
                          " (model wants a floating-point tensor)");
      return;
    }
    if (share) {
      const torch::Tensor mapped = share(tensor, target);
      if (mapped.defined()) {
        target.set_data(mapped);  // its pages are the parameter's now: not released
        return;
      }
    }
    target.copy_(tensor);  // converts to the parameter's dtype as it copies
    done(name);
  };
  for (auto& item : module.named_parameters(/*recurse=*/true)) assign(item.key(), item.value());
  for (auto& item : module.named_buffers(/*recurse=*/true)) assign(item.key(), item.value());
  std::vector<std::string> unexpected;
  for (const std::string& name : names) {
    if (!used.count(name) && !optional.count(name)) unexpected.push_back(name);
  }
  if (missing.empty() && unexpected.empty() && misshaped.empty()) return;
  std::ostringstream why;
  why << source << ": weights do not fit the model:";
  if (!missing.empty()) why << " missing " << list_some(missing) << ";";
  if (!unexpected.empty()) why << " unexpected " << list_some(unexpected) << ";";
  if (!misshaped.empty()) why << " wrong shape or dtype " << list_some(misshaped) << ";";
  throw InputError(why.str());
}

ShareTensor share_from(const SafetensorsFile& file) {
  MappedWeights* mapped = MappedWeights::current();
  if (mapped == nullptr) return nullptr;
  return [mapped, &file](const torch::Tensor& fetched, const torch::Tensor& target) {
    return mapped->share(file, fetched, target);
  };
}

}  // namespace

void load_into(torch::nn::Module& module, const std::set<std::string>& names,
               const std::function<torch::Tensor(const std::string&)>& fetch,
               const std::function<void(const std::string&)>& done, const std::string& source,
               const std::set<std::string>& optional) {
  load_into_sharing(module, names, fetch, done, source, optional, nullptr);
}

void load_into(torch::nn::Module& module, const std::map<std::string, torch::Tensor>& tensors,
               const std::string& source, const std::set<std::string>& optional) {
  std::set<std::string> names;
  for (const auto& item : tensors) names.insert(item.first);
  load_into(
      module, names, [&](const std::string& name) { return tensors.at(name); },
      [](const std::string&) {}, source, optional);
}

void load_into(torch::nn::Module& module, const SafetensorsFile& file, const std::string& source,
               const std::set<std::string>& optional) {
  std::set<std::string> names;
  for (const TensorInfo& info : file.tensors()) names.insert(info.name);
  load_into_sharing(
      module, names, [&](const std::string& name) { return view_tensor(file, *file.find(name)); },
      [&](const std::string& name) { file.release(*file.find(name)); }, source, optional,
      share_from(file));
}

void load_into(torch::nn::Module& module, const SafetensorsFile& file,
               const std::map<std::string, const TensorInfo*>& names, const std::string& source,
               const AdaptTensor& adapt, const std::set<std::string>& optional) {
  std::set<std::string> keys;
  for (const auto& item : names) keys.insert(item.first);
  load_into_sharing(
      module, keys,
      [&](const std::string& name) {
        const TensorInfo& info = *names.at(name);
        torch::Tensor tensor = view_tensor(file, info);
        return adapt ? adapt(info, std::move(tensor)) : tensor;
      },
      [&](const std::string& name) { file.release(*names.at(name)); }, source, optional,
      share_from(file));
}

std::vector<TensorToWrite> module_tensors(const torch::nn::Module& module,
                                          std::vector<torch::Tensor>& storage,
                                          const std::string& prefix,
                                          std::optional<torch::ScalarType> dtype) {
  std::vector<TensorToWrite> out;
  std::vector<std::pair<std::string, torch::Tensor>> all;
  for (const auto& item : module.named_parameters(true)) all.emplace_back(item.key(), item.value());
  for (const auto& item : module.named_buffers(true)) all.emplace_back(item.key(), item.value());
  storage.reserve(storage.size() + all.size());
  for (const auto& [name, tensor] : all) {
    torch::Tensor copy = tensor.detach().to(torch::kCPU);
    if (dtype && copy.is_floating_point()) copy = copy.to(*dtype);
    storage.push_back(copy.contiguous());
    const torch::Tensor& t = storage.back();
    out.push_back({prefix + name, to_safetensors_dtype(t.scalar_type()),
                   std::vector<int64_t>(t.sizes().begin(), t.sizes().end()),
                   std::string_view(static_cast<const char*>(t.data_ptr()), t.nbytes())});
  }
  return out;
}

std::vector<SafetensorsFile> open_weight_files(const std::filesystem::path& folder,
                                               const std::string& stem) {
  std::vector<SafetensorsFile> files;
  const std::filesystem::path single = folder / (stem + ".safetensors");
  const std::filesystem::path index = folder / (stem + ".safetensors.index.json");
  if (std::filesystem::exists(single)) {
    files.push_back(SafetensorsFile::open(single));
    return files;
  }
  if (!std::filesystem::exists(index)) {
    throw InputError(folder.string() + ": no " + single.filename().string() + " and no " +
                     index.filename().string());
  }
  std::set<std::string> shards;
  try {
    const nlohmann::json j = nlohmann::json::parse(read_text(index));
    for (const auto& [key, shard] : j.at("weight_map").items()) shards.insert(shard.get<std::string>());
  } catch (const nlohmann::json::exception& e) {
    throw InputError(index.string() + ": " + e.what());
  }
  for (const std::string& shard : shards) files.push_back(SafetensorsFile::open(folder / shard));
  return files;
}

}  // namespace lorapipe::models
