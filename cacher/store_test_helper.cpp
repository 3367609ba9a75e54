// A separate process for store_test.cpp: the writer it kills with SIGKILL, the readers that read
// while the test writes, and a writer that holds the lock. It reports on stdout, one line per
// event, written with write(2) so nothing sits in a buffer when it dies:
//
//   write DIR FIRST COUNT INITIAL_MAP_BYTES
//       Opens DIR as the writer and puts batch FIRST, FIRST+1, ... (COUNT of them, 0: forever),
//       each in one put, printing "committed N" after each commit returns. A failed put prints
//       "error MESSAGE" and exits 3.
//   read DIR LAST THREADS TIMEOUT_MS
//       Opens DIR read-only, prints "open", then THREADS threads each wait until batches 0..LAST
//       are all visible, checking that every batch is whole (never partly visible) and intact,
//       and that a batch once seen stays. Prints "saw LAST" and exits 0; "error ..." and exits 1
//       on a check that fails; exits 2 on timeout.
//   hold DIR
//       Opens DIR as the writer, prints "open" and sleeps until killed.

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <exception>
#include <string>
#include <thread>
#include <vector>

#include "cacher/store.h"
#include "cacher/store_test_batches.h"

namespace {

using lorapipe::cacher::Store;
using lorapipe::cacher::StoreOptions;
using lorapipe::cacher::Table;
namespace t = lorapipe::cacher::testing;

void say(const std::string& line) {
  const std::string text = line + "\n";
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(STDOUT_FILENO, text.data() + done, text.size() - done);
    if (n <= 0) std::_Exit(4);  // the test is gone
    done += static_cast<size_t>(n);
  }
}

int write_batches(const std::string& dir, uint64_t first, uint64_t count, uint64_t initial_map) {
  StoreOptions options;
  options.dir = dir;
  options.initial_map_bytes = initial_map;
  Store store = Store::open(options);
  for (uint64_t n = first; count == 0 || n < first + count; ++n) {
    try {
      store.put(Table::kLatents, t::make_batch(n));
    } catch (const std::exception& e) {
      say(std::string("error ") + e.what());
      return 3;
    }
    say("committed " + std::to_string(n));
  }
  return 0;
}

int read_batches(const std::string& dir, uint64_t last, int threads, int timeout_ms) {
  StoreOptions options;
  options.dir = dir;
  options.read_only = true;
  const Store store = Store::open(options);
  say("open");
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  std::atomic<int> status{0};
  std::vector<std::thread> workers;
  for (int w = 0; w < threads; ++w) {
    workers.emplace_back([&] {
      try {
        uint64_t whole = 0;  // batches 0..whole-1 seen whole
        while (whole <= last && status == 0) {
          // Re-check an already seen batch now and then: it must never vanish or change.
          if (whole > 0) {
            const t::BatchState old = t::check_batch(store, Table::kLatents, whole / 2);
            if (old.present != t::kRecordsPerBatch || old.damaged != 0) {
              say("error batch " + std::to_string(whole / 2) + " changed after it was seen");
              status = 1;
              return;
            }
          }
          const t::BatchState state = t::check_batch(store, Table::kLatents, whole);
          if (state.damaged != 0) {
            say("error batch " + std::to_string(whole) + " has damaged records");
            status = 1;
            return;
          }
          if (state.present == t::kRecordsPerBatch) {
            ++whole;
            continue;
          }
          if (state.present != 0) {
            say("error batch " + std::to_string(whole) +
                " is partly visible: " + std::to_string(state.present) + " records");
            status = 1;
            return;
          }
          if (std::chrono::steady_clock::now() > deadline) {
            say("error timeout waiting for batch " + std::to_string(whole));
            status = 2;
            return;
          }
          std::this_thread::sleep_for(std::chrono::microseconds(200));
        }
      } catch (const std::exception& e) {
        say(std::string("error ") + e.what());
        status = 1;
      }
    });
  }
  for (auto& worker : workers) worker.join();
  if (status == 0) say("saw " + std::to_string(last));
  return status;
}

}  // namespace

int main(int argc, char** argv) {
  const std::vector<std::string> args(argv + 1, argv + argc);
  try {
    if (args.size() == 5 && args[0] == "write") {
      return write_batches(args[1], std::stoull(args[2]), std::stoull(args[3]),
                           std::stoull(args[4]));
    }
    if (args.size() == 5 && args[0] == "read") {
      return read_batches(args[1], std::stoull(args[2]), std::stoi(args[3]), std::stoi(args[4]));
    }
    if (args.size() == 2 && args[0] == "hold") {
      StoreOptions options;
      options.dir = args[1];
      Store store = Store::open(options);
      say("open");
      for (;;) pause();
    }
  } catch (const std::exception& e) {
    say(std::string("error ") + e.what());
    return 1;
  }
  say("error usage: write DIR FIRST COUNT INITIAL_MAP | read DIR LAST THREADS TIMEOUT_MS | hold "
      "DIR");
  return 64;
}
