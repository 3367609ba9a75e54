#include "runtime/workers.h"

#include <algorithm>
#include <atomic>

namespace lorapipe::runtime {

WorkerPool::WorkerPool(int threads, size_t max_queued) : max_queued_(std::max<size_t>(1, max_queued)) {
  const int count = std::max(1, threads);
  threads_.reserve(count);
  for (int i = 0; i < count; ++i) threads_.emplace_back([this] { work(); });
}

WorkerPool::~WorkerPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    closing_ = true;
    queue_.clear();
  }
  has_job_.notify_all();
  has_room_.notify_all();
  for (std::thread& t : threads_) t.join();
}

void WorkerPool::work() {
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    has_job_.wait(lock, [&] { return closing_ || !queue_.empty(); });
    if (queue_.empty()) return;  // closing
    Job job = std::move(queue_.front());
    queue_.pop_front();
    ++running_;
    has_room_.notify_all();
    lock.unlock();
    std::exception_ptr error;
    try {
      job();
    } catch (...) {
      error = std::current_exception();
    }
    job = nullptr;  // what the job captured goes before the count says it is done
    lock.lock();
    --running_;
    if (error && !failure_) {
      failure_ = error;
      queue_.clear();  // the stage stops at its next check; nothing more of this work runs
    }
    has_room_.notify_all();
  }
}

bool WorkerPool::try_submit(Job job) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (failure_) std::rethrow_exception(failure_);
  if (queue_.size() >= max_queued_) return false;
  queue_.push_back(std::move(job));
  lock.unlock();
  has_job_.notify_one();
  return true;
}

void WorkerPool::submit(Job job) {
  std::unique_lock<std::mutex> lock(mutex_);
  has_room_.wait(lock, [&] { return failure_ || queue_.size() < max_queued_; });
  if (failure_) std::rethrow_exception(failure_);
  queue_.push_back(std::move(job));
  lock.unlock();
  has_job_.notify_one();
}

bool WorkerPool::full() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return queue_.size() >= max_queued_;
}

size_t WorkerPool::pending() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return queue_.size() + running_;
}

void WorkerPool::rethrow_failure() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (failure_) std::rethrow_exception(failure_);
}

void WorkerPool::wait_idle() {
  std::unique_lock<std::mutex> lock(mutex_);
  has_room_.wait(lock, [&] { return failure_ || (queue_.empty() && running_ == 0); });
  if (failure_) std::rethrow_exception(failure_);
}

void parallel_for(size_t n, int threads, const std::function<void(size_t)>& fn) {
  if (n == 0) return;
  const size_t count = std::min<size_t>(std::max(1, threads), n);
  std::atomic<size_t> next{0};
  std::atomic<bool> failed{false};
  std::mutex mutex;
  std::exception_ptr first;
  auto body = [&] {
    for (size_t i = next++; i < n && !failed; i = next++) {
      try {
        fn(i);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mutex);
        if (!first) first = std::current_exception();
        failed = true;
      }
    }
  };
  std::vector<std::thread> workers;
  workers.reserve(count - 1);
  for (size_t t = 1; t < count; ++t) workers.emplace_back(body);
  body();  // the calling thread is one of the workers
  for (std::thread& w : workers) w.join();
  if (first) std::rethrow_exception(first);
}

}  // namespace lorapipe::runtime
