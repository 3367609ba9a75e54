// The cache store: round trips, map growth and its limit, crash safety under a real kill -9,
// readers in other processes while the writer writes, the writer lock, full disks, and the
// record checks the trainer runs before step 0.
//
// Processes: tests fork and exec cache_store_test_helper (store_test_helper.cpp) so that the
// writer that is killed, and the readers, are really other processes with their own LMDB
// environment (LMDB allows one per folder per process).

#include "cacher/store.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "cacher/records.h"
#include "cacher/tools.h"
#include "common/hash.h"
#include "cacher/store_test_batches.h"
#include "common/error.h"
#include "tests/paths.h"

namespace lorapipe::cacher {
namespace {

namespace fs = std::filesystem;
using std::chrono::milliseconds;
using testing::kRecordsPerBatch;
using Records = std::vector<std::pair<std::string, std::string>>;

constexpr uint64_t kMiB = uint64_t{1} << 20;

bool contains(const std::string& text, std::string_view part) {
  return text.find(part) != std::string::npos;
}

// A fresh folder under /tmp, removed with everything in it.
class TempDir {
 public:
  TempDir() {
    std::string pattern = (fs::temp_directory_path() / "cache_store_test.XXXXXX").string();
    if (mkdtemp(pattern.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
    path_ = pattern;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  const fs::path& path() const { return path_; }
  fs::path operator/(std::string_view name) const { return path_ / name; }

 private:
  fs::path path_;
};

Store open_writer(const fs::path& dir, uint64_t initial = 64 * kMiB,
                  uint64_t max = uint64_t{1} << 40) {
  StoreOptions options;
  options.dir = dir;
  options.initial_map_bytes = initial;
  options.max_map_bytes = max;
  return Store::open(options);
}

Store open_reader(const fs::path& dir) {
  StoreOptions options;
  options.dir = dir;
  options.read_only = true;
  return Store::open(options);
}

std::map<std::string, std::string> snapshot(const Store& store, Table table) {
  std::map<std::string, std::string> entries;
  store.for_each(table, [&](std::string_view key, std::string_view value) {
    entries.emplace(key, value);
    return true;
  });
  return entries;
}

std::string error_of(const std::function<void()>& body) {
  try {
    body();
  } catch (const std::exception& e) {
    return e.what();
  }
  return {};
}

// A helper process with its stdout on a pipe we read line by line.
class Child {
 public:
  // `in_child` runs between fork and exec (async-signal-safe calls only).
  explicit Child(const std::vector<std::string>& args, void (*in_child)() = nullptr) {
    std::vector<std::string> argv_storage = {LORAPIPE_STORE_TEST_HELPER};
    argv_storage.insert(argv_storage.end(), args.begin(), args.end());
    std::vector<char*> argv;
    for (auto& arg : argv_storage) argv.push_back(arg.data());
    argv.push_back(nullptr);
    int fds[2];
    if (pipe2(fds, O_CLOEXEC) != 0) throw std::runtime_error("pipe2 failed");
    pid_ = fork();
    if (pid_ < 0) throw std::runtime_error("fork failed");
    if (pid_ == 0) {
      dup2(fds[1], STDOUT_FILENO);
      if (in_child != nullptr) in_child();
      execv(argv[0], argv.data());
      _exit(127);
    }
    ::close(fds[1]);
    out_ = fds[0];
  }
  Child(const Child&) = delete;
  Child& operator=(const Child&) = delete;
  ~Child() {
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      wait();
    }
    if (out_ >= 0) ::close(out_);
  }

  pid_t pid() const { return pid_; }

  // The next line, or nullopt at end of output or after `timeout`.
  std::optional<std::string> line(milliseconds timeout = milliseconds(15000)) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
      if (const size_t end = buffer_.find('\n'); end != std::string::npos) {
        std::string line = buffer_.substr(0, end);
        buffer_.erase(0, end + 1);
        return line;
      }
      if (eof_) return std::nullopt;
      const auto left =
          std::chrono::duration_cast<milliseconds>(deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) return std::nullopt;
      pollfd p{out_, POLLIN, 0};
      if (poll(&p, 1, static_cast<int>(left.count())) <= 0) continue;
      char chunk[4096];
      const ssize_t n = ::read(out_, chunk, sizeof(chunk));
      if (n <= 0) {
        if (n < 0 && errno == EINTR) continue;
        eof_ = true;
      } else {
        buffer_.append(chunk, static_cast<size_t>(n));
      }
    }
  }

  // Waits for the child to end; returns its wait status.
  int wait() {
    int status = 0;
    while (waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
    }
    pid_ = -1;
    return status;
  }

 private:
  pid_t pid_ = -1;
  int out_ = -1;
  std::string buffer_;
  bool eof_ = false;
};

// "committed N" -> N.
std::optional<uint64_t> committed_batch(const std::string& line) {
  constexpr std::string_view kPrefix = "committed ";
  if (line.rfind(kPrefix, 0) != 0) return std::nullopt;
  return std::stoull(line.substr(kPrefix.size()));
}

// Batches first..last whole and intact, in one assertion each.
void expect_batches_whole(const Store& store, uint64_t first, uint64_t last) {
  for (uint64_t n = first; n <= last; ++n) {
    const testing::BatchState state = testing::check_batch(store, Table::kLatents, n);
    EXPECT_EQ(state.present, kRecordsPerBatch) << "batch " << n << " lost records";
    EXPECT_EQ(state.damaged, 0) << "batch " << n << " has damaged records";
  }
}

// ---------------------------------------------------------------------------------------------
// Round trips, order, stats.

TEST(CacheStore, PutGetRoundTripInEveryTable) {
  TempDir tmp;
  Store store = open_writer(tmp.path());
  const std::string binary("a\0b\xff\x01", 5);
  for (Table table : {Table::kLatents, Table::kTexts, Table::kManifests, Table::kMeta}) {
    const std::string prefix(table_name(table));
    store.put(table, {{"k1", prefix + "-v1"}, {"k2", binary + prefix}});
  }
  for (Table table : {Table::kLatents, Table::kTexts, Table::kManifests, Table::kMeta}) {
    const std::string prefix(table_name(table));
    EXPECT_EQ(store.get(table, "k1"), prefix + "-v1") << prefix;
    EXPECT_EQ(store.get(table, "k2"), binary + prefix) << prefix;
    EXPECT_EQ(store.get(table, "absent"), std::nullopt) << prefix;
  }
  // Overwrite keeps one entry with the new value.
  store.put(Table::kTexts, {{"k1", "new"}});
  EXPECT_EQ(store.get(Table::kTexts, "k1"), "new");
  EXPECT_EQ(store.get(Table::kLatents, "k1"), "latents-v1");
  EXPECT_EQ(store.stats(Table::kTexts).entries, 2u);
  // An empty batch is no write at all.
  store.put(Table::kTexts, {});
  EXPECT_EQ(store.stats(Table::kTexts).entries, 2u);
}

TEST(CacheStore, MetaSaysWhatWroteTheStore) {
  TempDir tmp;
  {
    Store store = open_writer(tmp.path());
    EXPECT_EQ(store.get(Table::kMeta, kMetaStoreFormat), std::to_string(kStoreFormatVersion));
    EXPECT_EQ(store.get(Table::kMeta, kMetaRecordFormat), "1");
    const auto written_by = store.get(Table::kMeta, kMetaWrittenBy);
    ASSERT_TRUE(written_by);
    EXPECT_EQ(written_by->rfind("lorapipe ", 0), 0u) << *written_by;
    EXPECT_GT(written_by->size(), std::string("lorapipe ").size());
    const auto host = store.get(Table::kMeta, kMetaHost);
    ASSERT_TRUE(host);
    EXPECT_FALSE(host->empty());
  }
  // A store of another layout is refused, by readers and writers, naming both versions.
  {
    Store store = open_writer(tmp.path());
    store.put(Table::kMeta, {{std::string(kMetaStoreFormat), "999"}});
  }
  for (bool read_only : {true, false}) {
    StoreOptions options;
    options.dir = tmp.path();
    options.read_only = read_only;
    const std::string error = error_of([&] { Store::open(options); });
    EXPECT_TRUE(contains(error, "store format 999")) << error;
    EXPECT_TRUE(contains(error, tmp.path().string())) << error;
  }
}

TEST(CacheStore, GetManyAndContainsManyFollowTheRequestOrder) {
  TempDir tmp;
  Store store = open_writer(tmp.path());
  store.put(Table::kLatents, {{"b", "B"}, {"a", "A"}, {"c", "C"}});
  const std::vector<std::string> keys = {"c", "x", "a", "c", "b", "y"};
  const auto values = store.get_many(Table::kLatents, keys);
  ASSERT_EQ(values.size(), keys.size());
  EXPECT_EQ(values[0], "C");
  EXPECT_EQ(values[1], std::nullopt);
  EXPECT_EQ(values[2], "A");
  EXPECT_EQ(values[3], "C");
  EXPECT_EQ(values[4], "B");
  EXPECT_EQ(values[5], std::nullopt);
  EXPECT_EQ(store.contains_many(Table::kLatents, keys),
            (std::vector<bool>{true, false, true, true, true, false}));
  // Tables are separate.
  EXPECT_EQ(store.contains_many(Table::kTexts, keys), std::vector<bool>(keys.size(), false));
  EXPECT_TRUE(store.get_many(Table::kLatents, {}).empty());
}

TEST(CacheStore, ForEachVisitsInKeyOrderAndStops) {
  TempDir tmp;
  Store store = open_writer(tmp.path());
  std::vector<std::string> keys;
  for (int i = 0; i < 200; ++i) keys.push_back("key-" + std::to_string(i));
  std::vector<std::string> shuffled = keys;
  std::shuffle(shuffled.begin(), shuffled.end(), std::mt19937(7));
  Records records;
  for (const auto& key : shuffled) records.emplace_back(key, "value of " + key);
  store.put(Table::kTexts, records);

  std::vector<std::string> visited;
  store.for_each(Table::kTexts, [&](std::string_view key, std::string_view value) {
    EXPECT_EQ(value, "value of " + std::string(key));
    visited.emplace_back(key);
    return true;
  });
  std::vector<std::string> sorted = keys;
  std::sort(sorted.begin(), sorted.end());  // bytewise, as LMDB orders keys
  EXPECT_EQ(visited, sorted);

  visited.clear();
  store.for_each(Table::kTexts, [&](std::string_view key, std::string_view) {
    visited.emplace_back(key);
    return visited.size() < 5;
  });
  EXPECT_EQ(visited, std::vector<std::string>(sorted.begin(), sorted.begin() + 5));
}

TEST(CacheStore, StatsCountEntriesAndBytes) {
  TempDir tmp;
  Store store = open_writer(tmp.path());
  EXPECT_EQ(store.stats(Table::kLatents).entries, 0u);
  EXPECT_EQ(store.stats(Table::kLatents).bytes, 0u);
  const std::string big(100000, 'x');  // on overflow pages
  store.put(Table::kLatents, {{"ab", "cde"}, {"big", big}, {"f", ""}});
  const Store::TableStats stats = store.stats(Table::kLatents);
  EXPECT_EQ(stats.entries, 3u);
  EXPECT_EQ(stats.bytes, 2u + 3u + 3u + big.size() + 1u);
  EXPECT_EQ(store.stats(Table::kTexts).entries, 0u);
}

TEST(CacheStore, EraseRemovesAllOrNoneAndCounts) {
  TempDir tmp;
  Store store = open_writer(tmp.path());
  store.put(Table::kLatents, {{"a", "1"}, {"b", "2"}, {"c", "3"}});
  EXPECT_EQ(store.erase(Table::kLatents, {"a", "missing", "c"}), 2u);
  EXPECT_EQ(snapshot(store, Table::kLatents), (std::map<std::string, std::string>{{"b", "2"}}));
  EXPECT_EQ(store.erase(Table::kLatents, {}), 0u);
  // A bad key refuses the whole call before anything is written.
  EXPECT_THROW(store.erase(Table::kLatents, {"b", ""}), InputError);
  EXPECT_EQ(store.get(Table::kLatents, "b"), "2");
}

TEST(CacheStore, KeysOverLmdbLimitAreRefusedNamingTheKey) {
  TempDir tmp;
  Store store = open_writer(tmp.path());
  const std::string longest(kMaxKeyBytes, 'k');
  store.put(Table::kLatents, {{longest, "fits"}});
  EXPECT_EQ(store.get(Table::kLatents, longest), "fits");

  const std::string too_long = "deadbeef" + std::string(kMaxKeyBytes, 'z');
  for (const auto& call : std::vector<std::function<void()>>{
           [&] {
             store.put(Table::kLatents, {{"ok", "1"}, {too_long, "x"}});
           },
           [&] { store.get(Table::kLatents, too_long); },
           [&] { store.contains_many(Table::kLatents, {too_long}); }}) {
    try {
      call();
      ADD_FAILURE() << "a key of " << too_long.size() << " bytes was accepted";
    } catch (const InputError& e) {
      EXPECT_TRUE(contains(e.what(), "\"deadbeefzzzz")) << e.what();
      EXPECT_TRUE(contains(e.what(), "511")) << e.what();
    }
  }
  // The batch with the long key wrote nothing, not even its good record.
  EXPECT_EQ(store.get(Table::kLatents, "ok"), std::nullopt);
  EXPECT_THROW(store.put(Table::kLatents, {{"", "empty key"}}), InputError);
}

TEST(CacheStore, StoreIsMovable) {
  TempDir tmp;
  std::optional<Store> holder;
  {
    Store store = open_writer(tmp.path());
    store.put(Table::kLatents, {{"k", "v"}});
    holder.emplace(std::move(store));
  }
  EXPECT_EQ(holder->get(Table::kLatents, "k"), "v");
  EXPECT_EQ(holder->dir(), tmp.path());
  Store other = std::move(*holder);
  holder.reset();
  EXPECT_EQ(other.get(Table::kLatents, "k"), "v");
}

TEST(CacheStore, DataSurvivesCloseAndIsReadOnlyForReaders) {
  TempDir tmp;
  { open_writer(tmp.path()).put(Table::kManifests, {{"dataset", "manifest bytes"}}); }
  Store reader = open_reader(tmp.path());
  EXPECT_TRUE(reader.read_only());
  EXPECT_EQ(reader.get(Table::kManifests, "dataset"), "manifest bytes");
  const std::string error = error_of([&] { reader.put(Table::kManifests, {{"x", "y"}}); });
  EXPECT_TRUE(contains(error, "read-only")) << error;
}

TEST(CacheStore, DefaultCacheDirFollowsEnvironment) {
  const auto saved = [](const char* name) -> std::optional<std::string> {
    const char* value = std::getenv(name);
    return value ? std::optional<std::string>(value) : std::nullopt;
  };
  const auto restore = [](const char* name, const std::optional<std::string>& value) {
    if (value) {
      setenv(name, value->c_str(), 1);
    } else {
      unsetenv(name);
    }
  };
  const auto lorapipe = saved("LORAPIPE_CACHE_DIR");
  const auto xdg = saved("XDG_CACHE_HOME");
  const auto home = saved("HOME");

  setenv("LORAPIPE_CACHE_DIR", "/data/cache", 1);
  setenv("XDG_CACHE_HOME", "/xdg", 1);
  setenv("HOME", "/home/u", 1);
  EXPECT_EQ(default_cache_dir(), fs::path("/data/cache"));
  unsetenv("LORAPIPE_CACHE_DIR");
  EXPECT_EQ(default_cache_dir(), fs::path("/xdg/lorapipe/cache"));
  setenv("XDG_CACHE_HOME", "relative/ignored", 1);
  EXPECT_EQ(default_cache_dir(), fs::path("/home/u/.cache/lorapipe/cache"));
  unsetenv("XDG_CACHE_HOME");
  EXPECT_EQ(default_cache_dir(), fs::path("/home/u/.cache/lorapipe/cache"));

  restore("LORAPIPE_CACHE_DIR", lorapipe);
  restore("XDG_CACHE_HOME", xdg);
  restore("HOME", home);
}

// ---------------------------------------------------------------------------------------------
// Opening: missing folders, the writer lock.

TEST(CacheStoreOpen, ReadOnlyOpenOfMissingFolderNamesIt) {
  TempDir tmp;
  const fs::path missing = tmp / "no-such-cache";
  try {
    open_reader(missing);
    FAIL() << "opened a missing folder";
  } catch (const InputError& e) {
    EXPECT_TRUE(contains(e.what(), missing.string())) << e.what();
    EXPECT_TRUE(contains(e.what(), "does not exist")) << e.what();
  }
  EXPECT_FALSE(fs::exists(missing)) << "a reader must not create the folder";
  // A folder that exists but holds no store.
  try {
    open_reader(tmp.path());
    FAIL() << "opened an empty folder";
  } catch (const InputError& e) {
    EXPECT_TRUE(contains(e.what(), tmp.path().string())) << e.what();
    EXPECT_TRUE(contains(e.what(), "no lorapipe cache")) << e.what();
  }
}

TEST(CacheStoreOpen, WriterCreatesNestedFolders) {
  TempDir tmp;
  const fs::path dir = tmp / "a" / "b" / "cache";
  Store store = open_writer(dir);
  EXPECT_TRUE(fs::exists(dir / "data.mdb"));
  EXPECT_TRUE(fs::exists(dir / "writer.lock"));
}

TEST(CacheStoreOpen, SecondWriterInAnotherProcessFailsClearly) {
  TempDir tmp;
  Child holder({"hold", tmp.path().string()});
  ASSERT_EQ(holder.line(), "open");
  const std::string error = error_of([&] { open_writer(tmp.path()); });
  EXPECT_TRUE(contains(error, "already has a writer")) << error;
  EXPECT_TRUE(contains(error, "pid " + std::to_string(holder.pid()))) << error;
  EXPECT_TRUE(contains(error, tmp.path().string())) << error;
  // Readers need no lock: they read while that writer holds it.
  { EXPECT_EQ(open_reader(tmp.path()).get(Table::kLatents, "x"), std::nullopt); }
  // The lock dies with its holder, even by SIGKILL.
  kill(holder.pid(), SIGKILL);
  holder.wait();
  Store store = open_writer(tmp.path());
  store.put(Table::kLatents, {{"x", "y"}});
}

TEST(CacheStoreOpen, SecondOpenInOneProcessIsRefused) {
  TempDir tmp;
  Store store = open_writer(tmp.path());
  const std::string error = error_of([&] { open_writer(tmp.path()); });
  EXPECT_TRUE(contains(error, "already open in this process")) << error;
  const std::string reader_error = error_of([&] { open_reader(tmp.path()); });
  EXPECT_TRUE(contains(reader_error, "already open in this process")) << reader_error;
  // Closing frees the folder again.
  store = open_writer(tmp / "other");
  EXPECT_NO_THROW(open_reader(tmp.path()));
}

// ---------------------------------------------------------------------------------------------
// Map growth and its limit.

Records big_batch(const std::string& prefix, int count, size_t bytes_each) {
  Records records;
  for (int i = 0; i < count; ++i) {
    std::string value(bytes_each, static_cast<char>('a' + i % 26));
    value.replace(0, prefix.size(), prefix);
    records.emplace_back(prefix + "-" + std::to_string(i), std::move(value));
  }
  return records;
}

TEST(CacheStoreGrowth, TinyMapGrowsToTakeALargeBatch) {
  TempDir tmp;
  const Records batch = big_batch("big", 20, kMiB);  // 20 MiB in one transaction
  {
    Store store = open_writer(tmp.path(), /*initial=*/kMiB);
    EXPECT_EQ(store.map_bytes(), kMiB);
    store.put(Table::kLatents, batch);
    EXPECT_GE(store.map_bytes(), 20 * kMiB);
    for (const auto& [key, value] : batch) EXPECT_EQ(store.get(Table::kLatents, key), value);
  }
  Store reader = open_reader(tmp.path());
  EXPECT_EQ(reader.stats(Table::kLatents).entries, batch.size());
  for (const auto& [key, value] : batch) EXPECT_EQ(reader.get(Table::kLatents, key), value);
}

TEST(CacheStoreGrowth, MapLimitRefusesTheBatchAndKeepsTheStoreAsItWas) {
  TempDir tmp;
  const uint64_t limit = 4 * kMiB;
  std::map<std::string, std::string> before;
  {
    Store store = open_writer(tmp.path(), /*initial=*/kMiB, /*max=*/limit);
    store.put(Table::kLatents, big_batch("small", 5, 1000));
    store.put(Table::kLatents, big_batch("fits", 1, kMiB));  // grows the map
    before = snapshot(store, Table::kLatents);
    ASSERT_EQ(before.size(), 6u);

    // 4 MiB more: its first half would still fit under the limit, the whole batch does not.
    const std::string error =
        error_of([&] { store.put(Table::kLatents, big_batch("big", 40, 100 * 1024)); });
    EXPECT_TRUE(contains(error, "cache at " + tmp.path().string() +
                                    " is full: map size limit 4194304 bytes reached"))
        << error;
    EXPECT_EQ(store.map_bytes(), limit);
    // LMDB's transaction guarantee: nothing of the refused batch, everything from before.
    EXPECT_EQ(snapshot(store, Table::kLatents), before);
    // And a batch five times the limit.
    const std::string huge_error =
        error_of([&] { store.put(Table::kLatents, big_batch("huge", 20, kMiB)); });
    EXPECT_TRUE(contains(huge_error, "is full: map size limit 4194304 bytes reached"))
        << huge_error;
    EXPECT_EQ(snapshot(store, Table::kLatents), before);
    // The store still takes what fits.
    store.put(Table::kTexts, {{"after", "the refusal"}});
  }
  Store reopened = open_writer(tmp.path(), /*initial=*/kMiB, /*max=*/limit);
  EXPECT_EQ(snapshot(reopened, Table::kLatents), before);
  EXPECT_EQ(reopened.get(Table::kTexts, "after"), "the refusal");
}

// ---------------------------------------------------------------------------------------------
// Crash safety: kill -9 a writer mid-write.

TEST(CacheStoreCrash, KillNineMidWriteKeepsEveryCommittedBatchAndNoPartialOne) {
  TempDir tmp;
  std::mt19937 rng(20240611);
  uint64_t next = 0;  // the first batch the next writer writes
  // How many commits to wait for before the kill, then a random delay of up to 4 ms: the kill
  // lands mid-put, mid-commit (fsync), mid-growth (1 MiB initial map) or between batches.
  const int waits[] = {1, 3, 2, 6, 1, 4, 2, 5, 1, 1, 3, 2, 7, 1, 2, 4};
  for (int round = 0; round < 16; ++round) {
    SCOPED_TRACE("round " + std::to_string(round));
    int64_t reported = static_cast<int64_t>(next) - 1;  // last batch the child said it committed
    {
      Child writer({"write", tmp.path().string(), std::to_string(next), "0", std::to_string(kMiB)});
      while (reported < static_cast<int64_t>(next) + waits[round] - 1) {
        const auto line = writer.line();
        ASSERT_TRUE(line) << "the writer stopped reporting";
        const auto batch = committed_batch(*line);
        ASSERT_TRUE(batch) << *line;
        reported = static_cast<int64_t>(*batch);
      }
      std::this_thread::sleep_for(std::chrono::microseconds(rng() % 4000));
      ASSERT_EQ(kill(writer.pid(), SIGKILL), 0);
      const int status = writer.wait();
      ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << status;
      while (const auto line = writer.line(milliseconds(2000))) {
        const auto batch = committed_batch(*line);
        ASSERT_TRUE(batch) << *line;
        reported = static_cast<int64_t>(*batch);
      }
    }
    ASSERT_GE(reported, 0);
    Store store = open_writer(tmp.path(), /*initial=*/kMiB);
    expect_batches_whole(store, 0, static_cast<uint64_t>(reported));
    // The batch in flight was committed (and not yet reported) or not at all: never partly.
    const testing::BatchState in_flight =
        testing::check_batch(store, Table::kLatents, static_cast<uint64_t>(reported) + 1);
    ASSERT_TRUE(in_flight.present == 0 || in_flight.present == kRecordsPerBatch)
        << in_flight.present << " records of batch " << reported + 1 << " are visible";
    EXPECT_EQ(in_flight.damaged, 0);
    next = static_cast<uint64_t>(reported) + 1 + (in_flight.present != 0 ? 1 : 0);
    // Nothing else: the table holds exactly the whole batches.
    EXPECT_EQ(store.stats(Table::kLatents).entries, next * kRecordsPerBatch);
  }
}

// ---------------------------------------------------------------------------------------------
// Readers in other processes while the writer writes.

TEST(CacheStoreReaders, ReadersInOtherProcessesSeeLaterCommitsWhileTheMapGrows) {
  TempDir tmp;
  constexpr uint64_t kLast = 24;  // ~5 MiB of batches: the 1 MiB map grows three times
  Store store = open_writer(tmp.path(), /*initial=*/kMiB);
  store.put(Table::kLatents, testing::make_batch(0));
  std::vector<std::unique_ptr<Child>> readers;
  for (int r = 0; r < 4; ++r) {
    readers.push_back(std::make_unique<Child>(std::vector<std::string>{
        "read", tmp.path().string(), std::to_string(kLast), /*threads=*/"2", "15000"}));
  }
  // Every reader has its environment open (with the 1 MiB map) before the writes below.
  for (auto& reader : readers) ASSERT_EQ(reader->line(), "open");
  for (uint64_t n = 1; n <= kLast; ++n) {
    store.put(Table::kLatents, testing::make_batch(n));
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  EXPECT_GT(store.map_bytes(), 2 * kMiB);
  for (auto& reader : readers) {
    EXPECT_EQ(reader->line(), "saw " + std::to_string(kLast));
    const int status = reader->wait();
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  }
}

// Threads of one process share a Store: reads go on while a write grows the map (which LMDB
// allows only with no transaction open in the process).
TEST(CacheStoreReaders, ThreadsReadWhileTheMapGrows) {
  TempDir tmp;
  constexpr uint64_t kLast = 24;
  Store store = open_writer(tmp.path(), /*initial=*/kMiB);
  std::atomic<uint64_t> written{0};  // batches 0..written-1 are committed
  std::atomic<bool> done{false};
  std::vector<std::thread> readers;
  std::atomic<int> failures{0};
  for (int r = 0; r < 3; ++r) {
    readers.emplace_back([&] {
      while (!done) {
        const uint64_t committed = written;
        for (uint64_t n = 0; n < committed; n += 3) {
          const testing::BatchState state = testing::check_batch(store, Table::kLatents, n);
          if (state.present != kRecordsPerBatch || state.damaged != 0) ++failures;
        }
        const testing::BatchState next = testing::check_batch(store, Table::kLatents, committed);
        if (next.present != 0 && next.present != kRecordsPerBatch) ++failures;
      }
    });
  }
  for (uint64_t n = 0; n <= kLast; ++n) {
    store.put(Table::kLatents, testing::make_batch(n));
    written = n + 1;
  }
  done = true;
  for (auto& reader : readers) reader.join();
  EXPECT_EQ(failures, 0);
  EXPECT_GT(store.map_bytes(), 2 * kMiB);
  expect_batches_whole(store, 0, kLast);
}

// ---------------------------------------------------------------------------------------------
// Full disks.

// Writes batches until a put fails; returns how many were committed and the error.
std::pair<uint64_t, std::string> fill(Store& store) {
  for (uint64_t n = 0; n < 10000; ++n) {
    try {
      store.put(Table::kLatents, testing::make_batch(n));
    } catch (const Error& e) {
      return {n, e.what()};
    }
  }
  return {10000, ""};
}

void expect_exactly_batches(const Store& store, uint64_t committed) {
  if (committed > 0) expect_batches_whole(store, 0, committed - 1);
  EXPECT_EQ(testing::check_batch(store, Table::kLatents, committed).present, 0)
      << "the failed batch is partly visible";
  EXPECT_EQ(store.stats(Table::kLatents).entries, committed * kRecordsPerBatch);
}

TEST(CacheStoreFullDisk, FullTmpfsFailsClearlyAndKeepsEveryCommittedRecord) {
  TempDir tmp;
  const fs::path disk = tmp / "disk";
  fs::create_directories(disk);
  if (mount("tmpfs", disk.c_str(), "tmpfs", 0, "size=8m") != 0) {
    GTEST_SKIP() << "lorapipe-skip: cannot mount an 8 MiB tmpfs here (" << std::strerror(errno)
                 << "); the file-size-limit test covers the same path";
  }
  struct Unmount {
    fs::path path;
    ~Unmount() { umount2(path.c_str(), MNT_DETACH); }
  } unmount{disk};
  const fs::path dir = disk / "cache";

  uint64_t committed = 0;
  {
    Store store = open_writer(dir);  // 64 MiB map: the disk fills long before the map does
    std::string error;
    std::tie(committed, error) = fill(store);
    ASSERT_FALSE(error.empty()) << "an 8 MiB disk took 10000 batches";
    ASSERT_GT(committed, 0u);
    EXPECT_TRUE(contains(error, "cache at " + dir.string())) << error;
    EXPECT_TRUE(contains(error, "nothing of this batch was stored")) << error;
    EXPECT_TRUE(contains(error, "the disk is full")) << error;
    // The same Store still reads everything it committed.
    expect_exactly_batches(store, committed);
  }
  {
    Store reopened = open_writer(dir);
    expect_exactly_batches(reopened, committed);
  }
  Store reader = open_reader(dir);
  expect_exactly_batches(reader, committed);
}

void limit_file_size() {
  // Ignored, SIGXFSZ no longer kills the writer: writes past the limit fail with EFBIG.
  signal(SIGXFSZ, SIG_IGN);
  const rlimit limit{3 * kMiB, 3 * kMiB};
  setrlimit(RLIMIT_FSIZE, &limit);
}

TEST(CacheStoreFullDisk, FileSizeLimitFailsClearlyAndKeepsEveryCommittedRecord) {
  TempDir tmp;
  { open_writer(tmp.path()); }  // lock.mdb and data.mdb exist before the limit applies
  int64_t reported = -1;
  std::string error;
  {
    Child writer({"write", tmp.path().string(), "0", "0", std::to_string(kMiB)}, &limit_file_size);
    while (const auto line = writer.line()) {
      if (const auto batch = committed_batch(*line)) {
        reported = static_cast<int64_t>(*batch);
      } else {
        error = *line;
        break;
      }
    }
    const int status = writer.wait();
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 3) << status << " " << error;
  }
  ASSERT_GE(reported, 0) << error;
  EXPECT_TRUE(contains(error, "cache at " + tmp.path().string())) << error;
  EXPECT_TRUE(contains(error, "nothing of this batch was stored")) << error;
  EXPECT_TRUE(contains(error, "file size limit")) << error;
  EXPECT_LT(fs::file_size(tmp / "data.mdb"), 3 * kMiB + 1);
  Store store = open_writer(tmp.path());
  expect_exactly_batches(store, static_cast<uint64_t>(reported) + 1);
  // With the limit gone the store takes the batch that failed.
  store.put(Table::kLatents, testing::make_batch(static_cast<uint64_t>(reported) + 1));
  expect_exactly_batches(store, static_cast<uint64_t>(reported) + 2);
}

// ---------------------------------------------------------------------------------------------
// Record checks.

wire::Tensor tensor(wire::Tensor::DType dtype, std::vector<int64_t> shape, size_t bytes) {
  wire::Tensor t;
  t.set_dtype(dtype);
  for (int64_t d : shape) t.add_shape(d);
  t.set_data(std::string(bytes, '\x3c'));
  return t;
}

std::string latent(size_t mean_bytes, size_t std_bytes = 4 * 8 * 8 * 2) {
  wire::LatentRecord record;
  record.set_format_version(1);
  *record.mutable_mean() = tensor(wire::Tensor::F16, {4, 8, 8}, mean_bytes);
  *record.mutable_std() = tensor(wire::Tensor::F16, {4, 8, 8}, std_bytes);
  return record.SerializeAsString();
}

std::string text(size_t pooled_bytes) {
  wire::TextRecord record;
  record.set_format_version(1);
  *record.mutable_hidden_states() = tensor(wire::Tensor::F32, {12, 16}, 12 * 16 * 4);
  *record.mutable_pooled() = tensor(wire::Tensor::BF16, {16}, pooled_bytes);
  return record.SerializeAsString();
}

TEST(CacheRecords, TensorSizeMustMatchShapeAndDtype) {
  EXPECT_EQ(check_tensor(tensor(wire::Tensor::F32, {2, 3}, 24), "t"), "");
  EXPECT_EQ(check_tensor(tensor(wire::Tensor::F16, {2, 3}, 12), "t"), "");
  EXPECT_EQ(check_tensor(tensor(wire::Tensor::BF16, {2, 3}, 12), "t"), "");
  EXPECT_EQ(check_tensor(tensor(wire::Tensor::F32, {}, 4), "t"), "");  // a scalar
  EXPECT_EQ(check_tensor(tensor(wire::Tensor::F16, {0, 3}, 0), "t"), "");
  EXPECT_EQ(check_tensor(tensor(wire::Tensor::F16, {2, 3}, 24), "mean"),
            "mean: 24 data bytes, but shape [2, 3] F16 needs 12");
  EXPECT_EQ(check_tensor(tensor(wire::Tensor::DTYPE_UNSPECIFIED, {2}, 8), "t"),
            "t: dtype unspecified");
  EXPECT_EQ(check_tensor(tensor(wire::Tensor::F32, {2, -3}, 24), "t"),
            "t: negative dimension in shape [2, -3]");
  EXPECT_TRUE(contains(check_tensor(tensor(wire::Tensor::F32, {1ll << 40, 1ll << 40}, 4), "t"),
                       "too large"));
}

TEST(CacheRecords, RecordChecks) {
  EXPECT_EQ(check_latent_record(latent(512)), "");
  EXPECT_TRUE(contains(check_latent_record(latent(100)), "LatentRecord mean: 100 data bytes"));
  EXPECT_TRUE(contains(check_latent_record(latent(512, 7)), "LatentRecord std: 7 data bytes"));
  EXPECT_EQ(check_latent_record(""), "LatentRecord has no mean tensor");
  EXPECT_TRUE(contains(check_latent_record("this is not a protobuf"), "not a LatentRecord"));
  wire::LatentRecord mismatched;
  *mismatched.mutable_mean() = tensor(wire::Tensor::F16, {4, 8, 8}, 512);
  *mismatched.mutable_flipped_mean() = tensor(wire::Tensor::F16, {4, 8, 4}, 256);
  EXPECT_TRUE(contains(check_latent_record(mismatched.SerializeAsString()),
                       "flipped_mean has shape [4, 8, 4]"));
  EXPECT_EQ(check_text_record(text(32)), "");
  EXPECT_TRUE(contains(check_text_record(text(31)), "TextRecord pooled: 31 data bytes"));
  wire::TextRecord no_hidden;
  *no_hidden.mutable_pooled() = tensor(wire::Tensor::F32, {16}, 64);
  EXPECT_EQ(check_text_record(no_hidden.SerializeAsString()),
            "TextRecord has no hidden_states tensor");
}

TEST(CacheRecords, VerifyStoreAndCheckManifestNameCorruptAndMissingRecords) {
  TempDir tmp;
  Store store = open_writer(tmp.path());
  store.put(Table::kLatents, {{"good", latent(512)},
                              {"short", latent(100)},  // data shorter than its shape says
                              {"garbage", "this is not a protobuf"}});
  store.put(Table::kTexts, {{"text-good", text(32)}, {"text-bad", text(3)}});

  const auto bad = verify_store(store);
  ASSERT_EQ(bad.size(), 3u);
  // Latents first, in key order, then texts.
  EXPECT_EQ(bad[0].first, "garbage");
  EXPECT_TRUE(contains(bad[0].second, "not a LatentRecord")) << bad[0].second;
  EXPECT_EQ(bad[1].first, "short");
  EXPECT_TRUE(contains(bad[1].second, "100 data bytes")) << bad[1].second;
  EXPECT_EQ(bad[2].first, "text-bad");
  EXPECT_TRUE(contains(bad[2].second, "pooled")) << bad[2].second;

  wire::Manifest manifest;
  manifest.set_dataset_id("d");
  manifest.set_text_cached(true);
  const auto add = [&](const std::string& latent_key, const std::string& text_key) {
    auto* entry = manifest.add_entries();
    entry->set_latent_key(latent_key);
    entry->set_text_key(text_key);
    entry->set_path("img/" + latent_key + ".png");
  };
  add("good", "text-good");
  add("short", "text-good");
  add("garbage", "text-missing");
  add("missing", "text-bad");
  add("missing", "text-good");  // a key shared by two entries is reported once
  add("good", "");              // text is cached, but this entry has no text key

  const ManifestCheck check = check_manifest(store, manifest);
  EXPECT_FALSE(check.ok());
  EXPECT_EQ(check.missing, (std::vector<std::string>{"missing", "text-missing"}));
  std::map<std::string, std::string> corrupt(check.corrupt.begin(), check.corrupt.end());
  EXPECT_EQ(corrupt.size(), check.corrupt.size());
  ASSERT_EQ(corrupt.size(), 4u);
  EXPECT_TRUE(contains(corrupt["short"], "100 data bytes")) << corrupt["short"];
  EXPECT_TRUE(contains(corrupt["garbage"], "not a LatentRecord")) << corrupt["garbage"];
  EXPECT_TRUE(contains(corrupt["text-bad"], "pooled")) << corrupt["text-bad"];
  EXPECT_TRUE(contains(corrupt["entry 5 (img/good.png)"], "empty text_key"));

  // Without cached text only latents are checked.
  manifest.set_text_cached(false);
  const ManifestCheck latents_only = check_manifest(store, manifest);
  EXPECT_EQ(latents_only.missing, std::vector<std::string>{"missing"});
  EXPECT_EQ(latents_only.corrupt.size(), 2u);

  // A manifest whose records are all there and sound passes.
  wire::Manifest sound;
  sound.set_text_cached(true);
  auto* entry = sound.add_entries();
  entry->set_latent_key("good");
  entry->set_text_key("text-good");
  EXPECT_TRUE(check_manifest(store, sound).ok());
}

// lorapipe-cacher's --export_file, --import_file and --verify (cacher/tools.h) trust nothing they
// cannot parse: a manifest that is not one is not exported as an empty dataset, an export with a
// record of an unknown kind is refused rather than half imported, and a manifest entry without a
// key fails --verify, named.
TEST(CacheTools, ExportImportAndVerifyRefuseWhatTheyCannotTrust) {
  TempDir tmp;
  const fs::path source = tmp.path() / "source", keyless = tmp.path() / "keyless";
  wire::Manifest sound;
  sound.set_dataset_id("sound");
  sound.set_text_cached(true);
  auto* entry = sound.add_entries();
  entry->set_latent_key("good");
  entry->set_text_key("text-good");
  entry->set_path("img/good.png");
  {
    Store store = open_writer(source);
    store.put(Table::kLatents, {{"good", latent(512)}});
    store.put(Table::kTexts, {{"text-good", text(32)}});
    store.put(Table::kManifests, {{"sound", sound.SerializeAsString()},
                                  {"garbled", std::string("\x0a\xff", 2)}});
  }
  ToolOptions options;
  options.cache_dir = source;
  std::ostringstream out;
  try {
    export_dataset(options, "garbled", tmp.path() / "garbled.lpcache", out);
    ADD_FAILURE() << "a corrupt manifest was exported";
  } catch (const InputError& e) {
    EXPECT_TRUE(contains(e.what(), "manifest 'garbled' is corrupt")) << e.what();
  }
  EXPECT_FALSE(fs::exists(tmp.path() / "garbled.lpcache"));

  // A sound export whose first record (the manifest) is given a tag no lorapipe writes, with its
  // checksum made right again: what a newer format would look like.
  const fs::path file = tmp.path() / "sound.lpcache";
  export_dataset(options, "sound", file, out);
  std::string bytes;
  {
    std::ifstream in(file, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  const size_t magic = std::string_view("lorapipe-cache-export 1\n").size();
  ASSERT_EQ(bytes.compare(0, magic, "lorapipe-cache-export 1\n"), 0);
  ASSERT_EQ(bytes[magic + 8], 'm');
  bytes[magic + 8] = 'x';
  bytes.resize(bytes.size() - 16);
  const Hash128 checksum = hash_bytes(bytes);
  for (uint64_t v : {checksum.high, checksum.low}) {
    for (int i = 0; i < 8; ++i) bytes.push_back(static_cast<char>(v >> (8 * i)));
  }
  std::ofstream(file, std::ios::binary | std::ios::trunc) << bytes;
  ToolOptions into;
  into.cache_dir = tmp.path() / "into";
  try {
    import_dataset(into, file, out);
    ADD_FAILURE() << "an export with an unknown record was imported";
  } catch (const InputError& e) {
    EXPECT_TRUE(contains(e.what(), "unknown tag 'x'")) << e.what();
  }

  wire::Manifest no_key = sound;
  no_key.set_dataset_id("no-key");
  no_key.mutable_entries(0)->clear_latent_key();
  {
    Store store = open_writer(keyless);
    store.put(Table::kLatents, {{"good", latent(512)}});
    store.put(Table::kTexts, {{"text-good", text(32)}});
    store.put(Table::kManifests, {{"no-key", no_key.SerializeAsString()}});
  }
  options.cache_dir = keyless;
  std::ostringstream said;
  EXPECT_FALSE(verify(options, said));
  EXPECT_TRUE(contains(said.str(), "manifest no-key: entry 0 (img/good.png)")) << said.str();
}

}  // namespace
}  // namespace lorapipe::cacher
