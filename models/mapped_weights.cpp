#include "models/mapped_weights.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <ATen/ATen.h>

#include <cerrno>
#include <cstring>

#include "common/error.h"
#include "common/log.h"
#include "models/safetensors.h"

namespace lorapipe::models {
namespace {
thread_local MappedWeights* g_current = nullptr;
}  // namespace

// One file mapped whole, private and writable (see the header), unmapped when the last tensor
// viewing it goes.
struct MappedWeights::Mapping {
  char* base = nullptr;
  size_t size = 0;
  uint64_t data_offset = 0;  // where the data section starts in the file
  ~Mapping() {
    if (base != nullptr) munmap(base, size);
  }
};

MappedWeights::MappedWeights() : previous_(g_current) { g_current = this; }
MappedWeights::~MappedWeights() { g_current = previous_; }
MappedWeights* MappedWeights::current() { return g_current; }

std::shared_ptr<MappedWeights::Mapping> MappedWeights::mapping_of(const SafetensorsFile& file) {
  const std::string key = file.path().string();
  if (auto found = mappings_.find(key); found != mappings_.end()) return found->second;
  auto mapping = std::make_shared<Mapping>();
  mappings_[key] = mapping;  // a file that cannot be mapped again is copied from, and tried once
  const int fd = ::open(key.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return mapping;
  struct stat st {};
  if (fstat(fd, &st) == 0 && st.st_size >= 8) {
    void* p = mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ | PROT_WRITE, MAP_PRIVATE,
                   fd, 0);
    if (p != MAP_FAILED) {
      mapping->base = static_cast<char*>(p);
      mapping->size = static_cast<size_t>(st.st_size);
    }
  }
  ::close(fd);
  if (mapping->base == nullptr) return mapping;
  uint64_t header = 0;
  for (int i = 7; i >= 0; --i) header = (header << 8) | static_cast<unsigned char>(mapping->base[i]);
  // The same file as the loader's: its data section has the size the loader's header gave it
  // (a file replaced meanwhile is copied from the loader's own mapping instead).
  uint64_t data_size = 0;
  for (const TensorInfo& t : file.tensors()) data_size = std::max(data_size, t.end);
  if (header > mapping->size - 8 || mapping->size - 8 - header != data_size) {
    munmap(mapping->base, mapping->size);
    mapping->base = nullptr;
    return mapping;
  }
  mapping->data_offset = 8 + header;
  return mapping;
}

at::Tensor MappedWeights::share(const SafetensorsFile& file, const at::Tensor& tensor,
                                const at::Tensor& target) {
  const auto copied = [&] {
    ++copied_tensors_;
    copied_bytes_ += static_cast<int64_t>(target.nbytes());
    return at::Tensor();
  };
  if (!target.device().is_cpu() || !tensor.device().is_cpu() ||
      tensor.scalar_type() != target.scalar_type() || tensor.sizes() != target.sizes() ||
      !tensor.is_contiguous() || tensor.numel() == 0 || file.tensors().empty()) {
    return copied();
  }
  // Where the tensor lies in the loader's mapping of the data section (the loader fetched a view
  // of it, or of a part of it: a slice of a fused q/k/v is as good as a whole tensor).
  const TensorInfo& first = file.tensors().front();
  const char* data = file.bytes(first).data() - first.begin;
  const auto* at = static_cast<const char*>(tensor.data_ptr());
  uint64_t data_size = 0;
  for (const TensorInfo& t : file.tensors()) data_size = std::max(data_size, t.end);
  if (at < data || at + tensor.nbytes() > data + data_size) return copied();
  const std::shared_ptr<Mapping> mapping = mapping_of(file);
  if (mapping->base == nullptr) return copied();
  char* view = mapping->base + mapping->data_offset + (at - data);
  if (reinterpret_cast<uintptr_t>(view) % tensor.element_size() != 0) return copied();
  ++mapped_tensors_;
  mapped_bytes_ += static_cast<int64_t>(tensor.nbytes());
  return at::from_blob(
      view, tensor.sizes(), [mapping](void*) {}, tensor.options());
}

void log_mapped_weights(const MappedWeights& mapped, const char* stage) {
  const auto mib = [](int64_t bytes) { return std::to_string(bytes >> 20) + " MiB"; };
  if (mapped.mapped_tensors() == 0) {
    LP_LOG(kWarning, stage) << "--map_weights: no weight could be the model file's own pages ("
                            << mapped.copied_tensors() << " copied, " << mib(mapped.copied_bytes())
                            << "): the file holds them in another dtype than the model's "
                               "(--mixed_precision) or layout, or the model is not on the CPU";
    return;
  }
  LP_LOG(kInfo, stage) << "--map_weights: " << mapped.mapped_tensors() << " weights ("
                       << mib(mapped.mapped_bytes())
                       << ") are the model file's pages, shared with every process that maps "
                          "them; "
                       << mapped.copied_tensors() << " (" << mib(mapped.copied_bytes())
                       << ") copied, converted on the way";
}

}  // namespace lorapipe::models
