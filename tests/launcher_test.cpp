// The lorapipe launcher with the real stages as child processes on this machine's CPU: the
// built-in demo run end to end, Ctrl-C and resume, a stage that dies, and the flag table against
// every stage's own flags (--helpxml).

#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "common/error.h"
#include "common/kohya_flags.h"
#include "common/text.h"
#include "deploy/launcher.h"
#include "preprocess/demo_dataset.h"
#include "tests/paths.h"
#include "tests/process_util.h"

namespace lorapipe::launcher {
namespace {

namespace fs = std::filesystem;
using lorapipe::testing::read_text;
using lorapipe::testing::spawn;
using lorapipe::testing::wait_exit;
using nlohmann::json;
using Clock = std::chrono::steady_clock;

const fs::path kBin = LORAPIPE_BIN_DIR;

class LauncherTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // ctest runs two tests at once on two cores: each stage's LibTorch takes one thread (as the
    // trainer tests' --threads=1), inherited by every stage the launcher starts. Two runs whose
    // trainers and samplers each spun OpenMP threads on both cores took 480 s where one alone
    // takes under a minute.
    setenv("OMP_NUM_THREADS", "1", 1);
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    work_ = fs::temp_directory_path() /
            (std::string("lorapipe-launcher-") + info->name() + "-" + std::to_string(getpid()));
    fs::remove_all(work_);
    fs::create_directories(work_);
  }
  void TearDown() override {
    if (!HasFailure()) fs::remove_all(work_);
  }

  // Runs `lorapipe ARGS...` to the end; returns the exit code, output in out_/err_.
  int lorapipe(const std::vector<std::string>& args) {
    std::vector<std::string> argv = {(kBin / "lorapipe").string()};
    argv.insert(argv.end(), args.begin(), args.end());
    // Every run of this test gets a cache of its own (not the user's shared one), so the demo
    // run encodes all it uses and two tests never share a cache by accident.
    setenv("LORAPIPE_CACHE_DIR", (work_ / "cache").c_str(), 1);
    const pid_t pid = spawn(argv, work_ / "out.txt", work_ / "err.txt");
    unsetenv("LORAPIPE_CACHE_DIR");
    const int code = wait_exit(pid);
    out_ = read_text(work_ / "out.txt");
    err_ = read_text(work_ / "err.txt");
    return code;
  }

  json status(const fs::path& run) {
    EXPECT_EQ(lorapipe({"status", run.string(), "--json"}), 0) << err_;
    return json::parse(out_);
  }

  // The run's events so far (lines cut mid-write are skipped).
  static std::vector<json> events(const fs::path& run) {
    std::vector<json> out;
    std::ifstream in(run / "events.jsonl");
    for (std::string line; std::getline(in, line);) {
      json e = json::parse(line, nullptr, false);
      if (!e.is_discarded()) out.push_back(std::move(e));
    }
    return out;
  }

  // Waits until a TrainProgress at `step` or later is in the events; returns the trainer's pid.
  static pid_t wait_for_training(const fs::path& run, int step) {
    const auto deadline = Clock::now() + std::chrono::seconds(240);
    while (Clock::now() < deadline) {
      pid_t trainer = -1;
      bool reached = false;
      for (const json& e : events(run)) {
        if (e.value("event", "") == "Stage" && e.value("stage", "") == "trainer" &&
            e.contains("pid")) {
          trainer = e["pid"].get<pid_t>();
        }
        if (e.value("event", "") == "TrainProgress" &&
            std::stoll(e.value("step", std::string("0"))) >= step) {
          reached = true;
        }
      }
      if (reached && trainer > 0) return trainer;
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    return -1;
  }

  // Every stage the launcher started has ended (no orphans left running).
  static void expect_no_stage_alive(const fs::path& run) {
    for (const json& e : events(run)) {
      if (e.value("event", "") != "Stage" || !e.contains("pid")) continue;
      const pid_t pid = e["pid"].get<pid_t>();
      EXPECT_TRUE(kill(pid, 0) != 0 && errno == ESRCH)
          << e.value("stage", "") << " (pid " << pid << ") is still running";
    }
  }

  fs::path work_;
  std::string out_, err_;
};

using LauncherRun = LauncherTest;
using LauncherFlags = LauncherTest;

// The issue's one-machine run: no model given, so the built-in tiny model and the demo dataset;
// it must end with a LoRA, at least two sampled checkpoints, the gallery and every record.
TEST_F(LauncherRun, DemoRunCompletesWithLoraSamplesGalleryAndEvents) {
  const fs::path run = work_ / "run";
  const auto started = Clock::now();
  ASSERT_EQ(lorapipe({"run", "--output=" + run.string()}), 0) << out_ << err_;
  const double seconds = std::chrono::duration<double>(Clock::now() - started).count();
  std::printf("[launcher] the demo run took %.1f s on this machine's CPU\n", seconds);
  EXPECT_NE(out_.find("lorapipe: done"), std::string::npos) << out_;
  // The live display (on a terminal one line redrawn; here a line whenever it is drawn): each
  // stage's state, the cache's hits and misses, step/total, loss, s/it, ETA, the newest sample.
  const std::regex training(R"(cache \w+ \(\d+ hits, \d+ misses, 0 rejected\) \| )"
                            R"(trainer running step \d+/100 loss [0-9.]+ [0-9.]+ s/it ETA )");
  EXPECT_TRUE(std::regex_search(out_, training)) << out_;
  const std::regex last(R"(cache \w+ \(\d+ hits, \d+ misses, 0 rejected\) \| trainer done )"
                        R"(step 100/100 loss [0-9.]+ [0-9.]+ s/it ETA [^|]+\| sampler done )"
                        R"(demo_000100_sheet\.png)");
  EXPECT_TRUE(std::regex_search(out_, last)) << out_;

  EXPECT_TRUE(fs::exists(run / "lora" / "demo.safetensors"));
  EXPECT_TRUE(fs::exists(run / "samples" / "index.html"));
  // The gallery's curves, from the run's events: every step from the first the launcher heard
  // (the trainer publishes as soon as it binds, and the launcher's subscription, retried every
  // 100 ms, may join a few of the demo's fast steps late) to the last, its loss, the cosine
  // schedule's learning rate falling to its end, and the peak memory.
  EXPECT_TRUE(read_text(run / "samples" / "curves.js").starts_with("lorapipeCurves({"));
  const json curves = json::parse(read_text(run / "samples" / "curves.json"));
  ASSERT_FALSE(curves["steps"].empty()) << curves.dump();
  const int first = curves["steps"].front().get<int>();
  EXPECT_LE(first, 20) << curves.dump();
  const size_t heard = static_cast<size_t>(100 - first + 1);
  ASSERT_EQ(curves["steps"].size(), heard) << curves.dump();
  EXPECT_EQ(curves["steps"].back(), 100);
  for (const char* series : {"loss", "average_loss", "learning_rate", "peak_memory_bytes"}) {
    ASSERT_EQ(curves[series].size(), heard) << series;
    EXPECT_GT(curves[series].front().get<double>(), 0) << series;
  }
  EXPECT_LT(curves["learning_rate"].back().get<double>(),
            0.01 * curves["learning_rate"].front().get<double>());
  EXPECT_TRUE(curves["validation"].empty()) << "the demo holds nothing out";
  EXPECT_TRUE(fs::exists(run / "run.toml"));
  EXPECT_TRUE(fs::exists(run / "state" / "demo-state" / "trainer.json"));
  EXPECT_FALSE(fs::is_empty(run / "tensorboard"));
  for (const char* stage : {"preprocess", "cacher", "trainer", "sampler"}) {
    EXPECT_GT(fs::file_size(run / "logs" / (std::string(stage) + ".log")), 0u) << stage;
  }
  // Sampler and trainer share the CPU: the launcher has both map the model file's weights, and
  // says so; each stage's log says what it shared (the tiny model's file holds all of it in fp32).
  EXPECT_NE(out_.find("the sampler shares the trainer's CPU"), std::string::npos) << out_;
  for (const char* stage : {"trainer", "sampler"}) {
    const std::string log = read_text(run / "logs" / (std::string(stage) + ".log"));
    EXPECT_TRUE(std::regex_search(log, std::regex(R"(--map_weights: \d+ weights \(\d+ MiB\) are )"
                                                  R"(the model file's pages.*; 0 \(0 MiB\) copied)")))
        << stage << ": " << log;
  }

  const json s = status(run);
  EXPECT_EQ(s["state"], "done");
  EXPECT_EQ(s["training"]["step"], 100);
  EXPECT_EQ(s["training"]["total_steps"], 100);
  ASSERT_TRUE(s["training"]["loss"].is_number()) << s.dump(2);
  EXPECT_TRUE(std::isfinite(s["training"]["loss"].get<double>())) << s.dump(2);
  ASSERT_TRUE(s["training"]["s_per_it"].is_number()) << s.dump(2);
  EXPECT_GT(s["training"]["s_per_it"].get<double>(), 0.0) << s.dump(2);
  EXPECT_EQ(s["cache"]["hits"].get<int>() + s["cache"]["misses"].get<int>(), 36);
  EXPECT_EQ(s["cache"]["rejected"], 0);
  std::set<int> sampled;
  for (const json& sample : s["samples"]) {
    sampled.insert(sample["step"].get<int>());
    EXPECT_TRUE(fs::exists(sample["contact_sheet"].get<std::string>()));
  }
  EXPECT_GE(sampled.size(), 2u) << s.dump(2);
  EXPECT_TRUE(sampled.count(100)) << "the final checkpoint was not rendered";
  ASSERT_FALSE(s["checkpoints"].empty());
  EXPECT_TRUE(s["checkpoints"].back()["final"].get<bool>());
  for (const char* stage : {"preprocess", "cacher", "trainer", "sampler"}) {
    EXPECT_EQ(s["stages"][stage]["exit_code"], 0) << stage;
  }
  expect_no_stage_alive(run);

  // Every stage's own StageStatus reached events.jsonl (runtime::StatusPublisher): the trainer's
  // progress in steps of the total, and each stage's DONE, once each change.
  std::map<std::string, std::set<std::string>> reported;
  uint64_t last_trainer_step = 0, trainer_total = 0;
  std::ifstream events(run / "events.jsonl");
  for (std::string line; std::getline(events, line);) {
    const json e = json::parse(line);
    if (e.value("event", "") != "StageStatus") continue;
    reported[e["stage"]].insert(e["state"].get<std::string>());
    if (e["stage"] == "trainer" && e["state"] == "PROGRESS") {
      EXPECT_EQ(e["unit"], "steps");
      const uint64_t step = std::stoull(e["done"].get<std::string>());
      EXPECT_GT(step, last_trainer_step) << "a repeated status was logged twice: " << line;
      last_trainer_step = step;
      trainer_total = std::stoull(e["total"].get<std::string>());
    }
  }
  EXPECT_EQ(trainer_total, 100u);
  EXPECT_EQ(last_trainer_step, 100u);
  for (const char* stage : {"preprocess", "cacher", "trainer", "sampler"}) {
    EXPECT_TRUE(reported[stage].count("DONE")) << stage << " never said DONE";
  }
  EXPECT_TRUE(reported["sampler"].count("PROGRESS")) << "the sampler's renders were not reported";

  // The human form says the same.
  ASSERT_EQ(lorapipe({"status", run.string()}), 0);
  EXPECT_NE(out_.find("step 100 of 100"), std::string::npos) << out_;
  // --json before the folder, as README's `lorapipe status runs/dog  # or --json` reads.
  ASSERT_EQ(lorapipe({"status", "--json", run.string()}), 0) << err_;
  EXPECT_EQ(json::parse(out_)["training"]["step"], 100) << out_;
  EXPECT_EQ(lorapipe({"status", "--jsn", run.string()}), kExitError);
  EXPECT_NE(err_.find("unknown flag --jsn (it takes --json)"), std::string::npos) << err_;

  // The folder belongs to this run: a second `run` into it is refused, naming resume.
  EXPECT_EQ(lorapipe({"run", "--output=" + run.string()}), kExitError);
  EXPECT_NE(err_.find("lorapipe resume"), std::string::npos) << err_;
}

// kohya's --debug_dataset under the launcher: preprocess and the cacher run, the trainer prints
// every step's batches into its log and trains nothing, no sampler is started, and the run ends
// 0 saying where the batches are. At a --resolution of the user's, the demo's bucket range (64-256,
// for its 128 px) gives way to preprocess's own, so 512 needs no --max_bucket_reso. What
// preprocess left out (a broken image, a folder that is no repeat folder) is said on the screen.
TEST_F(LauncherRun, DebugDatasetPrintsTheBatchesAndTrainsNothing) {
  const fs::path run = work_ / "run";
  const fs::path data = work_ / "data";
  ASSERT_EQ(wait_exit(spawn({(kBin / "lorapipe-demo-dataset").string(), data.string()},
                            work_ / "demo.out", work_ / "demo.err")),
            0)
      << read_text(work_ / "demo.err");
  std::ofstream(data / preprocess::kDemoFolder / "zz_broken.jpg") << "not a jpeg";
  fs::create_directories(data / "shapes_no_repeat");
  fs::copy_file(fs::directory_iterator(data / preprocess::kDemoFolder)->path(),
                data / "shapes_no_repeat" / "x.png");
  ASSERT_EQ(lorapipe({"run", "--output=" + run.string(), "--debug_dataset", "--data_dir=" + data.string(),
                      "--max_train_steps=3", "--sample_every_n_steps=1", "--resolution=512"}),
            0)
      << out_ << err_;
  EXPECT_NE(out_.find("lorapipe: preprocess: 36 images used of 37 found; 1 skipped, 1 ignored "
                      "(the log says why): see " + (run / "logs" / "preprocess.log").string()),
            std::string::npos)
      << out_;
  // Nothing renders previews, so the trainer is not asked to save LoRAs for them.
  EXPECT_NE(out_.find("no previews are rendered (no --sample_prompts, or --debug_dataset): "
                      "--sample_every_n_steps=1 left out"),
            std::string::npos)
      << out_;
  const std::string log_path = (run / "logs" / "trainer.log").string();
  EXPECT_NE(out_.find("--debug_dataset: the batches are in " + log_path), std::string::npos)
      << out_;
  const std::string log = read_text(run / "logs" / "trainer.log");
  for (const char* step : {"step 1/3  epoch 1  batch 0", "step 3/3  epoch 1  batch 2"}) {
    EXPECT_NE(log.find(step), std::string::npos) << step << " not in:\n" << log;
  }
  EXPECT_EQ(log.find("step 4/3"), std::string::npos) << log;
  EXPECT_NE(log.find("10_shapes/"), std::string::npos) << "no image listed:\n" << log;
  EXPECT_FALSE(fs::exists(run / "logs" / "sampler.log")) << "a sampler was started";
  EXPECT_TRUE(!fs::exists(run / "lora") || fs::is_empty(run / "lora")) << "something was saved";
  expect_no_stage_alive(run);
}

// An SDXL model of the user's (the tiny SDXL single file, as users have theirs): `lorapipe run`
// trains an SDXL LoRA with kohya's SDXL names and metadata and renders its samples, and
// diffusers' StableDiffusionXLPipeline.load_lora_weights takes the file with no module left over
// and changes its outputs. A bucket step SDXL cannot take is refused before any stage starts.
TEST_F(LauncherRun, SdxlModelTrainsAnSdxlLoraThatDiffusersLoads) {
  const fs::path model = work_ / "model";
  ASSERT_EQ(wait_exit(spawn({(kBin / "lorapipe-make-tiny-model").string(), model.string(), "3",
                             "--sdxl"},
                            work_ / "tiny.out", work_ / "tiny.err")),
            0)
      << read_text(work_ / "tiny.err");
  const fs::path data = work_ / "data";
  ASSERT_EQ(wait_exit(spawn({(kBin / "lorapipe-demo-dataset").string(), data.string()},
                            work_ / "demo.out", work_ / "demo.err")),
            0);
  std::ofstream(work_ / "prompts.txt") << "a red circle --w 64 --h 64 --d 1 --s 4\n";
  const std::vector<std::string> common = {
      "--model=" + (model / "tiny-sdxl.safetensors").string(),
      "--tokenizer=" + (model / "tiny-sdxl-tokenizer").string(), "--data_dir=" + data.string(),
      "--resolution=128", "--min_bucket_reso=64", "--max_bucket_reso=256",
      "--train_batch_size=2", "--network_dim=4", "--learning_rate=1e-3", "--device=cpu",
      "--sampler_device=cpu", "--output_name=xl"};

  std::vector<std::string> refused = {"run", "--output=" + (work_ / "refused").string(),
                                      "--bucket_reso_steps=48", "--max_train_steps=2"};
  refused.insert(refused.end(), common.begin(), common.end());
  EXPECT_EQ(lorapipe(refused), kExitError);
  EXPECT_NE(err_.find("--bucket_reso_steps=48: Stable Diffusion XL needs bucket sides that are "
                      "multiples of 32"),
            std::string::npos)
      << err_;
  EXPECT_FALSE(fs::exists(work_ / "refused" / "logs" / "cacher.log")) << "a stage was started";
  // SDXL's defaults where none is given: 1024 px and buckets up to 2048; a command that gives
  // --resolution, as kohya's do, keeps kohya's bucket default. (Each run stops at the trainer's
  // flag check, after run.toml is written.)
  auto settings_of = [&](const std::string& name, std::vector<std::string> extra) {
    std::vector<std::string> args = {"run", "--output=" + (work_ / name).string(),
                                     "--model=" + (model / "tiny-sdxl.safetensors").string(),
                                     "--data_dir=" + data.string(), "--network_dim=0"};
    args.insert(args.end(), extra.begin(), extra.end());
    EXPECT_EQ(lorapipe(args), kExitError) << name;
    return read_text(work_ / name / "run.toml");
  };
  const std::string chosen = settings_of("defaults", {});
  EXPECT_NE(chosen.find("resolution = \"1024\""), std::string::npos) << chosen;
  EXPECT_NE(chosen.find("max_bucket_reso = \"2048\""), std::string::npos) << chosen;
  const std::string kohyas = settings_of("kohyas", {"--resolution=1024"});
  EXPECT_EQ(kohyas.find("max_bucket_reso"), std::string::npos) << kohyas;
  // A dataset file of the user's: its datasets without a resolution take the family's (kohya
  // requires one; preprocess alone would take SD1.5's 512 px), and the folder flags a kohya
  // command carries beside it are ignored as kohya ignores them, said on the screen.
  std::ofstream(work_ / "dataset.toml")
      << "[[datasets]]\n[[datasets.subsets]]\nimage_dir = \""
      << (data / preprocess::kDemoFolder).string() << "\"\n";
  const std::string own = settings_of(
      "own", {"--dataset_config=" + (work_ / "dataset.toml").string(),
              "--reg_data_dir=" + data.string()});
  EXPECT_NE(own.find("resolution = \"1024\""), std::string::npos) << own;
  EXPECT_EQ(own.find("data_dir"), std::string::npos) << own;
  EXPECT_NE(out_.find("lorapipe: ignoring --train_data_dir=" + data.string() +
                      ", --reg_data_dir=" + data.string() + ": --dataset_config="),
            std::string::npos)
      << out_;

  const fs::path run = work_ / "run";
  std::vector<std::string> args = {"run", "--output=" + run.string(), "--max_train_steps=4",
                                   "--sample_prompts=" + (work_ / "prompts.txt").string(),
                                   "--sample_every_n_steps=2", "--save_every_n_steps=2"};
  args.insert(args.end(), common.begin(), common.end());
  ASSERT_EQ(lorapipe(args), 0) << out_ << err_;
  const std::string trainer_log = read_text(run / "logs" / "trainer.log");
  EXPECT_NE(trainer_log.find("Stable Diffusion XL"), std::string::npos) << trainer_log;
  const fs::path lora = run / "lora" / "xl.safetensors";
  ASSERT_TRUE(fs::exists(lora));
  const json s = status(run);
  std::set<int> sampled;
  for (const json& sample : s["samples"]) {
    sampled.insert(sample["step"].get<int>());
    EXPECT_TRUE(fs::exists(sample["contact_sheet"].get<std::string>()));
  }
  EXPECT_TRUE(sampled.count(4)) << s.dump(2);

  // kohya's SDXL names and metadata, and diffusers' loader takes every module.
  const char* python = std::getenv("LORAPIPE_PYTHON");
  ASSERT_NE(python, nullptr) << "LORAPIPE_PYTHON (the test venv's python) is unset";
  const fs::path result = work_ / "diffusers.json";
  const std::string command = std::string(python) + " " + LORAPIPE_SOURCE_DIR +
                              "/trainer/reference/sdxl_diffusers_lora_check.py --model " +
                              (model / "tiny-sdxl-diffusers").string() + " --lora " +
                              lora.string() + " --out " + result.string() + " > " +
                              (work_ / "diffusers.log").string() + " 2>&1";
  ASSERT_EQ(std::system(command.c_str()), 0) << read_text(work_ / "diffusers.log");
  const json check = json::parse(read_text(result));
  std::printf("[diffusers] %s\n", check.dump().c_str());
  EXPECT_GT(check["file_modules"].get<int>(), 0);
  EXPECT_EQ(check["adapted_modules"], check["file_modules"]);
  EXPECT_TRUE(check["leftover"].empty()) << check["leftover"].dump();
  EXPECT_GT(check["unet_change"].get<double>(), 1e-4);
  EXPECT_GT(check["text_change"].get<double>(), 1e-4);
  ASSERT_EQ(wait_exit(spawn({(kBin / "lorapipe-inspect").string(), lora.string()},
                            work_ / "inspect.out", work_ / "inspect.err")),
            0);
  const std::string inspected = read_text(work_ / "inspect.out");
  for (const char* part : {"ss_base_model_version = sdxl_base_v1-0",
                           "modelspec.architecture = stable-diffusion-xl-v1-base/lora"}) {
    EXPECT_NE(inspected.find(part), std::string::npos) << part << " not in " << inspected;
  }
  expect_no_stage_alive(run);
}

// The "[I HH:MM:SS.mmm" stamp of the first line of `log` holding `part` (empty if none).
std::string stamp_of(const std::string& log, const std::string& part) {
  const size_t at = log.find(part);
  if (at == std::string::npos) return "";
  const size_t line = log.rfind('\n', at);
  const size_t start = line == std::string::npos ? 0 : line + 1;
  return log.substr(start + 3, 12);
}

// A FLUX.1 [dev] model as a diffusers folder (a tiny one diffusers saved): `lorapipe run` trains
// a Flux LoRA by flow matching with kohya's networks.lora_flux names and metadata, and renders
// its samples. Merged onto the same weights through the key map from Black Forest Labs' modules
// to diffusers' split ones, the LoRA changes FluxPipeline's transformer and CLIP-L, and
// FluxPipeline's render from the sample's seed equals the sampler's PNG (limit: 1/255 per
// channel, the rounding of one pixel; the two run the same fp32 operations). The cacher's T5 is
// gone before the trainer loads, and the trainer, training CLIP-L's LoRA, reads T5's states from
// the cache (kohya's partial caching) with the first loss of a run that encodes every caption.
// With --apply_t5_attn_mask the cache keeps fewer bytes per caption. A bucket step Flux cannot
// take is refused before any stage starts.
TEST_F(LauncherRun, FluxModelTrainsAFluxLoraThatFluxPipelineRendersTheSame) {
  const char* python = std::getenv("LORAPIPE_PYTHON");
  ASSERT_NE(python, nullptr) << "LORAPIPE_PYTHON (the test venv's python) is unset";
  const fs::path sd = work_ / "sd";
  ASSERT_EQ(wait_exit(spawn({(kBin / "lorapipe-make-tiny-model").string(), sd.string(), "3"},
                            work_ / "tiny.out", work_ / "tiny.err")),
            0)
      << read_text(work_ / "tiny.err");
  const fs::path flux = work_ / "flux";
  const std::string build = std::string(python) + " " + LORAPIPE_SOURCE_DIR +
                            "/models/reference/tiny_flux.py " +
                            (sd / "tiny-sd15-diffusers").string() + " " + flux.string() + " > " +
                            (work_ / "flux.log").string() + " 2>&1";
  ASSERT_EQ(std::system(build.c_str()), 0) << read_text(work_ / "flux.log");
  const fs::path data = work_ / "data";
  ASSERT_EQ(wait_exit(spawn({(kBin / "lorapipe-demo-dataset").string(), data.string()},
                            work_ / "demo.out", work_ / "demo.err")),
            0);
  std::ofstream(work_ / "prompts.txt") << "a red circle --w 64 --h 64 --d 7 --s 4\n";
  const std::vector<std::string> common = {
      "--model=" + flux.string(), "--data_dir=" + data.string(), "--resolution=128",
      "--min_bucket_reso=64", "--max_bucket_reso=256", "--train_batch_size=2",
      "--network_dim=4", "--learning_rate=1e-3",
      // Both "auto" (the CPU here, the first GPU on a GPU machine): one device, where a FLUX.1
      // sampler beside the training would hold its own T5 XXL, so it renders after the training.
      "--device=auto", "--sampler_device=auto",
      "--output_name=fx", "--t5xxl_max_token_length=32"};

  std::vector<std::string> refused = {"run", "--output=" + (work_ / "refused").string(),
                                      "--bucket_reso_steps=48", "--max_train_steps=2"};
  refused.insert(refused.end(), common.begin(), common.end());
  EXPECT_EQ(lorapipe(refused), kExitError);
  EXPECT_NE(err_.find("--bucket_reso_steps=48: FLUX.1 [dev] needs bucket sides that are "
                      "multiples of 32"),
            std::string::npos)
      << err_;
  EXPECT_FALSE(fs::exists(work_ / "refused" / "logs" / "cacher.log")) << "a stage was started";
  // kohya's flags of a FLUX.1 run that trains CLIP-L's LoRA (its default) with
  // --cache_text_encoder_outputs: T5's states come from the cache (kohya's partial caching).
  const std::vector<std::string> flow = {"--network_module=networks.lora_flux",
                                         "--timestep_sampling=shift",
                                         "--model_prediction_type=raw"};
  const fs::path run = work_ / "run";
  std::vector<std::string> args = {"run", "--output=" + run.string(), "--max_train_steps=4",
                                   "--sample_prompts=" + (work_ / "prompts.txt").string(),
                                   "--sample_every_n_steps=2", "--save_every_n_steps=2",
                                   "--cache_text_encoder_outputs"};
  args.insert(args.end(), flow.begin(), flow.end());
  args.insert(args.end(), common.begin(), common.end());
  ASSERT_EQ(lorapipe(args), 0) << out_ << err_;
  const std::string run_out = out_;
  const std::string trainer_log = read_text(run / "logs" / "trainer.log");
  const std::string cacher_log = read_text(run / "logs" / "cacher.log");
  EXPECT_NE(trainer_log.find("FLUX.1 [dev]"), std::string::npos) << trainer_log;
  EXPECT_NE(trainer_log.find("T5-XXL's output comes from the cache and T5-XXL is dropped"),
            std::string::npos)
      << trainer_log;
  EXPECT_NE(trainer_log.find("text from the cache, the trained encoders' part encoded at every "
                             "step"),
            std::string::npos)
      << trainer_log;
  // The same run with every caption encoded online (caption_dropout_every_n_epochs, which never
  // comes within the run, leaves the captions as they are but keeps them out of the cache): the
  // first step's loss, before any update, is the same but for the cache's fp16 rounding of T5's
  // states (2^-11 relative; bound 1e-3). CLIP-L's LoRA training from the partly cached text is
  // shown by the merged file changing FluxPipeline's CLIP-L below.
  const fs::path online = work_ / "online";
  std::vector<std::string> online_args = {"run", "--output=" + online.string(),
                                          "--max_train_steps=1",
                                          "--caption_dropout_every_n_epochs=1000"};
  online_args.insert(online_args.end(), flow.begin(), flow.end());
  online_args.insert(online_args.end(), common.begin(), common.end());
  ASSERT_EQ(lorapipe(online_args), 0) << out_ << err_;
  EXPECT_NE(read_text(online / "logs" / "trainer.log").find("; text encoded online"),
            std::string::npos)
      << read_text(online / "logs" / "trainer.log");
  // The trainer's log line of step 1 (its events may go before the launcher has subscribed).
  auto first_loss = [](const std::string& log) -> double {
    std::smatch m;
    const std::regex line(R"(step 1/\d+  loss ([0-9.eE+-]+))");
    return std::regex_search(log, m, line) ? std::stod(m[1]) : -1;
  };
  const double partial_loss = first_loss(trainer_log);
  const double online_loss = first_loss(read_text(online / "logs" / "trainer.log"));
  std::printf("[flux partial caching] step 1 loss %.9g (T5's states cached) against %.9g "
              "(online)\n",
              partial_loss, online_loss);
  ASSERT_GT(online_loss, 0) << read_text(online / "logs" / "trainer.log");
  EXPECT_NEAR(partial_loss, online_loss, 1e-3 * std::abs(online_loss));
  // The cacher (CLIP-L, T5, the AE) has written its report and exited before the trainer loads.
  const std::string cached = stamp_of(cacher_log, "bytes per caption");
  const std::string loaded = stamp_of(trainer_log, "FLUX.1 [dev]");
  ASSERT_FALSE(cached.empty()) << cacher_log;
  ASSERT_FALSE(loaded.empty()) << trainer_log;
  EXPECT_LE(cached, loaded) << "the trainer loaded before the cacher was done";
  EXPECT_NE(run_out.find("FLUX.1 [dev]'s sampler would load its own text encoders beside the "
                         "training: previews render after the training"),
            std::string::npos)
      << run_out;
  const std::string sampler_started = stamp_of(read_text(run / "logs" / "sampler.log"), "[");
  const std::string trained = stamp_of(trainer_log, " at step 4");
  ASSERT_FALSE(sampler_started.empty());
  ASSERT_FALSE(trained.empty()) << trainer_log;
  EXPECT_LE(trained, sampler_started) << "a FLUX.1 sampler started beside the training";
  const fs::path lora = run / "lora" / "fx.safetensors";
  ASSERT_TRUE(fs::exists(lora));
  // The final checkpoint's preview of the one prompt (kohya's image naming).
  const std::string png = (run / "samples" / "fx_000004_00.png").string();
  ASSERT_TRUE(fs::exists(png)) << status(run).dump(2);
  // Its parameters (A1111's text, as PIL reads it): Euler along the flow, whatever the
  // --sample_sampler, and FLUX.1's default CFG of 1.
  const std::string read_parameters =
      std::string(python) + " -c \"import sys; from PIL import Image; "
      "print(Image.open(sys.argv[1]).text['parameters'])\" " + png + " > " +
      (work_ / "parameters.txt").string() + " 2>&1";
  ASSERT_EQ(std::system(read_parameters.c_str()), 0) << read_text(work_ / "parameters.txt");
  EXPECT_NE(read_text(work_ / "parameters.txt")
                .find("a red circle\nSteps: 4, Sampler: Euler, CFG scale: 1, Seed: 7, "
                      "Size: 64x64"),
            std::string::npos)
      << read_text(work_ / "parameters.txt");

  const fs::path result = work_ / "diffusers.json";
  const std::string command =
      std::string(python) + " " + LORAPIPE_SOURCE_DIR +
      "/trainer/reference/flux_diffusers_lora_check.py --model " + flux.string() + " --lora " +
      lora.string() + " --out " + result.string() + " --png " + png +
      " --prompt 'a red circle' --seed 7 --steps 4 --width 64 --height 64 --t5_length 32 > " +
      (work_ / "diffusers.log").string() + " 2>&1";
  ASSERT_EQ(std::system(command.c_str()), 0) << read_text(work_ / "diffusers.log");
  const json check = json::parse(read_text(result));
  std::printf("[diffusers] %s\n", check.dump().c_str());
  EXPECT_GT(check["file_modules"].get<int>(), 0);
  EXPECT_EQ(check["merged_modules"], check["file_modules"]);
  EXPECT_TRUE(check["leftover"].empty()) << check["leftover"].dump();
  EXPECT_GT(check["transformer_change"].get<double>(), 1e-4);
  EXPECT_GT(check["text_change"].get<double>(), 1e-4);
  EXPECT_LE(check["pixel_difference"].get<int>(), 1);
  EXPECT_GE(check["pixel_difference"].get<int>(), 0) << "image sizes differ";
  ASSERT_EQ(wait_exit(spawn({(kBin / "lorapipe-inspect").string(), lora.string()},
                            work_ / "inspect.out", work_ / "inspect.err")),
            0);
  const std::string inspected = read_text(work_ / "inspect.out");
  for (const char* part :
       {"ss_base_model_version = flux1", "modelspec.architecture = flux-1-dev/lora",
        "ss_network_module = networks.lora_flux", "ss_guidance_scale = 3.5",
        "ss_apply_t5_attn_mask = False", "ss_timestep_sampling = shift",
        "ss_model_prediction_type = raw"}) {
    EXPECT_NE(inspected.find(part), std::string::npos) << part << " not in " << inspected;
  }
  EXPECT_EQ(inspected.find("modelspec.prediction_type"), std::string::npos)
      << "kohya writes none for FLUX.1: " << inspected;
  expect_no_stage_alive(run);

  // With T5's attention mask the cache keeps only each caption's states (and the mask).
  auto bytes_per_caption = [](const std::string& log) -> long {
    std::smatch m;
    const std::regex figure(R"((\d+) bytes per caption)");
    return std::regex_search(log, m, figure) ? std::stol(m[1]) : -1;
  };
  const fs::path masked = work_ / "masked";
  args = {"run", "--output=" + masked.string(), "--max_train_steps=2", "--apply_t5_attn_mask"};
  args.insert(args.end(), common.begin(), common.end());
  ASSERT_EQ(lorapipe(args), 0) << out_ << err_;
  const long full = bytes_per_caption(cacher_log);
  const long kept = bytes_per_caption(read_text(masked / "logs" / "cacher.log"));
  std::printf("[flux cache] bytes per caption: %ld (T5 at 32 tokens), %ld with the mask\n", full,
              kept);
  EXPECT_GT(full, 0);
  EXPECT_GT(kept, 0);
  EXPECT_LT(kept, full);
  expect_no_stage_alive(masked);
}

// A sampler that would share the trainer's GPU holds no second model beside the training: it
// starts once the trainer has exited and renders every LoRA the run saved (and the sample-only
// ones the trainer keeps), in step order. --sample_after_training asks for that here, on the CPU.
TEST_F(LauncherRun, SamplerAfterTrainingStartsWhenTheTrainerIsDoneAndRendersEverySave) {
  const fs::path run = work_ / "run";
  ASSERT_EQ(lorapipe({"run", "--output=" + run.string(), "--max_train_steps=6",
                      "--save_every_n_steps=3", "--sample_every_n_steps=2",
                      "--sample_after_training"}),
            0)
      << out_ << err_;
  EXPECT_NE(out_.find("previews render after the training"), std::string::npos) << out_;
  const std::string trainer_log = read_text(run / "logs" / "trainer.log");
  const std::string sampler_log = read_text(run / "logs" / "sampler.log");
  const std::string trained = stamp_of(trainer_log, " at step 6");  // the final state
  const std::string started = stamp_of(sampler_log, "[");
  ASSERT_FALSE(trained.empty()) << trainer_log;
  ASSERT_FALSE(started.empty()) << sampler_log;
  EXPECT_LE(trained, started) << "the sampler started before the training was over";
  for (const char* png : {"demo_000002_00.png", "demo_000003_00.png", "demo_000004_00.png",
                          "demo_000006_00.png"}) {
    EXPECT_TRUE(fs::exists(run / "samples" / png)) << png;
  }
  expect_no_stage_alive(run);
}

// The sampler on the trainer's device (both "auto": here the CPU, on a GPU machine its first
// GPU) renders as the training goes, over the trainer's own placed weights: the launcher says so,
// the trainer publishes its denoiser, the sampler attaches it (CUDA IPC on a GPU, shared memory
// here: the same manifest, lock and attach) and renders checkpoints before the training is over.
TEST_F(LauncherRun, SamplerOnTheTrainersDeviceRendersOverItsWeightsAsItTrains) {
  const fs::path run = work_ / "run";
  // The demo's 100 steps, a preview every 10: the first is due long before the end (measured
  // 3 s before it at 40 steps on this machine, about 10 s here).
  ASSERT_EQ(lorapipe({"run", "--output=" + run.string(), "--sample_every_n_steps=10",
                      "--device=auto", "--sampler_device=auto"}),
            0)
      << out_ << err_;
  EXPECT_NE(out_.find("renders over the trainer's own weights as it trains"), std::string::npos)
      << out_;
  const std::string trainer_log = read_text(run / "logs" / "trainer.log");
  const std::string sampler_log = read_text(run / "logs" / "sampler.log");
  EXPECT_NE(trainer_log.find("published "), std::string::npos) << trainer_log;
  EXPECT_NE(sampler_log.find("attached "), std::string::npos) << sampler_log;
  EXPECT_EQ(sampler_log.find("places its own copy"), std::string::npos) << sampler_log;
  const std::string trained = stamp_of(trainer_log, " at step 100");
  const std::string first_render = stamp_of(sampler_log, " images in ");
  ASSERT_FALSE(trained.empty()) << trainer_log;
  ASSERT_FALSE(first_render.empty()) << sampler_log;
  std::printf("[launcher] shared weights: first preview at %s, training over at %s\n",
              first_render.c_str(), trained.c_str());
  EXPECT_LT(first_render, trained) << "no preview was rendered while the trainer trained";
  EXPECT_TRUE(fs::exists(run / "samples" / "demo_000100_00.png"));
  EXPECT_NE(read_text(run / "shared_weights.json").find("\"released\""), std::string::npos)
      << "the trainer's end released its weights";
  expect_no_stage_alive(run);
}

// Ctrl-C mid-training: the trainer saves a state, every stage stops, exit 130; `lorapipe
// resume` continues from that state to the end.
TEST_F(LauncherRun, InterruptSavesAStateAndResumeFinishesTheRun) {
  const fs::path run = work_ / "run";
  const pid_t launcher =
      spawn({(kBin / "lorapipe").string(), "run", "--output=" + run.string(),
             "--cache_dir=" + (work_ / "cache").string(), "--max_train_steps=120",
             "--save_every_n_steps=1000"},
            work_ / "launcher.out", work_ / "launcher.err");
  ASSERT_GT(wait_for_training(run, 10), 0) << read_text(work_ / "launcher.out");
  // The folder is this launcher's while it runs: a resume of it is refused, naming the holder.
  EXPECT_NE(lorapipe({"resume", run.string()}), 0);
  EXPECT_NE(err_.find("is in use by another lorapipe (pid " + std::to_string(launcher) + ")"),
            std::string::npos)
      << err_;
  EXPECT_EQ(status(run)["state"], "running");
  kill(launcher, SIGINT);
  EXPECT_EQ(wait_exit(launcher), 130)
      << read_text(work_ / "launcher.out") << read_text(work_ / "launcher.err");
  EXPECT_NE(read_text(work_ / "launcher.out").find("continues from the trainer's state"),
            std::string::npos)
      << read_text(work_ / "launcher.out");
  expect_no_stage_alive(run);
  const json state = json::parse(read_text(run / "state" / "demo-state" / "trainer.json"));
  const int saved_at = state["global_step"].get<int>();
  EXPECT_GE(saved_at, 10);
  EXPECT_LT(saved_at, 120);
  EXPECT_EQ(status(run)["state"], "interrupted");
  EXPECT_EQ(status(run)["stages"]["trainer"]["exit_code"], 130);

  // What resume must pass over: a state a save left half-written under its temporary name, and
  // a trainer.json it cannot read, both claiming more steps than the real state.
  fs::create_directories(run / "state" / ".demo-state.tmp");
  std::ofstream(run / "state" / ".demo-state.tmp" / "trainer.json") << R"({"global_step": 119})";
  fs::create_directories(run / "state" / "broken");
  std::ofstream(run / "state" / "broken" / "trainer.json") << R"({"global_step": "119"})";
  // A resume that changes the LoRA's rank or alpha, or the seed, cannot go on with the state:
  // refused at once, naming the flag and what the state trained with, before any stage starts.
  const std::string trainer_log_before = read_text(run / "logs" / "trainer.log");
  for (const auto& [flag, had] :
       std::vector<std::pair<std::string, std::string>>{{"--network_dim=64", "rank 8"},
                                                        {"--network_alpha=0.5", "alpha 8"},
                                                        {"--seed=99", "trainer.json"}}) {
    EXPECT_EQ(lorapipe({"resume", run.string(), flag}), kExitError) << flag;
    EXPECT_NE(err_.find(flag + ": the state " + (run / "state" / "demo-state").string() +
                        " trained with "),
              std::string::npos)
        << err_;
    EXPECT_NE(err_.find(had), std::string::npos) << err_;
  }
  EXPECT_EQ(read_text(run / "logs" / "trainer.log"), trainer_log_before) << "a stage started";
  // A flag the state can take is said as the resume starts, with the run's value it replaces.
  // The state's own rank given again is no change to refuse (run.toml has no --network_dim).
  ASSERT_EQ(lorapipe({"resume", run.string(), "--max_grad_norm=0.5", "--network_dim=8"}), 0)
      << out_ << err_;
  EXPECT_NE(out_.find("lorapipe: resuming with --max_grad_norm=0.5 (the run had its default)"),
            std::string::npos)
      << out_;
  EXPECT_NE(out_.find("demo-state"), std::string::npos) << out_;
  const json s = status(run);
  EXPECT_EQ(s["state"], "done");
  EXPECT_EQ(s["training"]["step"], 120);
  // The resumed trainer started where the real state was (not the decoys): its log says so.
  const std::string log = read_text(run / "logs" / "trainer.log");
  EXPECT_NE(log.find("resumed from " + (run / "state" / "demo-state").string() + " at step " +
                     std::to_string(saved_at) + ", epoch"),
            std::string::npos)
      << log;
  EXPECT_TRUE(fs::exists(run / "lora" / "demo.safetensors"));
}

// A second Ctrl-C does not wait out the stop grace (120 s): the launcher kills the stages at once.
// The trainer is held (SIGSTOP) so that it cannot finish its save before the second interrupt:
// without the second interrupt's rule the launcher would wait the whole grace and say so. The
// first stop is a SIGTERM (what `kill`, systemd and Kubernetes send), read as Ctrl-C is.
TEST_F(LauncherRun, SecondInterruptKillsTheStagesAtOnce) {
  const fs::path run = work_ / "run";
  const pid_t launcher =
      spawn({(kBin / "lorapipe").string(), "run", "--output=" + run.string(),
             "--cache_dir=" + (work_ / "cache").string(), "--max_train_steps=2000",
             "--save_every_n_steps=1000"},
            work_ / "launcher.out", work_ / "launcher.err");
  const pid_t trainer = wait_for_training(run, 3);
  ASSERT_GT(trainer, 0) << read_text(work_ / "launcher.out");
  kill(trainer, SIGSTOP);
  kill(launcher, SIGTERM);
  const auto deadline = Clock::now() + std::chrono::seconds(60);
  while (read_text(work_ / "launcher.out").find("interrupt again to kill them at once") ==
             std::string::npos &&
         Clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  kill(launcher, SIGINT);
  EXPECT_EQ(wait_exit(launcher), 130) << read_text(work_ / "launcher.err");
  const std::string out = read_text(work_ / "launcher.out");
  EXPECT_NE(out.find("interrupted again; killing them now"), std::string::npos) << out;
  EXPECT_EQ(out.find("did not stop within"), std::string::npos) << out;
  EXPECT_NE(out.find("the trainer was killed by signal 9"), std::string::npos) << out;
  expect_no_stage_alive(run);
  EXPECT_EQ(status(run)["stages"]["trainer"]["exit_code"], 128 + SIGKILL);
}

// A launcher killed outright (SIGKILL, a machine gone down) writes no end to its events, but its
// lock on the folder goes with it: status says the run stopped, not that it runs.
TEST_F(LauncherRun, StatusOfARunWhoseLauncherIsGoneSaysStopped) {
  const fs::path run = work_ / "gone";
  fs::create_directories(run);
  std::ofstream(run / "events.jsonl")
      << R"({"event": "Run", "result": "started"})" << "\n"
      << R"({"event": "Stage", "stage": "trainer", "state": "started", "pid": 12345})" << "\n";
  std::ofstream(run / ".lock") << "12345\n";
  const json s = status(run);
  EXPECT_EQ(s["state"], "stopped");
  // Its stages ended with it (it stops them; they die with it), exit written or not.
  EXPECT_EQ(s["stages"]["trainer"]["state"], "ended (no exit recorded)") << s.dump(2);
  EXPECT_EQ(lorapipe({"status", run.string()}), 0);
  EXPECT_NE(out_.find("`lorapipe resume " + run.string() + "` continues it"), std::string::npos)
      << out_;
}

// A run that fails before its first save (the trainer refuses a flag) leaves nothing to resume,
// and no dead end: `lorapipe resume` with the flag corrected starts it over in its own folder and
// completes it. The trainer's flags are checked before any stage starts: nothing is cached for
// a run that cannot train; and so are the sampler's.
TEST_F(LauncherRun, RunStoppedBeforeItsFirstSaveStartsOverOnResume) {
  const fs::path run = work_ / "run";
  EXPECT_EQ(lorapipe({"run", "--output=" + run.string(), "--cache_dir=" + (work_ / "cache").string(),
                      "--max_train_steps=20", "--save_every_n_steps=1000",
                      "--lr_scheduler=constant", "--lr_warmup_steps=5"}),
            kExitError);
  EXPECT_NE(out_.find("the trainer refuses its flags (exit code 2), so no stage was started"),
            std::string::npos)
      << out_;
  EXPECT_NE(out_.find("constant_with_warmup"), std::string::npos) << out_;
  EXPECT_FALSE(fs::exists(work_ / "cache")) << "the cacher was started";
  EXPECT_FALSE(fs::exists(run / "logs" / "preprocess.log")) << "preprocess was started";
  EXPECT_EQ(status(run)["state"], "failed");
  // The resume renders from a prompt file with a line that has no prompt: said on the screen.
  std::ofstream(work_ / "prompts.txt") << "a red circle --w 64 --h 64 --s 2\n--w 64\n";
  // So does a flag the sampler would refuse (it may start only after the training).
  EXPECT_EQ(lorapipe({"resume", run.string(), "--lr_warmup_steps=0",
                      "--sample_prompts=" + (work_ / "prompts.txt").string(),
                      "--sample_sampler=lms9000"}),
            kExitError);
  EXPECT_NE(out_.find("the sampler refuses its flags (exit code 2), so no stage was started"),
            std::string::npos)
      << out_;
  EXPECT_NE(out_.find("unknown sampler 'lms9000'"), std::string::npos) << out_;
  EXPECT_FALSE(fs::exists(work_ / "cache")) << "the cacher was started";
  ASSERT_EQ(lorapipe({"resume", run.string(), "--lr_warmup_steps=0", "--sample_sampler=ddim",
                      "--sample_prompts=" + (work_ / "prompts.txt").string()}),
            0)
      << out_ << err_;
  const std::string skipped_line = "lorapipe: sampler: 1 prompts; in prompts.txt, lines skipped: "
                                   "1, read leniently: 0 (the log says which): see " +
                                   (run / "logs" / "sampler.log").string();
  const size_t shown = out_.find(skipped_line);
  EXPECT_NE(shown, std::string::npos) << out_;
  EXPECT_EQ(out_.find(skipped_line, shown + 1), std::string::npos) << "said more than once:\n"
                                                                    << out_;
  EXPECT_NE(out_.find("stopped before its first save; starting it over"), std::string::npos)
      << out_;
  const json s = status(run);
  EXPECT_EQ(s["state"], "done");
  EXPECT_EQ(s["training"]["step"], 20);
  EXPECT_TRUE(fs::exists(run / "lora" / "demo.safetensors"));
}

// A stage that dies mid-run: the launcher names it, shows its last log lines, stops the others
// and exits non-zero.
TEST_F(LauncherRun, StageThatDiesIsNamedAndTheOthersAreStopped) {
  const fs::path run = work_ / "run";
  const pid_t launcher = spawn({(kBin / "lorapipe").string(), "run", "--output=" + run.string(),
                                "--cache_dir=" + (work_ / "cache").string(),
                                "--max_train_steps=2000", "--save_every_n_steps=1000"},
                               work_ / "out.txt", work_ / "err.txt");
  const pid_t trainer = wait_for_training(run, 3);
  ASSERT_GT(trainer, 0) << read_text(work_ / "out.txt");
  kill(trainer, SIGKILL);
  EXPECT_EQ(wait_exit(launcher), kExitError);
  const std::string out = read_text(work_ / "out.txt");
  EXPECT_NE(out.find("the trainer was killed by signal 9"), std::string::npos) << out;
  EXPECT_NE(out.find("the last lines of " + (run / "logs" / "trainer.log").string()),
            std::string::npos)
      << out;
  EXPECT_NE(out.find("  | "), std::string::npos) << "no log lines shown:\n" << out;
  expect_no_stage_alive(run);
  const json s = status(run);
  EXPECT_EQ(s["state"], "failed");
  EXPECT_EQ(s["stages"]["sampler"]["state"], "exited");
}

// Two runs started at once on one cache, over the same folder at other resolutions: their
// cachers take turns on the cache, each run keeps its own manifest, and both complete.
TEST_F(LauncherRun, TwoRunsAtOnceOnOneCacheBothComplete) {
  const fs::path cache = work_ / "cache";
  auto start = [&](const std::string& name, const std::string& resolution) {
    return spawn({(kBin / "lorapipe").string(), "run", "--output=" + (work_ / name).string(),
                  "--cache_dir=" + cache.string(), "--resolution=" + resolution,
                  "--max_train_steps=20", "--save_every_n_steps=1000"},
                 work_ / (name + ".out"), work_ / (name + ".err"));
  };
  const pid_t a = start("a", "128");
  const pid_t b = start("b", "64");
  EXPECT_EQ(wait_exit(a), 0) << read_text(work_ / "a.out") << read_text(work_ / "a.err");
  EXPECT_EQ(wait_exit(b), 0) << read_text(work_ / "b.out") << read_text(work_ / "b.err");
  // The cacher that waits for the other's hold on the cache says so on its run's screen (it
  // holds the cache from its start, a second before it encodes: the two overlap).
  const std::string screens = read_text(work_ / "a.out") + read_text(work_ / "b.out");
  EXPECT_NE(screens.find("lorapipe: the cacher: "), std::string::npos) << screens;
  EXPECT_NE(screens.find("waiting for it to finish"), std::string::npos) << screens;
  const json sa = status(work_ / "a");
  const json sb = status(work_ / "b");
  EXPECT_EQ(sa["training"]["step"], 20);
  EXPECT_EQ(sb["training"]["step"], 20);
  const std::string ma = sa["cache"]["manifest"], mb = sb["cache"]["manifest"];
  EXPECT_NE(ma, mb) << "two settings, one manifest";
  // Each trainer trained on its own run's manifest.
  EXPECT_NE(read_text(work_ / "a" / "logs" / "trainer.log").find(ma), std::string::npos);
  EXPECT_NE(read_text(work_ / "b" / "logs" / "trainer.log").find(mb), std::string::npos);
  EXPECT_EQ(sa["cache"]["hits"].get<int>() + sa["cache"]["misses"].get<int>(), 36);
  EXPECT_EQ(sb["cache"]["hits"].get<int>() + sb["cache"]["misses"].get<int>(), 36);

  // A third run with a's settings and no --cache_dir: the user's shared cache by default
  // ($LORAPIPE_CACHE_DIR, the same folder here) holds every record it needs, so it encodes
  // nothing. (Its manifest is its own: the demo writes its dataset into each run's folder, and a
  // manifest is named by its dataset's source; the records are content-addressed and shared.)
  ASSERT_EQ(lorapipe({"run", "--output=" + (work_ / "c").string(), "--resolution=128",
                      "--max_train_steps=20", "--save_every_n_steps=1000"}),
            0)
      << out_ << err_;
  const json sc = status(work_ / "c");
  EXPECT_EQ(sc["cache"]["misses"], 0) << sc.dump(2);
  EXPECT_EQ(sc["cache"]["hits"], 36) << sc.dump(2);
}

// A stage that fails with an error says what failed (StageStatus ERROR): the launcher shows that
// message, then the log lines, and `lorapipe status` keeps it.
TEST_F(LauncherRun, StageErrorIsShownWithItsMessage) {
  const fs::path run = work_ / "run";
  EXPECT_EQ(lorapipe({"run", "--output=" + run.string(), "--learning_rate=1e30",
                      "--max_grad_norm=0", "--max_bad_steps=3", "--max_train_steps=50",
                      "--log_with=wandb"}),
            kExitError);
  // A flag the trainer takes with a warning is said on the screen before the run, not only in
  // the trainer's log.
  EXPECT_NE(out_.find("lorapipe: the trainer warns: --log_with=wandb"), std::string::npos) << out_;
  EXPECT_NE(out_.find("lorapipe: the trainer failed: stopping: 3 steps in a row had a non-finite"),
            std::string::npos)
      << out_;
  expect_no_stage_alive(run);
  const json s = status(run);
  EXPECT_EQ(s["stages"]["trainer"]["reported"], "ERROR");
  EXPECT_NE(s["stages"]["trainer"]["message"].get<std::string>().find("non-finite"),
            std::string::npos);
  EXPECT_EQ(s["stages"]["cacher"]["reported"], "DONE") << s.dump(2);
  EXPECT_EQ(s["stages"]["preprocess"]["reported"], "DONE") << s.dump(2);
}

TEST_F(LauncherFlags, UnknownFlagIsAnErrorNamingIt) {
  // --help after a command is the usage, not an unknown flag.
  for (const char* command : {"run", "resume", "status", "plan"}) {
    EXPECT_EQ(lorapipe({command, "--help"}), kExitOk) << command << ": " << err_;
    EXPECT_NE(out_.find("usage:"), std::string::npos) << command << ": " << out_;
  }
  EXPECT_EQ(lorapipe({"run", "--output=" + (work_ / "run").string(), "--netwrk_dim=8"}),
            kExitError);
  EXPECT_NE(err_.find("unknown flag --netwrk_dim (did you mean --network_dim?)"), std::string::npos)
      << err_;
  EXPECT_FALSE(fs::exists(work_ / "run")) << "nothing may start on a bad flag";
  // The launcher's own endpoints are not the user's to set.
  EXPECT_EQ(lorapipe({"run", "--output=" + (work_ / "run").string(), "--pub=tcp://*:5555"}),
            kExitError);
  EXPECT_NE(err_.find("--pub"), std::string::npos) << err_;
  // In a config file, the file and the key are named.
  std::ofstream(work_ / "bad.toml") << "network_dim = 8\nlearning_rat = 1e-4\n";
  EXPECT_EQ(lorapipe({"run", "--config=" + (work_ / "bad.toml").string()}), kExitError);
  EXPECT_NE(err_.find("bad.toml"), std::string::npos) << err_;
  EXPECT_NE(err_.find("--learning_rat"), std::string::npos) << err_;
}

TEST_F(LauncherFlags, ConfigFileHoldsTheFlagsAndFlagsWin) {
  std::ofstream(work_ / "run.toml") << "network_dim = 16\nlearning_rate = 1e-4\n"
                                       "gradient_checkpointing = true\nmodel = \"/m.safetensors\"\n"
                                       "optimizer_args = \"weight_decay=0.1\"\n";
  const Settings s = parse_run_args({"--config=" + (work_ / "run.toml").string(),
                                     "--network_dim", "32", "--optimizer_args", "betas=0.9,0.99",
                                     "eps=1e-8", "--base_weights", "/my loras/a.safetensors",
                                     "/b.safetensors", "--output_dir=/tmp/x",
                                     "--blocks_to_swap=16", "--merge_lora"});
  EXPECT_EQ(s.get("network_dim"), "32");
  EXPECT_EQ(std::stod(s.get("learning_rate")), 1e-4);
  EXPECT_EQ(s.get("gradient_checkpointing"), "true");
  EXPECT_EQ(s.get("pretrained_model_name_or_path"), "/m.safetensors");
  EXPECT_EQ(split_words(s.get("optimizer_args")),
            (std::vector<std::string>{"betas=0.9,0.99", "eps=1e-8"}));
  EXPECT_EQ(split_words(s.get("base_weights")),
            (std::vector<std::string>{"/my loras/a.safetensors", "/b.safetensors"}))
      << "a word of a multi-word flag keeps its spaces";
  EXPECT_EQ(s.output, "/tmp/x");
  // Each stage gets its own flags, under its own names.
  const auto cacher = stage_args(s, Stage::kCacher);
  EXPECT_NE(std::find(cacher.begin(), cacher.end(), "--pretrained_model_name_or_path=/m.safetensors"),
            cacher.end());
  const auto trainer = stage_args(s, Stage::kTrainer);
  EXPECT_NE(std::find(trainer.begin(), trainer.end(), "--network_dim=32"), trainer.end());
  EXPECT_NE(std::find(trainer.begin(), trainer.end(),
                      "--optimizer_args=\x1f" "betas=0.9,0.99\x1f" "eps=1e-8"),
            trainer.end());
  const auto sampler = stage_args(s, Stage::kSampler);
  EXPECT_NE(std::find(sampler.begin(), sampler.end(),
                      "--base_weights=\x1f/my loras/a.safetensors\x1f/b.safetensors"),
            sampler.end());
  // The previews swap the blocks the training swapped: they fit the card it fitted. A LoRA
  // cannot be merged into weights in host memory: --merge_lora is left out, said.
  for (const auto& stage : {trainer, sampler}) {
    EXPECT_NE(std::find(stage.begin(), stage.end(), "--blocks_to_swap=16"), stage.end());
  }
  EXPECT_FALSE(s.has("merge_lora"));
  EXPECT_NE(std::find_if(s.notes.begin(), s.notes.end(),
                         [](const std::string& n) {
                           return n.starts_with("--merge_lora is left out");
                         }),
            s.notes.end());
  const auto preprocess = stage_args(s, Stage::kPreprocess);
  EXPECT_TRUE(preprocess.empty()) << preprocess.front();
  // run.toml, written back, reads as the same settings.
  write_config(s, work_ / "again.toml");
  const Settings again = parse_run_args({"--config=" + (work_ / "again.toml").string()});
  using Map = std::map<std::string, std::string>;  // TOML keeps no order; the stages need none
  EXPECT_EQ(Map(again.flags.begin(), again.flags.end()), Map(s.flags.begin(), s.flags.end()));
  EXPECT_EQ(again.output, s.output);
  EXPECT_THROW(parse_run_args({"--gradient_checkpointing=maybe"}), InputError);
  // A full disk (its temporary name a link to /dev/full) leaves the settings written before.
  const std::string written = read_text(work_ / "again.toml");
  fs::create_symlink("/dev/full", work_ / "again.toml.partial");
  Settings changed = s;
  changed.set("network_dim", "64");
  EXPECT_THROW(write_config(changed, work_ / "again.toml"), Error);
  EXPECT_EQ(read_text(work_ / "again.toml"), written);
}

// Files and folders given relative to where `lorapipe run` starts are kept absolute (in the
// stages' flags and in run.toml), so `lorapipe resume DIR` from elsewhere finds them, and a
// folder the run creates (--cache_dir) is the same folder then.
TEST_F(LauncherFlags, RelativePathsAreKeptAbsolute) {
  fs::create_directories(work_ / "my data");
  std::ofstream(work_ / "prompts.txt") << "a cat\n";
  std::ofstream(work_ / "a.safetensors") << "x";
  const fs::path before = fs::current_path();
  fs::current_path(work_);
  const Settings s =
      parse_run_args({"--data_dir=my data", "--sample_prompts=./prompts.txt",
                      "--vae=missing.safetensors", "--base_weights", "a.safetensors", "/b"});
  fs::current_path(before);
  EXPECT_EQ(s.get("data_dir"), (work_ / "my data").string());
  EXPECT_EQ(s.get("sample_prompts"), (work_ / "prompts.txt").string());
  EXPECT_EQ(s.get("vae"), (work_ / "missing.safetensors").string());
  EXPECT_EQ(split_words(s.get("base_weights")),
            (std::vector<std::string>{(work_ / "a.safetensors").string(), "/b"}));
}

// The config kohya_ss's GUI writes and hands to train_network.py as --config_file: flat keys or
// one level of tables, lists for the multi-word flags, and kohya's flags lorapipe does not act
// on at their defaults. Those are taken and go to no stage; at another value they are refused,
// naming the file, the flag and why.
TEST_F(LauncherFlags, KohyasConfigFileIsTakenAsKohyaReadsIt) {
  std::ofstream(work_ / "config_lora.toml")
      << "output_dir = \"/tmp/out\"\nnetwork_dim = 8\nnetwork_args = [\"conv_dim=4\", "
         "\"conv_alpha=1\"]\noptimizer_args = []\nlr_scheduler_args = []\n"
         "dynamo_backend = \"no\"\ndeepspeed = false\nv2 = false\nfull_bf16 = true\n"
         "save_state = false\ncaption_extention = \".txt\"\n"
         "[model]\npretrained_model_name_or_path = \"/m.safetensors\"\n"
         "[training]\nlearning_rate = 2e-4\ntoken_warmup_min = 1\n"
         // Keys the GUI writes that kohya's LoRA scripts do not read.
         "epoch = 10\nnoise_offset_type = \"Original\"\nloraplus_lr_ratio = 16\n"
         // kohya's deprecated FLUX.1 flag: the swap kohya sets.
         "split_mode = true\n";
  // kohya's --config_file may leave out the extension.
  const Settings s = parse_run_args({"--config_file=" + (work_ / "config_lora").string(),
                                     "--ddp_timeout=30", "--lr_scheduler_args"});
  EXPECT_EQ(s.output, "/tmp/out");
  EXPECT_EQ(split_words(s.get("network_args")),
            (std::vector<std::string>{"conv_dim=4", "conv_alpha=1"}));
  EXPECT_FALSE(s.has("optimizer_args")) << "an empty list is the flag not given";
  EXPECT_EQ(s.get("pretrained_model_name_or_path"), "/m.safetensors");
  EXPECT_EQ(std::stod(s.get("learning_rate")), 2e-4);
  EXPECT_EQ(s.get("caption_extension"), ".txt");
  for (const char* taken : {"dynamo_backend", "deepspeed", "v2", "full_bf16", "save_state",
                            "ddp_timeout", "epoch", "noise_offset_type", "loraplus_lr_ratio",
                            "split_mode",
                            "lr_scheduler_args"}) {  // an empty list is the flag not given
    EXPECT_FALSE(s.has(taken)) << taken << " goes to no stage";
  }
  EXPECT_EQ(s.get("blocks_to_swap"), "18");
  // What acts nowhere is said, once each, as the run starts.
  auto noted = [&s](const std::string& text) {
    return std::count_if(s.notes.begin(), s.notes.end(), [&](const std::string& n) {
      return n.find(text) != std::string::npos;
    });
  };
  EXPECT_EQ(noted("config_lora.toml: epoch is the kohya_ss GUI's"), 1);
  EXPECT_EQ(noted("config_lora.toml: noise_offset_type is the kohya_ss GUI's"), 1);
  EXPECT_EQ(noted("loraplus_lr_ratio is the kohya_ss GUI's, which kohya's LoRA scripts do not "
                  "read, nor does lorapipe: kohya reads LoRA+ from network_args alone"), 1);
  EXPECT_EQ(noted("--full_bf16=true has no effect in lorapipe"), 1);
  EXPECT_EQ(noted("--ddp_timeout=30 has no effect in lorapipe"), 1);
  EXPECT_EQ(noted("--split_mode is kohya's deprecated form of --blocks_to_swap: "
                  "--blocks_to_swap=18"), 1);
  EXPECT_EQ(noted("dynamo_backend"), 1) << "accelerate's 'no' is not kohya's default";
  EXPECT_EQ(s.notes.size(), 7u);
  const Settings swapped = parse_run_args({"--split_mode", "--blocks_to_swap=8"});
  EXPECT_EQ(swapped.get("blocks_to_swap"), "8");
  EXPECT_FALSE(swapped.has("split_mode"));
  EXPECT_EQ(swapped.notes.size(), 1u);
  // The notes come first in what lorapipe run prints (here a run that stops at a missing model).
  EXPECT_EQ(lorapipe({"run", "--output=" + (work_ / "noted").string(), "--full_bf16",
                      "--pretrained_model_name_or_path=/no/such/model.safetensors"}),
            kExitError);
  EXPECT_EQ(out_.rfind("lorapipe: --full_bf16=true has no effect in lorapipe", 0), 0u) << out_;
  const auto trainer = stage_args(s, Stage::kTrainer);
  EXPECT_NE(std::find(trainer.begin(), trainer.end(),
                      "--network_args=\x1f" "conv_dim=4\x1f" "conv_alpha=1"),
            trainer.end());
  const auto preprocess = stage_args(s, Stage::kPreprocess);
  EXPECT_NE(std::find(preprocess.begin(), preprocess.end(), "--token_warmup_min=1"),
            preprocess.end());

  std::ofstream(work_ / "v2.toml") << "network_dim = 8\n[model]\nv2 = true\n";
  EXPECT_EQ(lorapipe({"run", "--config_file=" + (work_ / "v2.toml").string()}), kExitError);
  EXPECT_NE(err_.find("v2.toml: --v2=true: Stable Diffusion 2.x"), std::string::npos) << err_;
  EXPECT_EQ(lorapipe({"run", "--output=" + (work_ / "run").string(), "--color_aug"}), kExitError);
  EXPECT_NE(err_.find("--color_aug=true: "), std::string::npos) << err_;
  // kohya's --resume takes a state folder; a run folder's states are lorapipe resume's.
  EXPECT_EQ(lorapipe({"run", "--output=" + (work_ / "run").string(), "--resume", "/old/state"}),
            kExitError);
  EXPECT_NE(err_.find("--resume=/old/state: lorapipe run starts a run; `lorapipe resume DIR`"),
            std::string::npos)
      << err_;
  std::ofstream(work_ / "resume.toml") << "resume = \"/old/state\"\n";
  EXPECT_EQ(lorapipe({"run", "--config_file=" + (work_ / "resume.toml").string()}), kExitError);
  EXPECT_NE(err_.find("resume.toml: --resume=/old/state: lorapipe run starts a run"),
            std::string::npos)
      << err_;
  EXPECT_FALSE(fs::exists(work_ / "run")) << "nothing may start on a refused flag";
}

// Every stage ends on a flag it cannot read with README's code for bad flags (2), naming the flag,
// and on --help with 0: gflags' own exit(1) would read as "a check found a problem".
TEST_F(LauncherFlags, EveryStageExitsTwoOnAFlagItCannotRead) {
  const std::map<std::string, std::string> numeric = {{"preprocess", "timeout_ms"},
                                                      {"cacher", "idle_timeout_s"},
                                                      {"trainer", "timeout_s"},
                                                      {"sampler", "idle_timeout_s"}};
  for (const auto& [stage, number] : numeric) {
    const std::string bin = (kBin / ("lorapipe-" + stage)).string();
    EXPECT_EQ(wait_exit(spawn({bin, "--netwrok_dim=8"}, work_ / "out", work_ / "err")), 2) << stage;
    EXPECT_NE(read_text(work_ / "err").find("unknown command line flag 'netwrok_dim'"),
              std::string::npos)
        << stage << ": " << read_text(work_ / "err");
    if (stage == "trainer") {
      EXPECT_NE(read_text(work_ / "err").find("(did you mean --network_dim?)"), std::string::npos)
          << read_text(work_ / "err");
    }
    EXPECT_EQ(wait_exit(spawn({bin, "--" + number + "=soon"}, work_ / "out", work_ / "err")), 2)
        << stage;
    EXPECT_NE(read_text(work_ / "err").find("soon"), std::string::npos)
        << stage << ": " << read_text(work_ / "err");
    EXPECT_EQ(wait_exit(spawn({bin, "--help"}, work_ / "out", work_ / "err")), 0) << stage;
    EXPECT_NE(read_text(work_ / "out").find("lorapipe-" + stage), std::string::npos)
        << stage << ": the usage is printed whole";
  }
  // A flag's value that reads "help" is a value, not --help: the bad flag after it still counts.
  const std::string trainer = (kBin / "lorapipe-trainer").string();
  EXPECT_EQ(wait_exit(spawn({trainer, "--output_name", "help", "--netwrok_dim=8"}, work_ / "out",
                            work_ / "err")),
            2)
      << read_text(work_ / "err");
}

// --device and --sampler_device name one GPU however it is spelled, so a sampler beside the
// trainer never loads a second model there: "cuda", "cuda:0" and "auto" alike.
TEST(LauncherDevices, OneGpuHoweverItIsNamed) {
  EXPECT_TRUE(same_gpu("auto", "auto"));
  EXPECT_TRUE(same_gpu("cuda", "auto"));
  EXPECT_TRUE(same_gpu("cuda:0", "cuda"));
  EXPECT_TRUE(same_gpu("auto", "cuda:0"));
  EXPECT_TRUE(same_gpu("cuda:1", "cuda:1"));
  EXPECT_FALSE(same_gpu("cuda:1", "auto"));
  EXPECT_FALSE(same_gpu("cuda:0", "cuda:1"));
  EXPECT_FALSE(same_gpu("cpu", "cpu"));
  EXPECT_FALSE(same_gpu("cuda", "cpu"));
}

// With two GPUs or more the sampler takes one the trainer does not use; the GPUs are counted as
// CUDA sees them through CUDA_VISIBLE_DEVICES (up to its first entry naming no device).
TEST(LauncherDevices, SamplerTakesASpareGpuWhereThereIsOne) {
  EXPECT_EQ(spare_gpu_for_sampler("auto", 2), "cuda:1");
  EXPECT_EQ(spare_gpu_for_sampler("cuda", 4), "cuda:1");
  EXPECT_EQ(spare_gpu_for_sampler("cuda:0", 2), "cuda:1");
  EXPECT_EQ(spare_gpu_for_sampler("cuda:1", 2), "cuda:0");
  EXPECT_EQ(spare_gpu_for_sampler("auto", 1), "");
  EXPECT_EQ(spare_gpu_for_sampler("auto", 0), "");
  EXPECT_EQ(spare_gpu_for_sampler("cpu", 2), "");
  EXPECT_EQ(spare_gpu_for_sampler("cuda:2", 2), "") << "the trainer refuses a GPU that is not there";
  EXPECT_EQ(spare_gpu_for_sampler("cuda:x", 2), "");
  EXPECT_EQ(count_visible(nullptr, 2), 2);
  EXPECT_EQ(count_visible("0", 2), 1);
  EXPECT_EQ(count_visible("1,0", 2), 2);
  EXPECT_EQ(count_visible("0,1,2,3", 2), 2);
  EXPECT_EQ(count_visible("GPU-5e1f,GPU-77aa", 2), 2);
  EXPECT_EQ(count_visible("", 2), 0);
  EXPECT_EQ(count_visible("-1", 2), 0);
  EXPECT_EQ(count_visible("1,-1,0", 4), 1);
}

// Where previews render: over the trainer's weights on its GPU unless that is ruled out, then
// after the training, or (--sample_after_training=false) beside it with an own copy; on the CPU
// both map the model file; on another device as the run trains.
TEST(LauncherDevices, PreviewsShareTheTrainersGpuUnlessRuledOut) {
  const std::string none, swap = "--blocks_to_swap keeps weights off the device";
  auto is = [](const PreviewMode& m, bool share, bool after, bool own, bool map) {
    return m.share_weights == share && m.after_training == after && m.own_copy_beside == own &&
           m.map_weights == map;
  };
  EXPECT_TRUE(is(preview_mode("auto", "auto", "auto", true, none), true, false, false, false));
  EXPECT_TRUE(is(preview_mode("cuda", "cuda:0", "false", true, none), true, false, false, false));
  EXPECT_TRUE(is(preview_mode("auto", "auto", "true", true, none), false, true, false, false));
  EXPECT_TRUE(is(preview_mode("auto", "auto", "auto", true, swap), false, true, false, false));
  EXPECT_TRUE(is(preview_mode("cuda:0", "auto", "false", true, swap), false, false, true, false));
  EXPECT_TRUE(is(preview_mode("cuda:0", "cuda:1", "auto", true, none), false, false, false, false));
  EXPECT_TRUE(is(preview_mode("cpu", "cpu", "auto", true, none), false, false, false, true));
  EXPECT_TRUE(is(preview_mode("cpu", "cpu", "true", true, none), false, true, false, false));
  EXPECT_TRUE(is(preview_mode("auto", "auto", "auto", false, none), false, false, false, false));
}

// CUDA allocator settings whose memory CUDA IPC cannot share (expandable segments,
// cudaMallocAsync), in the environment the stages inherit, rule out previews over the trainer's
// weights by name: they render after the training. Other settings, or those turned off, do not.
TEST(LauncherDevices, AnAllocatorCudaIpcCannotShareRendersPreviewsAfterTheTraining) {
  struct Restore {
    std::map<std::string, std::string> saved;
    Restore() {
      for (const char* name : {"PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"}) {
        if (const char* v = std::getenv(name)) saved[name] = v;
        unsetenv(name);
      }
    }
    ~Restore() {
      for (const char* name : {"PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"}) unsetenv(name);
      for (const auto& [name, value] : saved) setenv(name.c_str(), value.c_str(), 1);
    }
  } restore;
  const Settings plain;
  EXPECT_EQ(why_previews_not_shared(plain, true, "SDXL"), "");
  setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128, expandable_segments:True", 1);
  const std::string why = why_previews_not_shared(plain, true, "SDXL");
  EXPECT_NE(why.find("PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:128, expandable_segments:True"),
            std::string::npos) << why;
  const PreviewMode mode = preview_mode("auto", "auto", "auto", true, why);
  EXPECT_FALSE(mode.share_weights);
  EXPECT_TRUE(mode.after_training);
  setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False,max_split_size_mb:128", 1);
  EXPECT_EQ(why_previews_not_shared(plain, true, "SDXL"), "");
  unsetenv("PYTORCH_CUDA_ALLOC_CONF");
  setenv("PYTORCH_ALLOC_CONF", "backend:cudaMallocAsync", 1);
  EXPECT_NE(why_previews_not_shared(plain, true, "SDXL").find("PYTORCH_ALLOC_CONF"),
            std::string::npos);
  unsetenv("PYTORCH_ALLOC_CONF");
  EXPECT_EQ(why_previews_not_shared(plain, true, "SDXL"), "");
}

// The flag table against the stages themselves: every flag the launcher passes exists in the
// stage it goes to, with the same kind (boolean or value), and every flag a stage has is either
// routed or one the launcher sets itself (endpoints, folders, tools), listed here with why.
TEST_F(LauncherFlags, TableMatchesEveryStagesOwnFlags) {
  const std::map<Stage, std::set<std::string>> launcher_owned = {
      {Stage::kPreprocess, {"push", "request", "pub", "timeout_ms", "report_only", "report_json"}},
      {Stage::kCacher,
       {"pull", "rep", "pub", "wait_for_writer_s", "serve", "idle_timeout_s", "inspect", "json", "verify", "gc", "drop_superseded",
        "export_file", "dataset", "import_file", "delay_per_batch_s",
        "test_oom_latent_batches"}},
      {Stage::kTrainer,
       {"output_dir", "pub", "save_state", "resume", "cacher",
        "console_log_file",  // the launcher keeps each stage's log in logs/
        "check_flags",       // the launcher's check before any stage starts
        "train_data_dir",    // refused, pointing to preprocess (where the launcher routes it)
        "share_weights"}},   // the launcher's choice, with the sampler's --shared_weights
      {Stage::kSampler,
       {"output_dir", "sub", "pub", "lora", "replay_dir", "idle_timeout_s", "delay_per_image_s",
        "shared_weights", "check_flags"}},
  };
  // A stage's second name for a flag: the launcher takes it too, as the routed name.
  const std::map<Stage, std::map<std::string, std::string>> aliases = {
      {Stage::kPreprocess,
       {{"train_data_dir", "data_dir"},                  // kohya's name
        {"caption_extention", "caption_extension"}}},  // kohya's old spelling
      // Every stage that loads a model takes it by kohya's name and as --model.
      {Stage::kCacher, {{"model", "pretrained_model_name_or_path"}}},
      {Stage::kTrainer, {{"model", "pretrained_model_name_or_path"}}},
      {Stage::kSampler, {{"model", "pretrained_model_name_or_path"}}},
  };
  for (const auto& [stage, names] : aliases) {
    for (const auto& [alias, name] : names) {
      EXPECT_TRUE(parse_run_args({"--" + alias + "=x"}).has(name)) << alias;
    }
  }
  std::map<Stage, std::map<std::string, std::string>> stage_flags;  // name -> gflags type
  for (Stage stage : {Stage::kPreprocess, Stage::kCacher, Stage::kTrainer, Stage::kSampler}) {
    const fs::path xml = work_ / (std::string(stage_name(stage)) + ".xml");
    const pid_t pid = spawn({(kBin / ("lorapipe-" + std::string(stage_name(stage)))).string(),
                             "--helpxml"},
                            xml, work_ / "helpxml.err");
    EXPECT_EQ(wait_exit(pid), 0) << "--helpxml is help (runtime/flags.h)";
    const std::string text = read_text(xml);
    const std::regex flag("<flag><file>([^<]*)</file><name>([^<]+)</name>.*?<type>([^<]+)</type>");
    for (auto it = std::sregex_iterator(text.begin(), text.end(), flag);
         it != std::sregex_iterator(); ++it) {
      // Only the stage's own flags (its main.cpp, and the model-loading flags every stage
      // shares from models/model_parts_flags.cpp), not gflags' built-ins.
      if ((*it)[1].str().find("main.cpp") != std::string::npos ||
          (*it)[1].str().find("model_parts_flags.cpp") != std::string::npos) {
        stage_flags[stage][(*it)[2].str()] = (*it)[3].str();
      }
    }
    ASSERT_GT(stage_flags[stage].size(), 5u) << stage_name(stage) << ":\n" << text;
  }
  std::map<Stage, std::set<std::string>> routed;
  for (const FlagInfo& f : flag_table()) {
    for (const auto& [stage, name] : f.targets) {
      routed[stage].insert(name);
      const auto it = stage_flags[stage].find(name);
      ASSERT_NE(it, stage_flags[stage].end())
          << "--" << f.name << " goes to the " << stage_name(stage) << " as --" << name
          << ", which it does not have";
      EXPECT_EQ(it->second == "bool", f.boolean) << "--" << f.name << " in the " << stage_name(stage);
    }
  }
  for (const auto& [stage, flags] : stage_flags) {
    for (const auto& [name, type] : flags) {
      const bool alias = aliases.count(stage) && aliases.at(stage).count(name) &&
                         routed[stage].count(aliases.at(stage).at(name));
      EXPECT_TRUE(routed[stage].count(name) || launcher_owned.at(stage).count(name) || alias)
          << "the " << stage_name(stage) << "'s --" << name
          << " is neither routed by the launcher nor set by it";
      // A kohya flag a stage acts on must never be swallowed as one lorapipe lacks.
      EXPECT_EQ(kohya::find_foreign_flag(name), nullptr)
          << "the " << stage_name(stage) << "'s --" << name
          << " is also in common/kohya_flags.cpp's table of flags lorapipe does not act on";
    }
  }
  for (const FlagInfo& f : flag_table()) EXPECT_EQ(kohya::find_foreign_flag(f.name), nullptr) << f.name;
}

}  // namespace
}  // namespace lorapipe::launcher
