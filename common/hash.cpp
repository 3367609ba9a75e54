#include "common/hash.h"

#define XXH_INLINE_ALL
#include <xxhash.h>

#include <bit>
#include <cstdio>
#include <new>

namespace lorapipe {

std::string Hash128::hex() const {
  char buffer[33];
  std::snprintf(buffer, sizeof(buffer), "%016llx%016llx", static_cast<unsigned long long>(high),
                static_cast<unsigned long long>(low));
  return buffer;
}

Hash128 hash_bytes(std::string_view bytes) {
  const XXH128_hash_t h = XXH3_128bits(bytes.data(), bytes.size());
  return {h.high64, h.low64};
}

Hasher::Hasher() : state_(XXH3_createState()) {
  if (state_ == nullptr) throw std::bad_alloc();
  XXH3_128bits_reset(static_cast<XXH3_state_t*>(state_));
}

Hasher::~Hasher() { XXH3_freeState(static_cast<XXH3_state_t*>(state_)); }

Hasher& Hasher::update(std::string_view bytes) {
  XXH3_128bits_update(static_cast<XXH3_state_t*>(state_), bytes.data(), bytes.size());
  return *this;
}

Hasher& Hasher::field(std::string_view bytes) {
  field(static_cast<int64_t>(bytes.size()));
  return update(bytes);
}

// Integers are hashed in host byte order; keys and manifest names built from them are shared
// between machines, so a big-endian build must swap to little-endian here first.
static_assert(std::endian::native == std::endian::little,
              "cache keys hash integers' host bytes: add a byte swap for big-endian hosts");

Hasher& Hasher::field(int64_t value) {
  return update(std::string_view(reinterpret_cast<const char*>(&value), sizeof(value)));
}

Hash128 Hasher::digest() const {
  const XXH128_hash_t h = XXH3_128bits_digest(static_cast<XXH3_state_t*>(state_));
  return {h.high64, h.low64};
}

}  // namespace lorapipe
