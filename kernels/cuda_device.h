#pragma once
// What the CUDA runtime linked into kernels/ sees. Raw runtime calls only (no LibTorch), so
// kernels/ compiles with any nvcc whatever CUDA version torch was built with.

#include <string>

namespace lorapipe::kernels {

// True when this build compiled the CUDA kernels (LORAPIPE_CUDA found nvcc).
bool built_with_cuda();

// Number of CUDA devices the runtime can use; 0 without a driver or a GPU. Never throws.
int cuda_device_count();

// "NVIDIA H200 (sm_90, 139.8 GiB)" for device `index`; empty when there is no such device.
std::string cuda_device_name(int index);

// Device `index`'s compute capability as major * 10 + minor (90 for an H100 or H200, 89 for an
// RTX 4090); 0 when there is no such device.
int cuda_compute_capability(int index);

// Device `index`'s UUID as nvidia-smi prints it ("GPU-" and 32 hex digits in 8-4-4-4-12 groups);
// empty when there is no such device. The same physical GPU has the same UUID in every process,
// whatever index CUDA_VISIBLE_DEVICES gives it there.
std::string cuda_device_uuid(int index);

}  // namespace lorapipe::kernels
