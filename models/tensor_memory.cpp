#include "models/tensor_memory.h"

#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <stdexcept>

namespace lorapipe::models {

TensorMemoryCounter& TensorMemoryCounter::install() {
  static TensorMemoryCounter* counter = [] {
    auto* c = new TensorMemoryCounter();  // lives to the end: blocks it handed out outlive scopes
    c10::SetCPUAllocator(c, /*priority=*/100);
    return c;
  }();
  return *counter;
}

// It hands out the default allocator's own blocks (data and context the same pointer, which
// LibTorch's raw_allocate callers require) and keeps each block's size until it is freed.
TensorMemoryCounter::TensorMemoryCounter() : base_(c10::GetDefaultCPUAllocator()) {
  instance_ = this;
  base_deleter_ = base_->raw_deleter();
  if (base_deleter_ == nullptr) throw std::runtime_error("the CPU allocator has no raw deleter");
}

c10::DataPtr TensorMemoryCounter::allocate(size_t bytes) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_CHECK_WITH(OutOfMemoryError, limit_ == 0 || alive_ + bytes <= limit_,
                     "CPU tensor memory limit: tried to allocate ", bytes, " bytes with ", alive_,
                     " of ", limit_, " allocated (TensorMemoryCounter::set_limit)");
  }
  c10::DataPtr inner = base_->allocate(bytes);
  const c10::Device device = inner.device();
  void* data = inner.release_context();  // ours to free now, through release()
  {
    std::lock_guard<std::mutex> lock(mutex_);
    sizes_[data] = bytes;
    alive_ += bytes;
    peak_ = std::max(peak_, alive_);
  }
  return {data, data, &TensorMemoryCounter::release, device};
}

size_t TensorMemoryCounter::alive_bytes() {
  std::lock_guard<std::mutex> lock(mutex_);
  return alive_;
}

size_t TensorMemoryCounter::peak_bytes() {
  std::lock_guard<std::mutex> lock(mutex_);
  return peak_;
}

void TensorMemoryCounter::set_limit(size_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  limit_ = bytes;
}

void TensorMemoryCounter::reset_peak() {
  std::lock_guard<std::mutex> lock(mutex_);
  peak_ = alive_;
}

void TensorMemoryCounter::release(void* data) {
  TensorMemoryCounter* self = instance_;
  {
    std::lock_guard<std::mutex> lock(self->mutex_);
    auto it = self->sizes_.find(data);
    if (it != self->sizes_.end()) {
      self->alive_ -= it->second;
      self->sizes_.erase(it);
    }
  }
  self->base_deleter_(data);
}

}  // namespace lorapipe::models
