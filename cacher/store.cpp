#include "cacher/store.h"

#include <fcntl.h>
#include <lmdb.h>
#include <pwd.h>
#include <sys/file.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <set>
#include <shared_mutex>
#include <thread>

#include "cacher/keys.h"
#include "common/error.h"
#include "common/log.h"

#ifndef LORAPIPE_VERSION
#define LORAPIPE_VERSION "unknown"
#endif

namespace lorapipe::cacher {
namespace fs = std::filesystem;

namespace {

constexpr std::string_view kLog = "store";
constexpr std::array<Table, 4> kTables = {Table::kLatents, Table::kTexts, Table::kManifests,
                                          Table::kMeta};
// Room for tables a later layout adds, so older readers still open the environment.
constexpr MDB_dbi kMaxTables = 16;
// Concurrent read transactions over all processes (trainer loader threads, samplers, serve
// threads). A slot is 64 bytes of lock.mdb; the first process to create lock.mdb sets it.
constexpr unsigned kMaxReaders = 1024;
// A reader whose map another process grew adopts the new size and retries; more than a few
// rounds in a row means something else is wrong.
constexpr int kMaxResizeRetries = 16;

constexpr const char* kWriterLockFile = "writer.lock";
constexpr uint64_t kMiB = uint64_t{1} << 20;

size_t table_index(Table table) {
  const auto i = static_cast<size_t>(table);
  if (i >= kTables.size()) throw Error("unknown cache table " + std::to_string(i));
  return i;
}

MDB_val as_val(std::string_view bytes) {
  return MDB_val{bytes.size(), const_cast<char*>(bytes.data())};
}

std::string_view as_view(const MDB_val& val) {
  return {static_cast<const char*>(val.mv_data), val.mv_size};
}

uint64_t page_bytes() { return static_cast<uint64_t>(sysconf(_SC_PAGESIZE)); }

std::string host_name() {
  char name[256] = {};
  if (gethostname(name, sizeof(name) - 1) != 0) return "unknown";
  return name;
}

// Processes keep one environment per folder (LMDB: "do not have an LMDB database open twice in
// the same process at the same time"; closing the second would drop the first one's fcntl
// locks on lock.mdb). Folders are told apart by device and inode.
using FolderId = std::pair<dev_t, ino_t>;

std::mutex& open_folders_mutex() {
  static std::mutex mutex;
  return mutex;
}

std::set<FolderId>& open_folders() {
  static std::set<FolderId> folders;
  return folders;
}

// Aborts a transaction it still owns when the scope ends (an exception, an early return).
class TxnGuard {
 public:
  explicit TxnGuard(MDB_txn* txn) : txn_(txn) {}
  TxnGuard(const TxnGuard&) = delete;
  TxnGuard& operator=(const TxnGuard&) = delete;
  ~TxnGuard() {
    if (txn_ != nullptr) mdb_txn_abort(txn_);
  }
  MDB_txn* get() const { return txn_; }
  MDB_txn* release() { return std::exchange(txn_, nullptr); }

 private:
  MDB_txn* txn_;
};

class CursorGuard {
 public:
  CursorGuard(MDB_txn* txn, MDB_dbi dbi, int* rc) { *rc = mdb_cursor_open(txn, dbi, &cursor_); }
  CursorGuard(const CursorGuard&) = delete;
  CursorGuard& operator=(const CursorGuard&) = delete;
  ~CursorGuard() {
    if (cursor_ != nullptr) mdb_cursor_close(cursor_);
  }
  MDB_cursor* get() const { return cursor_; }

 private:
  MDB_cursor* cursor_ = nullptr;
};

// A shared/exclusive lock that lets an exclusive locker in ahead of new shared ones. glibc's
// rwlock (under std::shared_mutex) prefers readers, so threads reading in a loop would hold off
// a map resize indefinitely; here a waiting resize closes the gate to new readers.
class MapLock {
 public:
  std::shared_lock<std::shared_mutex> shared() {
    std::lock_guard gate(gate_);
    return std::shared_lock(mutex_);
  }
  std::unique_lock<std::shared_mutex> exclusive() {
    std::lock_guard gate(gate_);
    return std::unique_lock(mutex_);
  }

 private:
  std::mutex gate_;
  std::shared_mutex mutex_;
};

}  // namespace

std::string_view table_name(Table table) {
  static constexpr std::array<std::string_view, 4> kNames = {"latents", "texts", "manifests",
                                                             "meta"};
  return kNames[table_index(table)];
}

struct Store::Impl {
  fs::path dir;
  bool read_only = false;
  double wait_for_writer_s = 0;
  uint64_t max_map_bytes = 0;
  size_t max_key_bytes = kMaxKeyBytes;
  MDB_env* env = nullptr;
  std::array<MDB_dbi, 4> dbis{};
  int lock_fd = -1;  // writer.lock, flock'ed for the writer's lifetime
  std::optional<FolderId> folder;

  // Writes are serialized in this process before they reach LMDB's own writer lock.
  std::mutex write_mutex;
  // Held shared by every open transaction and exclusively around mdb_env_set_mapsize, which
  // LMDB allows only while this process has no transaction open.
  mutable MapLock map_lock;

  Impl() = default;
  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;

  ~Impl() {
    if (env != nullptr) mdb_env_close(env);
    if (lock_fd >= 0) ::close(lock_fd);  // releases the writer lock, after the env is closed
    if (folder) {
      std::lock_guard lock(open_folders_mutex());
      open_folders().erase(*folder);
    }
  }

  std::string where() const { return "cache at " + dir.string(); }

  [[noreturn]] void fail(std::string_view action, int rc) const {
    throw Error(where() + ": " + std::string(action) + ": " + mdb_strerror(rc));
  }

  MDB_dbi dbi(Table table) const { return dbis[table_index(table)]; }

  void check_key(Table table, std::string_view key) const {
    if (key.empty()) {
      throw InputError(where() + ": empty key for table " + std::string(table_name(table)));
    }
    if (key.size() > max_key_bytes) {
      throw InputError(where() + ": key \"" + std::string(key.substr(0, 48)) + "...\" for table " +
                       std::string(table_name(table)) + " is " + std::to_string(key.size()) +
                       " bytes, over LMDB's limit of " + std::to_string(max_key_bytes));
    }
  }

  uint64_t current_map_bytes() const {
    MDB_envinfo info;
    mdb_env_info(env, &info);
    return info.me_mapsize;
  }

  // Takes the map size another process grew to (the one in the newest meta page). Called after
  // MDB_MAP_RESIZED with no transaction of this thread open.
  void adopt_map_size() const {
    auto lock = map_lock.exclusive();
    const int rc = mdb_env_set_mapsize(env, 0);
    if (rc != 0) fail("adopting the map size grown by the writer", rc);
  }

  // Doubles the map, up to max_map_bytes. Called after MDB_MAP_FULL, the transaction aborted.
  void grow_map(std::string_view action) {
    auto lock = map_lock.exclusive();
    const uint64_t current = current_map_bytes();
    if (current >= max_map_bytes) {
      throw Error(where() + " is full: map size limit " + std::to_string(max_map_bytes) +
                  " bytes reached while " + std::string(action) +
                  "; nothing of this batch was stored (raise max_map_bytes or use another cache "
                  "folder)");
    }
    const uint64_t next = current > max_map_bytes / 2 ? max_map_bytes : current * 2;
    const int rc = mdb_env_set_mapsize(env, next);
    if (rc != 0) fail("growing the map to " + std::to_string(next) + " bytes", rc);
    LP_LOG(kDebug, kLog) << where() << ": map grown from " << current << " to "
                         << current_map_bytes() << " bytes";
  }

  // A failed commit or put, with what a full disk or a file size limit looks like from here:
  // LMDB reports a short write as EIO, so the cause is read from the file system and the limit.
  [[noreturn]] void fail_write(std::string_view action, int rc, uint64_t batch_bytes) const {
    std::string cause = mdb_strerror(rc);
    if (rc == ENOSPC || rc == EDQUOT || rc == EFBIG || rc == EIO) {
      std::error_code ec;
      const uint64_t file_bytes = fs::file_size(dir / "data.mdb", ec);
      rlimit limit{};
      struct statvfs vfs {};
      const bool have_vfs = statvfs(dir.c_str(), &vfs) == 0;
      const uint64_t free_bytes = have_vfs ? static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize : 0;
      if (rc == EFBIG || (getrlimit(RLIMIT_FSIZE, &limit) == 0 && limit.rlim_cur != RLIM_INFINITY &&
                          !ec && file_bytes + batch_bytes >= limit.rlim_cur)) {
        cause = "data.mdb reached this process's file size limit (RLIMIT_FSIZE, ulimit -f) of " +
                std::to_string(limit.rlim_cur) + " bytes (" + cause + ")";
      } else if (rc == ENOSPC || rc == EDQUOT || (have_vfs && free_bytes < batch_bytes + kMiB)) {
        cause = "the disk is full, " + std::to_string(free_bytes) +
                " bytes free on its file system (" + cause + ")";
      } else if (have_vfs) {
        cause += " (" + std::to_string(free_bytes) + " bytes free on its file system)";
      }
    }
    throw Error(where() + ": " + std::string(action) + " failed: " + cause +
                "; nothing of this batch was stored");
  }

  // Runs `body` in a fresh read transaction. `body(txn)` may throw; the transaction is aborted
  // either way (a reader keeps no snapshot between calls, so it sees every later commit).
  template <typename Body>
  void read(std::string_view action, Body&& body) const {
    for (int attempt = 0;; ++attempt) {
      auto lock = map_lock.shared();
      MDB_txn* txn = nullptr;
      const int rc = mdb_txn_begin(env, nullptr, MDB_RDONLY, &txn);
      if (rc == MDB_MAP_RESIZED && attempt < kMaxResizeRetries) {
        lock.unlock();
        adopt_map_size();
        continue;
      }
      if (rc != 0) fail(action, rc);
      TxnGuard guard(txn);
      body(txn);
      return;
    }
  }

  // Runs `body(txn)` (returning an LMDB code) in one write transaction and commits it. On
  // MDB_MAP_FULL, from a put or from the commit, the transaction is aborted, the map doubled
  // and the whole batch run again: `body` must be safe to run again from the start.
  template <typename Body>
  void write(std::string_view action, uint64_t batch_bytes, Body&& body) {
    if (read_only) {
      throw Error(where() + " is open read-only: " + std::string(action) + " is not allowed");
    }
    std::lock_guard writer(write_mutex);
    for (int resized = 0;;) {
      int rc = 0;
      {
        auto lock = map_lock.shared();
        MDB_txn* txn = nullptr;
        rc = mdb_txn_begin(env, nullptr, 0, &txn);
        if (rc == 0) {
          TxnGuard guard(txn);
          rc = body(txn);
          // A failed commit frees the transaction itself.
          if (rc == 0) rc = mdb_txn_commit(guard.release());
        }
      }
      if (rc == 0) return;
      if (rc == MDB_MAP_FULL) {
        grow_map(action);  // throws at the limit, so this loop ends
      } else if (rc == MDB_MAP_RESIZED && ++resized < kMaxResizeRetries) {
        adopt_map_size();
      } else {
        fail_write(action, rc, batch_bytes);
      }
    }
  }

  // Who holds the writer lock, as its holder wrote it there.
  static std::string lock_holder(int fd) {
    char holder[128] = {};
    const ssize_t n = pread(fd, holder, sizeof(holder) - 1, 0);
    std::string who = n > 0 ? std::string(holder, static_cast<size_t>(n)) : "another process";
    while (!who.empty() && (who.back() == '\n' || who.back() == '\0')) who.pop_back();
    return who;
  }

  void take_writer_lock() {
    const fs::path path = dir / kWriterLockFile;
    const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0) {
      throw InputError(where() + ": cannot create the writer lock " + path.string() + ": " +
                       std::strerror(errno));
    }
    const auto deadline = std::chrono::steady_clock::now() +
                          std::chrono::duration<double>(std::max(0.0, wait_for_writer_s));
    bool said = false;
    while (flock(fd, LOCK_EX | LOCK_NB) != 0 && errno == EWOULDBLOCK &&
           std::chrono::steady_clock::now() < deadline) {
      if (!said) {
        LP_LOG(kWarning, kLog) << where() << " has a writer (" << lock_holder(fd)
                               << "); waiting for it to finish (up to " << wait_for_writer_s
                               << " s)";
        said = true;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
    if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
      const int err = errno;
      const std::string who = lock_holder(fd);
      ::close(fd);
      if (err == EWOULDBLOCK) {
        throw Error(where() + " already has a writer (" + who + " holds " + path.string() +
                    "); only one cacher may write to a cache folder at a time");
      }
      throw Error(where() + ": cannot lock " + path.string() + ": " + std::strerror(err));
    }
    // Says who holds it, for the message a second writer gets.
    const std::string holder = "pid " + std::to_string(getpid()) + " on " + host_name() + "\n";
    if (ftruncate(fd, 0) != 0 || pwrite(fd, holder.data(), holder.size(), 0) < 0) {
      LP_LOG(kWarning, kLog) << where() << ": could not record the writer in " << path.string()
                             << ": " << std::strerror(errno);
    }
    lock_fd = fd;
  }

  void register_folder() {
    struct stat st {};
    if (::stat(dir.c_str(), &st) != 0) {
      throw InputError(where() + ": cannot stat the folder: " + std::strerror(errno));
    }
    const FolderId id{st.st_dev, st.st_ino};
    std::lock_guard lock(open_folders_mutex());
    if (!open_folders().insert(id).second) {
      throw Error(where() +
                  " is already open in this process; LMDB allows one environment per "
                  "folder and process, so share that Store");
    }
    folder = id;
  }

  // Refuses a store of another layout.
  void check_store_format(std::optional<std::string_view> found) const {
    const std::string ours = std::to_string(kStoreFormatVersion);
    if (!found) {
      throw InputError(where() + " is not a lorapipe cache: meta has no " +
                       std::string(kMetaStoreFormat));
    }
    if (*found != ours) {
      throw InputError(where() + " has store format " + std::string(*found) +
                       "; this lorapipe reads format " + ours + ": use another cache folder");
    }
  }

  void open_reader_tables() {
    auto lock = map_lock.shared();
    MDB_txn* txn = nullptr;
    int rc = mdb_txn_begin(env, nullptr, MDB_RDONLY, &txn);
    if (rc != 0) fail("starting a read transaction", rc);
    TxnGuard guard(txn);
    for (Table table : kTables) {
      rc = mdb_dbi_open(txn, std::string(table_name(table)).c_str(), 0, &dbis[table_index(table)]);
      if (rc == MDB_NOTFOUND) {
        throw InputError(where() + " is not a lorapipe cache: it has no table " +
                         std::string(table_name(table)));
      }
      if (rc != 0) fail("opening table " + std::string(table_name(table)), rc);
    }
    MDB_val key = as_val(kMetaStoreFormat);
    MDB_val value;
    rc = mdb_get(txn, dbi(Table::kMeta), &key, &value);
    if (rc != 0 && rc != MDB_NOTFOUND) fail("reading meta", rc);
    check_store_format(rc == 0 ? std::optional(as_view(value)) : std::nullopt);
    // Committing a read transaction keeps the table handles it opened for later ones.
    rc = mdb_txn_commit(guard.release());
    if (rc != 0) fail("opening the tables", rc);
  }

  // Creates the tables when they are missing and records who writes, in one transaction: a
  // reader never sees tables without meta.
  void open_writer_tables() {
    const std::vector<std::pair<std::string_view, std::string>> meta = {
        {kMetaStoreFormat, std::to_string(kStoreFormatVersion)},
        {kMetaRecordFormat, std::to_string(kRecordFormatVersion)},
        {kMetaWrittenBy, std::string("lorapipe ") + LORAPIPE_VERSION},
        {kMetaHost, host_name()},
    };
    write("creating the tables", /*batch_bytes=*/0, [&](MDB_txn* txn) {
      for (Table table : kTables) {
        const int rc = mdb_dbi_open(txn, std::string(table_name(table)).c_str(), MDB_CREATE,
                                    &dbis[table_index(table)]);
        if (rc != 0) return rc;
      }
      MDB_val key = as_val(kMetaStoreFormat);
      MDB_val value;
      const int rc = mdb_get(txn, dbi(Table::kMeta), &key, &value);
      if (rc == 0) check_store_format(as_view(value));  // throws; the transaction is aborted
      for (const auto& [name, text] : meta) {
        MDB_val k = as_val(name);
        MDB_val v = as_val(text);
        if (const int put_rc = mdb_put(txn, dbi(Table::kMeta), &k, &v, 0); put_rc != 0) {
          return put_rc;
        }
      }
      return 0;
    });
  }
};

Store::Store(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Store::Store(Store&&) noexcept = default;
Store& Store::operator=(Store&&) noexcept = default;
Store::~Store() = default;

Store Store::open(const StoreOptions& options) {
  if (options.dir.empty()) throw InputError("cache folder not given (empty path)");
  auto impl = std::make_unique<Impl>();
  Impl& s = *impl;
  s.dir = options.dir;
  s.read_only = options.read_only;
  s.wait_for_writer_s = options.wait_for_writer_s;
  const uint64_t page = page_bytes();
  s.max_map_bytes = std::max(page, options.max_map_bytes / page * page);

  std::error_code ec;
  if (s.read_only) {
    if (!fs::exists(s.dir, ec)) throw InputError(s.where() + " does not exist");
    if (!fs::is_directory(s.dir, ec)) throw InputError(s.where() + " is not a folder");
    if (!fs::exists(s.dir / "data.mdb", ec)) {
      throw InputError(s.where() + " holds no lorapipe cache (no data.mdb): run the cacher first");
    }
  } else {
    fs::create_directories(s.dir, ec);
    if (ec) throw InputError(s.where() + ": cannot create the folder: " + ec.message());
  }
  s.register_folder();
  if (!s.read_only) s.take_writer_lock();

  int rc = mdb_env_create(&s.env);
  if (rc != 0) s.fail("creating the LMDB environment", rc);
  if ((rc = mdb_env_set_maxdbs(s.env, kMaxTables)) != 0) s.fail("setting max tables", rc);
  if ((rc = mdb_env_set_maxreaders(s.env, kMaxReaders)) != 0) s.fail("setting max readers", rc);
  if (!s.read_only) {
    // LMDB raises a map smaller than the data to the data's size.
    const uint64_t initial = std::clamp(options.initial_map_bytes, page, s.max_map_bytes);
    if ((rc = mdb_env_set_mapsize(s.env, (initial + page - 1) / page * page)) != 0) {
      s.fail("setting the map size", rc);
    }
  }
  // MDB_NOTLS: a read transaction belongs to the call, not the thread, so many threads read at
  // once. No MDB_WRITEMAP: with it a full disk would be SIGBUS instead of an error code.
  const unsigned flags = MDB_NOTLS | (s.read_only ? MDB_RDONLY : 0u);
  rc = mdb_env_open(s.env, s.dir.c_str(), flags, 0644);
  if (rc != 0) {
    throw InputError(s.where() + ": cannot open" + (s.read_only ? " for reading" : "") + ": " +
                     mdb_strerror(rc));
  }
  s.max_key_bytes = std::min<size_t>(kMaxKeyBytes, mdb_env_get_maxkeysize(s.env));

  if (s.read_only) {
    s.open_reader_tables();
  } else {
    // Reader slots of processes that died (kill -9) would pin old pages forever.
    int dead = 0;
    mdb_reader_check(s.env, &dead);
    if (dead > 0) {
      LP_LOG(kInfo, kLog) << s.where() << ": cleared " << dead << " reader slots of dead processes";
    }
    s.open_writer_tables();
  }
  return Store(std::move(impl));
}

void Store::put(Table table, const std::vector<std::pair<std::string, std::string>>& records) {
  if (records.empty()) return;
  for (const auto& record : records) impl_->check_key(table, record.first);
  const MDB_dbi dbi = impl_->dbi(table);
  uint64_t bytes = 0;
  for (const auto& [key, value] : records) bytes += key.size() + value.size();
  impl_->write(
      "writing " + std::to_string(records.size()) + " records to " + std::string(table_name(table)),
      bytes, [&](MDB_txn* txn) {
        for (const auto& [key, value] : records) {
          MDB_val k = as_val(key);
          MDB_val v = as_val(value);
          if (const int rc = mdb_put(txn, dbi, &k, &v, 0); rc != 0) return rc;
        }
        return 0;
      });
}

size_t Store::erase(Table table, const std::vector<std::string>& keys) {
  if (keys.empty()) return 0;
  for (const auto& key : keys) impl_->check_key(table, key);
  const MDB_dbi dbi = impl_->dbi(table);
  size_t erased = 0;
  impl_->write(
      "erasing " + std::to_string(keys.size()) + " keys from " + std::string(table_name(table)),
      /*batch_bytes=*/0, [&](MDB_txn* txn) {
        erased = 0;
        for (const auto& key : keys) {
          MDB_val k = as_val(key);
          const int rc = mdb_del(txn, dbi, &k, nullptr);
          if (rc == MDB_NOTFOUND) continue;
          if (rc != 0) return rc;
          ++erased;
        }
        return 0;
      });
  return erased;
}

void Store::visit_many(
    Table table, const std::vector<std::string>& keys,
    const std::function<void(size_t index, std::optional<std::string_view> value)>& visit) const {
  for (const auto& key : keys) impl_->check_key(table, key);
  const MDB_dbi dbi = impl_->dbi(table);
  impl_->read("reading " + std::string(table_name(table)), [&](MDB_txn* txn) {
    for (size_t i = 0; i < keys.size(); ++i) {
      MDB_val k = as_val(keys[i]);
      MDB_val v;
      const int rc = mdb_get(txn, dbi, &k, &v);
      if (rc == MDB_NOTFOUND) {
        visit(i, std::nullopt);
      } else if (rc != 0) {
        impl_->fail("reading key " + keys[i] + " of " + std::string(table_name(table)), rc);
      } else {
        visit(i, as_view(v));
      }
    }
  });
}

std::optional<std::string> Store::get(Table table, std::string_view key) const {
  std::optional<std::string> value;
  visit_many(table, {std::string(key)}, [&](size_t, std::optional<std::string_view> found) {
    if (found) value.emplace(*found);
  });
  return value;
}

std::vector<std::optional<std::string>> Store::get_many(
    Table table, const std::vector<std::string>& keys) const {
  std::vector<std::optional<std::string>> values(keys.size());
  visit_many(table, keys, [&](size_t i, std::optional<std::string_view> found) {
    if (found) values[i].emplace(*found);
  });
  return values;
}

std::vector<bool> Store::contains_many(Table table, const std::vector<std::string>& keys) const {
  std::vector<bool> present(keys.size(), false);
  visit_many(table, keys, [&](size_t i, std::optional<std::string_view> found) {
    present[i] = found.has_value();
  });
  return present;
}

void Store::for_each(
    Table table,
    const std::function<bool(std::string_view key, std::string_view value)>& visit) const {
  const MDB_dbi dbi = impl_->dbi(table);
  const std::string action = "reading " + std::string(table_name(table));
  impl_->read(action, [&](MDB_txn* txn) {
    int rc = 0;
    CursorGuard cursor(txn, dbi, &rc);
    if (rc != 0) impl_->fail(action, rc);
    MDB_val k;
    MDB_val v;
    for (rc = mdb_cursor_get(cursor.get(), &k, &v, MDB_FIRST); rc == 0;
         rc = mdb_cursor_get(cursor.get(), &k, &v, MDB_NEXT)) {
      if (!visit(as_view(k), as_view(v))) return;
    }
    if (rc != MDB_NOTFOUND) impl_->fail(action, rc);
  });
}

Store::TableStats Store::stats(Table table) const {
  const MDB_dbi dbi = impl_->dbi(table);
  const std::string action = "counting " + std::string(table_name(table));
  TableStats stats;
  impl_->read(action, [&](MDB_txn* txn) {
    MDB_stat st;
    int rc = mdb_stat(txn, dbi, &st);
    if (rc != 0) impl_->fail(action, rc);
    stats.entries = st.ms_entries;
    // Sizes come from the leaf nodes; overflow pages holding large values are not read.
    CursorGuard cursor(txn, dbi, &rc);
    if (rc != 0) impl_->fail(action, rc);
    MDB_val k;
    MDB_val v;
    for (rc = mdb_cursor_get(cursor.get(), &k, &v, MDB_FIRST); rc == 0;
         rc = mdb_cursor_get(cursor.get(), &k, &v, MDB_NEXT)) {
      stats.bytes += k.mv_size + v.mv_size;
    }
    if (rc != MDB_NOTFOUND) impl_->fail(action, rc);
  });
  return stats;
}

const fs::path& Store::dir() const { return impl_->dir; }

bool Store::read_only() const { return impl_->read_only; }

uint64_t Store::map_bytes() const {
  auto lock = impl_->map_lock.shared();
  return impl_->current_map_bytes();
}

fs::path default_cache_dir() {
  if (const char* dir = std::getenv("LORAPIPE_CACHE_DIR"); dir != nullptr && *dir != '\0') {
    return dir;
  }
  // XDG Base Directory spec: a relative XDG_CACHE_HOME is invalid and ignored.
  if (const char* xdg = std::getenv("XDG_CACHE_HOME");
      xdg != nullptr && *xdg != '\0' && fs::path(xdg).is_absolute()) {
    return fs::path(xdg) / "lorapipe" / "cache";
  }
  const char* home = std::getenv("HOME");
  if (home == nullptr || *home == '\0') {
    const passwd* pw = getpwuid(getuid());
    home = pw != nullptr ? pw->pw_dir : nullptr;
  }
  if (home == nullptr || *home == '\0') {
    throw Error("no cache folder: set LORAPIPE_CACHE_DIR (neither XDG_CACHE_HOME nor HOME is set)");
  }
  return fs::path(home) / ".cache" / "lorapipe" / "cache";
}

}  // namespace lorapipe::cacher
