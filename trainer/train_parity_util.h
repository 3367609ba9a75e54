#pragma once
// Shared by the training-step parity tests (sdxl_train_parity_test.cpp,
// flux_train_parity_test.cpp): the initial LoRA both sides start from, and the comparison of a
// step's gradients and the final weights with the reference's, with the tolerance rule the tests
// state.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <filesystem>
#include <functional>
#include <map>
#include <string>

#include "models/parity_util.h"
#include "trainer/lora_file.h"
#include "trainer/lora_network.h"

namespace lorapipe::trainer::testing {

// The initial LoRA: kohya's down, an up drawn small but non-zero (a zero up would leave down's
// gradient zero and hide half the comparison), written to `file` and loaded into `network`.
inline void start_from_random_ups(LoraNetwork& network, const std::filesystem::path& file) {
  auto state = network.state_dict();
  torch::manual_seed(99);
  for (auto& [name, t] : state) {
    if (name.ends_with(".lora_up.weight")) t = torch::randn_like(t) * 0.05;
  }
  write_lora_file(file, state, {});
  network.load(file);
}

struct Worst {
  double error = 0;
  std::string name;
  void take(double e, const std::string& n) {
    if (e > error) error = e, name = n;
  }
};

// Each of `ours` (a step's LoRA gradients, "<module>.lora_{down,up}.grad") against the
// reference's: its largest difference over its own scale, or 1% of the step's largest gradient
// where it is smaller (sums that nearly cancel: see train_parity_test.cpp's gradient_error),
// within `tolerance`. A gradient `unused` names is zero on both sides (its module feeds nothing);
// every other one must be nonzero.
inline Worst expect_gradients_close(const std::map<std::string, torch::Tensor>& ours,
                                    const std::map<std::string, torch::Tensor>& reference,
                                    double tolerance,
                                    const std::function<bool(const std::string&)>& unused = {}) {
  double step_scale = 0;
  for (const auto& [name, grad] : ours) {
    EXPECT_TRUE(reference.count(name)) << "reference has no " << name;
    if (!reference.count(name)) return {};
    step_scale = std::max(step_scale, reference.at(name).abs().max().item<double>());
  }
  Worst worst;
  for (const auto& [name, grad] : ours) {
    const torch::Tensor& want = reference.at(name);
    if (unused && unused(name)) {
      EXPECT_EQ(want.abs().max().item<double>(), 0) << name;
      EXPECT_EQ(grad.abs().max().item<double>(), 0) << name;
      continue;
    }
    EXPECT_GT(want.abs().max().item<double>(), 0) << name << " is all zero";
    const double e = (grad.to(torch::kFloat64) - want).abs().max().item<double>() /
                     std::max(want.abs().max().item<double>(), 0.01 * step_scale);
    worst.take(e, name);
    EXPECT_LE(e, tolerance) << name;
  }
  return worst;
}

// Each of `ours` (final LoRA weights) within `tolerance` relative of the reference's.
inline Worst expect_weights_close(const std::map<std::string, torch::Tensor>& ours,
                                  const std::map<std::string, torch::Tensor>& reference,
                                  double tolerance) {
  Worst worst;
  for (const auto& [name, w] : ours) {
    const double e = models::testing::relative_error(w, reference.at(name));
    worst.take(e, name);
    EXPECT_LE(e, tolerance) << name;
  }
  return worst;
}

}  // namespace lorapipe::trainer::testing
