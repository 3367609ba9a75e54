// `lorapipe plan` (deploy/plan.h) against the real thing: its reading of a model's structure
// against the trainer's own LoRA on the same model, its predicted peaks against the peaks real
// training steps allocate on this CPU (trainer_bench solo, every tensor's storage counted), and
// the plan it writes.

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <map>
#include <sstream>
#include <nlohmann/json.hpp>
#include <regex>
#include <string>
#include <vector>

#include "common/error.h"
#include "deploy/plan.h"
#include "tests/paths.h"
#include "tests/process_util.h"

namespace lorapipe::launcher {
namespace {

namespace fs = std::filesystem;
using lorapipe::testing::read_text;
using lorapipe::testing::spawn;
using lorapipe::testing::wait_exit;
using nlohmann::json;

const fs::path kBin = LORAPIPE_BIN_DIR;

// A step of trainer_bench solo SIZE at a resolution and batch, with its options (trainer_bench's
// flags; --blocks_to_swap and the others also `lorapipe plan`'s).
struct AccuracyCase {
  std::string size;
  int resolution, batch;
  std::vector<std::string> options;
};

class PlanTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // ctest runs two tests at once on two cores: trainer_bench's LibTorch takes one thread, as
    // the launcher tests' stages do. Spinning OpenMP threads on both cores beside another test,
    // SDXL's accuracy step took 383 s against 94 s alone.
    setenv("OMP_NUM_THREADS", "1", 1);
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    work_ = fs::temp_directory_path() /
            (std::string("lorapipe-plan-") + info->name() + "-" + std::to_string(getpid()));
    fs::remove_all(work_);
    fs::create_directories(work_);
  }
  void TearDown() override {
    if (!HasFailure()) fs::remove_all(work_);
  }

  // Runs bin/NAME ARGS... to the end; its stdout, and the exit code in code_.
  std::string run(const std::string& name, const std::vector<std::string>& args) {
    std::vector<std::string> argv = {(kBin / name).string()};
    argv.insert(argv.end(), args.begin(), args.end());
    code_ = wait_exit(spawn(argv, work_ / "out.txt", work_ / "err.txt"));
    err_ = read_text(work_ / "err.txt");
    return read_text(work_ / "out.txt");
  }

  struct Bench {
    std::string structure;     // what `lorapipe plan --model` takes
    double lora_parameters = 0;
    double lora_modules = 0;
    double peak_bytes = 0;     // over the timed step (0 with --steps 0)
    double step_flops = 0;     // a step's analytic FLOPs at its --resolution and --batch
  };

  // trainer_bench solo SIZE ARGS... --write_structure: the model's structure and, with steps, the
  // peak of one training step on the CPU.
  Bench bench(const std::string& size, std::vector<std::string> args, const std::string& tag) {
    std::vector<std::string> argv = {"solo", size, "--device", "cpu", "--dtype", "fp32", "--write_structure",
                                     (work_ / tag).string()};
    argv.insert(argv.end(), args.begin(), args.end());
    const std::string out = run("trainer_bench", argv);
    EXPECT_EQ(code_, 0) << err_;
    Bench b;
    std::smatch m;
    if (std::regex_search(out, m, std::regex("structure (\\S+)"))) b.structure = m[1];
    if (std::regex_search(out, m, std::regex("LoRA modules (\\d+)"))) b.lora_modules = std::stod(m[1]);
    if (std::regex_search(out, m, std::regex("LoRA parameters (\\d+)"))) {
      b.lora_parameters = std::stod(m[1]);
    }
    if (std::regex_search(out, m, std::regex("peak allocated ([0-9.]+) MiB"))) {
      b.peak_bytes = std::stod(m[1]) * (1 << 20);
    }
    if (std::regex_search(out, m, std::regex("step flops ([0-9.e+]+)"))) {
      b.step_flops = std::stod(m[1]);
    }

    EXPECT_FALSE(b.structure.empty()) << out;
    return b;
  }

  // Each case's measured peak against `lorapipe plan`'s prediction for it (below).
  void expect_predicted_peaks(const std::vector<AccuracyCase>& cases);

  fs::path work_;
  int code_ = -1;
  std::string err_;
};

// The plan counts kohya's LoRA targets from the checkpoint's keys; the trainer builds its LoRA on
// the model. Both must agree to the parameter, on each family's full-size structure (FLUX.1 at
// full width, two double and four single blocks): the LoRA, its gradients and its optimizer
// state are the analytic part of every prediction. And the plan's FLOPs of a step, which time
// it, equal the trainer's analytic count (models::unet_forward_flops, flux_forward_flops) at a
// size and batch the calibration never counted: within 1%, the fit's form being the count's
// own but for FLUX.1's per-block modulation, a thousandth of it.
TEST_F(PlanTest, PlanStructureCountsTheTrainersLoraAndFlopsOnEveryFamily) {
  struct Case {
    std::string size;
    std::vector<std::string> args;
    std::string family;
    int resolution = 0, batch = 0;  // the FLOPs compared there (full-size families)
  };
  for (const Case& c : std::vector<Case>{{"full", {}, "sd15", 896, 3},
                                        {"sdxl", {}, "sdxl", 896, 3},
                                        {"flux", {"--depth", "2"}, "flux-dev", 768, 2},
                                        {"tiny", {}, "sd15"},
                                        {"flux_tiny", {}, "flux-dev"}}) {
    std::vector<std::string> args = c.args;
    args.insert(args.end(), {"--steps", "0"});
    if (c.resolution > 0) {
      args.insert(args.end(), {"--resolution", std::to_string(c.resolution), "--batch",
                               std::to_string(c.batch)});
    }
    const Bench b = bench(c.size, args, c.size);
    // The structure folder holds the denoiser alone, without the SDXL text encoders that tell
    // SDXL from its refiner: the family is named.
    const ModelStructure s = read_structure(b.structure, c.size == "sdxl" ? "sdxl" : "");
    EXPECT_EQ(s.family, c.family) << c.size;
    EXPECT_EQ(s.lora_modules, b.lora_modules) << c.size;
    EXPECT_EQ(16.0 * static_cast<double>(s.lora_in_out), b.lora_parameters) << c.size;
    if (c.size == "sdxl") {
      EXPECT_EQ(s.lora_modules, 722);  // kohya's count at full size
    }
    if (c.resolution == 0) continue;
    ASSERT_GT(b.step_flops, 0) << c.size;
    std::vector<std::string> plan = {"plan", "--explain", "--model=" + b.structure,
                                     "--resolution=" + std::to_string(c.resolution),
                                     "--train_batch_size=" + std::to_string(c.batch),
                                     "--gradient_checkpointing"};
    if (c.size == "sdxl") plan.push_back("--model_family=sdxl");
    const std::string out = run("lorapipe", plan);
    ASSERT_EQ(code_, 0) << err_;
    const double flops = json::parse(out).at("flops").get<double>();
    std::printf("[plan] %s %dpx batch %d: step FLOPs counted %.4g, the plan's %.4g (%+.3f%%)\n",
                c.size.c_str(), c.resolution, c.batch, b.step_flops, flops,
                100 * (flops / b.step_flops - 1));
    EXPECT_NEAR(flops / b.step_flops, 1, 0.01) << c.size;
  }
  // The full-size FLUX.1 [dev] transformer's structure (built on the meta device): kohya's 304
  // LoRA modules and its 11.9 B parameters.
  const Bench b = bench("flux", {"--steps", "0"}, "flux_full");
  const ModelStructure s = read_structure(b.structure, "");
  EXPECT_EQ(s.family, "flux-dev");
  EXPECT_EQ(s.lora_modules, 304);
  EXPECT_NEAR(static_cast<double>(s.params) / 1e9, 11.90, 0.005);
}

// The prediction against the measured peak of real steps on this CPU, for each family at full
// size (FLUX.1 at full width and reduced depth), at resolutions and batches the calibration
// (bench/plan_calibrate.py) never ran, with and without checkpointing, float8 and block swap.
// fp32 base: this CPU has no bf16 matrix units, and its bf16 steps take minutes. Goal, and
// tolerance: 10% (the issue's; bench/plan_calibrate.py reports the whole grid's worst case). One
// test per family, each a few minutes: ctest starts them first and runs them one at a time
// (tests/CMakeLists.txt), beside the rest of the suite.
void PlanTest::expect_predicted_peaks(const std::vector<AccuracyCase>& cases) {
  double worst = 0;
  for (const AccuracyCase& c : cases) {
    // One warm-up step makes the optimizer's state; the measured step then allocates as every
    // later one does (on the CPU no kernel choice changes what a step holds). The warm-up runs at
    // 64 px: the state a step leaves does not depend on its size (measured: every case's peak is
    // the same to the MiB as after a warm-up at its own size), and a full-size step at 64 px
    // costs a fraction of one at the measured size.
    std::vector<std::string> args = {"--steps", "1", "--warmup", "1", "--warmup_resolution", "64",
                                     "--batch", std::to_string(c.batch), "--resolution",
                                     std::to_string(c.resolution)};
    // trainer_bench steps the denoiser alone: the run that trains it alone, its text cached.
    std::vector<std::string> plan_args = {"plan", "--explain", "--network_dim=16",
                                          "--network_train_unet_only", "--mixed_precision=no",
                                          "--resolution=" + std::to_string(c.resolution),
                                          "--train_batch_size=" + std::to_string(c.batch)};
    for (size_t i = 0; i < c.options.size(); ++i) {
      args.push_back(c.options[i]);
      if (c.options[i] == "--depth") {
        args.push_back(c.options[++i]);
      } else if (c.options[i] == "--blocks_to_swap") {
        args.push_back(c.options[++i]);
        plan_args.push_back("--blocks_to_swap=" + c.options[i]);
      } else {
        plan_args.push_back(c.options[i]);
      }
    }
    const Bench b = bench(c.size, args, c.size);
    plan_args.push_back("--model=" + b.structure);
    if (c.size == "sdxl") plan_args.push_back("--model_family=sdxl");
    const std::string out = run("lorapipe", plan_args);
    ASSERT_EQ(code_, 0) << err_;
    ASSERT_GT(b.peak_bytes, 0) << "trainer_bench printed no peak";
    const double predicted = json::parse(out).at("predicted_peak_bytes").get<double>();
    const double error = predicted / b.peak_bytes - 1;
    worst = std::max(worst, std::abs(error));
    std::printf("[plan] %s %dpx batch %d", c.size.c_str(), c.resolution, c.batch);
    for (const std::string& o : c.options) std::printf(" %s", o.c_str());
    std::printf(": measured %.3f GiB, predicted %.3f GiB (%+.1f%%)\n", b.peak_bytes / (1 << 30),
                predicted / (1 << 30), 100 * error);
    EXPECT_LT(std::abs(error), 0.10) << c.size << " " << c.resolution << " " << c.batch;
  }
  std::printf("[plan] worst error %.1f%%\n", 100 * worst);
}

TEST_F(PlanTest, PlanAccuracySd15PredictsMeasuredCpuPeaksWithinTenPercent) {
  expect_predicted_peaks({{"full", 288, 1, {"--gradient_checkpointing"}},
                          {"full", 256, 2, {"--fp8_base"}}});
}

TEST_F(PlanTest, PlanAccuracySdxlPredictsMeasuredCpuPeaksWithinTenPercent) {
  expect_predicted_peaks(
      {{"sdxl", 288, 1, {"--gradient_checkpointing", "--fp8_base", "--fp8_scaled"}}});
}

TEST_F(PlanTest, PlanAccuracyFluxPredictsMeasuredCpuPeaksWithinTenPercent) {
  expect_predicted_peaks(
      {{"flux", 288, 1, {"--depth", "1", "--gradient_checkpointing"}},
       {"flux", 256, 1, {"--depth", "3", "--gradient_checkpointing", "--blocks_to_swap", "2"}}});
}

// `lorapipe plan` for a 6 GB and a 12 GB card: the table, plan.json as the issue lays it out,
// and the plot; the recommendation fits, a larger card never gets a smaller setting, and more
// batch or resolution never predicts less memory.
TEST_F(PlanTest, PlanCommandWritesTheTableJsonAndPlot) {
  const Bench b = bench("full", {"--steps", "0"}, "sd15");
  json plans[2];
  int index = 0;
  for (const std::string budget : {"6GB", "12GB"}) {
    const fs::path dir = work_ / budget;
    const std::string out = run("lorapipe", {"plan", "--model=" + b.structure,
                                             "--vram_budget=" + budget, "--output=" + dir.string()});
    ASSERT_EQ(code_, 0) << err_;
    EXPECT_NE(out.find("recommended:"), std::string::npos) << out;
    EXPECT_NE(out.find("lorapipe run --pretrained_model_name_or_path="), std::string::npos);
    const json plan = json::parse(read_text(dir / "plan.json"));
    const json& candidates = plan.at("candidates");
    ASSERT_GT(candidates.size(), 100u);
    const int r = plan.at("recommended").get<int>();
    const json& best = candidates.at(r);
    EXPECT_TRUE(best.at("fits").get<bool>());
    EXPECT_LT(best.at("predicted_peak_bytes").get<double>(), plan.at("budget_bytes").get<double>());
    EXPECT_GT(best.at("predicted_s_per_it").get<double>(), 0);
    bool has_resolution = false;
    for (const auto& f : best.at("flags")) has_resolution |= f.get<std::string>().starts_with("--resolution=");
    EXPECT_TRUE(has_resolution);
    for (const auto& a : candidates) {
      for (const auto& c : candidates) {
        const bool same_options =
            a.at("gradient_checkpointing") == c.at("gradient_checkpointing") &&
            a.at("fp8") == c.at("fp8") && a.at("optimizer_type") == c.at("optimizer_type") &&
            a.at("blocks_to_swap") == c.at("blocks_to_swap");
        if (same_options && a.at("batch_size").get<int>() <= c.at("batch_size").get<int>() &&
            a.at("resolution")[0].get<int>() <= c.at("resolution")[0].get<int>()) {
          EXPECT_LE(a.at("predicted_peak_bytes").get<double>(),
                    c.at("predicted_peak_bytes").get<double>());
        }
      }
    }
    // The plot is a PNG a user can open.
    const std::string png = read_text(dir / "plan.png");
    ASSERT_GT(png.size(), 1000u);
    EXPECT_EQ(png.substr(1, 3), "PNG");
    plans[index++] = plan;
  }
  const json& small = plans[0].at("candidates").at(plans[0].at("recommended").get<int>());
  const json& large = plans[1].at("candidates").at(plans[1].at("recommended").get<int>());
  EXPECT_GE(large.at("resolution")[0].get<int>() * large.at("batch_size").get<int>(),
            small.at("resolution")[0].get<int>() * small.at("batch_size").get<int>());
}

TEST_F(PlanTest, PlanCommandNamesBadValues) {
  const Bench b = bench("tiny", {"--steps", "0"}, "tiny");
  run("lorapipe", {"plan", "--model=" + b.structure, "--vram_budget=lots"});
  EXPECT_NE(code_, 0);
  EXPECT_NE(err_.find("--vram_budget=lots"), std::string::npos) << err_;
  run("lorapipe", {"plan", "--model=" + b.structure, "--gpu=Voodoo2"});
  EXPECT_NE(code_, 0);
  EXPECT_NE(err_.find("RTX 3060"), std::string::npos) << err_;
  run("lorapipe", {"plan", "--model=" + (work_ / "missing.safetensors").string()});
  EXPECT_NE(code_, 0);
  EXPECT_NE(err_.find("missing.safetensors"), std::string::npos) << err_;
  // A prompt file the sampler cannot read, where previews would share the card: named.
  run("lorapipe", {"plan", "--model=" + b.structure, "--device=cuda:0", "--sampler_device=cuda:0",
                   "--sample_prompts=" + (work_ / "no_prompts.txt").string()});
  EXPECT_NE(code_, 0);
  EXPECT_NE(err_.find("no_prompts.txt"), std::string::npos) << err_;
  // A run flag's number and the probe's, by name.
  for (const std::string bad : {"--gradient_accumulation_steps=x", "--network_dim=16.5",
                                "--learning_rate=fast", "--probe_steps=abc"}) {
    std::vector<std::string> args = {"plan", "--model=" + b.structure, bad};
    if (bad.rfind("--probe", 0) == 0) args.push_back("--probe");
    run("lorapipe", args);
    EXPECT_NE(code_, 0) << bad;
    EXPECT_NE(err_.find(bad), std::string::npos) << bad << ": " << err_;
  }
}


// `lorapipe run --plan_budget=6GB`: the run's flags become the plan's recommendation for the
// same model and flags (what `lorapipe plan` writes as the recommended candidate's flags), and a
// budget nothing fits is refused by name instead of training into an out-of-memory.
// A run that trains a text-encoder LoRA (kohya's default) keeps its text encoders on the card,
// encoding every step: the plan counts their weights (SD1.5's in bf16, and in float8 with
// --fp8_base, the sampler's measured bytes: predict_preview_share's), and says so;
// --network_train_unet_only leaves them off. FLUX.1's settings train the transformer alone, as
// kohya's small-card recipes do (CLIP-L would stay on the card, T5-XXL's states cached): its
// recommended command says --network_train_unet_only.
TEST_F(PlanTest, PlanCountsTheTextEncodersATextEncoderLoraKeepsOnTheCard) {
  const Bench sd = bench("full", {"--steps", "0"}, "sd15");
  const auto explain = [&](std::vector<std::string> extra) {
    std::vector<std::string> args = {"plan", "--explain", "--model=" + sd.structure,
                                     "--resolution=512", "--train_batch_size=1",
                                     "--gradient_checkpointing"};
    args.insert(args.end(), extra.begin(), extra.end());
    const std::string out = run("lorapipe", args);
    EXPECT_EQ(code_, 0) << err_;
    return json::parse(out);
  };
  const json both = explain({});
  const json alone = explain({"--network_train_unet_only"});
  const json float8 = explain({"--fp8_base"});
  PlanOptions bf16;
  const double encoders = predict_preview_share(read_structure(sd.structure), 512, 512, bf16)
                              .text_encoders;
  EXPECT_GT(encoders, 0.2 * (1 << 30));  // CLIP-L's 123 M parameters in bf16
  EXPECT_DOUBLE_EQ(both.at("text_encoders").get<double>(), encoders);
  EXPECT_EQ(alone.at("text_encoders").get<double>(), 0);
  EXPECT_DOUBLE_EQ(both.at("predicted_peak_bytes").get<double>() -
                       alone.at("predicted_peak_bytes").get<double>(),
                   encoders);
  EXPECT_LT(float8.at("text_encoders").get<double>(), 0.75 * encoders);
  const std::string table = run("lorapipe", {"plan", "--model=" + sd.structure});
  EXPECT_NE(table.find("the text encoders stay on the card"), std::string::npos) << table;
  // Captions that change every step are encoded every step, whatever trains.
  const json shuffled = explain({"--network_train_unet_only", "--shuffle_caption"});
  EXPECT_DOUBLE_EQ(shuffled.at("text_encoders").get<double>(), encoders);

  const Bench flux = bench("flux", {"--steps", "0"}, "flux_full");
  run("lorapipe", {"plan", "--model=" + flux.structure, "--vram_budget=12GB",
                   "--output=" + (work_ / "flux").string()});
  ASSERT_EQ(code_, 0) << err_;
  const json plan = json::parse(read_text(work_ / "flux" / "plan.json"));
  const json& best = plan.at("candidates").at(plan.at("recommended").get<int>());
  bool unet_only = false;
  for (const auto& f : best.at("flags")) unet_only |= f == "--network_train_unet_only";
  EXPECT_TRUE(unet_only) << best.at("flags").dump();
  // `lorapipe run --plan_budget` runs that setting, the flag included.
  Settings budgeted = parse_run_args({"--pretrained_model_name_or_path=" + flux.structure,
                                      "--plan_budget=12GB"});
  const std::string said = apply_plan_budget(budgeted);
  EXPECT_EQ(budgeted.get("network_train_unet_only"), "true") << said;
  EXPECT_NE(said.find("the transformer alone"), std::string::npos) << said;
  // Captions that change every step keep T5-XXL on the card, which the plan does not count:
  // it says so.
  const std::string online = run("lorapipe", {"plan", "--model=" + flux.structure,
                                              "--shuffle_caption", "--vram_budget=12GB"});
  EXPECT_NE(online.find("T5-XXL (4.8 B parameters) and CLIP-L stay on the card"),
            std::string::npos)
      << online;
  // A CLIP-L LoRA the run asks for by name keeps CLIP-L alone there: T5-XXL's states come from
  // the cache (the trainer's partial caching).
  const std::string clip = run("lorapipe", {"plan", "--model=" + flux.structure,
                                            "--network_train_text_encoder_only",
                                            "--vram_budget=12GB"});
  EXPECT_NE(clip.find("CLIP-L stays on the card, encoding every step"), std::string::npos)
      << clip;
  EXPECT_EQ(clip.find("T5-XXL (4.8 B parameters) and CLIP-L stay"), std::string::npos) << clip;
}

TEST_F(PlanTest, PlanBudgetGivesTheRunTheRecommendation) {
  const Bench b = bench("full", {"--steps", "0"}, "sd15");
  Settings settings = parse_run_args({"--pretrained_model_name_or_path=" + b.structure,
                                      "--plan_budget=6GB", "--network_dim=16",
                                      "--optimizer_type=AdamW8bit"});
  const std::string said = apply_plan_budget(settings);
  EXPECT_NE(said.find("--plan_budget 6.00 GiB"), std::string::npos) << said;

  run("lorapipe", {"plan", "--model=" + b.structure, "--vram_budget=6GB", "--network_dim=16",
                   "--optimizer_type=AdamW8bit", "--output=" + (work_ / "plan").string()});
  ASSERT_EQ(code_, 0) << err_;
  const json plan = json::parse(read_text(work_ / "plan" / "plan.json"));
  const json& best = plan.at("candidates").at(plan.at("recommended").get<int>());
  EXPECT_EQ(best.at("optimizer_type"), "AdamW8bit");  // the run's flag narrowed the plan
  for (const auto& flag : best.at("flags")) {
    const std::string f = flag.get<std::string>();
    const size_t eq = f.find('=');
    const std::string name = f.substr(2, eq == std::string::npos ? std::string::npos : eq - 2);
    const std::string value = eq == std::string::npos ? "true" : f.substr(eq + 1);
    if (name == "pretrained_model_name_or_path") continue;
    EXPECT_EQ(settings.get(name), value) << name;
  }

  Settings tiny = parse_run_args({"--pretrained_model_name_or_path=" + b.structure,
                                  "--plan_budget=1GB"});
  try {
    apply_plan_budget(tiny);
    ADD_FAILURE() << "a 1 GB budget for SD1.5 in fp32 was accepted";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("--plan_budget=1GB"), std::string::npos) << e.what();
  }
}

// Previews on the training card: the share the plan predicts for a sampler rendering over the
// trainer's weights against what that sampler's render holds on this CPU, every tensor counted
// (sampler_bench solo: SD1.5's full-size text encoder and VAE, a random rank-16 LoRA in the
// sampler's slots, one render of one step with CFG, at a size bench/plan_calibrate.py --preview
// never ran). The encoders' and VAE's bytes are the same modules'; the render's working memory is
// the fitted part. Goal and tolerance: 10%, the plan's own.
TEST_F(PlanTest, PlanPreviewShareSd15PredictsTheSamplersMeasuredShareWithinTenPercent) {
  const Bench b = bench("full", {"--steps", "0"}, "sd15");
  const std::string out = run("sampler_bench", {"solo", "--family", "sd15", "--resolution", "320",
                                                "--steps", "1", "--images", "1", "--lora_rank",
                                                "16"});
  ASSERT_EQ(code_, 0) << err_;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(out, m, std::regex(R"(preview share ([0-9]+) MiB)"))) << out;
  const double measured = std::stod(m[1]) * (1 << 20);
  PlanOptions options;
  options.storage_bytes = 4;  // the bench's fp32
  options.rank = 16;
  const PreviewShare predicted = predict_preview_share(read_structure(b.structure), 320, 320,
                                                       options);
  const double error = predicted.bytes() / measured - 1;
  std::printf("[plan] SD1.5 preview 320x320 beside the training: measured %.3f GiB, predicted "
              "%.3f GiB (%+.1f%%)\n", measured / (1 << 30), predicted.bytes() / (1 << 30),
              100 * error);
  EXPECT_LT(std::abs(error), 0.10) << out;
}

// Previews rendered on the training card (the launcher's default on one GPU) take their share of
// the budget: the plan reads the prompt file's largest preview as the sampler does, weighs the
// settings against what is left, and says so; previews rendered after the training or on another
// device leave the budget whole. `lorapipe run --plan_budget` plans the same way.
TEST_F(PlanTest, PlanPreviewsOnTheTrainingCardTakeTheirShareOfTheBudget) {
  const Bench b = bench("full", {"--steps", "0"}, "sd15");
  const fs::path prompts = work_ / "prompts.txt";
  std::ofstream(prompts) << "a red circle --w 512 --h 512\na blue square --w 768 --h 640\n";
  // Both stages named on one GPU: no spare GPU of the machine running the test takes previews.
  const std::vector<std::string> flags = {"plan", "--model=" + b.structure, "--vram_budget=8GB",
                                          "--device=cuda:0", "--sampler_device=cuda:0"};
  auto plan_with = [&](const std::string& tag, std::vector<std::string> extra) {
    std::vector<std::string> args = flags;
    args.insert(args.end(), extra.begin(), extra.end());
    args.push_back("--output=" + (work_ / tag).string());
    const std::string out = run("lorapipe", args);
    EXPECT_EQ(code_, 0) << err_;
    return std::make_pair(out, json::parse(read_text(work_ / tag / "plan.json")));
  };
  const auto [alone_out, alone] = plan_with("alone", {});
  const auto [beside_out, beside] =
      plan_with("beside", {"--sample_prompts=" + prompts.string()});
  const auto [after_out, after] = plan_with(
      "after", {"--sample_prompts=" + prompts.string(), "--sample_after_training"});

  EXPECT_TRUE(alone.at("preview").is_null());
  EXPECT_EQ(alone.at("training_budget_bytes"), alone.at("budget_bytes"));
  EXPECT_TRUE(after.at("preview").is_null());
  EXPECT_EQ(after.at("training_budget_bytes"), after.at("budget_bytes"));
  EXPECT_NE(after_out.find("previews render after the training: the training has the whole "
                           "budget"), std::string::npos)
      << after_out;

  const json& preview = beside.at("preview");
  ASSERT_TRUE(preview.is_object()) << beside_out;
  EXPECT_EQ(preview.at("width"), 768);  // the largest by pixels
  EXPECT_EQ(preview.at("height"), 640);
  EXPECT_NE(beside_out.find("previews on this card, up to 768x640"), std::string::npos)
      << beside_out;
  // Its share in the run's bf16 (the plan's default): SD1.5's text encoder and VAE alone are
  // 0.39 GiB there.
  const double share = preview.at("predicted_bytes").get<double>();
  EXPECT_GT(share, 0.39 * (1 << 30));
  const double training = beside.at("training_budget_bytes").get<double>();
  EXPECT_NEAR(beside.at("budget_bytes").get<double>() - training, share * 1.1 + 0.6e9, 4);
  // Each candidate fits the training's share by the plan's own rule, and fewer fit than alone.
  // With a float8 base the sampler's text encoder is float8 too: its share is smaller, and the
  // training's larger.
  int fit_alone = 0, fit_beside = 0;
  for (const json& c : alone.at("candidates")) fit_alone += c.at("fits").get<bool>();
  for (const json& c : beside.at("candidates")) {
    const double own = c.at("training_budget_bytes").get<double>();
    if (c.at("fp8") == "none") {
      EXPECT_EQ(own, training);
    } else {
      // CLIP-L's 85 M Linear weights from 2 bytes to 1 (1.06 with --fp8_scaled's scales), +10%:
      // 84 to 89 MiB more for the training.
      EXPECT_GT(own, training + 80.0 * (1 << 20)) << c.dump();
      EXPECT_LT(own, beside.at("budget_bytes").get<double>());
    }
    const double needed = c.at("predicted_peak_bytes").get<double>() * 1.1 + 0.6e9;
    if (std::abs(needed - own) > 1e3) {
      EXPECT_EQ(c.at("fits").get<bool>(), needed <= own) << c.dump();
    }
    fit_beside += c.at("fits").get<bool>();
  }
  EXPECT_LT(fit_beside, fit_alone);
  EXPECT_GT(fit_beside, 0);

  Settings settings = parse_run_args({"--pretrained_model_name_or_path=" + b.structure,
                                      "--plan_budget=8GB", "--sample_prompts=" + prompts.string(),
                                      "--device=cuda:0", "--sampler_device=cuda:0"});
  const std::string said = apply_plan_budget(settings);
  EXPECT_NE(said.find("previews up to 768x640 render on the training card"), std::string::npos)
      << said;
}

// With a dataset, the plan weighs its own buckets, as the run's preprocess stage picks them (the
// demo dataset: drawn shapes of varied sizes and aspect ratios, 10 repeats): the buckets are the
// stage's report's, each candidate's peak is its largest bucket's largest batch (the explained
// prediction of that bucket alone), which is less than the square's at the same pixel budget.
TEST_F(PlanTest, PlanWeighsTheDatasetsOwnBuckets) {
  const Bench b = bench("tiny", {"--steps", "0"}, "tiny");
  const fs::path data = work_ / "data";
  run("lorapipe-demo-dataset", {data.string()});
  ASSERT_EQ(code_, 0) << err_;
  auto report_of = [&] {
    run("lorapipe-preprocess", {"--data_dir=" + data.string(), "--resolution=512,512",
                                "--report_only",
                                "--report_json=" + (work_ / "report.json").string()});
    EXPECT_EQ(code_, 0) << err_;
    return json::parse(read_text(work_ / "report.json"));
  };
  // Without its square images, every bucket is smaller than the square the plan would weigh
  // without the dataset.
  for (const json& image : report_of().at("images")) {
    if (image.at("bucket") != json::array({512, 512})) continue;
    fs::path path = image.at("path").get<std::string>();
    if (path.is_relative()) path = data / path;
    ASSERT_TRUE(fs::remove(path)) << path;
    fs::remove(fs::path(path).replace_extension(".txt"));
  }
  const json report = report_of();
  ASSERT_GT(report.at("buckets").size(), 2u) << "the demo dataset should span several buckets";

  const std::vector<std::string> common = {"--model=" + b.structure, "--vram_budget=6GB",
                                           "--network_dim=16", "--gradient_checkpointing",
                                           "--optimizer_type=AdamW"};
  std::vector<std::string> args = {"plan", "--data_dir=" + data.string(), "--resolutions=512",
                                   "--output=" + (work_ / "plan").string()};
  args.insert(args.end(), common.begin(), common.end());
  const std::string out = run("lorapipe", args);
  ASSERT_EQ(code_, 0) << err_;
  int64_t samples = 0;
  for (const json& bucket : report.at("buckets")) samples += bucket.at("count_with_repeats").get<int64_t>();
  EXPECT_NE(out.find("dataset at 512: " + std::to_string(samples) + " samples per epoch"),
            std::string::npos) << out;
  const json plan = json::parse(read_text(work_ / "plan" / "plan.json"));
  const json& buckets = plan.at("dataset_buckets").at("512");
  ASSERT_EQ(buckets.size(), report.at("buckets").size());
  for (size_t i = 0; i < buckets.size(); ++i) {
    EXPECT_EQ(buckets[i].at("resolution"), report.at("buckets")[i].at("bucket"));
    EXPECT_EQ(buckets[i].at("count"), report.at("buckets")[i].at("count_with_repeats"));
  }

  // Batch 4, no float8: its peak is the largest of each bucket's prediction at its largest batch.
  double largest = 0;
  for (const json& bucket : buckets) {
    std::vector<std::string> explain = {
        "plan", "--explain", "--mixed_precision=bf16",
        "--resolution=" + std::to_string(bucket.at("resolution")[0].get<int>()) + "," +
            std::to_string(bucket.at("resolution")[1].get<int>()),
        "--train_batch_size=" + std::to_string(std::min<int>(4, bucket.at("count").get<int>()))};
    explain.insert(explain.end(), common.begin(), common.end());
    const std::string e = run("lorapipe", explain);
    ASSERT_EQ(code_, 0) << err_;
    largest = std::max(largest, json::parse(e).at("predicted_peak_bytes").get<double>());
  }
  std::vector<std::string> square = {"plan", "--explain", "--mixed_precision=bf16",
                                     "--resolution=512,512", "--train_batch_size=4"};
  square.insert(square.end(), common.begin(), common.end());
  const double square_peak = json::parse(run("lorapipe", square)).at("predicted_peak_bytes").get<double>();
  bool found = false;
  for (const json& c : plan.at("candidates")) {
    if (c.at("batch_size") != 4 || c.at("fp8") != "none") continue;
    found = true;
    // Both round to whole bytes (plan.json's llround).
    EXPECT_NEAR(c.at("predicted_peak_bytes").get<double>(), largest, 1.0);
    EXPECT_LT(c.at("predicted_peak_bytes").get<double>(), square_peak);
    EXPECT_GT(c.at("predicted_samples_per_s").get<double>(), 0);
  }
  EXPECT_TRUE(found);

  // A dataset the stage cannot read is named.
  run("lorapipe", {"plan", "--model=" + b.structure, "--data_dir=" + (work_ / "none").string()});
  EXPECT_NE(code_, 0);
  EXPECT_NE(err_.find((work_ / "none").string()), std::string::npos) << err_;
}

// --auto_batch: each of the dataset's buckets (the preprocess stage's report) gets the largest
// batch per rank whose prediction fits the budget, at most the run's samples per step
// (train_batch_size x gradient_accumulation_steps, 2 x 8 here). The budget is the one at which
// the largest bucket (512x512) just fits a batch of 8: it gets 8, the smaller buckets more, and
// each bucket's batch fits while one more would not.
TEST_F(PlanTest, PlanAutoBatchGivesEachBucketTheLargestBatchThatFits) {
  const Bench b = bench("tiny", {"--steps", "0"}, "tiny");
  const fs::path data = work_ / "data";
  run("lorapipe-demo-dataset", {data.string()});
  ASSERT_EQ(code_, 0) << err_;
  run("lorapipe-preprocess", {"--data_dir=" + data.string(), "--resolution=512", "--report_only",
                              "--report_json=" + (work_ / "report.json").string()});
  ASSERT_EQ(code_, 0) << err_;
  const json report = json::parse(read_text(work_ / "report.json"));
  ASSERT_GT(report.at("buckets").size(), 2u);

  const std::vector<std::string> memory = {"--gradient_checkpointing", "--mixed_precision=bf16",
                                           "--network_dim=16", "--optimizer_type=AdamW"};
  std::vector<std::string> plan_args = {"--model=" + b.structure};
  plan_args.insert(plan_args.end(), memory.begin(), memory.end());
  const PlanOptions options = parse_plan_args(plan_args);
  const ModelStructure model = read_structure(b.structure);
  auto needed = [&](int width, int height, int batch) {
    return budget_needed(predict(model, {width, height, batch, true, "", 0, "AdamW"}, options));
  };
  const double budget = needed(512, 512, 8) + (1 << 20);
  std::ostringstream budget_flag;
  budget_flag << std::setprecision(12) << "--vram_budget=" << budget / (1 << 20) << "MB";
  std::vector<std::string> run_args = {"--pretrained_model_name_or_path=" + b.structure,
                                       "--data_dir=" + data.string(), "--resolution=512",
                                       "--train_batch_size=2", "--gradient_accumulation_steps=8",
                                       "--auto_batch", budget_flag.str()};
  run_args.insert(run_args.end(), memory.begin(), memory.end());
  Settings settings = parse_run_args(run_args);
  const std::string said = apply_auto_batch(settings);
  std::printf("%s\n", said.c_str());
  EXPECT_NE(said.find("16 samples per optimizer step"), std::string::npos) << said;
  EXPECT_NE(said.find("the learning rate is unchanged"), std::string::npos) << said;
  std::map<std::string, int> sizes;
  std::stringstream pieces(settings.get("bucket_batch_sizes"));
  for (std::string piece; std::getline(pieces, piece, ',');) {
    sizes[piece.substr(0, piece.find(':'))] = std::stoi(piece.substr(piece.find(':') + 1));
  }
  ASSERT_EQ(sizes.size(), report.at("buckets").size()) << settings.get("bucket_batch_sizes");
  int largest_batch = 0;
  for (const json& bucket : report.at("buckets")) {
    const int w = bucket.at("bucket")[0], h = bucket.at("bucket")[1];
    const std::string name = std::to_string(w) + "x" + std::to_string(h);
    ASSERT_TRUE(sizes.count(name)) << name;
    const int batch = sizes.at(name);
    EXPECT_GE(batch, 1);
    EXPECT_LE(batch, 16) << name << ": more than a step's samples";
    EXPECT_LE(needed(w, h, batch), budget) << name << " at " << batch << " does not fit";
    if (batch < 16) {
      EXPECT_GT(needed(w, h, batch + 1), budget) << name << ": one more fits";
    }
    largest_batch = std::max(largest_batch, batch);
  }
  EXPECT_EQ(sizes.at("512x512"), 8);
  EXPECT_GT(largest_batch, 8) << "the smaller buckets take larger batches";

  // Previews rendered on the same GPU take their share first: a budget larger by exactly that
  // share gives the same batches.
  const fs::path prompts = work_ / "prompts.txt";
  std::ofstream(prompts) << "a red circle --w 512 --h 512\n";
  std::vector<std::string> beside_args = {"--sample_prompts=" + prompts.string(),
                                          "--device=cuda:0", "--sampler_device=cuda:0"};
  beside_args.insert(beside_args.begin(), run_args.begin(), run_args.end());
  const PreviewShare share = predict_preview_share(model, 512, 512, parse_plan_args(beside_args));
  ASSERT_GT(share.bytes(), 0);
  std::ostringstream beside_budget;
  beside_budget << std::setprecision(12) << "--vram_budget="
                << (budget + share.budget_needed()) / (1 << 20) << "MB";
  *std::find(beside_args.begin(), beside_args.end(), budget_flag.str()) = beside_budget.str();
  Settings beside = parse_run_args(beside_args);
  const std::string beside_said = apply_auto_batch(beside);
  EXPECT_NE(beside_said.find("beside previews up to 512x512"), std::string::npos) << beside_said;
  EXPECT_EQ(beside.get("bucket_batch_sizes"), settings.get("bucket_batch_sizes")) << beside_said;

  // Without a budget it asks for one; without a dataset it says what it sizes.
  Settings unbudgeted = parse_run_args({"--pretrained_model_name_or_path=" + b.structure,
                                        "--data_dir=" + data.string(), "--auto_batch"});
  try {
    apply_auto_batch(unbudgeted);
    ADD_FAILURE() << "--auto_batch without a budget was taken";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("--vram_budget"), std::string::npos) << e.what();
  }

  // `lorapipe plan --auto_batch` previews the same sizes.
  std::vector<std::string> preview = {"plan"};
  preview.insert(preview.end(), run_args.begin(), run_args.end());
  const std::string out = run("lorapipe", preview);
  ASSERT_EQ(code_, 0) << err_;
  EXPECT_NE(out.find("--bucket_batch_sizes=" + settings.get("bucket_batch_sizes")),
            std::string::npos)
      << out;
}

// `lorapipe run --auto_batch` hands the trainer the sizes: the demo run (built-in tiny model),
// 1 x 4 samples per step on a budget that fits every bucket's whole step, trains in batches of 4
// per bucket, and run.toml keeps the sizes for a resume.
TEST_F(PlanTest, PlanAutoBatchReachesTheTrainerInARun) {
  const fs::path dir = work_ / "run";
  run("lorapipe", {"run", "--output=" + dir.string(), "--auto_batch", "--vram_budget=24GB",
                   "--max_train_steps=2", "--train_batch_size=1",
                   "--gradient_accumulation_steps=4", "--sample_every_n_steps=0",
                   "--device=cpu", "--sampler_device=cpu"});
  ASSERT_EQ(code_, 0) << err_;
  const std::string trainer_log = read_text(dir / "logs" / "trainer.log");
  EXPECT_NE(trainer_log.find("4 samples per step)"), std::string::npos) << trainer_log;
  const std::string toml = read_text(dir / "run.toml");
  std::smatch m;
  ASSERT_TRUE(std::regex_search(toml, m, std::regex(R"re(bucket_batch_sizes = "([^"]+)")re"))) << toml;
  std::stringstream pieces(m[1].str());
  int buckets = 0;
  for (std::string piece; std::getline(pieces, piece, ',');) {
    ++buckets;
    EXPECT_EQ(piece.substr(piece.find(':')), ":4") << piece;
    EXPECT_NE(trainer_log.find(piece), std::string::npos) << piece << " not in " << trainer_log;
  }
  EXPECT_GT(buckets, 1);
  // Resumed, the run keeps its sizes (its state was trained in them) rather than sizing again.
  const std::string resumed = run("lorapipe", {"resume", dir.string(), "--max_train_steps=3"});
  ASSERT_EQ(code_, 0) << err_ << resumed;
  EXPECT_NE(resumed.find("--auto_batch: the run's batch sizes per bucket, " + m[1].str()),
            std::string::npos)
      << resumed;
}

// `lorapipe run --plan_budget` plans once: a resumed run goes on in the settings planned when it
// started (its state was trained in them), rather than planning again with the resume's flags.
TEST_F(PlanTest, PlanBudgetIsNotPlannedAgainOnResume) {
  const fs::path dir = work_ / "run";
  run("lorapipe-make-tiny-model", {(work_ / "model").string()});  // the demo's model and data
  ASSERT_EQ(code_, 0) << err_;
  run("lorapipe-demo-dataset", {(work_ / "data").string()});
  ASSERT_EQ(code_, 0) << err_;
  const std::string first = run(
      "lorapipe",
      {"run", "--output=" + dir.string(), "--plan_budget=24GB",
       "--pretrained_model_name_or_path=" + (work_ / "model" / "tiny-sd15.safetensors").string(),
       "--tokenizer=" + (work_ / "model" / "tiny-sd15-tokenizer").string(),
       "--data_dir=" + (work_ / "data").string(), "--max_train_steps=2",
       "--sample_every_n_steps=0", "--device=cpu", "--sampler_device=cpu"});
  ASSERT_EQ(code_, 0) << err_ << first;
  EXPECT_NE(first.find("--plan_budget 24.00 GiB"), std::string::npos) << first;
  const std::string resumed = run("lorapipe", {"resume", dir.string(), "--max_train_steps=3"});
  ASSERT_EQ(code_, 0) << err_ << resumed;
  EXPECT_NE(resumed.find("--plan_budget: the run goes on in the settings planned when it started"),
            std::string::npos)
      << resumed;
  EXPECT_EQ(resumed.find("--plan_budget 24.00 GiB"), std::string::npos) << resumed;
}

// `lorapipe plan --probe`: each shown setting runs as real steps (trainer_bench, here the tiny
// SD1.5 on the CPU, the budget's memory less the CUDA reserve enforced by the tensor counter as a
// card's capacity): measured next to predicted in the output and plan.json, a setting that runs
// out of memory said so without stopping the probe, its size's larger batches skipped, and each
// measured peak the one trainer_bench measures of that setting alone.
TEST_F(PlanTest, PlanProbeRunsTheSettingsAndStopsEachSizeAtItsFirstOutOfMemory) {
  const Bench b = bench("tiny", {"--steps", "0"}, "tiny");
  // 26 MiB for tensors: the tiny model at 256x256 takes 18 MiB at batch 2 and 33 at batch 4
  // (128x128: 18 at batch 8).
  const double limit = 26.0 * (1 << 20);
  std::ostringstream budget;
  budget << std::setprecision(12) << "--vram_budget=" << (0.6e9 + limit) / (1 << 20) << "MB";
  const std::string out =
      run("lorapipe", {"plan", "--model=" + b.structure, "--probe", "--probe_device=cpu",
                       "--probe_size=tiny", "--probe_steps=1", "--mixed_precision=no",
                       "--resolutions=128,256", "--batch_sizes=1,2,4,8",
                       "--gradient_checkpointing", "--optimizer_type=AdamW", "--fp8_base",
                       "--network_train_unet_only",  // the bench's denoiser alone on the card
                       budget.str(), "--output=" + (work_ / "plan").string()});
  ASSERT_EQ(code_, 0) << err_ << out;
  std::printf("%s", out.substr(out.find("probe:")).c_str());
  const json plan = json::parse(read_text(work_ / "plan" / "plan.json"));
  std::map<std::pair<int, int>, json> probed;  // (side, batch)
  for (const json& c : plan.at("candidates")) {
    if (c.contains("probe")) probed[{c.at("resolution")[0], c.at("batch_size")}] = c.at("probe");
  }
  ASSERT_EQ(probed.size(), 8u) << "every shown setting: 2 sizes x 4 batches";
  int out_of_memory = 0, skipped = 0;
  for (const auto& [key, p] : probed) {
    const auto [side, batch] = key;
    if (p.at("out_of_memory").get<bool>()) {
      ++out_of_memory;
      EXPECT_EQ(side, 256) << "128x128 fits 26 MiB at every batch";
      EXPECT_EQ(batch, 4);
      continue;
    }
    if (p.at("skipped").get<bool>()) {
      ++skipped;
      EXPECT_TRUE(probed.at({side, batch / 2}).at("out_of_memory").get<bool>() ||
                  probed.at({side, batch / 2}).at("skipped").get<bool>())
          << side << " batch " << batch << " skipped after no out-of-memory";
      continue;
    }
    const double peak = p.at("measured_peak_bytes").get<double>();
    EXPECT_GT(peak, 0);
    EXPECT_LE(peak, limit) << side << " batch " << batch;
    EXPECT_GT(p.at("s_per_it").get<double>(), 0);
  }
  EXPECT_EQ(out_of_memory, 1) << out;
  EXPECT_EQ(skipped, 1) << "256x256 at batch 8 skipped, not run: " << out;
  EXPECT_NE(out.find("out of memory"), std::string::npos) << out;
  EXPECT_NE(out.find("worst peak error"), std::string::npos) << out;
  // The probe's measurement is the bench's own of the setting alone (the tensor counter's peak,
  // to the MiB it prints).
  const std::string alone = run("trainer_bench", {"solo", "tiny", "--device", "cpu", "--dtype",
                                                  "fp32", "--steps", "1", "--batch", "2",
                                                  "--resolution", "256", "--fp8_base",
                                                  "--gradient_checkpointing"});
  ASSERT_EQ(code_, 0) << err_;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(alone, m, std::regex("peak allocated ([0-9]+) MiB"))) << alone;
  EXPECT_NEAR(probed.at({256, 2}).at("measured_peak_bytes").get<double>() / (1 << 20),
              std::stod(m[1]), 1.0);

  // A probe that fails for another reason than memory says why, marks its settings failed in
  // the table and plan.json, and still writes the plan; the exit code says it failed.
  const std::string failed =
      run("lorapipe", {"plan", "--model=" + b.structure, "--probe", "--probe_device=cpu",
                       "--probe_size=enormous", "--output=" + (work_ / "plan2").string()});
  EXPECT_NE(code_, 0);
  EXPECT_NE(failed.find("trainer_bench exited"), std::string::npos) << failed;
  EXPECT_NE(failed.find("failed: trainer_bench exited"), std::string::npos) << failed;
  EXPECT_NE(err_.find("group(s) of settings failed"), std::string::npos) << err_;
  const json written = json::parse(read_text(work_ / "plan2" / "plan.json"));
  int marked = 0;
  for (const json& c : written.at("candidates")) {
    marked += c.contains("probe") && c.at("probe").contains("failed");
  }
  EXPECT_GT(marked, 0) << written.dump(1);
}

}  // namespace
}  // namespace lorapipe::launcher
