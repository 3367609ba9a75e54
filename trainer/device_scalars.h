#pragma once
// Scalars computed on the device, read back together. A loop that calls .item() for each of a
// LoRA's tensors waits for the device once per tensor (about 2000 waits a step for an SDXL LoRA
// with both text encoders), and each wait drains the queue the host had filled ahead of it.

#include <vector>

namespace at {
class Tensor;
}

namespace lorapipe::trainer {

// The values of `scalars` (0-d floating tensors on one device) in order, each exactly as
// .item<double>() gives it, from one device-to-host copy.
std::vector<double> read_scalars(const std::vector<at::Tensor>& scalars);

}  // namespace lorapipe::trainer
