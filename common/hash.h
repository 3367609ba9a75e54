#pragma once
// Content hashes for cache keys: XXH3-128, rendered as 32 lowercase hex digits. Fast enough to
// hash every image byte on every run (tens of GB/s), and 128 bits make an accidental collision
// between two images negligible.

#include <cstdint>
#include <string>
#include <string_view>

namespace lorapipe {

struct Hash128 {
  uint64_t high = 0;
  uint64_t low = 0;
  std::string hex() const;  // 32 hex digits
  bool operator==(const Hash128&) const = default;
};

Hash128 hash_bytes(std::string_view bytes);

// Hashes a sequence of pieces as one stream.
class Hasher {
 public:
  Hasher();
  ~Hasher();
  Hasher(const Hasher&) = delete;
  Hasher& operator=(const Hasher&) = delete;

  Hasher& update(std::string_view bytes);
  // Length-prefixed, so ("ab","c") and ("a","bc") hash differently.
  Hasher& field(std::string_view bytes);
  Hasher& field(int64_t value);
  Hash128 digest() const;

 private:
  void* state_;
};

}  // namespace lorapipe
