#include "common/sha256.h"

#include <openssl/evp.h>

#include <cstdio>
#include <vector>

#include "common/error.h"

namespace lorapipe {

Sha256::Sha256() : context_(EVP_MD_CTX_new()) {
  if (context_ == nullptr ||
      EVP_DigestInit_ex(static_cast<EVP_MD_CTX*>(context_), EVP_sha256(), nullptr) != 1) {
    throw Error("sha256: OpenSSL could not start a digest");
  }
}

Sha256::~Sha256() { EVP_MD_CTX_free(static_cast<EVP_MD_CTX*>(context_)); }

Sha256& Sha256::update(std::string_view bytes) {
  EVP_DigestUpdate(static_cast<EVP_MD_CTX*>(context_), bytes.data(), bytes.size());
  return *this;
}

std::string Sha256::hex() {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int size = 0;
  EVP_DigestFinal_ex(static_cast<EVP_MD_CTX*>(context_), digest, &size);
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  for (unsigned int i = 0; i < size; ++i) {
    out.push_back(kHex[digest[i] >> 4]);
    out.push_back(kHex[digest[i] & 15]);
  }
  return out;
}

std::string sha256_hex(std::string_view bytes) { return Sha256().update(bytes).hex(); }

std::string sha256_file(const std::filesystem::path& path) {
  std::FILE* in = std::fopen(path.c_str(), "rb");
  if (in == nullptr) throw Error("cannot read " + path.string() + " to hash it");
  Sha256 hash;
  std::vector<char> buffer(1 << 20);
  size_t n = 0;
  while ((n = std::fread(buffer.data(), 1, buffer.size(), in)) > 0) {
    hash.update(std::string_view(buffer.data(), n));
  }
  const bool failed = std::ferror(in) != 0;
  std::fclose(in);
  if (failed) throw Error("cannot read " + path.string() + " to hash it");
  return hash.hex();
}

}  // namespace lorapipe
