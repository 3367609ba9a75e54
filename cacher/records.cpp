#include "cacher/records.h"

#include <algorithm>
#include <climits>
#include <tuple>
#include <limits>
#include <set>

namespace lorapipe::cacher {

namespace {

std::string shape_text(const wire::Tensor& tensor) {
  std::string text = "[";
  for (int i = 0; i < tensor.shape_size(); ++i) {
    if (i > 0) text += ", ";
    text += std::to_string(tensor.shape(i));
  }
  return text + "]";
}

bool same_shape(const wire::Tensor& a, const wire::Tensor& b) {
  return a.shape_size() == b.shape_size() &&
         std::equal(a.shape().begin(), a.shape().end(), b.shape().begin());
}

// Parses `bytes` as `record`; empty when it parses, else the reason.
std::string parse(std::string_view bytes, google::protobuf::Message& record) {
  const std::string& type = record.GetDescriptor()->name();
  if (bytes.size() > static_cast<size_t>(INT_MAX)) {
    return "not a " + type + ": " + std::to_string(bytes.size()) + " bytes, over protobuf's 2 GiB";
  }
  if (!record.ParseFromArray(bytes.data(), static_cast<int>(bytes.size()))) {
    return "not a " + type + ": " + std::to_string(bytes.size()) + " bytes that do not parse";
  }
  return {};
}

// Checks `tensor`, when present, and that its shape is `reference`'s.
std::string check_companion(bool present, const wire::Tensor& tensor, std::string_view name,
                            const wire::Tensor& reference) {
  if (!present) return {};
  if (std::string reason = check_tensor(tensor, name); !reason.empty()) return reason;
  if (!same_shape(tensor, reference)) {
    return std::string(name) + " has shape " + shape_text(tensor) + ", the mean " +
           shape_text(reference);
  }
  return {};
}

// An entry's key that the store cannot hold, as a reason; empty when the key is usable.
std::string bad_key(const std::string& key, std::string_view kind) {
  if (key.empty()) return "empty " + std::string(kind);
  if (key.size() > kMaxKeyBytes) {
    return std::string(kind) + " \"" + key.substr(0, 48) + "...\" is " +
           std::to_string(key.size()) + " bytes, over LMDB's limit of " +
           std::to_string(kMaxKeyBytes);
  }
  return {};
}

void check_table(const Store& store, Table table, const std::vector<std::string>& keys,
                 std::string (*check)(std::string_view), ManifestCheck& result) {
  store.visit_many(table, keys, [&](size_t i, std::optional<std::string_view> value) {
    if (!value) {
      result.missing.push_back(keys[i]);
    } else if (std::string reason = check(*value); !reason.empty()) {
      result.corrupt.emplace_back(keys[i], std::move(reason));
    }
  });
}

}  // namespace

std::string check_tensor(const wire::Tensor& tensor, std::string_view name) {
  const std::string who(name);
  uint64_t element_bytes = 0;
  const char* dtype = "";
  switch (tensor.dtype()) {
    case wire::Tensor::F32:
      element_bytes = 4, dtype = "F32";
      break;
    case wire::Tensor::F16:
      element_bytes = 2, dtype = "F16";
      break;
    case wire::Tensor::BF16:
      element_bytes = 2, dtype = "BF16";
      break;
    case wire::Tensor::DTYPE_UNSPECIFIED:
      return who + ": dtype unspecified";
    default:
      return who + ": unknown dtype " + std::to_string(static_cast<int>(tensor.dtype()));
  }
  uint64_t elements = 1;
  for (const int64_t dim : tensor.shape()) {
    if (dim < 0) return who + ": negative dimension in shape " + shape_text(tensor);
    const auto d = static_cast<uint64_t>(dim);
    if (d != 0 && elements > std::numeric_limits<uint64_t>::max() / d / element_bytes) {
      return who + ": shape " + shape_text(tensor) + " is too large";
    }
    elements *= d;
  }
  const uint64_t expected = elements * element_bytes;
  if (tensor.data().size() != expected) {
    return who + ": " + std::to_string(tensor.data().size()) + " data bytes, but shape " +
           shape_text(tensor) + " " + dtype + " needs " + std::to_string(expected);
  }
  return {};
}

std::string check_latent_record(std::string_view bytes) {
  wire::LatentRecord record;
  if (std::string reason = parse(bytes, record); !reason.empty()) return reason;
  if (!record.has_mean()) return "LatentRecord has no mean tensor";
  if (std::string reason = check_tensor(record.mean(), "LatentRecord mean"); !reason.empty()) {
    return reason;
  }
  for (const std::string& reason :
       {check_companion(record.has_std(), record.std(), "LatentRecord std", record.mean()),
        check_companion(record.has_flipped_mean(), record.flipped_mean(),
                        "LatentRecord flipped_mean", record.mean()),
        check_companion(record.has_flipped_std(), record.flipped_std(), "LatentRecord flipped_std",
                        record.mean())}) {
    if (!reason.empty()) return reason;
  }
  // The masks are [h, w]: one value per latent cell.
  for (const auto& [present, mask, name] :
       {std::tuple{record.has_mask(), &record.mask(), "LatentRecord mask"},
        std::tuple{record.has_flipped_mask(), &record.flipped_mask(),
                   "LatentRecord flipped_mask"}}) {
    if (!present) continue;
    if (std::string reason = check_tensor(*mask, name); !reason.empty()) return reason;
    const auto& latent = record.mean().shape();
    if (mask->shape_size() != 2 || latent.size() != 3 || mask->shape(0) != latent[1] ||
        mask->shape(1) != latent[2]) {
      return std::string(name) + " has shape " + shape_text(*mask) + ", the mean " +
             shape_text(record.mean());
    }
  }
  return {};
}

std::string check_text_record(std::string_view bytes) {
  wire::TextRecord record;
  if (std::string reason = parse(bytes, record); !reason.empty()) return reason;
  if (!record.has_hidden_states()) return "TextRecord has no hidden_states tensor";
  if (std::string reason = check_tensor(record.hidden_states(), "TextRecord hidden_states");
      !reason.empty()) {
    return reason;
  }
  if (record.has_pooled()) {
    if (std::string reason = check_tensor(record.pooled(), "TextRecord pooled"); !reason.empty()) {
      return reason;
    }
  }
  if (record.has_mask()) return check_tensor(record.mask(), "TextRecord mask");
  return {};
}

ManifestCheck check_manifest(const Store& store, const wire::Manifest& manifest) {
  ManifestCheck result;
  std::vector<std::string> latent_keys;
  std::vector<std::string> text_keys;
  std::set<std::string> seen_latents;
  std::set<std::string> seen_texts;
  for (int i = 0; i < manifest.entries_size(); ++i) {
    const wire::ManifestEntry& entry = manifest.entries(i);
    const std::string where = "entry " + std::to_string(i) + " (" + entry.path() + ")";
    if (std::string reason = bad_key(entry.latent_key(), "latent_key"); !reason.empty()) {
      result.corrupt.emplace_back(where, std::move(reason));
    } else if (seen_latents.insert(entry.latent_key()).second) {
      latent_keys.push_back(entry.latent_key());
    }
    if (!manifest.text_cached()) continue;
    if (std::string reason = bad_key(entry.text_key(), "text_key"); !reason.empty()) {
      result.corrupt.emplace_back(where, std::move(reason) + " in a manifest whose text is cached");
    } else if (seen_texts.insert(entry.text_key()).second) {
      text_keys.push_back(entry.text_key());
    }
  }
  check_table(store, Table::kLatents, latent_keys, &check_latent_record, result);
  check_table(store, Table::kTexts, text_keys, &check_text_record, result);
  return result;
}

std::vector<std::pair<std::string, std::string>> verify_store(const Store& store) {
  std::vector<std::pair<std::string, std::string>> bad;
  const auto verify = [&](Table table, std::string (*check)(std::string_view)) {
    store.for_each(table, [&](std::string_view key, std::string_view value) {
      if (std::string reason = check(value); !reason.empty()) {
        bad.emplace_back(std::string(key), std::move(reason));
      }
      return true;
    });
  };
  verify(Table::kLatents, &check_latent_record);
  verify(Table::kTexts, &check_text_record);
  return bad;
}

}  // namespace lorapipe::cacher
