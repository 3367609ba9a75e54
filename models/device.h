#pragma once
// The compute device a stage runs its models on, from the `--device` flag every LibTorch stage
// takes (cacher, trainer, sampler).

#include <c10/core/Device.h>

#include <exception>
#include <string>
#include <string_view>

namespace lorapipe::models {

// Parses "auto" (the first CUDA device when there is one, else the CPU), "cpu", "cuda" or
// "cuda:N". Throws lorapipe::InputError naming the value when it is malformed or names a
// device this machine does not have.
c10::Device resolve_device(std::string_view spec);

// "cpu", or "cuda:0 (NVIDIA H200)" for logs.
std::string describe_device(const c10::Device& device);

// Whether `e` says a device ran out of memory: CUDA's allocator says so by type; the CPU's (c10's
// default allocator, oneDNN's scratchpads, the standard library) by std::bad_alloc or by a
// c10::Error whose message says it.
bool is_out_of_memory(const std::exception& e);

}  // namespace lorapipe::models
