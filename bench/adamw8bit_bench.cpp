// lorapipe's AdamW8bit step (kernels/adamw8bit.h) on one tensor of N parameters, for
// bench/adamw8bit_bench.py, which runs torch's AdamW and bitsandbytes' AdamW8bit on the same
// sizes beside it.
//
//   adamw8bit_bench N STEPS [--device cpu|cuda] [--dtype fp32|bf16] [--threads T] [--paged]
//
// Prints one line: "ours <median ms per step> <state bytes> <bytes moved per step>" where the
// state is both 8-bit moments and their absmax arrays, and the bytes moved are what one step
// must read and write at least (gradient, parameter, both moments; the bandwidth bound). With
// --device cuda it also measures the device's copy bandwidth ("copy_gbps <GB/s>") so the script
// can print the bound, and the peak device memory the optimizer state took ("state_device_mib").

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "kernels/adamw8bit.h"

#if __has_include(<c10/cuda/CUDAStream.h>) && __has_include(<cuda_runtime.h>)
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#define LORAPIPE_BENCH_CUDA 1
#endif

namespace k = lorapipe::kernels;

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

void sync(const torch::Device& device) {
  if (device.is_cuda()) torch::cuda::synchronize();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr,
                 "usage: adamw8bit_bench N STEPS [--device cpu|cuda] [--dtype fp32|bf16] "
                 "[--threads T] [--paged]\n");
    return 2;
  }
  const int64_t n = std::atoll(argv[1]);
  const int steps = std::atoi(argv[2]);
  torch::Device device(torch::kCPU);
  torch::ScalarType dtype = torch::kFloat32;
  bool paged = false;
  int threads = 0;
  for (int i = 3; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--device" && i + 1 < argc) {
      device = torch::Device(argv[++i]);
      if (device.is_cuda() && !device.has_index()) device = torch::Device(torch::kCUDA, 0);
    } else if (flag == "--dtype" && i + 1 < argc) {
      dtype = std::string(argv[++i]) == "bf16" ? torch::kBFloat16 : torch::kFloat32;
    } else if (flag == "--threads" && i + 1 < argc) {
      threads = std::atoi(argv[++i]);
    } else if (flag == "--paged") {
      paged = true;
    } else {
      std::fprintf(stderr, "unknown argument %s\n", flag.c_str());
      return 2;
    }
  }
  if (threads > 0) torch::set_num_threads(threads);
  torch::NoGradGuard no_grad;
  torch::Tensor p = (torch::randn({n}, torch::TensorOptions().device(device)) * 0.1).to(dtype);
  torch::Tensor g = (torch::randn({n}, torch::TensorOptions().device(device)) * 0.01).to(dtype);
  const int64_t blocks = k::adamw8bit_blocks(n);
  const int64_t state_bytes = 2 * n + 2 * 4 * blocks;
  sync(device);

  // The state: two byte arrays and two absmax arrays, in device memory or managed memory.
  auto bytes_options = torch::TensorOptions().device(device).dtype(torch::kUInt8);
  auto float_options = torch::TensorOptions().device(device).dtype(torch::kFloat32);
  void* managed = nullptr;
  torch::Tensor s1, s2, a1, a2;
#ifdef LORAPIPE_BENCH_CUDA
  size_t free_before = 0, total = 0;
  if (device.is_cuda()) cudaMemGetInfo(&free_before, &total);
#endif
  if (paged && device.is_cuda()) {
    managed = k::alloc_managed(static_cast<size_t>(state_bytes), device.index());
    auto* base = static_cast<uint8_t*>(managed);
    s1 = torch::from_blob(base, {n}, bytes_options);
    s2 = torch::from_blob(base + n, {n}, bytes_options);
    a1 = torch::from_blob(base + 2 * n, {blocks}, float_options);
    a2 = torch::from_blob(base + 2 * n + 4 * blocks, {blocks}, float_options);
  } else {
    s1 = torch::empty({n}, bytes_options);
    s2 = torch::empty({n}, bytes_options);
    a1 = torch::empty({blocks}, float_options);
    a2 = torch::empty({blocks}, float_options);
  }
  s1.fill_(127);  // the signed map's 0
  s2.zero_();
  a1.zero_();
  a2.zero_();
  k::AdamW8bitTensor t;
  t.param = p.data_ptr();
  t.grad = g.data_ptr();
  t.state1 = s1.data_ptr();
  t.state2 = s2.data_ptr();
  t.absmax1 = a1.data_ptr<float>();
  t.absmax2 = a2.data_ptr<float>();
  t.numel = n;
  t.quantized = true;
  const k::ParamDtype param_dtype =
      dtype == torch::kBFloat16 ? k::ParamDtype::kBFloat16 : k::ParamDtype::kFloat32;

  std::unique_ptr<k::AdamW8bitCudaPlan> plan;
  void* stream = nullptr;
  // "cuda" names no index: the current device, which the kernels' calls need as a number.
  int device_index = -1;
  if (device.is_cuda()) {
#ifdef LORAPIPE_BENCH_CUDA
    device_index = device.has_index() ? device.index() : c10::cuda::current_device();
    stream = c10::cuda::getCurrentCUDAStream(device_index).stream();
#endif
    plan = std::make_unique<k::AdamW8bitCudaPlan>(&t, 1, param_dtype, device_index);
  }
  std::vector<double> ms;
  for (int step = 0; step <= steps; ++step) {  // step 0 warms up and is not counted
    const k::AdamW8bitStep c = k::adamw8bit_step_constants(1e-3, 0.9, 0.999, 1e-8, 0.01, step + 1);
    sync(device);
    const auto start = std::chrono::steady_clock::now();
    if (device.is_cuda()) {
      if (managed != nullptr) {
        k::prefetch_managed(managed, static_cast<size_t>(state_bytes), device_index, stream);
      }
      plan->step(&c, 1, stream);
    } else {
      k::adamw8bit_step_cpu(&t, 1, param_dtype, &c, 1, threads);
    }
    sync(device);
    const double elapsed =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
            .count();
    if (step > 0) ms.push_back(elapsed);
  }
  const int64_t element = dtype == torch::kBFloat16 ? 2 : 4;
  // Read g and p, write p, read and write both state bytes (absmax: 16 bytes per 256 elements).
  const int64_t moved = n * (3 * element + 4) + 16 * blocks;
  std::printf("ours %.3f %lld %lld\n", median(ms), static_cast<long long>(state_bytes),
              static_cast<long long>(moved));
#ifdef LORAPIPE_BENCH_CUDA
  if (device.is_cuda()) {
    size_t free_after = 0;
    cudaMemGetInfo(&free_after, &total);
    std::printf("state_device_mib %.1f\n",
                (static_cast<double>(free_before) - static_cast<double>(free_after)) / (1 << 20));
    // The device's copy bandwidth: a 1 GiB device-to-device copy reads and writes 1 GiB each.
    torch::Tensor a = torch::empty({int64_t{1} << 30}, bytes_options), b = torch::empty_like(a);
    std::vector<double> copies;
    for (int i = 0; i < 6; ++i) {
      sync(device);
      const auto start = std::chrono::steady_clock::now();
      b.copy_(a);
      sync(device);
      copies.push_back(
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
    std::printf("copy_gbps %.1f\n", 2.0 * (1 << 30) / median(copies) / 1e9);
  }
#endif
  s1 = s2 = a1 = a2 = torch::Tensor();
  if (managed != nullptr) k::free_managed(managed);
  return 0;
}
