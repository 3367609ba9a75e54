#pragma once
// models::Linear layers made without torch's initialisation, for models built in their storage
// dtype and filled from a checkpoint (the Flux transformer, T5): torch's constructor would first
// make every weight in the default dtype and initialise it for nothing, so an 11.9 B-parameter
// transformer would exist in fp32 before its first weight was read.

#include <ATen/ops/empty.h>
#include <c10/core/TensorOptions.h>

#include <memory>

#include "models/linear.h"

namespace lorapipe::models {

// A LinearImpl whose weight [out, in] and bias [out] are made with `options` and left
// uninitialised (no memory at all on the meta device). A subclass only to reach Module's
// parameter table; to everyone else it is a LinearImpl.
struct EmptyLinearImpl : LinearImpl {
  EmptyLinearImpl(int64_t in, int64_t out, bool with_bias, const at::TensorOptions& tensor)
      : LinearImpl(torch::nn::LinearOptions(1, 0).bias(with_bias)) {  // nothing to initialise
    options = torch::nn::LinearOptions(in, out).bias(with_bias);
    weight = at::empty({out, in}, tensor).requires_grad_(true);
    parameters_["weight"] = weight;
    if (with_bias) {
      bias = at::empty({out}, tensor).requires_grad_(true);
      parameters_["bias"] = bias;
    }
  }
};

inline Linear empty_linear(int64_t in, int64_t out, bool bias, const at::TensorOptions& options) {
  return Linear(std::static_pointer_cast<LinearImpl>(
      std::make_shared<EmptyLinearImpl>(in, out, bias, options)));
}

}  // namespace lorapipe::models
