#pragma once
// The stages' worker threads: a bounded pool that runs jobs beside a stage's socket loop (the
// cacher's encoder, so requests are answered while a batch encodes), and parallel_for for a
// fixed amount of work (preprocess's probing and decoding).
//
// Errors: an exception a job throws is kept, the jobs still queued are dropped, and the stage's
// own thread gets it rethrown at its next rethrow_failure() / wait_idle(): a worker never calls
// std::terminate and never swallows a failure. Jobs that want to skip bad input catch it
// themselves; what escapes a job is the stage's failure.

#include <condition_variable>
#include <cstddef>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace lorapipe::runtime {

class WorkerPool {
 public:
  using Job = std::function<void()>;

  // `threads` workers (at least 1); at most `max_queued` jobs wait beyond those running.
  WorkerPool(int threads, size_t max_queued);
  // Drops the jobs still queued, waits for the running ones and joins; failures are dropped too
  // (call wait_idle first to see them).
  ~WorkerPool();
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  // Queues `job` unless max_queued jobs already wait; false then. Rethrows an earlier failure.
  bool try_submit(Job job);
  // Queues `job`, waiting for room. Rethrows an earlier failure (also one during the wait).
  void submit(Job job);
  // True while max_queued jobs wait.
  bool full() const;
  // Jobs queued or running.
  size_t pending() const;
  // Rethrows the first failure of any job, once it happened; else returns.
  void rethrow_failure();
  // Waits until every queued job has run, or one failed; then rethrows that failure.
  void wait_idle();

 private:
  void work();

  const size_t max_queued_;
  mutable std::mutex mutex_;
  std::condition_variable has_job_;   // workers wait for a job (or closing)
  std::condition_variable has_room_;  // submit and wait_idle wait for progress
  std::deque<Job> queue_;
  size_t running_ = 0;
  bool closing_ = false;
  std::exception_ptr failure_;
  std::vector<std::thread> threads_;
};

// Runs fn(i) for every i in [0, n) on up to `threads` threads (the calling thread waits). When
// an fn throws, the others finish their current i and take no more, and the first exception is
// rethrown here.
void parallel_for(size_t n, int threads, const std::function<void(size_t)>& fn);

}  // namespace lorapipe::runtime
