#include "trainer/device_scalars.h"

#include <ATen/ATen.h>

namespace lorapipe::trainer {

std::vector<double> read_scalars(const std::vector<at::Tensor>& scalars) {
  if (scalars.empty()) return {};
  // One kernel joins them (promoting to the widest floating dtype among them, which is exact),
  // one copy brings them over, and fp64 on the host holds every float value exactly.
  std::vector<at::Tensor> views;
  views.reserve(scalars.size());
  for (const at::Tensor& s : scalars) views.push_back(s.reshape({1}));
  const at::Tensor host = at::cat(views).to(at::kCPU, at::kDouble).contiguous();
  const double* values = host.data_ptr<double>();
  return std::vector<double>(values, values + host.numel());
}

}  // namespace lorapipe::trainer
