#include "models/device.h"

#include <torch/cuda.h>

#include <charconv>

#include "common/error.h"
#include "kernels/cuda_device.h"

namespace lorapipe::models {

c10::Device resolve_device(std::string_view spec) {
  const int64_t gpus = static_cast<int64_t>(torch::cuda::device_count());
  if (spec == "auto") return gpus > 0 ? c10::Device(c10::kCUDA, 0) : c10::Device(c10::kCPU);
  if (spec == "cpu") return c10::Device(c10::kCPU);
  constexpr std::string_view kCuda = "cuda";
  if (spec.substr(0, kCuda.size()) != kCuda) {
    throw InputError("--device='" + std::string(spec) +
                     "' is not a device: use auto, cpu, cuda or cuda:N");
  }
  int64_t index = 0;
  std::string_view rest = spec.substr(kCuda.size());
  if (!rest.empty()) {
    const std::string_view digits = rest.substr(1);
    auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), index);
    if (rest[0] != ':' || digits.empty() || ec != std::errc() ||
        end != digits.data() + digits.size() || index < 0) {
      throw InputError("--device='" + std::string(spec) +
                       "' is not a device: use auto, cpu, cuda or cuda:N");
    }
  }
  if (index >= gpus) {
    throw InputError("--device='" + std::string(spec) + "' but this machine has " +
                     std::to_string(gpus) + " CUDA device(s) visible to LibTorch");
  }
  return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(index));
}

std::string describe_device(const c10::Device& device) {
  if (!device.is_cuda()) return device.str();
  const std::string name = kernels::cuda_device_name(device.index());
  return name.empty() ? device.str() : device.str() + " (" + name + ")";
}

bool is_out_of_memory(const std::exception& e) {
  if (dynamic_cast<const c10::OutOfMemoryError*>(&e) != nullptr) return true;
  if (dynamic_cast<const std::bad_alloc*>(&e) != nullptr) return true;
  if (const auto* c10_error = dynamic_cast<const c10::Error*>(&e)) {
    const std::string message = c10_error->what_without_backtrace();
    // ALLOC_FAILED: cuBLAS's and cuDNN's own workspaces (CUBLAS_STATUS_ALLOC_FAILED, ...).
    for (const char* says : {"not enough memory", "out of memory", "can't allocate memory",
                             "Cannot allocate memory", "ALLOC_FAILED"}) {
      if (message.find(says) != std::string::npos) return true;
    }
  }
  return false;
}

}  // namespace lorapipe::models
