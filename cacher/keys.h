#pragma once
// Cache keys (DESIGN.md, "Cache keys"): content-addressed, so an edited image or caption, or
// other weights, can never be served a stale record, and the same image in two datasets is
// cached once.
//   latent: <image content hash>.<transform hash>.<VAE fingerprint>.v<format>
//           (preprocess sends the first two parts: ImageSample.image_key)
//   text:   <caption hash>.<text encoder fingerprint>.v<format>
// Fingerprints hash the weights actually loaded (models/fingerprint.h) with the settings that
// change the output (dtype, clip skip, max length, tokenizer).

#include <cstdint>
#include <string>
#include <string_view>

#include "common/hash.h"

namespace lorapipe::cacher {

// Bumped when LatentRecord/TextRecord contents change meaning.
inline constexpr uint32_t kRecordFormatVersion = 1;

inline std::string latent_key(std::string_view image_key, std::string_view vae_fingerprint) {
  return std::string(image_key) + "." + std::string(vae_fingerprint) + ".v" +
         std::to_string(kRecordFormatVersion);
}

inline std::string text_key(std::string_view caption, std::string_view text_fingerprint) {
  return hash_bytes(caption).hex() + "." + std::string(text_fingerprint) + ".v" +
         std::to_string(kRecordFormatVersion);
}

}  // namespace lorapipe::cacher
