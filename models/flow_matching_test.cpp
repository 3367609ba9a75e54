// The flow-matching objective against kohya's Flux draws and losses
// (models/reference/flow_matching_reference.py: diffusers' compute_density_for_timestep_sampling,
// FlowMatchEulerDiscreteScheduler and compute_loss_weighting_for_sd3, kohya's formulas for the
// other modes), from the same CPU generator: every --timestep_sampling, --weighting_scheme and
// --model_prediction_type. The option checks of both families.
//
// Tolerance: 1e-6 absolute on sigmas, noisy latents, predictions and weights (all of order 1):
// the same fp32 draws from the same generator, the same few fp32 operations (the schedule's
// shift and the flux_shift exponentials round once or twice differently at most).

#include "models/flow_matching.h"

#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "common/error.h"
#include "models/family.h"
#include "models/loading.h"
#include "models/objective.h"
#include "models/parity_util.h"

namespace lorapipe::models {
namespace {

namespace fs = std::filesystem;

ModelFamily flow_family() {
  ModelFamily f;
  f.name = "flow";
  f.display_name = "a flow-matching family";
  f.objective = ObjectiveKind::kFlowMatching;
  return f;
}

double worst(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
}

TEST(FlowMatchingParity, DrawsAndLossesAreKohyas) {
  const fs::path ref = testing::reference_output("models/reference/flow_matching_reference.py");
  const nlohmann::json cases = nlohmann::json::parse(read_text(ref / "cases.json"));
  const auto in = testing::read_all(ref / "inputs.safetensors");
  const ModelFamily family = flow_family();
  ASSERT_EQ(cases.size(), 11u);
  for (size_t i = 0; i < cases.size(); ++i) {
    const nlohmann::json& c = cases[i];
    ObjectiveOptions o;
    o.timestep_sampling = c["timestep_sampling"];
    o.weighting_scheme = c["weighting_scheme"];
    o.discrete_flow_shift = c["discrete_flow_shift"];
    o.sigmoid_scale = c["sigmoid_scale"];
    o.logit_mean = c["logit_mean"];
    o.logit_std = c["logit_std"];
    o.mode_scale = c["mode_scale"];
    o.model_prediction_type = c["model_prediction_type"];
    const auto objective = make_training_objective(family, o);
    const auto expected = testing::read_all(ref / (std::to_string(i) + ".safetensors"));
    const at::Tensor sigma = objective->draw_times(8, at::make_generator<at::CPUGeneratorImpl>(77),
                                                   at::kCPU, /*latent_height=*/64,
                                                   /*latent_width=*/48);
    const at::Tensor noisy = objective->noisy_latents(in.at("x0"), in.at("noise"), sigma);
    const at::Tensor prediction = objective->prediction(in.at("output"), noisy, sigma);
    const at::Tensor weight = objective->weighted(torch::ones({8}), sigma);
    const double errors[] = {
        worst(sigma, expected.at("sigma")), worst(noisy, expected.at("noisy")),
        worst(prediction, expected.at("prediction")), worst(weight, expected.at("weight")),
        worst(objective->target(in.at("x0"), in.at("noise"), sigma), expected.at("target"))};
    std::printf(
        "[flow] %s: sigma %.1e, noisy %.1e, prediction %.1e, weight %.1e, target %.1e "
        "(limit 1e-6)\n",
        c.dump().c_str(), errors[0], errors[1], errors[2], errors[3], errors[4]);
    for (double e : errors) EXPECT_LE(e, 1e-6) << c.dump();
  }
}

// Kohya's validation timesteps as sigmas, and the velocity as the target whatever sigma is.
TEST(FlowMatchingObjective, ValidationAtKohyasFixedSigmas) {
  const auto objective = make_training_objective(flow_family(), {});
  std::vector<double> sigmas;
  for (const ValidationPoint& p : objective->validation_points(2, at::kCPU)) {
    EXPECT_EQ(p.time.sizes(), (std::vector<int64_t>{2}));
    sigmas.push_back(p.time[0].item<double>());
  }
  ASSERT_EQ(sigmas.size(), 4u);
  EXPECT_NEAR(sigmas[0], 0.2, 1e-7);
  EXPECT_NEAR(sigmas[3], 0.8, 1e-7);
  std::map<std::string, std::string> m;
  objective->write_metadata(m);
  EXPECT_EQ(m.at("ss_timestep_sampling"), "sigma");
  EXPECT_EQ(m.at("ss_model_prediction_type"), "sigma_scaled");
  EXPECT_EQ(m.at("ss_discrete_flow_shift"), "3.0");
}

TEST(FlowMatchingObjective, HuberSchedulesAsKohyaAndSnrRefused) {
  ObjectiveOptions o;
  o.huber_schedule = "exponential";
  o.huber_c = 0.2;
  const at::Tensor sigma = torch::tensor({0.25f, 0.75f});
  const at::Tensor c = make_training_objective(flow_family(), o)->huber_threshold(sigma);
  // kohya: exp(-alpha * timestep) * huber_scale, alpha = -log(c) / 1000, timestep = sigma * 1000.
  EXPECT_NEAR(c[0].item<double>(), std::pow(0.2, 0.25), 1e-6);
  EXPECT_NEAR(c[1].item<double>(), std::pow(0.2, 0.75), 1e-6);
  o.huber_schedule = "snr";
  EXPECT_THROW(make_training_objective(flow_family(), o)->huber_threshold(sigma), InputError);
}

// Each family refuses the other's knobs by the flag's name, and bad values are named.
TEST(FlowMatchingObjective, OptionsOfTheOtherObjectiveAreRefusedByName) {
  auto message = [](const ModelFamily& family, const ObjectiveOptions& o) -> std::string {
    try {
      make_training_objective(family, o);
    } catch (const InputError& e) {
      return e.what();
    }
    return "";
  };
  ObjectiveOptions sd_only;
  sd_only.min_snr_gamma = 5;
  EXPECT_NE(message(flow_family(), sd_only).find("--min_snr_gamma"), std::string::npos);
  ObjectiveOptions v;
  v.v_prediction = true;
  EXPECT_NE(message(flow_family(), v).find("--v_parameterization"), std::string::npos);
  ObjectiveOptions flow_only;
  flow_only.timestep_sampling = "shift";
  EXPECT_NE(message(model_family("sd15"), flow_only).find("--timestep_sampling"),
            std::string::npos);
  ObjectiveOptions bad;
  bad.model_prediction_type = "scaled";
  EXPECT_NE(message(flow_family(), bad).find("--model_prediction_type='scaled'"),
            std::string::npos);
  EXPECT_EQ(message(model_family("sd15"), {}), "");
}

}  // namespace
}  // namespace lorapipe::models
