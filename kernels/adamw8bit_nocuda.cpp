// The CPU-only build of kernels/adamw8bit.h's CUDA half: no device, so the plan and the managed
// allocations refuse with a clear error (the CPU reference is always built).
#include <stdexcept>
#include <string>

#include "kernels/adamw8bit.h"

namespace lorapipe::kernels {
namespace {
[[noreturn]] void no_cuda(const char* what) {
  throw std::runtime_error(std::string(what) +
                           ": this build of lorapipe has no CUDA kernels "
                           "(configured without nvcc)");
}
}  // namespace

AdamW8bitCudaPlan::AdamW8bitCudaPlan(const AdamW8bitTensor*, size_t, ParamDtype dtype, int)
    : dtype_(dtype) {
  no_cuda("AdamW8bit on CUDA");
}
AdamW8bitCudaPlan::~AdamW8bitCudaPlan() = default;
void AdamW8bitCudaPlan::step(const AdamW8bitStep*, size_t, void*) const {
  no_cuda("AdamW8bit on CUDA");
}
void AdamW8bitCudaPlan::retarget(const AdamW8bitTensor*, size_t, void*) {
  no_cuda("AdamW8bit on CUDA");
}
void* alloc_managed(size_t, int) { return nullptr; }
void free_managed(void*) {}
bool managed_memory_supported(int) { return false; }
void prefetch_managed(const void*, size_t, int, void*) {}

}  // namespace lorapipe::kernels
