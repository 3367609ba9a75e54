#pragma once
// Base weights that are the model file's own pages rather than a copy of them (--map_weights).
//
// While a MappedWeights lives on a thread, loading a model from safetensors files on that thread
// (models/weights.h's file-reading load_into, which every family's loader goes through) makes each
// CPU parameter or buffer whose tensor the file holds as the module holds it — same dtype, same
// shape, contiguous, aligned, no conversion — a view of the file's mapped pages; the others are
// copied as usual. Two processes that load the same file this way (a trainer and the sampler
// rendering its previews on the same machine) share those pages in the page cache: the second
// adds no copy of the model, and neither counts them as its private memory.
//
// The pages are mapped private and writable: nothing here writes them, and if anything did (a
// --base_weights merge, the sampler's --merge_lora), the kernel would copy that page for the
// writing process alone: the file and the other process never see a write. They are not
// allocated through LibTorch's allocator, so the CPU's allocated-tensor counter
// (models/tensor_memory.h) does not count them.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>

namespace lorapipe::models {

class SafetensorsFile;

class MappedWeights {
 public:
  MappedWeights();
  ~MappedWeights();
  MappedWeights(const MappedWeights&) = delete;
  MappedWeights& operator=(const MappedWeights&) = delete;

  // The one active on this thread, or null.
  static MappedWeights* current();

  // What loading has done under this scope so far: tensors (and their bytes) that are views of a
  // file's pages, and tensors copied because they needed a conversion.
  int64_t mapped_tensors() const { return mapped_tensors_; }
  int64_t mapped_bytes() const { return mapped_bytes_; }
  int64_t copied_tensors() const { return copied_tensors_; }
  int64_t copied_bytes() const { return copied_bytes_; }

  // A view of the same bytes as `tensor` (a view into `file`'s mapping, as the loader fetched it)
  // in a mapping of the file that outlives `file`, when it can stand for `target` as is (CPU,
  // same dtype and shape, contiguous, aligned); else an undefined tensor (and the caller copies).
  // Counts either way.
  at::Tensor share(const SafetensorsFile& file, const at::Tensor& tensor, const at::Tensor& target);

 private:
  struct Mapping;
  std::shared_ptr<Mapping> mapping_of(const SafetensorsFile& file);

  std::map<std::string, std::shared_ptr<Mapping>> mappings_;
  MappedWeights* previous_ = nullptr;
  int64_t mapped_tensors_ = 0, mapped_bytes_ = 0, copied_tensors_ = 0, copied_bytes_ = 0;
};

// Logs, as `stage`, what a load under `mapped` shared and what it copied.
void log_mapped_weights(const MappedWeights& mapped, const char* stage);

}  // namespace lorapipe::models
