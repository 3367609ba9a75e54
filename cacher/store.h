#pragma once
// The LMDB cache store: one environment in a folder, written by exactly one process (the cacher)
// and read by any number of trainers and samplers in other processes at the same time.
//
// Layout: named databases ("tables") `latents`, `texts`, `manifests` and `meta` in one LMDB
// environment (data.mdb, lock.mdb) plus `writer.lock`, an flock held for the writer's lifetime.
//
// Guarantees
// - Every put/erase is one LMDB write transaction: all of its records are committed or none
//   (a crash, kill -9, full disk or full map mid-write leaves the store as it was before).
// - Every read call runs in a fresh read transaction, so a reader sees everything committed
//   before the call, including records written after it opened the store, and one call sees
//   one consistent snapshot.
// - The map grows by itself: on MDB_MAP_FULL the transaction is aborted, the map doubled and
//   the whole batch retried, up to StoreOptions::max_map_bytes. Readers follow a map grown by
//   the writer (MDB_MAP_RESIZED) on their own.
//
// Thread safety: a Store may be used from many threads at once (MDB_NOTLS; read calls run in
// parallel, writes are serialized). LMDB allows one environment per database file per process,
// so a process opens a folder once and shares that Store; a second open of the same folder in
// one process is refused.

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace lorapipe::cacher {

enum class Table { kLatents, kTexts, kManifests, kMeta };

// The LMDB database name of `table` ("latents", "texts", "manifests", "meta").
std::string_view table_name(Table table);

// Keys of the meta table, written by every writer when it opens the store.
inline constexpr std::string_view kMetaStoreFormat = "store_format_version";    // layout, "1"
inline constexpr std::string_view kMetaRecordFormat = "record_format_version";  // records
inline constexpr std::string_view kMetaWrittenBy = "written_by";                // "lorapipe 0.1.0"
inline constexpr std::string_view kMetaHost = "host";                           // the writer's host
// Followed by a manifest's dataset id (one named by default): {"series", "unix_ms"}, when the
// cacher wrote it and what it caches but for its contents (cacher.cpp, manifest_series).
inline constexpr std::string_view kMetaManifestWritten = "manifest_written/";

// Version of the store's layout (tables and meta keys). A store of another layout is refused.
inline constexpr uint32_t kStoreFormatVersion = 1;

// LMDB's compiled-in maximum key size (mdb_env_get_maxkeysize of Debian's liblmdb).
inline constexpr size_t kMaxKeyBytes = 511;

struct StoreOptions {
  std::filesystem::path dir;
  // Readers never write and take no writer lock; the folder must hold a store already.
  bool read_only = false;
  // Writer only: how long to wait for another process's writer lock before failing (0: fail at
  // once). Two runs started at once on one cache take turns instead of failing.
  double wait_for_writer_s = 0;
  // Writer only. The map starts at this size (or what the data already needs) and doubles on
  // MDB_MAP_FULL up to max_map_bytes. The map is address space, not disk: the file grows with
  // the data.
  uint64_t initial_map_bytes = uint64_t{64} << 20;
  uint64_t max_map_bytes = uint64_t{1} << 40;
};

class Store {
 public:
  // Opens the store in `options.dir`. A writer creates the folder, its tables and meta, and takes
  // the writer lock; throws Error when another process holds it. A reader throws InputError
  // naming the folder when it does not exist or holds no lorapipe store.
  static Store open(const StoreOptions& options);

  Store(Store&&) noexcept;
  Store& operator=(Store&&) noexcept;
  Store(const Store&) = delete;
  Store& operator=(const Store&) = delete;
  ~Store();  // a moved-from Store may only be destroyed or assigned to

  // Writes all `records` (key, value) in one transaction: all are committed or none. Existing
  // keys are overwritten; an empty batch does nothing. Grows the map on MDB_MAP_FULL and retries
  // the batch. Throws Error when the map has reached max_map_bytes ("cache at DIR is full: map
  // size limit N bytes reached") or the disk is full, in both cases with the store unchanged;
  // InputError for an empty key or one over kMaxKeyBytes (keys are any bytes, ordered
  // bytewise; lorapipe's are ASCII); Error for a read-only store.
  void put(Table table, const std::vector<std::pair<std::string, std::string>>& records);

  // Removes `keys` in one transaction (all or none); keys that are not there are no error.
  // Returns how many were removed.
  size_t erase(Table table, const std::vector<std::string>& keys);

  // Reads. Every call is one read transaction. Keys are checked as for put (InputError).
  std::optional<std::string> get(Table table, std::string_view key) const;
  // One value per key, in the order of `keys`; nullopt where the key is not stored.
  std::vector<std::optional<std::string>> get_many(Table table,
                                                   const std::vector<std::string>& keys) const;
  std::vector<bool> contains_many(Table table, const std::vector<std::string>& keys) const;
  // As get_many without copying: calls visit(i, value of keys[i] or nullopt) for each key in
  // order. The view points into the map and is valid only during that call.
  void visit_many(
      Table table, const std::vector<std::string>& keys,
      const std::function<void(size_t index, std::optional<std::string_view> value)>& visit) const;

  // Visits every entry in key order (bytewise) inside one read transaction; the visitor returns
  // false to stop. Views are valid only during the call; the visitor must not write to this
  // Store (a write that grows the map would wait for this read to end).
  void for_each(
      Table table,
      const std::function<bool(std::string_view key, std::string_view value)>& visit) const;

  struct TableStats {
    uint64_t entries = 0;
    uint64_t bytes = 0;  // keys + values
  };
  // Counts in one read transaction; `bytes` walks the table's keys (values are not read).
  TableStats stats(Table table) const;

  const std::filesystem::path& dir() const;
  bool read_only() const;
  // The current map size of this process's view of the environment.
  uint64_t map_bytes() const;

 private:
  struct Impl;
  explicit Store(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// The default cache folder shared by all runs of a user: $LORAPIPE_CACHE_DIR, else
// $XDG_CACHE_HOME/lorapipe/cache (when absolute, as the XDG spec asks), else
// ~/.cache/lorapipe/cache. Throws Error when none of them can be found.
std::filesystem::path default_cache_dir();

}  // namespace lorapipe::cacher
