#pragma once
// Looking after a cache: inspect, verify, garbage-collect, and move one dataset between
// machines as one file. Used by `lorapipe-cacher --inspect|--verify|--gc|--export_file|
// --import_file`.

#include <cstdint>
#include <filesystem>
#include <ostream>
#include <string>

namespace lorapipe::cacher {

struct ToolOptions {
  std::filesystem::path cache_dir;  // empty: default_cache_dir()
  uint64_t max_map_bytes = uint64_t{1} << 40;
};

// Record counts and bytes per table, fingerprints seen, manifests (human text or JSON).
std::string inspect_text(const ToolOptions& options);
std::string inspect_json(const ToolOptions& options);

// Reads and checks every record; prints each corrupt one with its key and reason. True when
// none is corrupt.
bool verify(const ToolOptions& options, std::ostream& out);

// Drops latent and text records that no manifest references.
void gc(const ToolOptions& options, std::ostream& out);

// Drops each manifest that a later caching of the same dataset replaced: one named by default
// (no --dataset_id) whose folder, model and settings a later manifest shares, its images or
// captions since edited (every edit names a new manifest, and the old one would keep its
// records from gc for ever). Manifests without a recorded caching time are kept. Prints each
// one dropped and the one that replaced it. A run still to resume on a dropped manifest is
// refused by its trainer, naming the dataset; a training still running on one loses its records
// under it (trainers read without a lock): run it when no training of the older data runs.
void drop_superseded(const ToolOptions& options, std::ostream& out);

// Writes dataset `dataset_id`'s manifest and every record it references to `file` (temp name,
// then renamed), for import_dataset on another machine.
void export_dataset(const ToolOptions& options, const std::string& dataset_id,
                    const std::filesystem::path& file, std::ostream& out);
// Checks a file written by export_dataset (format, checksum, every record) and adds its
// records and manifest to the cache in one transaction per table.
void import_dataset(const ToolOptions& options, const std::filesystem::path& file,
                    std::ostream& out);

}  // namespace lorapipe::cacher
