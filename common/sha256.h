#pragma once
// SHA-256 (OpenSSL's), for the hashes kohya and the web UIs write into and compute of model
// files: ss_new_sd_model_hash, sshs_model_hash, a checkpoint's announced sha256.

#include <filesystem>
#include <string>
#include <string_view>

namespace lorapipe {

class Sha256 {
 public:
  Sha256();
  ~Sha256();
  Sha256(const Sha256&) = delete;
  Sha256& operator=(const Sha256&) = delete;
  Sha256& update(std::string_view bytes);
  std::string hex();  // 64 lowercase hex digits; call once

 private:
  void* context_;
};

std::string sha256_hex(std::string_view bytes);
// The whole file, read in 1 MiB pieces; throws Error naming the file when it cannot be read.
std::string sha256_file(const std::filesystem::path& path);

}  // namespace lorapipe
