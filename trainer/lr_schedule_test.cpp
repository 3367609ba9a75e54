// lorapipe's learning-rate schedules against transformers' (diffusers' for piecewise_constant),
// built as kohya's get_scheduler_fix builds them: trainer/reference/lr_schedule_reference.py.
#include "tests/paths.h"
#include "trainer/lr_schedule.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "common/error.h"
#include "models/parity_util.h"

namespace lorapipe::trainer {
namespace {

namespace fs = std::filesystem;

// Every schedule kohya names, with warmup and without, past its last step (what a resumed or
// epoch-rounded run reaches), and on two processes. The multipliers are the same formulas in double on both sides;
// they may differ in the last bits of cos, pow and sqrt, so the tolerance is 1e-12 absolute.
TEST(TrainLrSchedule, EveryScheduleEqualsTransformersAsKohyaBuildsIt) {
  std::vector<LrScheduleOptions> cases;
  auto add = [&](const std::string& name, int64_t warmup, auto&& set) {
    LrScheduleOptions o;
    o.name = name;
    o.warmup_steps = warmup;
    o.training_steps = 40;
    o.initial_lr = 1e-3;
    set(o);
    cases.push_back(o);
  };
  auto none = [](LrScheduleOptions&) {};
  for (int64_t warmup : {0, 7}) {
    add("constant_with_warmup", warmup, none);
    add("linear", warmup, none);
    add("cosine", warmup, none);
    add("cosine_with_restarts", warmup, [](LrScheduleOptions& o) { o.num_cycles = 3; });
    add("polynomial", warmup, [](LrScheduleOptions& o) { o.power = 2.0, o.lr_end = 1e-5; });
    add("cosine_with_min_lr", warmup, [](LrScheduleOptions& o) { o.min_lr_ratio = 0.1; });
    add("cosine_with_min_lr", warmup,
        [](LrScheduleOptions& o) { o.min_lr_ratio = 0.05, o.num_cycles = 3; });
    add("warmup_stable_decay", warmup,
        [](LrScheduleOptions& o) { o.decay_steps = 0.25, o.min_lr_ratio = 0.1; });
    add("warmup_stable_decay", warmup, [](LrScheduleOptions& o) {
      o.decay_steps = 12, o.warmup_type = "cosine", o.decay_type = "1-sqrt";
    });
    add("warmup_stable_decay", warmup,
        [](LrScheduleOptions& o) { o.decay_steps = 10, o.decay_type = "linear"; });
    add("inverse_sqrt", warmup, none);
    add("inverse_sqrt", warmup, [](LrScheduleOptions& o) { o.timescale = 25; });
  }
  add("constant", 0, none);
  add("piecewise_constant", 0, [](LrScheduleOptions& o) { o.step_rules = "1:10,0.1:20,0.01"; });
  // Two processes, as accelerate steps kohya's scheduler: twice per optimizer step over twice the
  // steps (total 40 is 20 optimizer steps), the warmup count as given.
  for (const char* name : {"cosine", "warmup_stable_decay", "piecewise_constant"}) {
    add(name, std::string(name) == "piecewise_constant" ? 0 : 7, [](LrScheduleOptions& o) {
      o.processes = 2;
      o.decay_steps = 10;
      o.step_rules = "1:10,0.1:20,0.01";
    });
  }

  nlohmann::json config = nlohmann::json::array();
  constexpr int kSteps = 44;
  for (const LrScheduleOptions& o : cases) {
    validate(o);
    config.push_back({{"name", o.name},
                      {"lr", o.initial_lr},
                      {"warmup", o.warmup_steps},
                      {"total", o.training_steps},
                      {"num_cycles", o.num_cycles},
                      {"power", o.power},
                      {"lr_end", o.lr_end},
                      {"min_lr_ratio", o.min_lr_ratio ? nlohmann::json(*o.min_lr_ratio) : nullptr},
                      {"decay_steps", warmup_steps_from(o.decay_steps, o.training_steps)},
                      {"timescale", o.timescale},
                      {"warmup_type", o.warmup_type},
                      {"decay_type", o.decay_type},
                      {"step_rules", o.step_rules},
                      {"processes", o.processes},
                      {"steps", kSteps}});
  }
  const fs::path dir = models::testing::make_temp_dir("lr-schedule");
  std::ofstream(dir / "cases.json") << config.dump();
  const char* python = std::getenv("LORAPIPE_PYTHON");
  ASSERT_NE(python, nullptr) << "LORAPIPE_PYTHON (the test venv's python) is unset";
  const std::string command = std::string(python) + " " + LORAPIPE_SOURCE_DIR +
                              "/trainer/reference/lr_schedule_reference.py --config " +
                              (dir / "cases.json").string() + " --out " +
                              (dir / "out.json").string();
  ASSERT_EQ(std::system(command.c_str()), 0) << command;
  std::ifstream in(dir / "out.json");
  const nlohmann::json reference = nlohmann::json::parse(in);
  ASSERT_EQ(reference.size(), cases.size());
  double worst = 0;
  for (size_t c = 0; c < cases.size(); ++c) {
    for (int step = 0; step < kSteps; ++step) {
      const double want = reference[c][step].get<double>();
      const double got = lr_multiplier(cases[c], step);
      worst = std::max(worst, std::abs(got - want));
      EXPECT_NEAR(got, want, 1e-12) << config[c].dump() << " at step " << step;
    }
  }
  std::printf("[lr schedules] %zu cases x %d steps, largest difference %.3g\n", cases.size(),
              kSteps, worst);
}

TEST(TrainLrSchedule, SchedulerArgsAreReadAsKohyaPassesThem) {
  LrScheduleOptions o;
  o.name = "cosine_with_min_lr";
  o.initial_lr = 2e-4;
  apply_lr_scheduler_args(o, {"min_lr=2e-5"});
  EXPECT_DOUBLE_EQ(*o.min_lr_ratio, 0.1);
  o.name = "piecewise_constant";
  apply_lr_scheduler_args(o, {"step_rules='1:10,0.5'"});  // kohya's literal_eval quotes
  EXPECT_EQ(o.step_rules, "1:10,0.5");
  EXPECT_THROW(apply_lr_scheduler_args(o, {"lr_end=1e-6"}), InputError)
      << "lr_end is polynomial's";
  EXPECT_THROW(apply_lr_scheduler_args(o, {"T_max=100"}), InputError);
  o.name = "warmup_stable_decay";
  EXPECT_THROW(apply_lr_scheduler_args(o, {"decay_type=step"}), InputError);
}

}  // namespace
}  // namespace lorapipe::trainer
