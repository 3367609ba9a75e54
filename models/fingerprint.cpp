#include "models/fingerprint.h"

#include <torch/torch.h>

#include <algorithm>
#include <fstream>
#include <iterator>

#include "common/hash.h"

namespace lorapipe::models {

namespace {

std::string fingerprint_of(const torch::nn::Module& module, const std::string& extra,
                           const std::vector<std::string>& prefixes) {
  auto wanted = [&](const std::string& name) {
    if (prefixes.empty()) return true;
    for (const std::string& p : prefixes) {
      if (name.starts_with(p)) return true;
    }
    return false;
  };
  std::vector<std::pair<std::string, torch::Tensor>> all;
  for (const auto& item : module.named_parameters(true)) {
    if (wanted(item.key())) all.emplace_back(item.key(), item.value());
  }
  for (const auto& item : module.named_buffers(true)) {
    if (wanted(item.key())) all.emplace_back(item.key(), item.value());
  }
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

}  // namespace

std::string weights_fingerprint(const torch::nn::Module& module, const std::string& extra) {
  return fingerprint_of(module, extra, {});
}

std::string vae_encoder_fingerprint(const torch::nn::Module& vae) {
  // What AutoencoderKL::encode runs (models/vae.h): the encoder and the quant conv.
  return fingerprint_of(vae, "vae-encoder", {"encoder.", "quant_conv."});
}

std::string tokenizer_fingerprint(std::string_view file_name, std::string_view bytes) {
  Hasher hasher;
  hasher.field(file_name).field(bytes);
  return hasher.digest().hex();
}

std::string tokenizer_fingerprint(const std::filesystem::path& path) {
  namespace fs = std::filesystem;
  Hasher hasher;
  auto add = [&](const fs::path& file) {
    std::ifstream in(file, std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    hasher.field(file.filename().string()).field(bytes);
  };
  if (fs::is_directory(path)) {
    for (const char* name : {"vocab.json", "merges.txt"}) {
      if (fs::exists(path / name)) add(path / name);
    }
  } else if (!path.empty()) {
    add(path);
  }
  return hasher.digest().hex();
}

std::string text_encoder_settings(int clip_skip, const std::string& tokenizer_fingerprint,
                                  int max_token_length) {
  // One chunk keeps the string it always had, so caches made before the option stay valid.
  const std::string length = max_token_length == 75
                                 ? "max_length=77"
                                 : "max_token_length=" + std::to_string(max_token_length);
  return "clip_skip=" + std::to_string(clip_skip) + ";" + length + ";tokenizer=" +
         tokenizer_fingerprint;
}

}  // namespace lorapipe::models
