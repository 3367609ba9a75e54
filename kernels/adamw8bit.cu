// CUDA AdamW with blockwise 8-bit state (kernels/adamw8bit.h states the algorithm).
//
// One launch updates every tensor of the optimizer: thread block b takes 256 consecutive
// elements of one tensor (a table of first blocks maps b to its tensor), one element per thread.
// The four 256-entry tables (signed and unsigned codes, and their midpoints for the nearest-code
// search) are loaded into shared memory once per thread block.
//
// Memory traffic per element and step, the bound this kernel aims for: read the gradient and the
// parameter, write the parameter (2 + 2 + 2 bytes in bf16, 4 + 4 + 4 in fp32), read and write
// two state bytes (4 bytes), plus 16 bytes of absmax per 256 elements: about 10 bytes per bf16
// parameter. The arithmetic (a 2 x 8-step search in shared memory, one block-wide max) hides
// under those loads.
//
// Built with --fmad=false and IEEE division and square root (nvcc's defaults for the latter), so
// every element gets exactly the fp32 operations of adamw8bit_rules.h that the CPU reference runs.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/adamw8bit.h"
#include "kernels/adamw8bit_rules.h"

namespace lorapipe::kernels {
namespace {

namespace rules = adamw8bit_rules;

constexpr int kThreads = static_cast<int>(kAdamW8bitBlock);

void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    throw std::runtime_error(std::string("adamw8bit: ") + what + ": " + cudaGetErrorString(status));
  }
}

// Makes `device` current, as torch.cuda.set_device does, and leaves it so: switching back would
// create a CUDA context on the device that was current before (cudaSetDevice initialises one),
// hundreds of MB on GPU 0 for every rank on another GPU.
void use_device(int device) {
  int current = 0;
  check(cudaGetDevice(&current), "cudaGetDevice");
  if (current != device) check(cudaSetDevice(device), "cudaSetDevice");
}

struct GroupSteps {
  AdamW8bitStep step[kAdamW8bitMaxGroups];
};

template <typename T>
struct Io;
template <>
struct Io<float> {
  static __device__ float load(const void* p, int64_t i) { return static_cast<const float*>(p)[i]; }
  static __device__ void store(void* p, int64_t i, float x) { static_cast<float*>(p)[i] = x; }
};
template <>
struct Io<__nv_bfloat16> {
  static __device__ float load(const void* p, int64_t i) {
    return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
  }
  static __device__ void store(void* p, int64_t i, float x) {
    static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(x);
  }
};
template <>
struct Io<__half> {
  static __device__ float load(const void* p, int64_t i) {
    return __half2float(static_cast<const __half*>(p)[i]);
  }
  static __device__ void store(void* p, int64_t i, float x) {
    static_cast<__half*>(p)[i] = __float2half_rn(x);
  }
};

// Block-wide max of a non-negative value (max is exact in any order).
__device__ float block_max(float x, float* scratch) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) scratch[warp] = x;
  __syncthreads();
  if (warp == 0) {
    x = lane < kThreads / 32 ? scratch[lane] : 0.f;
    for (int offset = 16; offset > 0; offset >>= 1) {
      x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
    }
    if (lane == 0) scratch[0] = x;
  }
  __syncthreads();
  const float out = scratch[0];
  __syncthreads();
  return out;
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    adamw8bit_kernel(const AdamW8bitTensor* table, const int64_t* first_block, int count,
                     const float* maps, GroupSteps steps) {
  __shared__ float code1[256], code2[256], mid1[256], mid2[256];
  __shared__ float scratch[kThreads / 32];
  __shared__ int tensor_index;
  const int tid = threadIdx.x;
  code1[tid] = maps[tid];
  code2[tid] = maps[256 + tid];
  mid1[tid] = maps[512 + tid];
  mid2[tid] = maps[768 + tid];
  if (tid == 0) {
    int lo = 0, hi = count - 1;  // the last tensor whose first block is <= blockIdx.x
    while (lo < hi) {
      const int probe = (lo + hi + 1) / 2;
      if (first_block[probe] <= static_cast<int64_t>(blockIdx.x))
        lo = probe;
      else
        hi = probe - 1;
    }
    tensor_index = lo;
  }
  __syncthreads();

  const AdamW8bitTensor t = table[tensor_index];
  // No gradient this step: left alone. The condition is the same for every thread of the block
  // (one tensor per block), so the whole block returns and no thread waits at a barrier after.
  if (t.grad == nullptr) return;
  const AdamW8bitStep& s = steps.step[t.group];
  const int64_t block = static_cast<int64_t>(blockIdx.x) - first_block[tensor_index];
  const int64_t i = block * kAdamW8bitBlock + tid;
  const bool valid = i < t.numel;

  float g = 0.f, m = 0.f, v = 0.f;
  if (valid) {
    g = Io<T>::load(t.grad, i);
    if (t.quantized) {
      m = code1[static_cast<const uint8_t*>(t.state1)[i]] * t.absmax1[block];
      v = code2[static_cast<const uint8_t*>(t.state2)[i]] * t.absmax2[block];
    } else {
      m = static_cast<const float*>(t.state1)[i];
      v = static_cast<const float*>(t.state2)[i];
    }
    if (rules::is_finite(g)) rules::update_moments(s, g, m, v);
  }
  // Uniform across the thread block (one tensor per block), so the barriers inside are safe.
  float max1 = 0.f, max2 = 0.f;
  if (t.quantized) {
    max1 = block_max(valid ? fabsf(m) : 0.f, scratch);
    max2 = block_max(valid ? fabsf(v) : 0.f, scratch);
  }
  if (!valid) return;
  if (rules::is_finite(g)) {
    Io<T>::store(t.param, i, rules::update_param(s, Io<T>::load(t.param, i), m, v));
  }
  if (t.quantized) {
    const int index1 = rules::nearest_code(mid1, rules::normalized(m, max1));
    static_cast<uint8_t*>(t.state1)[i] = static_cast<uint8_t>(rules::sign_fixed(code1, index1, m));
    static_cast<uint8_t*>(t.state2)[i] =
        static_cast<uint8_t>(rules::nearest_code(mid2, rules::normalized(v, max2)));
    if (tid == 0) {
      t.absmax1[block] = max1;
      t.absmax2[block] = max2;
    }
  } else if (rules::is_finite(g)) {
    static_cast<float*>(t.state1)[i] = m;
    static_cast<float*>(t.state2)[i] = v;
  }
}

}  // namespace

AdamW8bitCudaPlan::AdamW8bitCudaPlan(const AdamW8bitTensor* tensors, size_t count, ParamDtype dtype,
                                     int device)
    : count_(count), dtype_(dtype), device_(device) {
  if (device_ < 0) check(cudaGetDevice(&device_), "cudaGetDevice");
  if (count == 0) return;
  std::vector<int64_t> first(count + 1, 0);
  for (size_t i = 0; i < count; ++i) {
    if (tensors[i].group < 0 || tensors[i].group >= kAdamW8bitMaxGroups) {
      throw std::invalid_argument("adamw8bit: tensor " + std::to_string(i) + " has group " +
                                  std::to_string(tensors[i].group));
    }
    first[i + 1] = first[i] + adamw8bit_blocks(tensors[i].numel);
    groups_ = std::max(groups_, tensors[i].group + 1);
  }
  blocks_ = first[count];
  layout_.assign(tensors, tensors + count);
  std::vector<float> maps(4 * 256);
  const auto mid1 = code_midpoints(dynamic_map_signed());
  const auto mid2 = code_midpoints(dynamic_map_unsigned());
  for (int k = 0; k < 256; ++k) {
    maps[k] = dynamic_map_signed()[k];
    maps[256 + k] = dynamic_map_unsigned()[k];
    maps[512 + k] = mid1[k];
    maps[768 + k] = mid2[k];
  }
  use_device(device_);
  try {
    check(cudaMalloc(&table_, count * sizeof(AdamW8bitTensor)), "cudaMalloc");
    check(cudaMalloc(&offsets_, first.size() * sizeof(int64_t)), "cudaMalloc");
    check(cudaMalloc(&maps_, maps.size() * sizeof(float)), "cudaMalloc");
    check(cudaMemcpy(table_, tensors, count * sizeof(AdamW8bitTensor), cudaMemcpyHostToDevice),
          "cudaMemcpy");
    check(cudaMemcpy(offsets_, first.data(), first.size() * sizeof(int64_t),
                     cudaMemcpyHostToDevice),
          "cudaMemcpy");
    check(cudaMemcpy(maps_, maps.data(), maps.size() * sizeof(float), cudaMemcpyHostToDevice),
          "cudaMemcpy");
    // From pageable memory cudaMemcpy may return before the copy lands, and the step's kernel
    // runs on torch's stream, which need not wait for the legacy default one: landed first.
    check(cudaStreamSynchronize(nullptr), "cudaStreamSynchronize");
  } catch (...) {
    // The destructor does not run for a constructor that throws: free what was allocated.
    cudaFree(table_);
    cudaFree(offsets_);
    cudaFree(maps_);
    throw;
  }
}

AdamW8bitCudaPlan::~AdamW8bitCudaPlan() {
  if (table_ == nullptr && offsets_ == nullptr && maps_ == nullptr) return;
  int current = 0;  // the plan's own calls left its device current; make sure (no throw here)
  if (cudaGetDevice(&current) == cudaSuccess && current != device_) cudaSetDevice(device_);
  cudaFree(table_);
  cudaFree(offsets_);
  cudaFree(maps_);
}

void AdamW8bitCudaPlan::step(const AdamW8bitStep* group_steps, size_t groups, void* stream) const {
  if (blocks_ == 0) return;
  if (groups > static_cast<size_t>(kAdamW8bitMaxGroups)) {
    throw std::invalid_argument("adamw8bit: " + std::to_string(groups) + " groups, at most " +
                                std::to_string(kAdamW8bitMaxGroups));
  }
  if (groups < static_cast<size_t>(groups_)) {
    throw std::invalid_argument("adamw8bit: a tensor has group " + std::to_string(groups_ - 1) +
                                " but the step gives " + std::to_string(groups) + " group(s)");
  }
  use_device(device_);
  GroupSteps steps{};
  for (size_t k = 0; k < groups; ++k) steps.step[k] = group_steps[k];
  const auto* table = static_cast<const AdamW8bitTensor*>(table_);
  const auto* first = static_cast<const int64_t*>(offsets_);
  const auto* maps = static_cast<const float*>(maps_);
  const auto cuda_stream = static_cast<cudaStream_t>(stream);
  const dim3 grid(static_cast<unsigned>(blocks_));
  const int n = static_cast<int>(count_);
  switch (dtype_) {
    case ParamDtype::kFloat32:
      adamw8bit_kernel<float><<<grid, kThreads, 0, cuda_stream>>>(table, first, n, maps, steps);
      break;
    case ParamDtype::kBFloat16:
      adamw8bit_kernel<__nv_bfloat16>
          <<<grid, kThreads, 0, cuda_stream>>>(table, first, n, maps, steps);
      break;
    case ParamDtype::kFloat16:
      adamw8bit_kernel<__half><<<grid, kThreads, 0, cuda_stream>>>(table, first, n, maps, steps);
      break;
  }
  check(cudaGetLastError(), "kernel launch");
}

void AdamW8bitCudaPlan::retarget(const AdamW8bitTensor* tensors, size_t count, void* stream) {
  if (count != count_) {
    throw std::invalid_argument("adamw8bit: retarget to " + std::to_string(count) +
                                " tensors, the plan has " + std::to_string(count_));
  }
  for (size_t i = 0; i < count; ++i) {
    const AdamW8bitTensor& was = layout_[i];
    const AdamW8bitTensor& now = tensors[i];
    if (now.numel != was.numel || now.group != was.group || now.quantized != was.quantized) {
      throw std::invalid_argument("adamw8bit: retarget: tensor " + std::to_string(i) +
                                  " is not the plan's (its size, group or state changed)");
    }
  }
  if (count == 0) return;
  use_device(device_);
  // From pageable memory the call returns once the source is staged: `tensors` may go after it.
  check(cudaMemcpyAsync(table_, tensors, count * sizeof(AdamW8bitTensor), cudaMemcpyHostToDevice,
                        static_cast<cudaStream_t>(stream)),
        "cudaMemcpyAsync");
  layout_.assign(tensors, tensors + count);
}

void* alloc_managed(size_t bytes, int device) {
  use_device(device);
  void* ptr = nullptr;
  check(cudaMallocManaged(&ptr, bytes, cudaMemAttachGlobal), "cudaMallocManaged");
  return ptr;
}

void free_managed(void* ptr) { cudaFree(ptr); }

bool managed_memory_supported(int device) {
  int concurrent = 0;
  if (cudaDeviceGetAttribute(&concurrent, cudaDevAttrConcurrentManagedAccess, device) !=
      cudaSuccess) {
    cudaGetLastError();  // a "no" here, not a sticky error for the next launch's check
    return false;
  }
  return concurrent != 0;
}

void prefetch_managed(const void* ptr, size_t bytes, int device, void* stream) {
  if (ptr == nullptr || bytes == 0 || !managed_memory_supported(device)) return;
  const auto cuda_stream = static_cast<cudaStream_t>(stream);
#if CUDART_VERSION >= 13000
  cudaMemLocation location{};
  location.type = cudaMemLocationTypeDevice;
  location.id = device;
  check(cudaMemPrefetchAsync(ptr, bytes, location, /*flags=*/0, cuda_stream),
        "cudaMemPrefetchAsync");
#else
  check(cudaMemPrefetchAsync(ptr, bytes, device, cuda_stream), "cudaMemPrefetchAsync");
#endif
}

}  // namespace lorapipe::kernels
