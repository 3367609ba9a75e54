#pragma once
// The CPU's counterpart of torch.cuda.memory_allocated / max_memory_allocated: every CPU tensor's
// storage allocated after install() passes through a counter of the bytes alive and the most
// alive at once, free of the heap's slack. Benches report peaks with it; tests check that a
// graph keeps only what it should.

#include <c10/core/Allocator.h>

#include <cstddef>
#include <mutex>
#include <unordered_map>

namespace lorapipe::models {

class TensorMemoryCounter final : public c10::Allocator {
 public:
  // Installs the process's counter as LibTorch's CPU allocator (once; later calls return it).
  // Storage allocated before is neither counted nor harmed: each block is freed by the deleter
  // it was made with.
  static TensorMemoryCounter& install();
  // The counter where install() ran, else null.
  static TensorMemoryCounter* installed() { return instance_; }

  c10::DataPtr allocate(size_t bytes) override;
  c10::DeleterFnPtr raw_deleter() const override { return &TensorMemoryCounter::release; }
  void copy_data(void* dest, const void* src, size_t count) const override {
    default_copy_data(dest, src, count);
  }

  size_t alive_bytes();
  size_t peak_bytes();
  double alive_mib() { return static_cast<double>(alive_bytes()) / (1 << 20); }
  double peak_mib() { return static_cast<double>(peak_bytes()) / (1 << 20); }
  void reset_peak();  // the peak restarts from what is alive now
  // A card's capacity on the CPU: an allocation that would take the counted bytes past `bytes`
  // throws c10::OutOfMemoryError, as CUDA's allocator does when the device is full (0: none).
  // `lorapipe plan --probe` on the CPU stops a setting there as it would on the card.
  void set_limit(size_t bytes);

 private:
  TensorMemoryCounter();
  static void release(void* data);

  static inline TensorMemoryCounter* instance_ = nullptr;
  c10::Allocator* base_;
  c10::DeleterFnPtr base_deleter_ = nullptr;
  std::mutex mutex_;
  std::unordered_map<void*, size_t> sizes_;
  size_t alive_ = 0, peak_ = 0, limit_ = 0;
};

}  // namespace lorapipe::models
