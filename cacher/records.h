#pragma once
// Checks of the records in a cache store: does a stored value parse as the record its table
// holds, and does every tensor carry exactly the bytes its dtype and shape say. The trainer's
// pre-flight runs the record checks on every record of its run before step 0 (through its record
// source, local or remote), so a missing or damaged record is named up front instead of failing
// mid-epoch; lorapipe-cacher --verify runs verify_store and check_manifest over a whole cache.
//
// A check never throws for what it finds: findings are values (a reason, a list).

#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "cacher/store.h"
#include "proto/lorapipe.pb.h"

namespace lorapipe::cacher {

// Empty when `tensor` is well formed: a known dtype (F32 4 bytes, F16 and BF16 2), no negative
// dimension, and data of exactly product(shape) * sizeof(dtype) bytes; else the reason, naming
// the tensor as `name`.
std::string check_tensor(const wire::Tensor& tensor, std::string_view name);

// Empty when `bytes` parse as a LatentRecord that has a mean tensor, every tensor present is
// well formed (check_tensor), and std, flipped_mean and flipped_std (when present) have the
// mean's shape; else the reason.
std::string check_latent_record(std::string_view bytes);

// Empty when `bytes` parse as a TextRecord that has hidden_states and every tensor present is
// well formed; else the reason.
std::string check_text_record(std::string_view bytes);

struct ManifestCheck {
  std::vector<std::string> missing;                          // keys not in the store, once each
  std::vector<std::pair<std::string, std::string>> corrupt;  // (key, reason)
  bool ok() const { return missing.empty() && corrupt.empty(); }
};

// Checks that every entry's latent_key is in `latents` and, when manifest.text_cached(), its
// text_key in `texts`, and that each record found passes its check. Each key is checked once
// however many entries share it. An entry with an empty or over-long key is reported as corrupt
// under "entry N (path)". Reads without copying records, in one read transaction per table.
ManifestCheck check_manifest(const Store& store, const wire::Manifest& manifest);

// Reads and checks every record of `latents`, then of `texts`, in key order: (key, reason) for
// each that fails.
std::vector<std::pair<std::string, std::string>> verify_store(const Store& store);

}  // namespace lorapipe::cacher
