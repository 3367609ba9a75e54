#pragma once
// The compute device a stage runs its models on, from the `--device` flag every LibTorch stage
// takes (cacher, trainer, sampler).

#include <c10/core/Device.h>

#include <string>
#include <string_view>

namespace lorapipe::models {

// Parses "auto" (the first CUDA device when there is one, else the CPU), "cpu", "cuda" or
// "cuda:N". Throws lorapipe::InputError naming the value when it is malformed or names a
// device this machine does not have.
c10::Device resolve_device(std::string_view spec);

// "cpu", or "cuda:0 (NVIDIA H200)" for logs.
std::string describe_device(const c10::Device& device);

}  // namespace lorapipe::models
