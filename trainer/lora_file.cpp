#include "trainer/lora_file.h"

#include <torch/torch.h>

#include <vector>

#include "common/sha256.h"
#include "models/safetensors.h"
#include "models/weights.h"

namespace lorapipe::trainer {

WrittenLora write_lora_file(const std::filesystem::path& path,
                            const std::map<std::string, at::Tensor>& tensors,
                            std::map<std::string, std::string> metadata) {
  std::vector<at::Tensor> storage;
  std::vector<models::TensorToWrite> entries;
  Sha256 data_hash;
  storage.reserve(tensors.size());
  for (const auto& [name, tensor] : tensors) {  // std::map: ordered by name
    storage.push_back(tensor.detach().to(torch::kCPU).contiguous());
    const at::Tensor& t = storage.back();
    models::TensorToWrite entry;
    entry.name = name;
    entry.dtype = models::to_safetensors_dtype(t.scalar_type());
    entry.shape.assign(t.sizes().begin(), t.sizes().end());
    entry.bytes = std::string_view(static_cast<const char*>(t.data_ptr()), t.nbytes());
    data_hash.update(entry.bytes);
    entries.push_back(entry);
  }
  WrittenLora written;
  // The web UIs' additional-networks hash: sha256 of everything after the header.
  written.sshs_model_hash = data_hash.hex();
  metadata["sshs_model_hash"] = written.sshs_model_hash;
  models::write_safetensors(path, entries, metadata);
  written.sha256 = sha256_file(path);
  return written;
}

std::map<std::string, at::Tensor> read_tensor_file(const std::filesystem::path& path) {
  const models::SafetensorsFile file = models::SafetensorsFile::open(path);
  return models::read_tensors(file);
}

}  // namespace lorapipe::trainer
