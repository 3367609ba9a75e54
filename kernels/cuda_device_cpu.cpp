// The CPU-only build of kernels/cuda_device.h: no CUDA runtime, no devices.
#include "kernels/cuda_device.h"

namespace lorapipe::kernels {

bool built_with_cuda() { return false; }
int cuda_device_count() { return 0; }
std::string cuda_device_name(int) { return {}; }
int cuda_compute_capability(int) { return 0; }
std::string cuda_device_uuid(int) { return {}; }

}  // namespace lorapipe::kernels
