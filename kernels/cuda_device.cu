// CUDA runtime queries for kernels/: device count and a one-line description per device.
#include <cuda_runtime.h>

#include <cstdio>

#include "kernels/cuda_device.h"

namespace lorapipe::kernels {

bool built_with_cuda() { return true; }

int cuda_device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver" error so later calls start clean
    return 0;
  }
  return count;
}

std::string cuda_device_name(int index) {
  cudaDeviceProp prop{};
  if (index < 0 || index >= cuda_device_count() ||
      cudaGetDeviceProperties(&prop, index) != cudaSuccess) {
    return {};
  }
  char line[512];
  std::snprintf(line, sizeof(line), "%s (sm_%d%d, %.1f GiB)", prop.name, prop.major, prop.minor,
                static_cast<double>(prop.totalGlobalMem) / (1024.0 * 1024.0 * 1024.0));
  return line;
}

int cuda_compute_capability(int index) {
  cudaDeviceProp prop{};
  if (index < 0 || index >= cuda_device_count() ||
      cudaGetDeviceProperties(&prop, index) != cudaSuccess) {
    return 0;
  }
  return prop.major * 10 + prop.minor;
}

std::string cuda_device_uuid(int index) {
  cudaDeviceProp prop{};
  if (index < 0 || index >= cuda_device_count() ||
      cudaGetDeviceProperties(&prop, index) != cudaSuccess) {
    return {};
  }
  std::string uuid = "GPU-";
  for (int i = 0; i < 16; ++i) {
    if (i == 4 || i == 6 || i == 8 || i == 10) uuid += '-';
    char hex[3];
    std::snprintf(hex, sizeof(hex), "%02x", static_cast<unsigned char>(prop.uuid.bytes[i]));
    uuid += hex;
  }
  return uuid;
}

}  // namespace lorapipe::kernels
