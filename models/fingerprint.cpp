#include "models/fingerprint.h"

#include <torch/torch.h>

#include <algorithm>

#include "common/hash.h"

namespace lorapipe::models {

std::string weights_fingerprint(const torch::nn::Module& module, const std::string& extra) {
  std::vector<std::pair<std::string, torch::Tensor>> all;
  for (const auto& item : module.named_parameters(true)) all.emplace_back(item.key(), item.value());
  for (const auto& item : module.named_buffers(true)) all.emplace_back(item.key(), item.value());
  std::sort(all.begin(), all.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  Hasher hasher;
  hasher.field("lorapipe-weights").field(extra);
  for (const auto& [name, tensor] : all) {
    const torch::Tensor t = tensor.detach().to(torch::kCPU).contiguous();
    hasher.field(name).field(std::string(c10::toString(t.scalar_type())));
    for (int64_t d : t.sizes()) hasher.field(d);
    hasher.field(std::string_view(static_cast<const char*>(t.data_ptr()), t.nbytes()));
  }
  return hasher.digest().hex();
}

}  // namespace lorapipe::models
