#include "trainer/lora_file.h"

#include <torch/torch.h>

#include <algorithm>
#include <nlohmann/json.hpp>
#include <vector>

#include "common/sha256.h"
#include "models/safetensors.h"
#include "models/weights.h"

namespace lorapipe::trainer {
namespace {

// The Python safetensors writer's order of dtypes (its Dtype enum, declaration order; it writes
// tensors by dtype, largest first, then by name).
int safetensors_dtype_rank(models::Dtype d) {
  switch (d) {
    case models::Dtype::kBool: return 0;
    case models::Dtype::kU8: return 1;
    case models::Dtype::kI8: return 2;
    case models::Dtype::kF8E5M2: return 3;
    case models::Dtype::kF8E4M3: return 4;
    case models::Dtype::kI16: return 5;
    case models::Dtype::kF16: return 7;
    case models::Dtype::kBF16: return 8;
    case models::Dtype::kI32: return 9;
    case models::Dtype::kF32: return 11;
    case models::Dtype::kF64: return 12;
    case models::Dtype::kI64: return 13;
  }
  return 0;
}

}  // namespace

KohyaHashes kohya_hashes(const std::vector<models::TensorToWrite>& tensors,
                         const std::map<std::string, std::string>& metadata) {
  // What safetensors.torch.save(tensors, ss_metadata) writes: the 8-byte length, the JSON header
  // (the ss_* metadata, then each tensor in the writer's order; padded with spaces to 8 bytes),
  // the data in the same order. nlohmann's dump escapes as serde_json does (", \, control
  // characters; UTF-8 as is), so the header has the same length whatever order the metadata's
  // keys take.
  std::vector<const models::TensorToWrite*> order;
  for (const auto& t : tensors) order.push_back(&t);
  std::stable_sort(order.begin(), order.end(), [](const auto* a, const auto* b) {
    const int ra = safetensors_dtype_rank(a->dtype), rb = safetensors_dtype_rank(b->dtype);
    return ra != rb ? ra > rb : a->name < b->name;
  });
  std::map<std::string, std::string> ss;
  for (const auto& [key, value] : metadata) {
    if (key.rfind("ss_", 0) == 0) ss[key] = value;
  }
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!ss.empty()) header["__metadata__"] = ss;
  uint64_t offset = 0;
  for (const auto* t : order) {
    header[t->name] = {{"dtype", models::dtype_name(t->dtype)},
                       {"shape", t->shape},
                       {"data_offsets", {offset, offset + t->bytes.size()}}};
    offset += t->bytes.size();
  }
  std::string json = header.dump();
  json.append((8 - json.size() % 8) % 8, ' ');
  std::string prefix(8, '\0');
  for (int i = 0; i < 8; ++i) prefix[i] = static_cast<char>(json.size() >> (8 * i));
  prefix += json;
  // addnet_hash_legacy: sha256 of the 64 KiB at 1 MiB (what there is of them), 8 hex digits.
  constexpr uint64_t kBegin = 0x100000, kEnd = kBegin + 0x10000;
  Sha256 legacy, data;
  uint64_t at = 0;
  auto window = [&](std::string_view part) {
    const uint64_t begin = std::max(at, kBegin), end = std::min(at + part.size(), kEnd);
    if (begin < end) legacy.update(part.substr(begin - at, end - begin));
    at += part.size();
  };
  window(prefix);
  for (const auto* t : order) {
    window(t->bytes);
    data.update(t->bytes);  // addnet_hash_safetensors: everything after the header
  }
  return {data.hex(), legacy.hex().substr(0, 8)};
}

WrittenLora write_lora_file(const std::filesystem::path& path,
                            const std::map<std::string, at::Tensor>& tensors,
                            std::map<std::string, std::string> metadata) {
  std::vector<at::Tensor> storage;
  std::vector<models::TensorToWrite> entries;
  storage.reserve(tensors.size());
  for (const auto& [name, tensor] : tensors) {  // std::map: ordered by name
    storage.push_back(tensor.detach().to(torch::kCPU).contiguous());
    const at::Tensor& t = storage.back();
    models::TensorToWrite entry;
    entry.name = name;
    entry.dtype = models::to_safetensors_dtype(t.scalar_type());
    entry.shape.assign(t.sizes().begin(), t.sizes().end());
    entry.bytes = std::string_view(static_cast<const char*>(t.data_ptr()), t.nbytes());
    entries.push_back(entry);
  }
  WrittenLora written;
  // The web UIs' additional-networks hashes, as kohya's precalculate_safetensors_hashes computes
  // them over the file the safetensors package would write (its tensor order: by dtype, then by
  // name; the same as this file's when every tensor has one dtype).
  const KohyaHashes hashes = kohya_hashes(entries, metadata);
  written.sshs_model_hash = hashes.model_hash;
  written.sshs_legacy_hash = hashes.legacy_hash;
  metadata["sshs_model_hash"] = written.sshs_model_hash;
  metadata["sshs_legacy_hash"] = written.sshs_legacy_hash;
  models::write_safetensors(path, entries, metadata);
  written.sha256 = sha256_file(path);
  return written;
}

std::map<std::string, at::Tensor> read_tensor_file(const std::filesystem::path& path) {
  const models::SafetensorsFile file = models::SafetensorsFile::open(path);
  return models::read_tensors(file);
}

}  // namespace lorapipe::trainer
