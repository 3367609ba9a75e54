#pragma once
// Deterministic batches that the store tests and their helper processes write and check. Batch n
// holds kRecordsPerBatch records whose keys, sizes and bytes follow from n alone, so a process
// that did not write them can tell a whole batch from a partial or damaged one. Sizes run from
// 1 to 49 KiB, so most values sit on LMDB overflow pages and a commit writes many pages.

#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "cacher/store.h"

namespace lorapipe::cacher::testing {

inline constexpr int kRecordsPerBatch = 8;

inline uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

inline std::string batch_key(uint64_t batch, int index) {
  char key[48];
  std::snprintf(key, sizeof(key), "batch-%08llu-%02d", static_cast<unsigned long long>(batch),
                index);
  return key;
}

inline std::string batch_value(uint64_t batch, int index) {
  uint64_t state = batch * 1000 + static_cast<uint64_t>(index);
  const size_t size = 1024 + splitmix64(state) % (48 * 1024);
  std::string value(size, '\0');
  for (size_t i = 0; i < size; i += 8) {
    const uint64_t word = splitmix64(state);
    for (size_t b = 0; b < 8 && i + b < size; ++b)
      value[i + b] = static_cast<char>(word >> (8 * b));
  }
  return value;
}

inline std::vector<std::pair<std::string, std::string>> make_batch(uint64_t batch) {
  std::vector<std::pair<std::string, std::string>> records;
  for (int i = 0; i < kRecordsPerBatch; ++i)
    records.emplace_back(batch_key(batch, i), batch_value(batch, i));
  return records;
}

struct BatchState {
  int present = 0;  // records of the batch in the store
  int damaged = 0;  // of those, how many hold other bytes than written
};

// Looks at one batch in one read transaction (one snapshot).
inline BatchState check_batch(const Store& store, Table table, uint64_t batch) {
  std::vector<std::string> keys;
  for (int i = 0; i < kRecordsPerBatch; ++i) keys.push_back(batch_key(batch, i));
  BatchState state;
  store.visit_many(table, keys, [&](size_t i, std::optional<std::string_view> value) {
    if (!value) return;
    ++state.present;
    if (*value != batch_value(batch, static_cast<int>(i))) ++state.damaged;
  });
  return state;
}

}  // namespace lorapipe::cacher::testing
