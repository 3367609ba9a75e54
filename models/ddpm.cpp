#include "models/ddpm.h"

#include <torch/torch.h>

#include <cmath>

#include "common/error.h"

namespace lorapipe::models {

at::Tensor ddpm_betas(const DdpmSchedule& s) {
  if (s.steps < 2 || !(s.beta_start > 0) || !(s.beta_end > s.beta_start) || s.beta_end >= 1) {
    throw Error("DDPM schedule: need 0 < beta_start < beta_end < 1 and at least 2 steps");
  }
  return torch::linspace(std::sqrt(s.beta_start), std::sqrt(s.beta_end), s.steps, torch::kFloat32)
      .pow(2);
}

at::Tensor ddpm_alphas_cumprod(const DdpmSchedule& s) {
  return torch::cumprod(1.0 - ddpm_betas(s), /*dim=*/0);
}

}  // namespace lorapipe::models
