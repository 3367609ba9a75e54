// sampler/schedulers.h against diffusers 0.36's schedulers, stepped on the same model outputs by
// sampler/reference/schedulers_reference.py (built as kohya builds them; "ddim_sd15" as the SD1.5
// config does), at 20 steps and at 7 (the multistep samplers' lower-order steps, odd grids), one
// comparison per model call (Heun, DPM2 and PNDM call the model more often than their steps).
//
// Tolerance: 1e-5 of the sample's scale (max |ours - ref| / max |ref|) at every step, the
// issue's bound. Both sides build the tables with the same LibTorch CPU ops and combine the
// step's fp32 scalars in the same order, so most steps agree to the bit; what can differ is the
// fp32 log of the sigma table (numpy's against ATen's, up to 2 ulp), which moves the timesteps
// found from a sigma (Euler's Karras ones, DPM2's midpoints, which diffusers also finds in fp32
// where we use double) by up to 1e-4: those are compared within 2e-4 absolute (a 2e-7 relative
// change of a timestep the UNet embeds), everything else within 1e-5. LMS's coefficients are
// integrated exactly here and by scipy's quad over an fp32 integrand there: 1e-7 apart.

#include "sampler/schedulers.h"

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <string>

#include "common/error.h"
#include "models/parity_util.h"
#include "models/safetensors.h"
#include "models/weights.h"

namespace lorapipe::sampler {
namespace {

namespace fs = std::filesystem;

const fs::path& reference_dir() {
  static const fs::path dir =
      models::testing::reference_output("sampler/reference/schedulers_reference.py");
  return dir;
}

double scaled_error(const torch::Tensor& a, const torch::Tensor& b) {
  return (a.to(torch::kFloat64) - b.to(torch::kFloat64)).abs().max().item<double>() /
         std::max(b.abs().max().item<double>(), 1e-30);
}

void check(const std::string& name, int steps, const SchedulerOptions& options) {
  const std::string file = name + "_" + std::to_string(steps) + ".safetensors";
  const auto ref = models::read_tensors(models::SafetensorsFile::open(reference_dir() / file));
  const std::unique_ptr<Scheduler> scheduler = make_scheduler(options, steps);
  const bool found_from_sigma = (options.karras && options.kind == SamplerKind::kEuler) ||
                                options.kind == SamplerKind::kDpm2 ||
                                options.kind == SamplerKind::kDpm2Ancestral;
  ASSERT_EQ(scheduler->timesteps().scalar_type(), ref.at("timesteps").scalar_type()) << name;
  ASSERT_EQ(scheduler->calls(), ref.at("timesteps").size(0)) << name;
  if (found_from_sigma) {
    EXPECT_LE((scheduler->timesteps() - ref.at("timesteps")).abs().max().item<double>(), 2e-4)
        << name << ": " << scheduler->timesteps() << ref.at("timesteps");
  } else {
    EXPECT_TRUE(torch::equal(scheduler->timesteps(), ref.at("timesteps")))
        << name << ": " << scheduler->timesteps() << ref.at("timesteps");
  }
  if (ref.count("sigmas")) {
    EXPECT_LE(scaled_error(scheduler->sigmas(), ref.at("sigmas")), 1e-6) << name;
  }
  EXPECT_NEAR(scheduler->init_noise_sigma(), ref.at("init_noise_sigma").item<double>(), 1e-6);
  auto noise = at::detail::createCPUGenerator(1234);
  torch::Tensor sample = ref.at("initial");
  double worst = 0;
  int exact = 0;
  for (int i = 0; i < scheduler->calls(); ++i) {
    const std::string k = std::to_string(i);
    const torch::Tensor input = scheduler->scale_model_input(sample, i);
    EXPECT_LE(scaled_error(input, ref.at("input." + k)), 1e-5) << name << " step " << i;
    sample = scheduler->step(ref.at("model_output." + k), i, sample, noise);
    const double error = scaled_error(sample, ref.at("sample." + k));
    worst = std::max(worst, error);
    exact += torch::equal(sample, ref.at("sample." + k)) ? 1 : 0;
    ASSERT_LE(error, 1e-5) << name << " call " << i << " of " << scheduler->calls();
  }
  std::printf("[schedulers] %-24s %2d steps: worst %.2e of scale, %d of %d calls bit-identical\n",
              name.c_str(), steps, worst, exact, scheduler->calls());
}

void check_both(const std::string& name, bool v) {
  for (int steps : {20, 7}) check(name + (v ? "_v" : ""), steps, scheduler_options(name, v));
}

TEST(SamplerParity, DdimAsKohya) {
  check_both("ddim", false);
  check_both("ddim", true);
}
TEST(SamplerParity, DdimAsTheSd15Config) {
  SchedulerOptions o;
  o.steps_offset = 1;
  o.set_alpha_to_one = false;
  o.clip_sample = false;
  for (int steps : {20, 7}) check("ddim_sd15", steps, o);
}
TEST(SamplerParity, Euler) {
  check_both("euler", false);
  check_both("euler", true);
}
TEST(SamplerParity, EulerKarras) {
  check_both("euler_karras", false);
  check_both("euler_karras", true);
}
TEST(SamplerParity, EulerAncestral) {
  check_both("euler_a", false);
  check_both("euler_a", true);
}
TEST(SamplerParity, DpmSolverPlusPlus2M) {
  check_both("dpmsolver++", false);
  check_both("dpmsolver++", true);
}
TEST(SamplerParity, DpmSolverPlusPlus2MKarras) {
  check_both("dpmsolver++_karras", false);
  check_both("dpmsolver++_karras", true);
}

// kohya's other samplers (train_util.get_my_scheduler), each against its diffusers class.
TEST(SamplerParity, DpmSolver2M) {
  check_both("dpmsolver", false);
  check_both("dpmsolver", true);
}
TEST(SamplerParity, DpmSolverPlusPlus2SSinglestep) {
  check_both("dpmsingle", false);
  check_both("dpmsingle", true);
}
TEST(SamplerParity, Heun) {
  check_both("heun", false);
  check_both("heun", true);
}
TEST(SamplerParity, Dpm2) {
  check_both("dpm_2", false);
  check_both("dpm_2", true);
}
TEST(SamplerParity, Dpm2Ancestral) {
  check_both("dpm_2_a", false);
  check_both("dpm_2_a", true);
}
TEST(SamplerParity, Lms) {
  check_both("lms", false);
  check_both("lms", true);
}
TEST(SamplerParity, PndmWithItsRungeKuttaWarmUp) {
  check_both("pndm", false);
  check_both("pndm", true);
}
TEST(SamplerParity, Ddpm) {
  check_both("ddpm", false);
  check_both("ddpm", true);
}

TEST(SamplerSchedulers, UnknownNamesAndBadStepsAreRefusedByName) {
  try {
    scheduler_options("lms9000", false);
    FAIL() << "no error";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("lms9000"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("euler_a"), std::string::npos);
  }
  EXPECT_THROW(make_scheduler(scheduler_options("ddim", false), 0), InputError);
  EXPECT_THROW(make_scheduler(scheduler_options("euler", false), 1001), InputError);
  EXPECT_THROW(make_scheduler(scheduler_options("pndm", false), 3), InputError);
  EXPECT_EQ(make_scheduler(scheduler_options("k_dpm_2_a", false), 20)->calls(), 39);
  EXPECT_EQ(make_scheduler(scheduler_options("heun", false), 20)->calls(), 39);
  EXPECT_EQ(make_scheduler(scheduler_options("pndm", false), 20)->calls(), 29);
}

}  // namespace
}  // namespace lorapipe::sampler
