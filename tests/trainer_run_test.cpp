// lorapipe-trainer as a real process on the tiny SD1.5 model and the demo dataset, cached by the
// real preprocess and cacher processes into a real LMDB cache: it learns, it is deterministic,
// it resumes bit-exactly after kill -9, its LoRA file is kohya's, and bad input is refused with a
// clear message before any compute.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <torch/torch.h>
#ifdef LORAPIPE_WITH_SAMPLER
#include <vips/vips8>  // the sampler's PNGs
#endif

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <map>
#include <optional>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <sstream>
#include <thread>
#include <tuple>

#include "cacher/store.h"
#include "common/error.h"
#include "common/numbers.h"
#include "common/sha256.h"
#include "models/ddpm.h"
#include "models/pipeline.h"
#include "models/safetensors.h"
#include "models/sd15_lora.h"
#include "models/tiny.h"
#include "models/weights.h"
#include "preprocess/demo_dataset.h"
#include "proto/lorapipe.pb.h"
#include "proto/wire.h"
#include "runtime/process.h"
#include "tests/damaged_model.h"
#include "tests/paths.h"
#include "tests/process_util.h"
#include "trainer/dataset.h"
#include "trainer/lora_file.h"
#include "trainer/loss_recorder.h"
#include "trainer/lr_schedule.h"
#include "trainer/noise.h"
#include "trainer/ranks.h"

namespace lorapipe {
namespace {
namespace fs = std::filesystem;
using testing::read_text;
using testing::spawn;
using testing::wait_exit;

constexpr const char* kDataset = "demo";

struct TrainRun {
  int exit = -1;
  std::string out, err;
};

class TrainRunTest : public ::testing::Test {
 protected:
  void expect_sample_schedule(int64_t every, int64_t epochs);
  // One cache of the demo dataset at 128 px (16x16 latents), shared by every test.
  static void SetUpTestSuite() {
    dir_ = fs::temp_directory_path() / ("lorapipe-train-run-" + std::to_string(getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    tiny_ = models::write_tiny_checkpoint(dir_ / "model", /*seed=*/3);
    preprocess::write_demo_dataset(dir_ / "data");
    const pid_t cacher =
        spawn({LORAPIPE_CACHER_BIN, "--model=" + tiny_.diffusers.string(),
               "--cache_dir=" + (dir_ / "cache").string(),
               "--pull=ipc://" + (dir_ / "pull.sock").string(),
               "--rep=ipc://" + (dir_ / "rep.sock").string(), "--idle_timeout_s=120"},
              dir_ / "cacher.out", dir_ / "cacher.err");
    const pid_t pre =
        spawn({LORAPIPE_PREPROCESS_BIN, "--data_dir=" + (dir_ / "data").string(),
               std::string("--dataset_id=") + kDataset, "--resolution=128", "--min_bucket_reso=64",
               "--max_bucket_reso=256", "--push=ipc://" + (dir_ / "pull.sock").string(),
               "--request=ipc://" + (dir_ / "rep.sock").string(), "--timeout_ms=20000"},
              dir_ / "pre.out", dir_ / "pre.err");
    ASSERT_EQ(wait_exit(pre), 0) << read_text(dir_ / "pre.err");
    ASSERT_EQ(wait_exit(cacher), 0) << read_text(dir_ / "cacher.err");
  }
  static void TearDownTestSuite() {
    if (!std::getenv("LORAPIPE_KEEP")) fs::remove_all(dir_);
  }

  void SetUp() override {
    work_ = dir_ / ::testing::UnitTest::GetInstance()->current_test_info()->name();
    fs::remove_all(work_);
    fs::create_directories(work_);
  }

  // N steps straight against N/2, kill -9, resume, N/2 more (defined below the fixture).
  void expect_resume_bit_exact(const std::vector<std::string>& extra,
                               bool crash_mid_save = false) const;

  // lorapipe-cacher --serve on `rep` over `cache` (the suite's by default), its output in
  // work_/cacher-TAG.out and .err.
  pid_t serve_cache(const std::string& rep, const std::string& tag,
                    const fs::path& cache = {}) const {
    return spawn({LORAPIPE_CACHER_BIN, "--model=" + tiny_.diffusers.string(),
                  "--cache_dir=" + (cache.empty() ? dir_ / "cache" : cache).string(), "--serve",
                  "--rep=" + rep, "--pull=ipc://" + (work_ / ("pull-" + tag)).string()},
                 work_ / ("cacher-" + tag + ".out"), work_ / ("cacher-" + tag + ".err"));
  }

  // The demo dataset cached afresh by a cacher given `flags`, into work_/cache-TAG (its output in
  // work_/TAG-cacher.err); returns the cache's folder.
  fs::path cache_with(const std::string& tag, const std::vector<std::string>& flags) const {
    const fs::path cache = work_ / ("cache-" + tag);
    std::vector<std::string> c{LORAPIPE_CACHER_BIN, "--model=" + tiny_.diffusers.string(),
                               "--cache_dir=" + cache.string(),
                               "--pull=ipc://" + (work_ / (tag + "-pull.sock")).string(),
                               "--rep=ipc://" + (work_ / (tag + "-rep.sock")).string(),
                               "--idle_timeout_s=120"};
    c.insert(c.end(), flags.begin(), flags.end());
    const pid_t cacher = spawn(c, work_ / (tag + "-cacher.out"), work_ / (tag + "-cacher.err"));
    const pid_t pre = spawn(
        {LORAPIPE_PREPROCESS_BIN, "--data_dir=" + (dir_ / "data").string(),
         std::string("--dataset_id=") + kDataset, "--resolution=128", "--min_bucket_reso=64",
         "--max_bucket_reso=256", "--push=ipc://" + (work_ / (tag + "-pull.sock")).string(),
         "--request=ipc://" + (work_ / (tag + "-rep.sock")).string(), "--timeout_ms=20000"},
        work_ / (tag + "-pre.out"), work_ / (tag + "-pre.err"));
    EXPECT_EQ(wait_exit(pre), 0) << read_text(work_ / (tag + "-pre.err"));
    EXPECT_EQ(wait_exit(cacher), 0) << read_text(work_ / (tag + "-cacher.err"));
    return cache;
  }

  std::vector<std::string> args(const fs::path& out, std::vector<std::string> extra) const {
    std::vector<std::string> a{LORAPIPE_TRAINER_BIN,
                               "--pretrained_model_name_or_path=" + tiny_.diffusers.string(),
                               "--cache_dir=" + (dir_ / "cache").string(),
                               std::string("--dataset_id=") + kDataset,
                               "--output_dir=" + out.string(),
                               "--output_name=tiny",
                               "--device=cpu",
                               "--threads=1",  // ctest runs two tests at once on two cores
                               "--learning_rate=1e-3",
                               "--network_dim=4",
                               "--network_alpha=4"};
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  }

  TrainRun run(const fs::path& out, std::vector<std::string> extra) const {
    return run_on(dir_ / "cache", kDataset, out, std::move(extra));
  }

  // run() on manifest `id` of `cache` (a copy add_manifest made) instead of the suite's.
  TrainRun run_on(const fs::path& cache, const std::string& id, const fs::path& out,
                  std::vector<std::string> extra) const {
    fs::create_directories(out);
    std::vector<std::string> a = args(out, std::move(extra));
    a[2] = "--cache_dir=" + cache.string();
    a[3] = "--dataset_id=" + id;
    const pid_t pid = spawn(a, out / "trainer.out", out / "trainer.err");
    TrainRun r;
    r.exit = wait_exit(pid);
    r.out = read_text(out / "trainer.out");
    r.err = read_text(out / "trainer.err");
    return r;
  }

  // Copies the shared cache to `cache` (once) and adds manifest `id`: the demo manifest after
  // `edit`.
  static void add_manifest(const fs::path& cache, const std::string& id,
                           const std::function<void(wire::Manifest&)>& edit) {
    if (!fs::exists(cache)) fs::copy(dir_ / "cache", cache, fs::copy_options::recursive);
    cacher::StoreOptions o;
    o.dir = cache;
    cacher::Store store = cacher::Store::open(o);
    wire::Manifest m;
    ASSERT_TRUE(m.ParseFromString(*store.get(cacher::Table::kManifests, kDataset)));
    edit(m);
    store.put(cacher::Table::kManifests, {{id, m.SerializeAsString()}});
  }

  // The first `count` training images of the demo manifest, once each.
  static void keep_images(wire::Manifest& m, int count) {
    m.mutable_entries()->DeleteSubrange(count, m.entries_size() - count);
    for (auto& e : *m.mutable_entries()) {
      e.set_is_reg(false);
      e.set_repeats(1);
    }
  }

  static std::map<std::string, torch::Tensor> lora(const fs::path& file) {
    return models::read_tensors(models::SafetensorsFile::open(file));
  }

  static void expect_identical(const fs::path& a, const fs::path& b) {
    const auto x = lora(a), y = lora(b);
    ASSERT_EQ(x.size(), y.size());
    for (const auto& [name, t] : x) {
      ASSERT_TRUE(y.count(name)) << name;
      EXPECT_TRUE(torch::equal(t, y.at(name))) << name << " differs";
    }
  }

  // The 60-step learning run the optimizers share (LearnsAndIsDeterministic's), with `extra`:
  // its validation loss at the start and at the end, from the run's summary.
  std::pair<double, double> learn(const fs::path& out, std::vector<std::string> extra) const {
    std::vector<std::string> flags{"--max_train_steps=60", "--validation_split=0.25",
                                   "--validation_seed=5", "--train_batch_size=2"};
    flags.insert(flags.end(), extra.begin(), extra.end());
    const TrainRun r = run(out, flags);
    EXPECT_EQ(r.exit, 0) << r.err;
    std::smatch m;
    const std::regex re(R"(validation loss: ([0-9.]+) at the start, ([0-9.]+) at the end)");
    if (!std::regex_search(r.out, m, re)) {
      ADD_FAILURE() << "no validation summary in: " << r.out;
      return {0, 0};
    }
    return {std::stod(m[1]), std::stod(m[2])};
  }

  // learn() with `extra`, which must lower the validation loss by at least 10% (the measured drop
  // is printed) and name the optimizer in ss_optimizer as kohya does.
  void expect_learns(const std::string& label, const std::vector<std::string>& extra,
                     const std::string& ss_optimizer) const {
    const auto [first, last] = learn(work_, extra);
    std::printf("[learn] %s validation loss %.5f -> %.5f (%.1f%% lower)\n", label.c_str(), first,
                last, 100 * (1 - last / first));
    EXPECT_LT(last, first * 0.9);
    EXPECT_EQ(models::SafetensorsFile::open(work_ / "lora" / "tiny.safetensors")
                  .metadata()
                  .at("ss_optimizer"),
              ss_optimizer);
  }

  // The run's TensorBoard events file in `out`/tensorboard, as TensorBoard's own loader reads it
  // (trainer/reference/read_tensorboard.py): {"scalars": [{"tag", "step", "value"}, ...], ...}.
  static nlohmann::json tensorboard_events(const fs::path& out) {
    fs::path events;
    for (const auto& f : fs::directory_iterator(out / "tensorboard")) {
      if (f.path().filename().string().starts_with("events.out.tfevents.")) events = f.path();
    }
    EXPECT_FALSE(events.empty()) << "no events file in " << (out / "tensorboard");
    const char* python = std::getenv("LORAPIPE_PYTHON");
    EXPECT_NE(python, nullptr) << "LORAPIPE_PYTHON (the test venv's python) is unset";
    if (events.empty() || python == nullptr) return nlohmann::json::object();
    const std::string command = std::string(python) + " " + LORAPIPE_SOURCE_DIR +
                                "/trainer/reference/read_tensorboard.py read " + events.string() +
                                " > " + (out / "tb.json").string();
    EXPECT_EQ(std::system(command.c_str()), 0) << command;
    return nlohmann::json::parse(read_text(out / "tb.json"), nullptr, false);
  }

  static std::vector<double> losses(const std::string& log) { return testing::trainer_losses(log); }

  // loss/current of each step, as TensorBoard stored it (float32).
  static std::vector<double> tensorboard_losses(const fs::path& out) {
    std::vector<double> losses;
    const nlohmann::json read = tensorboard_events(out);  // alive through the loop
    for (const auto& scalar : read["scalars"]) {
      if (scalar["tag"] == "loss/current") losses.push_back(scalar["value"].get<double>());
    }
    EXPECT_FALSE(losses.empty()) << out;
    return losses;
  }

  static fs::path dir_;
  static models::TinyCheckpoint tiny_;
  fs::path work_;
};
fs::path TrainRunTest::dir_;
models::TinyCheckpoint TrainRunTest::tiny_;

// The LoRA must learn the demo set: held-out validation loss (kohya's fixed timesteps and noise)
// after 60 steps below the loss at step 0. The margin, 10%, is well inside what the run reaches
// (the measured drop is printed) and far above the run-to-run noise, which is zero: the same
// seed gives the same curve bit for bit, which the test checks by training twice.
TEST_F(TrainRunTest, LearnsAndIsDeterministic) {
  const std::vector<std::string> extra{"--max_train_steps=60", "--validation_split=0.25",
                                       "--validation_seed=5", "--train_batch_size=2",
                                       "--lr_scheduler=constant"};
  const TrainRun a = run(work_ / "a", extra);
  ASSERT_EQ(a.exit, 0) << a.err;
  const TrainRun b = run(work_ / "b", extra);
  ASSERT_EQ(b.exit, 0) << b.err;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(
      a.out, m, std::regex(R"(validation loss: ([0-9.]+) at the start, ([0-9.]+) at the end)")))
      << a.out;
  const double first = std::stod(m[1]), last = std::stod(m[2]);
  std::printf("[learn] validation loss %.5f -> %.5f (%.1f%% lower)\n", first, last,
              100 * (1 - last / first));
  EXPECT_LT(last, first * 0.9);
  const auto la = losses(a.err), lb = losses(b.err);
  ASSERT_EQ(la.size(), 60u) << a.err;
  EXPECT_EQ(la, lb);
  expect_identical(work_ / "a" / "lora" / "tiny.safetensors",
                   work_ / "b" / "lora" / "tiny.safetensors");
}

// N steps straight against N/2, kill -9, resume, N/2 more: bit-identical LoRA weights.
void TrainRunTest::expect_resume_bit_exact(const std::vector<std::string>& extra,
                                           bool crash_mid_save) const {
  const fs::path& work = work_;
  std::vector<std::string> common{"--max_train_steps=40",
                                  "--train_batch_size=2",
                                  "--lr_scheduler=cosine",
                                  "--lr_warmup_steps=4",
                                  "--gradient_accumulation_steps=2",
                                  "--network_dropout=0.1",
                                  "--noise_offset=0.05"};
  common.insert(common.end(), extra.begin(), extra.end());
  // The straight run saves at step 20 too: a save puts a schedule-free optimizer's average in the
  // weights and the next step takes them back, as the killed run's save does (others: no change).
  auto straight_flags = common;
  straight_flags.push_back("--save_every_n_steps=20");
  const TrainRun straight = run(work / "straight", straight_flags);
  ASSERT_EQ(straight.exit, 0) << straight.err;

  const fs::path killed = work / "killed";
  fs::create_directories(killed);
  auto with = common;
  with.insert(with.end(), {"--save_every_n_steps=20", "--save_state"});
  const pid_t pid = spawn(args(killed, with), killed / "trainer.out", killed / "trainer.err");
  const fs::path state = killed / "state" / "tiny-step00000020-state";
  for (int i = 0; i < 60000 && !fs::exists(state / "trainer.json"); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ::kill(pid, SIGKILL);
  const int status = wait_exit(pid);
  ASSERT_TRUE(fs::exists(state / "trainer.json")) << read_text(killed / "trainer.err");
  EXPECT_EQ(status, 128 + SIGKILL) << "the run finished before it could be killed";

  if (crash_mid_save) {
    // A crash while a save replaced the state, where renaming cannot swap two folders at once:
    // the old state moved aside, the new one not yet in place. The trainer resumes from it.
    fs::rename(state, state.parent_path() / ("." + state.filename().string() + ".old"));
  }
  auto resume = common;
  resume.push_back("--resume=" + state.string());
  const TrainRun resumed = run(killed, resume);
  ASSERT_EQ(resumed.exit, 0) << resumed.err;
  if (crash_mid_save) {
    EXPECT_NE(resumed.err.find("the state a crash left while the next one was being saved"),
              std::string::npos)
        << resumed.err;
  }
  // It resumed (training is deterministic, so a resume that restored nothing and trained all 40
  // steps over would end on the same LoRA): the log says where, and the 20 steps it ran are the
  // straight run's last 20, loss for loss.
  EXPECT_TRUE(std::regex_search(resumed.err, std::regex(R"(resumed from \S+ at step 20, epoch)")))
      << resumed.err;
  const std::vector<double> all = losses(straight.err), after = losses(resumed.err);
  ASSERT_EQ(all.size(), 40u) << straight.err;
  EXPECT_EQ(after, std::vector<double>(all.begin() + 20, all.end())) << resumed.err;
  expect_identical(work / "straight" / "lora" / "tiny.safetensors",
                   killed / "lora" / "tiny.safetensors");
}

// A state save that the disk cannot take (here a file-size limit, RLIMIT_FSIZE, with SIGXFSZ
// ignored so that writes fail with EFBIG as on a full disk) stops the run with an error naming the
// file, and leaves the state before it whole and in place, with no half-written folder beside it:
// resuming from it, with room again, finishes the run.
TEST_F(TrainRunTest, AStateSaveTheDiskCannotTakeKeepsThePreviousState) {
  const TrainRun first = run(work_, {"--max_train_steps=2", "--save_state"});
  ASSERT_EQ(first.exit, 0) << first.err;
  const fs::path state = work_ / "state" / "tiny-state";
  // The limit lets every file of the run through but the optimizer's state, the largest.
  const uintmax_t lora = fs::file_size(state / "lora.safetensors");
  const uintmax_t optimizer = fs::file_size(state / "optimizer.pt");
  ASSERT_GT(optimizer, lora + 4096) << "the limit needs room between the two";
  const uintmax_t limit = (lora + optimizer) / 2;
  std::vector<std::string> limited{"/bin/sh", "-c", "trap '' XFSZ; exec prlimit --fsize=" +
                                                        std::to_string(limit) + " -- \"$@\"",
                                   "sh"};
  for (const std::string& a : args(work_, {"--max_train_steps=4", "--save_state",
                                           "--resume=" + state.string()})) {
    limited.push_back(a);
  }
  const pid_t pid = spawn(limited, work_ / "limited.out", work_ / "limited.err");
  const int exit = wait_exit(pid);
  const std::string err = read_text(work_ / "limited.err");
  EXPECT_EQ(exit, 2) << err;
  EXPECT_NE(err.find("cannot save the state " + state.string() +
                     " at step 4 (the state saved there before stays whole): cannot write"),
            std::string::npos)
      << err;
  EXPECT_NE(err.find("optimizer.pt: File too large"), std::string::npos) << err;
  EXPECT_NE(err.find("resumed from " + state.string() + " at step 2"), std::string::npos) << err;
  const nlohmann::json saved = nlohmann::json::parse(read_text(state / "trainer.json"));
  EXPECT_EQ(saved["global_step"], 2) << "the state was replaced by the one that failed";
  EXPECT_EQ(fs::file_size(state / "optimizer.pt"), optimizer);
  EXPECT_FALSE(fs::exists(work_ / "state" / ".tiny-state.tmp")) << "a half-written state is left";
  const TrainRun again = run(work_, {"--max_train_steps=4", "--resume=" + state.string()});
  ASSERT_EQ(again.exit, 0) << again.err;
  EXPECT_NE(again.err.find("at step 2, epoch"), std::string::npos) << again.err;
  EXPECT_EQ(losses(again.err).size(), 2u) << again.err;
}

TEST_F(TrainRunTest, ResumeAfterKillNineIsBitExact) { expect_resume_bit_exact({}); }

// The same when the kill came in the middle of replacing a state (see write_folder).
TEST_F(TrainRunTest, ResumeFromAStateACrashLeftMovedAsideIsBitExact) {
  expect_resume_bit_exact({}, /*crash_mid_save=*/true);
}

// The trainer with kernels/' 8-bit optimizer (a suite of its own, so its name says it).
class AdamW8bitTrainRun : public TrainRunTest {};

// The same with AdamW8bit, every LoRA tensor on 8-bit state (min_8bit_size=0: the tiny model's
// tensors are all under bitsandbytes' 4096): its bytes and absmax come back exactly.
TEST_F(AdamW8bitTrainRun, ResumeAfterKillNineIsBitExact) {
  expect_resume_bit_exact({"--optimizer_type=AdamW8bit", "--optimizer_args=min_8bit_size=0"});
}

// AdamW8bit learns like AdamW: the same 60 steps as LearnsAndIsDeterministic with every LoRA
// tensor on 8-bit state. The validation loss must fall by at least 80% of what AdamW's falls:
// 8-bit state moves each step by the quantisation of the moments (under 1% of the step, see
// kernels/adamw8bit_test.cpp), which over 60 steps changes the curve by a few percent of the
// drop (measured and printed), while a broken update (wrong sign, lost decay of the moments, a
// stale absmax) stalls or diverges the loss.
// kohya's block-wise learning rates give a group per block, and LoRA+ doubles them: more groups
// than AdamW8bit once took (8). Every block's group trains at its own rate, as with AdamW.
TEST_F(AdamW8bitTrainRun, BlockWiseLearningRatesWithLoraPlusTrainEveryGroup) {
  const std::vector<std::string> flags{"--max_train_steps=2", "--optimizer_type=AdamW8bit",
                                       "--network_args", "mid_lr_weight=0.5",
                                       "up_lr_weight=linear", "loraplus_lr_ratio=4"};
  const TrainRun r = run(work_, flags);
  ASSERT_EQ(r.exit, 0) << r.err;
  std::set<std::string> groups;
  const nlohmann::json events = tensorboard_events(work_);
  for (const auto& scalar : events["scalars"]) {
    const std::string tag = scalar["tag"].get<std::string>();
    if (tag.starts_with("lr/")) groups.insert(tag);
  }
  EXPECT_GT(groups.size(), 8u) << r.err;
  EXPECT_TRUE(groups.count("lr/unet_block1 plus")) << r.err;
}

TEST_F(AdamW8bitTrainRun, LearnsLikeAdamW) {
  double first[2], last[2];
  std::tie(first[0], last[0]) = learn(work_ / "adamw", {"--lr_scheduler=constant"});
  std::tie(first[1], last[1]) =
      learn(work_ / "adamw8bit", {"--lr_scheduler=constant", "--optimizer_type=AdamW8bit",
                                  "--optimizer_args=min_8bit_size=0"});
  const double drop = first[0] - last[0], drop8 = first[1] - last[1];
  std::printf(
      "[learn] validation loss AdamW %.5f -> %.5f, AdamW8bit %.5f -> %.5f (%.1f%% of "
      "AdamW's drop)\n",
      first[0], last[0], first[1], last[1], 100 * drop8 / drop);
  EXPECT_EQ(first[0], first[1]) << "same start";
  EXPECT_GT(drop, 0);
  EXPECT_GE(drop8, 0.8 * drop);
}

// The trainer with Prodigy (a suite of its own, so its name says it).
class ProdigyTrainRun : public TrainRunTest {};

// Prodigy's state (moments, its running sum s, the initial weights p0, and the step-size
// estimate d with its numerator) comes back exactly after kill -9.
TEST_F(ProdigyTrainRun, ResumeAfterKillNineIsBitExact) {
  expect_resume_bit_exact({"--optimizer_type=Prodigy", "--learning_rate=1.0", "--optimizer_args",
                           "use_bias_correction=True", "weight_decay=0.01"});
}

// Prodigy at kohya's usual --learning_rate=1.0 finds its own step size and learns: the same 60
// steps as LearnsAndIsDeterministic, the validation loss at least 10% lower at the end (the
// measured drop is printed). A broken estimate leaves d at its 1e-6 start (no learning) or blows
// it up (divergence); the step size it settles on is in the metadata kohya writes.
TEST_F(ProdigyTrainRun, LearnsAtLearningRateOne) {
  expect_learns("Prodigy",
                {"--lr_scheduler=constant", "--optimizer_type=prodigy", "--learning_rate=1.0",
                 "--optimizer_args", "d_coef=2"},
                "prodigyopt.prodigy.Prodigy(d_coef=2)");
}

// The trainer with DAdaptAdam (a suite of its own, so its name says it):
// its state (moments, the running sum s, d and its weighted numerator) comes back exactly after
// kill -9, and at lr 1.0 it finds a step size that learns the demo set.
class DAdaptAdamTrainRun : public TrainRunTest {};

TEST_F(DAdaptAdamTrainRun, ResumeAfterKillNineIsBitExact) {
  expect_resume_bit_exact({"--optimizer_type=DAdaptAdam", "--learning_rate=1.0",
                           "--optimizer_args", "decouple=True", "weight_decay=0.01"});
}

TEST_F(DAdaptAdamTrainRun, LearnsAtLearningRateOne) {
  expect_learns("DAdaptAdam",
                {"--lr_scheduler=constant", "--optimizer_type=DAdaptAdam", "--learning_rate=1.0"},
                "dadaptation.dadapt_adam.DAdaptAdam");
}

// The trainer with Lion (a suite of its own, so its name says it): its moment comes back exactly
// after kill -9, and at a Lion-sized rate (a third of AdamW's 1e-3 here) it learns the demo set
// like LearnsAndIsDeterministic (validation loss at least 10% lower after 60 steps; the measured
// drop is printed). A sign error or a lost moment stalls or diverges the loss.
class LionTrainRun : public TrainRunTest {};

TEST_F(LionTrainRun, ResumeAfterKillNineIsBitExact) {
  expect_resume_bit_exact({"--optimizer_type=Lion", "--learning_rate=3e-4",
                           "--optimizer_args=weight_decay=0.1"});
}

TEST_F(LionTrainRun, Learns) {
  expect_learns("Lion",
                {"--lr_scheduler=constant", "--optimizer_type=lion", "--learning_rate=3e-4"},
                "lion_pytorch.lion_pytorch.Lion");
}

// The trainer with AdamWScheduleFree (a suite of its own, so its name says it): a state is saved
// with the average in the weights (a LoRA save's eval()), and the resumed run's first train()
// takes them back exactly as the killed run did, so the run ends bit-identical after kill -9; at
// AdamW's rate under a constant schedule (its own warm-up) it learns the demo set (validation
// loss, taken at the average, at least 10% lower after 60 steps; the drop is printed).
class ScheduleFreeTrainRun : public TrainRunTest {};

TEST_F(ScheduleFreeTrainRun, ResumeAfterKillNineIsBitExact) {
  expect_resume_bit_exact({"--optimizer_type=AdamWScheduleFree", "--optimizer_args",
                           "warmup_steps=4", "weight_decay=0.01"});
}

// Every save puts the average in the weights before it writes them: the states at a save step
// and at the end were written in eval mode (their optimizer's first scalar, its mode, is 0), so
// the LoRA file written just before each holds the average; the steps after a save go on.
TEST_F(ScheduleFreeTrainRun, SavesWriteTheAverage) {
  const TrainRun r = run(work_, {"--max_train_steps=4", "--save_every_n_steps=2", "--save_state",
                                 "--optimizer_type=AdamWScheduleFree"});
  ASSERT_EQ(r.exit, 0) << r.err;
  EXPECT_EQ(losses(r.err).size(), 4u) << r.err;
  for (const std::string state : {"tiny-step00000002-state", "tiny-state"}) {
    torch::serialize::InputArchive archive;
    archive.load_from((work_ / "state" / state / "optimizer.pt").string());
    at::Tensor scalars;
    archive.read("scalars", scalars);
    EXPECT_EQ(scalars[0].item<double>(), 0) << state << " was saved with the training point";
  }
}

TEST_F(ScheduleFreeTrainRun, Learns) {
  expect_learns("AdamWScheduleFree",
                {"--lr_scheduler=constant", "--optimizer_type=AdamWScheduleFree",
                 "--learning_rate=1e-3", "--optimizer_args", "warmup_steps=5"},
                "schedulefree.adamw_schedulefree.AdamWScheduleFree(warmup_steps=5)");
}

// The trainer with Adafactor (a suite of its own, so its name says it): with kohya's default
// relative step (under kohya's adafactor schedule, which takes no warmup) its state (factored
// moments, each parameter's RMS, the step size it reports) comes back exactly after kill -9; with
// kohya's SDXL preset (a fixed rate, no parameter scaling) at AdamW's rate it learns the demo set
// (validation loss at least 10% lower after 60 steps; the measured drop is printed).
class AdafactorTrainRun : public TrainRunTest {};

TEST_F(AdafactorTrainRun, ResumeAfterKillNineIsBitExact) {
  expect_resume_bit_exact({"--optimizer_type=Adafactor", "--optimizer_args=beta1=0.9",
                           "--lr_scheduler=adafactor", "--lr_warmup_steps=0"});
}

// kohya's adafactor schedule: taken with Adafactor's relative step alone, where it stands in for
// any --lr_scheduler (ss_lr_scheduler "adafactor:<lr>", as kohya writes it) and refuses a warmup.
TEST_F(AdafactorTrainRun, KohyasAdafactorScheduleGoesWithTheRelativeStep) {
  const TrainRun r = run(work_, {"--max_train_steps=1", "--optimizer_type=Adafactor",
                                 "--lr_scheduler=cosine", "--learning_rate=2e-4"});
  ASSERT_EQ(r.exit, 0) << r.err;
  EXPECT_EQ(models::SafetensorsFile::open(work_ / "lora" / "tiny.safetensors")
                .metadata()
                .at("ss_lr_scheduler"),
            "adafactor:0.0002");
  const std::vector<std::pair<std::vector<std::string>, std::string>> refused = {
      {{"--optimizer_type=Adafactor", "--lr_warmup_steps=10", "--lr_scheduler=cosine"},
       "--lr_warmup_steps=10: Adafactor with relative_step"},
      {{"--lr_scheduler=adafactor"}, "--lr_scheduler=adafactor is transformers' AdafactorSchedule"},
      {{"--optimizer_type=Adafactor", "--optimizer_args", "relative_step=False",
        "--lr_scheduler=adafactor"},
       "it needs --optimizer_type=Adafactor with relative_step"}};
  for (const auto& [flags, expected] : refused) {
    std::vector<std::string> check = flags;
    check.push_back("--check_flags");
    const TrainRun c = run(work_ / "check", check);
    EXPECT_EQ(c.exit, 2) << flags[0];
    EXPECT_NE(c.err.find(expected), std::string::npos) << c.err;
  }
}

TEST_F(AdafactorTrainRun, LearnsWithKohyasPreset) {
  expect_learns("Adafactor",
                {"--lr_scheduler=constant_with_warmup", "--lr_warmup_steps=5",
                 "--optimizer_type=adafactor", "--optimizer_args", "scale_parameter=False",
                 "relative_step=False", "warmup_init=False"},
                "transformers.optimization.Adafactor(scale_parameter=False,relative_step=False,"
                "warmup_init=False)");
}

// kohya's block-wise network_args from the command line to the file and TensorBoard: block_dims
// give each block's modules its rank (IN01: 1, IN02: 2, ...), block_alphas their .alpha; with
// up_lr_weight=zeros no OUT block learns, so the file has no up-block module; each block with
// modules logs its rate as kohya tags it (lr/unet_block1). The rule itself, block by block, is
// TrainParity.BlockArgsShapeRanksAlphasAndRatesAsKohya's.
TEST_F(TrainRunTest, BlockWiseNetworkArgsShapeTheFile) {
  std::string dims, alphas;
  for (int b = 0; b < 25; ++b) {
    dims += (b ? "," : "") + std::to_string(b % 4 + 1);
    alphas += (b ? "," : "") + std::to_string(b) + ".5";
  }
  const TrainRun r = run(work_, {"--max_train_steps=2", "--network_args", "block_dims=" + dims,
                                 "block_alphas=" + alphas, "mid_lr_weight=0.5", "up_lr_weight=zeros"});
  ASSERT_EQ(r.exit, 0) << r.err;
  const auto tensors = lora(work_ / "lora" / "tiny.safetensors");
  size_t down_modules = 0, mid_modules = 0;
  for (const auto& [key, tensor] : tensors) {
    if (!key.starts_with("lora_unet_") || !key.ends_with(".lora_down.weight")) continue;
    EXPECT_EQ(key.find("up_blocks"), std::string::npos) << key << ": OUT blocks learn nothing";
    const std::string name = key.substr(0, key.find('.'));
    int block = 12;
    if (name.starts_with("lora_unet_down_blocks_")) {
      ++down_modules;
      // lora_unet_down_blocks_I_(resnets|attentions)_J_...: IN(1 + 3I + J).
      const std::smatch m = [&] {
        std::smatch found;
        std::regex_search(name, found, std::regex("down_blocks_([0-9])_(resnets|attentions)_([0-9])_"));
        return found;
      }();
      ASSERT_FALSE(m.empty()) << name;
      block = 1 + 3 * std::stoi(m[1].str()) + std::stoi(m[3].str());
    } else {
      ASSERT_TRUE(name.starts_with("lora_unet_mid_block_")) << name;
      ++mid_modules;
    }
    EXPECT_EQ(tensor.size(0), block % 4 + 1) << name;
    EXPECT_FLOAT_EQ(tensors.at(name + ".alpha").item<float>(), block + 0.5f) << name;
  }
  EXPECT_GT(down_modules, 0u);
  EXPECT_GT(mid_modules, 0u);
  const nlohmann::json read = tensorboard_events(work_);
  std::map<std::string, double> last;
  for (const auto& scalar : read["scalars"]) {
    last[scalar["tag"].get<std::string>()] = scalar["value"].get<double>();
  }
  EXPECT_TRUE(last.count("lr/unet_block1")) << read.dump();
  EXPECT_TRUE(last.count("lr/unet_block12")) << read.dump();
  EXPECT_FALSE(last.count("lr/unet")) << "one group for each block, none for the whole U-Net";
  EXPECT_FALSE(last.count("lr/unet_block13")) << "OUT00 has no module";
  const auto meta = models::SafetensorsFile::open(work_ / "lora" / "tiny.safetensors").metadata();
  EXPECT_EQ(nlohmann::json::parse(meta.at("ss_network_args"))["up_lr_weight"], "zeros");
  // Continuing a whole LoRA with blocks left out: their modules in the file are not loaded, as
  // kohya's non-strict load leaves them (before: "keys that fit no module").
  const TrainRun whole = run(work_ / "whole", {"--max_train_steps=1"});
  ASSERT_EQ(whole.exit, 0) << whole.err;
  const TrainRun on = run(work_ / "on", {"--max_train_steps=1", "--network_weights=" +
                                             (work_ / "whole" / "lora" / "tiny.safetensors").string(),
                                         "--network_args", "up_lr_weight=zeros"});
  EXPECT_EQ(on.exit, 0) << on.err;
  EXPECT_NE(on.err.find("tensors of modules this network does not train are not loaded"),
            std::string::npos)
      << on.err;
}

// Every key maps onto a module of the base model; shapes and metadata are kohya's.
TEST_F(TrainRunTest, LoraFileIsKohyas) {
  const TrainRun r =
      run(work_, {"--max_train_steps=4", "--save_precision=fp16", "--learning_rate=1e-2",
                  "--network_args", "conv_dim=2", "conv_alpha=1"});
  ASSERT_EQ(r.exit, 0) << r.err;
  const fs::path file = work_ / "lora" / "tiny.safetensors";
  const auto tensors = lora(file);
  const std::unique_ptr<models::DiffusionModel> model = models::load_model(tiny_.diffusers);
  std::map<std::string, models::LoraTarget> targets;
  for (auto& t : model->lora_targets(/*text_encoder=*/true, /*conv_kxk=*/true)) targets[t.name] = t;
  size_t modules = 0, conv_kxk = 0;
  for (const auto& [key, tensor] : tensors) {
    const size_t dot = key.find('.');
    const std::string name = key.substr(0, dot), part = key.substr(dot + 1);
    ASSERT_TRUE(targets.count(name)) << key << " maps onto no module of the base model";
    const auto& target = targets.at(name);
    EXPECT_EQ(tensor.scalar_type(), torch::kHalf) << key;
    if (part == "alpha") {
      EXPECT_EQ(tensor.dim(), 0) << key;
      ++modules;
    } else if (part == "lora_down.weight") {
      EXPECT_EQ(tensor.size(1), target.in_features()) << key;
      EXPECT_EQ(tensor.dim(), target.conv ? 4 : 2) << key;  // 1x1 convs too: [r, in, 1, 1]
      conv_kxk += target.is_conv_kxk();
      EXPECT_EQ(tensor.size(0), target.is_conv_kxk() ? 2 : 4) << key;
    } else {
      ASSERT_EQ(part, "lora_up.weight") << key;
      EXPECT_EQ(tensor.size(0), target.out_features()) << key;
    }
  }
  EXPECT_EQ(modules, targets.size()) << "every target has its module in the file";
  EXPECT_GT(conv_kxk, 0u);
  const auto file_info = models::SafetensorsFile::open(file);
  const auto& meta = file_info.metadata();
  for (const char* key :
       {"ss_network_dim", "ss_network_alpha", "ss_network_module", "ss_network_args",
        "ss_learning_rate", "ss_optimizer", "ss_seed", "ss_num_train_images", "ss_bucket_info",
        "ss_steps", "ss_base_model_version", "sshs_model_hash", "modelspec.architecture"}) {
    EXPECT_TRUE(meta.count(key)) << key;
  }
  EXPECT_EQ(meta.at("ss_network_dim"), "4");
  EXPECT_EQ(meta.at("ss_network_module"), "networks.lora");
  // What a UI or a model site reads, as kohya writes it: its arguments as str() gives them, None
  // for those not given, the optimizer's arguments only where the user gave some, and for a
  // diffusers folder the hashes kohya's model_hash and calculate_sha256 give a folder.
  EXPECT_EQ(meta.at("ss_network_alpha"), python_float_repr(std::stod(meta.at("ss_network_alpha"))));
  EXPECT_NE(meta.at("ss_network_alpha").find('.'), std::string::npos) << meta.at("ss_network_alpha");
  EXPECT_EQ(meta.at("ss_unet_lr"), "None");
  EXPECT_EQ(meta.at("ss_text_encoder_lr"), "None");
  EXPECT_EQ(meta.at("ss_clip_skip"), "None");
  EXPECT_FALSE(meta.count("modelspec.encoder_layer")) << "kohya's: --clip_skip not given";
  EXPECT_EQ(meta.at("ss_optimizer").find('('), std::string::npos) << meta.at("ss_optimizer");
  EXPECT_EQ(meta.at("ss_sd_model_name"), tiny_.diffusers.filename().string());  // the suite's
  EXPECT_EQ(meta.at("ss_sd_model_hash"), "IsADirectory");
  EXPECT_EQ(meta.at("ss_new_sd_model_hash"), "IsADirectory");
  EXPECT_EQ(meta.at("ss_lowram"), "False");  // kohya writes its --lowram, given or not
  EXPECT_EQ(meta.at("ss_steps"), "4");
  EXPECT_EQ(meta.at("ss_resolution"), "(128, 128)");  // the suite caches at --resolution=128
  EXPECT_EQ(meta.at("modelspec.resolution"), "128x128");
  // json.dumps of kohya's net_kwargs: the arguments in their order, then train_network's
  // LyCORIS "dropout" (None without --network_dropout).
  EXPECT_EQ(meta.at("ss_network_args"), R"({"conv_dim": "2", "conv_alpha": "1", "dropout": null})");
  // kohya's dataset metadata, through preprocess, the cacher's manifest and the trainer: the
  // demo's one repeat folder, and its captions (one tag each: they hold no comma) counted as
  // the caption files give them.
  std::map<std::string, int> captions;
  size_t images = 0;
  for (const auto& f : fs::directory_iterator(dir_ / "data" / preprocess::kDemoFolder)) {
    if (f.path().extension() != ".txt") continue;
    ++images;
    std::string caption = read_text(f.path());
    ASSERT_EQ(caption.find(','), std::string::npos) << f.path();
    caption.erase(caption.find_last_not_of(" \n") + 1);
    ++captions[caption];
  }
  const auto tags = nlohmann::json::parse(meta.at("ss_tag_frequency"));
  ASSERT_EQ(tags.size(), 1u) << tags;
  const auto counted = tags[preprocess::kDemoFolder].get<std::map<std::string, int>>();
  EXPECT_EQ(counted, captions) << tags;
  EXPECT_EQ(nlohmann::json::parse(meta.at("ss_dataset_dirs")),
            nlohmann::json::parse(R"({")" + std::string(preprocess::kDemoFolder) +
                                  R"(":{"n_repeats":10,"img_count":)" + std::to_string(images) +
                                  "}}"));
  EXPECT_EQ(meta.at("ss_reg_dataset_dirs"), "{}");
  // The dataset's settings as preprocess was given them (kohya's layout without a TOML), and the
  // buckets with kohya's mean aspect-ratio error.
  EXPECT_EQ(meta.at("ss_enable_bucket"), "True");
  EXPECT_EQ(meta.at("ss_min_bucket_reso"), "64");
  EXPECT_EQ(meta.at("ss_max_bucket_reso"), "256");
  EXPECT_EQ(meta.at("ss_bucket_no_upscale"), "False");
  EXPECT_EQ(meta.at("ss_flip_aug"), "False");
  EXPECT_EQ(meta.at("ss_caption_dropout_rate"), "0.0");
  const auto bucket_info = nlohmann::json::parse(meta.at("ss_bucket_info"));
  EXPECT_TRUE(bucket_info.contains("mean_img_ar_error")) << bucket_info;
  EXPECT_FALSE(meta.count("ss_datasets")) << "kohya writes it for a dataset TOML only";
  // Timestamps as kohya's str(time.time()): A1111's metadata editor reads them with float().
  for (const char* key : {"ss_training_started_at", "ss_training_finished_at"}) {
    const std::optional<double> seconds = parse_double(meta.at(key));
    ASSERT_TRUE(seconds.has_value()) << key << " = " << meta.at(key);
    EXPECT_GT(*seconds, 1.7e9) << key << ": seconds since 1970, after 2023";
  }

  // diffusers' load_lora_weights loads the file as written: every module adapted, no key left
  // over, and the UNet's and text encoder's outputs equal those of the weights merged by hand
  // (W += up @ down * alpha / rank). 1e-5 relative: the same fp32 numbers summed in another
  // order (measured about 2e-6). The LoRA must also change the outputs (1e-4 is far below what
  // four steps at 1e-2 reach and far above rounding).
  const char* python = std::getenv("LORAPIPE_PYTHON");
  ASSERT_NE(python, nullptr) << "LORAPIPE_PYTHON (the test venv's python) is unset";
  const fs::path result = work_ / "diffusers.json";
  const std::string command = std::string(python) + " " + LORAPIPE_SOURCE_DIR +
                              "/trainer/reference/diffusers_lora_check.py --model " +
                              tiny_.diffusers.string() + " --lora " + file.string() + " --out " +
                              result.string() + " > " + (work_ / "diffusers.log").string() +
                              " 2>&1";
  ASSERT_EQ(std::system(command.c_str()), 0) << read_text(work_ / "diffusers.log");
  const auto check = nlohmann::json::parse(read_text(result));
  std::printf("[diffusers] %s\n", check.dump().c_str());
  EXPECT_EQ(check["file_modules"], modules);
  EXPECT_EQ(check["adapted_modules"], modules);
  EXPECT_TRUE(check["leftover_keys"].empty()) << check["leftover_keys"].dump();
  EXPECT_LT(check["unet_max_rel_diff"].get<double>(), 1e-5);
  EXPECT_LT(check["text_max_rel_diff"].get<double>(), 1e-5);
  EXPECT_GT(check["unet_change"].get<double>(), 1e-4);
  // The web UIs' hash, as kohya computes it from the same tensors and ss_* metadata.
  EXPECT_EQ(check["kohya_sshs_model_hash"].get<std::string>(), meta.at("sshs_model_hash"));
  EXPECT_GT(check["text_change"].get<double>(), 1e-4);
}

// A state is a place in the batches its flags planned: resuming it with another batch size,
// accumulation, last-batch rule or validation split would pick up elsewhere in the epoch, so it
// is refused, naming the flag and both values. The same flags (a longer run) resume.
TEST_F(TrainRunTest, ResumeRefusesAnotherDataPlanNamingTheFlag) {
  const TrainRun first = run(work_, {"--max_train_steps=2", "--save_state"});
  ASSERT_EQ(first.exit, 0) << first.err;
  const std::string state = "--resume=" + (work_ / "state" / "tiny-state").string();
  const TrainRun other = run(work_, {"--max_train_steps=4", state, "--train_batch_size=3"});
  EXPECT_NE(other.exit, 0);
  EXPECT_NE(other.err.find("that state was trained with --train_batch_size=1, this run gives 3"),
            std::string::npos)
      << other.err;
  // A hand-edited trainer.json with a value of the wrong type: named with the file and key.
  const fs::path file = work_ / "state" / "tiny-state" / "trainer.json";
  const std::string saved = read_text(file);
  for (const auto& [key, value, says] :
       std::vector<std::tuple<std::string, nlohmann::json, std::string>>{
           {"seed", "42", "'seed' is not a whole number"},
           {"dataset_id", 7, "'dataset_id' is not text"},
           {"plan", nlohmann::json::array(), "'plan' is not an object of flags"}}) {
    nlohmann::json edited = nlohmann::json::parse(saved);
    edited[key] = value;
    std::ofstream(file) << edited.dump();
    const TrainRun bad = run(work_, {"--max_train_steps=4", state});
    EXPECT_NE(bad.exit, 0) << key;
    EXPECT_NE(bad.err.find(file.string() + ": " + says), std::string::npos) << bad.err;
  }
  std::ofstream(file) << saved;
  // AdamW's state under other --optimizer_args: refused by name, as every optimizer's is (torch
  // would load the old ones over them).
  const TrainRun decay = run(work_, {"--max_train_steps=4", state,
                                     "--optimizer_args=weight_decay=0.05"});
  EXPECT_NE(decay.exit, 0);
  EXPECT_NE(decay.err.find("that state was trained with --optimizer_args weight_decay=0.01, this "
                           "run gives 0.05"),
            std::string::npos)
      << decay.err;
  const TrainRun longer = run(work_, {"--max_train_steps=4", state});
  EXPECT_EQ(longer.exit, 0) << longer.err;
  EXPECT_NE(longer.err.find("at step 2, epoch"), std::string::npos) << longer.err;
  EXPECT_EQ(losses(longer.err).size(), 2u) << longer.err;
}

// A dataset cached again under the same --dataset_id with images removed is not the dataset a
// state's place in the epoch is in: refused by name. A caption edited (the same shape) resumes.
TEST_F(TrainRunTest, ResumeRefusesADatasetCachedAgainWithOtherImages) {
  const fs::path cache = work_ / "cache";
  add_manifest(cache, "mine", [](wire::Manifest& m) { keep_images(m, 12); });
  const TrainRun first = run_on(cache, "mine", work_, {"--max_train_steps=2", "--save_state"});
  ASSERT_EQ(first.exit, 0) << first.err;
  const std::string state = "--resume=" + (work_ / "state" / "tiny-state").string();
  add_manifest(cache, "mine", [](wire::Manifest& m) {
    keep_images(m, 12);
    m.mutable_entries(0)->set_caption("an edited caption");
  });
  const TrainRun edited = run_on(cache, "mine", work_, {"--max_train_steps=3", state});
  EXPECT_EQ(edited.exit, 0) << edited.err;
  add_manifest(cache, "mine", [](wire::Manifest& m) { keep_images(m, 10); });
  const TrainRun fewer = run_on(cache, "mine", work_, {"--max_train_steps=4", state});
  EXPECT_NE(fewer.exit, 0);
  EXPECT_NE(fewer.err.find("the dataset 'mine' is not the one that state trained (\"12 samples"),
            std::string::npos)
      << fewer.err;
  EXPECT_NE(fewer.err.find("\"10 samples"), std::string::npos) << fewer.err;
}

// --bucket_batch_sizes (lorapipe run --auto_batch): where every bucket takes the whole step, a
// batch of 1 with 2 accumulated trains the LoRA of a batch of 2 bit for bit (the same samples,
// draws and step count: accumulation became batch); where buckets take 1, each step runs 2
// micro-batches of 1 and keeps 2 samples per step. A state remembers the sizes; the log names
// them.
TEST_F(TrainRunTest, BucketBatchSizesTurnAccumulationIntoBatchWhereTheCardAllows) {
  std::set<std::string> buckets;
  const fs::path cache = work_ / "cache";
  add_manifest(cache, "auto", [&](wire::Manifest& m) {
    keep_images(m, 9);
    for (const auto& e : m.entries()) {
      buckets.insert(std::to_string(e.bucket().width()) + "x" +
                     std::to_string(e.bucket().height()));
    }
  });
  ASSERT_GE(buckets.size(), 2u) << "the demo set's first images span buckets";
  auto sized = [&](int batch) {
    std::string flag = "--bucket_batch_sizes=";
    for (const std::string& b : buckets) flag += b + ":" + std::to_string(batch) + ",";
    return flag;
  };
  auto train = [&](const std::string& tag, std::vector<std::string> extra) {
    extra.push_back("--max_train_epochs=2");
    std::vector<std::string> a = args(work_ / tag, extra);
    a[2] = "--cache_dir=" + cache.string();
    a[3] = "--dataset_id=auto";
    fs::create_directories(work_ / tag);
    const pid_t pid = spawn(a, work_ / tag / "out", work_ / tag / "err");
    EXPECT_EQ(wait_exit(pid), 0) << read_text(work_ / tag / "err");
    return read_text(work_ / tag / "err") + read_text(work_ / tag / "out");
  };
  const std::string batch2 = train("batch2", {"--train_batch_size=2"});
  const std::string whole =
      train("whole", {"--train_batch_size=1", "--gradient_accumulation_steps=2", sized(2),
                      "--save_state"});
  const std::string ones =
      train("ones", {"--train_batch_size=1", "--gradient_accumulation_steps=2", sized(1)});
  expect_identical(work_ / "batch2" / "lora" / "tiny.safetensors",
                   work_ / "whole" / "lora" / "tiny.safetensors");
  // The epoch's steps: one per bucket's pair of samples, the same in all three runs.
  const std::regex per_epoch(R"((\d+) batches and (\d+) steps per epoch)");
  std::smatch a, b, c;
  ASSERT_TRUE(std::regex_search(batch2, a, per_epoch)) << batch2;
  ASSERT_TRUE(std::regex_search(whole, b, per_epoch)) << whole;
  ASSERT_TRUE(std::regex_search(ones, c, per_epoch)) << ones;
  EXPECT_EQ(b[2], a[2]);
  EXPECT_EQ(c[2], a[2]);
  EXPECT_EQ(b[1], a[1]) << "batches of 2 where the bucket takes 2";
  EXPECT_EQ(std::stoi(c[1]), 9) << "each of the 9 samples its own micro-batch";
  EXPECT_NE(ones.find("batch per bucket: "), std::string::npos) << ones;
  EXPECT_NE(ones.find("2 samples per step)"), std::string::npos) << ones;
  EXPECT_EQ(losses(ones).size(), losses(batch2).size()) << "the same step count";
  for (const char* tag : {"batch2", "whole", "ones"}) {
    EXPECT_EQ(models::SafetensorsFile::open(work_ / tag / "lora" / "tiny.safetensors")
                  .metadata()
                  .at("ss_total_batch_size"),
              "2")
        << tag;
  }
  // The sizes are part of the data plan a state resumes in.
  std::vector<std::string> resumed = args(work_ / "resumed", {"--max_train_epochs=3",
      "--train_batch_size=1", "--gradient_accumulation_steps=2",
      "--resume=" + (work_ / "whole" / "state" / "tiny-state").string()});
  resumed[2] = "--cache_dir=" + cache.string();
  resumed[3] = "--dataset_id=auto";
  fs::create_directories(work_ / "resumed");
  const pid_t pid = spawn(resumed, work_ / "resumed" / "out", work_ / "resumed" / "err");
  EXPECT_NE(wait_exit(pid), 0);
  EXPECT_NE(read_text(work_ / "resumed" / "err").find("--bucket_batch_sizes="), std::string::npos)
      << read_text(work_ / "resumed" / "err");
}

// A kohya command line carries over as it is (network_module, save_model_as, no_half_vae,
// xformers, cache_latents, logging_dir, log_prefix, and the noise and loss options drawn in a
// real run: ip_noise_gamma with random strength): saves are named as kohya names them and
// pruned by its rules, and TensorBoard goes where kohya puts it.
TEST_F(TrainRunTest, KohyaCommandSavesAndLogsWhereKohyaDoes) {
  std::ofstream(work_ / "thumb.png") << "abcd";  // its bytes, as any file's, go in base64
  const TrainRun r =
      run(work_, {"--max_train_steps=6", "--save_every_n_steps=2", "--save_last_n_steps=2",
                  "--network_module=networks.lora", "--save_model_as=safetensors",
                  "--no_half_vae", "--xformers", "--cache_latents", "--log_with=tensorboard",
                  "--logging_dir=" + (work_ / "logs").string(), "--log_prefix=dog-",
                  "--log_tracker_name=dog_lora", "--ip_noise_gamma=0.1", "--clip_skip=1", "--ip_noise_gamma_random_strength",
                  "--debiased_estimation_loss",
                  // kohya_ss's GUI passes kohya's flags at their defaults, and a few that change
                  // nothing here: all taken.
                  "--ddp_timeout=30", "--full_bf16", "--dynamo_backend=no", "--lr_scheduler_args",
                  "--deepspeed=false", "--v2=false", "--fp8_base=false",
                  // ModelSpec, and states kept by their own count.
                  "--metadata_title=Dog", "--metadata_author=me", "--metadata_tags=dog,photo",
                  "--metadata_trigger_phrase=sks dog",
                  "--metadata_thumbnail=" + (work_ / "thumb.png").string(), "--save_state",
                  "--save_last_n_steps_state=4", "--initial_step=0", "--console_log_level=warning"});
  ASSERT_EQ(r.exit, 0) << r.err;
  EXPECT_NE(r.err.find("--full_bf16=true has no effect in lorapipe"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("trainer] saved"), std::string::npos) << "--console_log_level=warning";
  EXPECT_TRUE(fs::exists(work_ / "lora" / "tiny.safetensors"));
  EXPECT_TRUE(fs::exists(work_ / "lora" / "tiny-step00000004.safetensors"));
  // kohya's rule: at step s, the save of step s - N - 1 (rounded down to a save step) goes, so at
  // the end (step 6) the step-2 save is removed and the step-4 one kept.
  EXPECT_FALSE(fs::exists(work_ / "lora" / "tiny-step00000002.safetensors"))
      << "--save_last_n_steps=2 keeps only the saves of the last 2 steps";
  EXPECT_FALSE(fs::exists(work_ / "lora" / "tiny-step00000006.safetensors"))
      << "the last step is the final save";
  // --save_last_n_steps_state=4 keeps the step-2 state that --save_last_n_steps=2 would remove.
  EXPECT_TRUE(fs::exists(work_ / "state" / "tiny-step00000002-state"));
  EXPECT_TRUE(fs::exists(work_ / "state" / "tiny-step00000004-state"));
  EXPECT_TRUE(fs::exists(work_ / "state" / "tiny-state"));
  // kohya's sai_model_spec: the title is the same on every save, the flags' fields are added,
  // a thumbnail file becomes a data: URL.
  for (const char* name : {"tiny.safetensors", "tiny-step00000004.safetensors"}) {
    const auto meta = models::SafetensorsFile::open(work_ / "lora" / name).metadata();
    EXPECT_EQ(meta.at("modelspec.title"), "Dog") << name;
    EXPECT_EQ(meta.at("modelspec.author"), "me") << name;
    EXPECT_EQ(meta.at("modelspec.tags"), "dog,photo") << name;
    EXPECT_EQ(meta.at("modelspec.trigger_phrase"), "sks dog") << name;
    EXPECT_EQ(meta.at("modelspec.thumbnail"), "data:image/png;base64,YWJjZA==") << name;
    EXPECT_EQ(meta.at("modelspec.sai_model_spec"), "1.0.1") << name;
    EXPECT_EQ(meta.at("modelspec.encoder_layer"), "1") << name << ": kohya's, --clip_skip given";
  }
  // kohya's layout: LOGGING_DIR/<log_prefix><%Y%m%d%H%M%S>/<log_tracker_name>/events..., the
  // tracker's folder network_train by default.
  auto events_under = [](const fs::path& logs, const std::string& prefix,
                         const std::string& tracker) {
    bool events = false;
    for (const auto& run_dir : fs::directory_iterator(logs)) {
      EXPECT_TRUE(std::regex_match(run_dir.path().filename().string(),
                                   std::regex(prefix + "[0-9]{14}")))
          << run_dir.path();
      for (const auto& f : fs::directory_iterator(run_dir.path() / tracker)) {
        events |= f.path().filename().string().starts_with("events.out.tfevents.");
      }
    }
    return events;
  };
  EXPECT_TRUE(events_under(work_ / "logs", "dog-", "dog_lora"));
  EXPECT_FALSE(fs::exists(work_ / "tensorboard"));
  // (And kohya's --text_encoder_lr=0: the text encoder's LoRA stays as it starts, its up
  // matrices zero, while the U-Net's learns.)
  const TrainRun plain =
      run(work_ / "plain", {"--max_train_steps=2", "--text_encoder_lr=0",
                            "--logging_dir=" + (work_ / "plain-logs").string()});
  ASSERT_EQ(plain.exit, 0) << plain.err;
  EXPECT_TRUE(events_under(work_ / "plain-logs", "", "network_train"));
  double te_moved = 0, unet_moved = 0;
  for (const auto& [name, t] : lora(work_ / "plain" / "lora" / "tiny.safetensors")) {
    if (!name.ends_with(".lora_up.weight")) continue;
    double& moved = name.starts_with("lora_te_") ? te_moved : unet_moved;
    moved = std::max(moved, t.abs().max().item<double>());
  }
  EXPECT_EQ(te_moved, 0.0) << "the text encoder's LoRA trained at rate 0";
  EXPECT_GT(unet_moved, 0.0);
}

// Gradient accumulation stops at the end of each epoch (accelerate syncs at the end of kohya's
// dataloader), so an epoch is ceil(batches / accumulation) steps and ends on a step: with an
// accumulation that does not divide the batches, every epoch save still happens. And
// --save_last_n_epochs keeps the last N epoch saves, spaced --save_every_n_epochs apart. On the
// first 25 images once each (five epochs of the whole demo set would be 1800 samples).
TEST_F(TrainRunTest, EpochsEndOnStepsUnderAccumulationAndKeepTheLastEpochSaves) {
  const fs::path cache = work_ / "cache";
  add_manifest(cache, "some", [](wire::Manifest& m) { keep_images(m, 25); });
  auto run = [&](const fs::path& out, std::vector<std::string> extra) {
    return run_on(cache, "some", out, std::move(extra));
  };
  const TrainRun probe = run(work_ / "probe", {"--max_train_steps=1", "--train_batch_size=2"});
  ASSERT_EQ(probe.exit, 0) << probe.err;
  const std::string probe_log = probe.out + probe.err;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(probe_log, m, std::regex(R"((\d+) batches and)"))) << probe_log;
  const int batches = std::stoi(m[1]);
  int accumulation = 2;
  while (batches % accumulation == 0) ++accumulation;
  const int steps_per_epoch = (batches + accumulation - 1) / accumulation;

  const TrainRun r =
      run(work_, {"--train_batch_size=2", "--max_train_epochs=5",
                  "--gradient_accumulation_steps=" + std::to_string(accumulation),
                  "--save_every_n_epochs=2", "--save_last_n_epochs=2"});
  ASSERT_EQ(r.exit, 0) << r.err;
  const std::string log = r.out + r.err;
  ASSERT_TRUE(std::regex_search(log, m, std::regex(R"((\d+) steps per epoch; (\d+) steps in all)")))
      << log;
  EXPECT_EQ(std::stoi(m[1]), steps_per_epoch) << batches << " batches, accumulation " << accumulation;
  std::printf("[epochs] %d batches, accumulation %d: %d steps per epoch\n", batches, accumulation,
              steps_per_epoch);
  EXPECT_EQ(std::stoi(m[2]), 5 * steps_per_epoch);
  // Saves at epochs 2 and 4, both kept: saving 4 drops only 4 - 2 * 2 = 0 (dropping 4 - 2 would
  // keep one save, not two). Epoch 5 is the final save.
  const fs::path lora = work_ / "lora";
  EXPECT_TRUE(fs::exists(lora / "tiny-000002.safetensors")) << "one of the last 2 epoch saves";
  EXPECT_TRUE(fs::exists(lora / "tiny-000004.safetensors")) << log;
  EXPECT_FALSE(fs::exists(lora / "tiny-000005.safetensors")) << "the last epoch is the final save";
  EXPECT_TRUE(fs::exists(lora / "tiny.safetensors"));

  // TensorBoard, read by its own loader: kohya's tags, and loss/epoch_average once per epoch.
  const nlohmann::json read = tensorboard_events(work_);
  std::map<std::string, std::vector<int64_t>> steps;
  for (const auto& scalar : read["scalars"]) {
    steps[scalar["tag"].get<std::string>()].push_back(scalar["step"].get<int64_t>());
  }
  for (const char* tag : {"loss/current", "loss/average", "lr/unet", "lr/textencoder",
                          "time/s_per_it", "time/data_wait_ms", "memory/peak_allocated_bytes",
                          "memory/peak_rss_bytes"}) {
    EXPECT_EQ(steps[tag].size(), static_cast<size_t>(5 * steps_per_epoch)) << tag;
  }
  // On the CPU the peak is the allocated tensors', as on CUDA: the tiny model's weights and the
  // step's tensors at the least, and well under the process's resident set (LibTorch's code and
  // the heap alone are tens of MiB).
  double allocated = 0, rss = 0;
  for (const auto& scalar : read["scalars"]) {
    if (scalar["tag"] == "memory/peak_allocated_bytes") allocated = scalar["value"];
    if (scalar["tag"] == "memory/peak_rss_bytes") rss = scalar["value"];
  }
  EXPECT_GT(allocated, 1 << 20);
  EXPECT_LT(allocated, 0.5 * rss);
  EXPECT_EQ(steps["loss/epoch_average"], (std::vector<int64_t>{1, 2, 3, 4, 5}));
}

// loss/average is kohya's LossRecorder over the run's own losses: the mean so far through the
// first epoch, then a window of one epoch in which each batch position's loss replaces the one
// of the epoch before (never reset at an epoch's start). Rebuilt here from loss/current (one
// micro-batch a step); TensorBoard keeps float32, hence 1e-5 relative.
TEST_F(TrainRunTest, AverageLossMovesAsKohyas) {
  // The first 40 images once each: epochs of about ten steps (the whole set's are 90).
  const fs::path cache = work_ / "cache";
  add_manifest(cache, "some", [](wire::Manifest& m) { keep_images(m, 40); });
  const TrainRun r = run_on(cache, "some", work_, {"--train_batch_size=4", "--max_train_epochs=2"});
  ASSERT_EQ(r.exit, 0) << r.err;
  const nlohmann::json read = tensorboard_events(work_);
  std::map<int64_t, double> current, average;
  for (const auto& scalar : read["scalars"]) {
    if (scalar["tag"] == "loss/current") current[scalar["step"]] = scalar["value"];
    if (scalar["tag"] == "loss/average") average[scalar["step"]] = scalar["value"];
  }
  ASSERT_EQ(current.size(), average.size());
  ASSERT_EQ(current.size() % 2, 0u) << "two epochs of equal length";
  const int64_t steps_per_epoch = static_cast<int64_t>(current.size() / 2);
  ASSERT_GT(steps_per_epoch, 1);
  // kohya's window, computed here on its own terms rather than with trainer::LossRecorder: at
  // each step, the mean of the last min(step, steps per epoch) losses.
  std::vector<double> seen;
  for (const auto& [step, loss] : current) {
    seen.push_back(loss);
    const size_t window = std::min<size_t>(seen.size(), static_cast<size_t>(steps_per_epoch));
    double sum = 0;
    for (size_t i = seen.size() - window; i < seen.size(); ++i) sum += seen[i];
    const double expected = sum / static_cast<double>(window);
    EXPECT_NEAR(average.at(step), expected, 1e-5 * expected) << "step " << step;
  }
}

// kohya's --learning_rate defaults to 2e-6: a command that gives --unet_lr alone trains the text
// encoder at that rate there, and so here (lorapipe's own default, 1e-4, would train it 50 times
// faster). TensorBoard keeps float32, hence 1e-6 relative.
TEST_F(TrainRunTest, UnetLrAloneTrainsTheTextEncoderAtKohyasDefaultRate) {
  std::vector<std::string> a = args(work_, {"--max_train_steps=2", "--unet_lr=1e-3"});
  a.erase(std::find(a.begin(), a.end(), std::string("--learning_rate=1e-3")));
  ASSERT_EQ(wait_exit(spawn(a, work_ / "out", work_ / "err")), 0) << read_text(work_ / "err");
  EXPECT_NE(read_text(work_ / "err").find("the text encoders train at kohya's default "
                                          "--learning_rate, 2e-6"),
            std::string::npos)
      << read_text(work_ / "err");
  std::map<std::string, int> seen;
  const nlohmann::json read = tensorboard_events(work_);  // alive through the loop
  for (const auto& scalar : read["scalars"]) {
    const std::string tag = scalar["tag"];
    const double want = tag == "lr/unet" ? 1e-3 : tag == "lr/textencoder" ? 2e-6 : -1;
    if (want < 0) continue;
    EXPECT_NEAR(scalar["value"].get<double>(), want, 1e-6 * want) << tag;
    ++seen[tag];
  }
  EXPECT_EQ(seen["lr/unet"], 2);
  EXPECT_EQ(seen["lr/textencoder"], 2);
  // The metadata as kohya writes it for that command: its default rate, no text-encoder rate.
  const auto meta = models::SafetensorsFile::open(work_ / "lora" / "tiny.safetensors").metadata();
  EXPECT_EQ(meta.at("ss_learning_rate"), "2e-06");
  EXPECT_EQ(meta.at("ss_text_encoder_lr"), "None");
  EXPECT_EQ(meta.at("ss_unet_lr"), "0.001");
}

// The newer schedules kohya takes, driven by their flags: warmup_stable_decay with its warmup as
// kohya's percentage, its decay steps, floor and decay shape (--lr_scheduler_args). The rate TensorBoard records at each step
// is the schedule's (trainer/lr_schedule.cpp, which TrainLrSchedule checks against
// transformers) times --learning_rate; TensorBoard keeps float32, hence 1e-6 relative.
TEST_F(TrainRunTest, LrSchedulesFollowTheirFlags) {
  const TrainRun r = run(work_, {"--max_train_steps=10", "--learning_rate=1e-3",
                                 "--lr_scheduler=warmup_stable_decay", "--lr_warmup_steps=20%",
                                 "--lr_decay_steps=0.4", "--lr_scheduler_min_lr_ratio=0.1",
                                 "--lr_scheduler_args", "decay_type='linear'"});
  ASSERT_EQ(r.exit, 0) << r.err;
  const nlohmann::json read = tensorboard_events(work_);
  trainer::LrScheduleOptions schedule;
  schedule.name = "warmup_stable_decay";
  schedule.warmup_steps = 2;
  schedule.training_steps = 10;
  schedule.decay_steps = 0.4;
  schedule.min_lr_ratio = 0.1;
  schedule.decay_type = "linear";
  int seen = 0;
  for (const auto& scalar : read["scalars"]) {
    if (scalar["tag"] != "lr/unet") continue;
    const int64_t step = scalar["step"].get<int64_t>();
    const double want = 1e-3 * trainer::lr_multiplier(schedule, step - 1);
    EXPECT_NEAR(scalar["value"].get<double>(), want, 1e-6 * want + 1e-12) << "step " << step;
    ++seen;
  }
  EXPECT_EQ(seen, 10);
  // kohya writes --lr_warmup_steps as its int_or_float read it: 20% is 0.2.
  EXPECT_EQ(models::SafetensorsFile::open(work_ / "lora" / "tiny.safetensors")
                .metadata()
                .at("ss_lr_warmup_steps"),
            "0.2");
}

// kohya's --max_token_length: text cached at 75 tokens is other text (encoded online instead),
// the denoiser attends to kohya's chunked states, and the file says so as kohya's does. Two
// lengths, both encoded online from the same seed, must train differently (152 against 227
// states): were the length lost on the way to the tokenizer, both would be 77 and bit-identical.
TEST_F(TrainRunTest, MaxTokenLengthEncodesCaptionsInKohyasChunks) {
  const TrainRun plain =
      run(work_ / "plain", {"--max_train_steps=2", "--network_train_unet_only"});
  ASSERT_EQ(plain.exit, 0) << plain.err;
  EXPECT_NE(plain.err.find("text from the cache"), std::string::npos) << plain.err;
  for (const char* length : {"150", "225"}) {
    const TrainRun r = run(work_ / length, {"--max_train_steps=2", "--network_train_unet_only",
                                            std::string("--max_token_length=") + length});
    ASSERT_EQ(r.exit, 0) << r.err;
    EXPECT_NE(r.err.find("max_token_length or T5 setting: captions are encoded online"),
              std::string::npos)
        << r.err;
    EXPECT_EQ(models::SafetensorsFile::open(work_ / length / "lora" / "tiny.safetensors")
                  .metadata()
                  .at("ss_max_token_length"),
              length);
  }
  EXPECT_EQ(models::SafetensorsFile::open(work_ / "plain" / "lora" / "tiny.safetensors")
                .metadata()
                .at("ss_max_token_length"),
            "None");
  const auto x = lora(work_ / "150" / "lora" / "tiny.safetensors");
  const auto y = lora(work_ / "225" / "lora" / "tiny.safetensors");
  double largest = 0;
  for (const auto& [name, t] : x) largest = std::max(largest, (t - y.at(name)).abs().max().item<double>());
  EXPECT_GT(largest, 0) << "150 and 225 tokens trained alike: the length never reached the encoder";
}

// --scale_weight_norms bounds every module of the saved LoRA: its update up @ down * alpha / rank
// (a 3x3 conv's down convolved by up) is no longer than the bound in Frobenius norm. The rate is
// high enough that updates outgrow the bound within the run, so some modules sit on it. With
// --zero_terminal_snr and --v_parameterization too (the pairing kohya expects), both written to
// the metadata as kohya writes them.
TEST_F(TrainRunTest, MaxNormBoundsEverySavedModule) {
  constexpr double kBound = 0.02;
  const TrainRun r = run(work_ / "bounded",
                         {"--max_train_steps=6", "--learning_rate=2e-2", "--zero_terminal_snr",
                          "--v_parameterization", "--scale_weight_norms=" + std::to_string(kBound),
                          "--network_args", "conv_dim=2", "conv_alpha=1"});
  ASSERT_EQ(r.exit, 0) << r.err;
  const fs::path file = work_ / "bounded" / "lora" / "tiny.safetensors";
  const auto tensors = lora(file);
  double largest = 0;
  int modules = 0, convs = 0;
  for (const auto& [key, down] : tensors) {
    if (!key.ends_with(".lora_down.weight")) continue;
    const std::string name = key.substr(0, key.size() - std::string(".lora_down.weight").size());
    const torch::Tensor up = tensors.at(name + ".lora_up.weight").to(torch::kFloat64);
    const torch::Tensor d = down.to(torch::kFloat64);
    torch::Tensor update = d.dim() == 4 && d.size(2) > 1
                               ? torch::conv2d(d.transpose(0, 1), up).transpose(0, 1)
                               : up.flatten(1).matmul(d.flatten(1));
    update = update * tensors.at(name + ".alpha").item<double>() / static_cast<double>(d.size(0));
    const double norm = update.norm().item<double>();
    // fp32 rounding of the scaled tensors: a few ulps of the bound.
    EXPECT_LE(norm, kBound * (1 + 1e-5)) << name;
    largest = std::max(largest, norm);
    ++modules;
    convs += d.dim() == 4 && d.size(2) > 1;
  }
  EXPECT_GT(convs, 0) << "no LoCon 3x3 module in the file";
  std::printf("[max-norm] largest of %d module norms %.6g (bound %g)\n", modules, largest, kBound);
  // The clamped modules are scaled to the bound exactly, up to fp32 rounding of a few ulps (about
  // 1e-7 of it); 1e-4 leaves room for that and still tells a bound reached from one never met.
  EXPECT_GT(largest, kBound * (1 - 1e-4)) << "no module reached the bound: the test shows nothing";
  // What each pass reported, under kohya's tags, must agree with itself: a scaled module sits on
  // the bound afterwards, so the mean norm is at least bound * scaled / modules, and it is the
  // bound itself exactly when every module was scaled (this rate scales them all from step 1).
  // The last pass's largest norm is the file's. TensorBoard keeps float32: 1e-5 relative.
  const nlohmann::json events = tensorboard_events(work_ / "bounded");
  std::map<int, std::map<std::string, double>> passes;  // step -> tag -> value
  for (const auto& scalar : events["scalars"]) {
    const std::string tag = scalar["tag"].get<std::string>();
    if (tag.starts_with("max_norm/") || tag == "norm/avg_key_norm") {
      passes[scalar["step"].get<int>()][tag.substr(tag.find('/') + 1)] =
          scalar["value"].get<double>();
    }
  }
  ASSERT_EQ(passes.size(), 6u) << "one pass per step";
  for (auto& [step, pass] : passes) {
    const double scaled = pass["keys_scaled"], mean = pass["avg_key_norm"];
    EXPECT_GE(scaled, 1) << "step " << step;
    EXPECT_LE(scaled, modules) << "step " << step;
    EXPECT_GE(mean, kBound * scaled / modules * (1 - 1e-5)) << "step " << step;
    EXPECT_EQ(scaled == modules, mean >= kBound * (1 - 1e-5))
        << "step " << step << ": " << scaled << " of " << modules << " scaled, mean " << mean;
    EXPECT_LE(mean, pass["max_key_norm"] * (1 + 1e-5)) << "step " << step;
  }
  EXPECT_NEAR(passes.rbegin()->second["max_key_norm"], largest, largest * 1e-5);
  const auto meta = models::SafetensorsFile::open(file).metadata();
  EXPECT_EQ(meta.at("ss_scale_weight_norms"), "0.02");
  EXPECT_EQ(meta.at("ss_zero_terminal_snr"), "True");
}

// kohya weighs the validation loss as the training loss. Before the first step the LoRA's up is
// zero, so both runs see the same model and the same per-timestep losses; min-SNR (gamma 1)
// weighs t = 200 (SNR above 1) by 1 / SNR and leaves 400, 600 and 800 (SNR below 1) at 1.
TEST_F(TrainRunTest, ValidationLossIsWeighedAsTheTrainingLoss) {
  const std::vector<std::string> common{"--max_train_steps=1", "--validation_split=0.25",
                                        "--validation_seed=5", "--train_batch_size=2"};
  auto start_loss = [&](const std::string& tag, std::vector<std::string> extra) {
    extra.insert(extra.end(), common.begin(), common.end());
    const TrainRun r = run(work_ / tag, extra);
    EXPECT_EQ(r.exit, 0) << r.err;
    std::smatch m;
    EXPECT_TRUE(std::regex_search(r.out, m, std::regex(R"(validation loss: ([0-9.]+) at the start)")))
        << r.out;
    return m.empty() ? -1.0 : std::stod(m[1]);
  };
  const double plain = start_loss("plain", {});
  const double weighted = start_loss("min_snr", {"--min_snr_gamma=1"});
  const double snr200 = models::DdpmNoiseSchedule(models::model_family("sd15").schedule)
                            .snr(torch::tensor({int64_t{200}}))
                            .item<double>();
  ASSERT_GT(snr200, 1);
  std::printf("[validation] plain %.6f, min-SNR 1 %.6f (t=200 weighed by %.4f)\n", plain, weighted,
              1 / snr200);
  EXPECT_LT(weighted, plain);
  EXPECT_GT(weighted, plain / snr200);
}

// kohya validates at the end of every epoch (every N with --validate_every_n_epochs; the last
// epoch's is the run's final validation) and every --validate_every_n_steps;
// --max_validation_steps takes the first N batches' worth of held-out images alone, which changes
// the loss the start reports; the validation noise is drawn as training's (noise offset too).
TEST_F(TrainRunTest, ValidationRunsEveryEpochAndOnTheFirstItemsAsKohya) {
  // Most images held out keeps the epochs short; two batches of held-out images keep validation
  // cheap.
  const std::vector<std::string> common{"--validation_split=0.9", "--validation_seed=5",
                                        "--train_batch_size=4", "--max_validation_steps=2"};
  auto logged = [&](const std::string& tag, const std::vector<std::string>& extra) {
    std::vector<std::string> flags = common;  // then extra, which wins
    flags.insert(flags.end(), extra.begin(), extra.end());
    const TrainRun r = run(work_ / tag, flags);
    EXPECT_EQ(r.exit, 0) << r.err;
    return r.err + r.out;
  };
  const std::string every = logged("every", {"--max_train_epochs=3"});
  for (const char* epoch : {"1", "2", "3"}) {  // the last one is the run's final validation
    EXPECT_NE(every.find(std::string("validation loss at the end of epoch ") + epoch + ":"),
              std::string::npos)
        << every;
  }
  // --validate_every_n_steps: at every Nth step, as kohya. (Step 0 and the last step are the
  // run's start and end, which validate anyway.)
  const std::string stepwise =
      logged("steps", {"--max_train_steps=5", "--validate_every_n_steps=2"});
  for (const char* step : {"2", "4"}) {
    EXPECT_NE(stepwise.find(std::string("validation loss at step ") + step + ":"),
              std::string::npos)
        << stepwise;
  }
  for (const char* step : {"1", "3"}) {
    EXPECT_EQ(stepwise.find(std::string("validation loss at step ") + step + ":"),
              std::string::npos)
        << stepwise;
  }
  // Under kohya's tags: step_average at those steps (and at the run's start and end), each
  // step's divergence its average less loss/average's at that step (none at the start, before
  // any training loss); epoch_average and its divergence at each epoch's end, the last epoch's
  // average loss written where --max_train_steps cut it. TensorBoard keeps float32: 1e-5.
  auto tags = [this](const std::string& run) {
    std::map<std::string, std::map<int64_t, double>> out;
    const nlohmann::json read = tensorboard_events(work_ / run);  // alive through the loop
    for (const auto& scalar : read["scalars"]) {
      out[scalar["tag"].get<std::string>()][scalar["step"].get<int64_t>()] =
          scalar["value"].get<double>();
    }
    return out;
  };
  auto steps_of = [](const std::map<int64_t, double>& series) {
    std::vector<int64_t> out;
    for (const auto& [step, value] : series) out.push_back(step);
    return out;
  };
  auto at_steps = tags("steps");
  EXPECT_EQ(steps_of(at_steps["loss/validation/step_average"]),
            (std::vector<int64_t>{0, 2, 4, 5}));
  EXPECT_EQ(steps_of(at_steps["loss/validation/step_divergence"]),
            (std::vector<int64_t>{2, 4, 5}));
  for (const auto& [step, divergence] : at_steps["loss/validation/step_divergence"]) {
    const double want =
        at_steps["loss/validation/step_average"][step] - at_steps["loss/average"][step];
    EXPECT_NEAR(divergence, want, 1e-5 * std::abs(want) + 1e-6) << "step " << step;
  }
  const auto steps_meta =
      models::SafetensorsFile::open(work_ / "steps" / "lora" / "tiny.safetensors").metadata();
  const int64_t last_epoch = std::stoll(steps_meta.at("ss_epoch"));
  EXPECT_NE(5 % std::stoll(steps_meta.at("ss_num_batches_per_epoch")), 0)
      << "the 5 steps must cut their last epoch for the test to show its average";
  ASSERT_FALSE(at_steps["loss/epoch_average"].empty());
  EXPECT_EQ(at_steps["loss/epoch_average"].rbegin()->first, last_epoch);
  auto by_epoch = tags("every");
  EXPECT_EQ(steps_of(by_epoch["loss/validation/epoch_average"]), (std::vector<int64_t>{1, 2, 3}));
  EXPECT_EQ(steps_of(by_epoch["loss/validation/epoch_divergence"]),
            (std::vector<int64_t>{1, 2, 3}));
  const std::string second = logged("second", {"--max_train_epochs=3", "--validate_every_n_epochs=2"});
  EXPECT_EQ(second.find("validation loss at the end of epoch 1:"), std::string::npos) << second;
  EXPECT_NE(second.find("validation loss at the end of epoch 2:"), std::string::npos) << second;
  EXPECT_EQ(second.find("validation loss at the end of epoch 3:"), std::string::npos) << second;

  auto start = [](const std::string& log) {
    std::smatch m;
    return std::regex_search(log, m, std::regex(R"(validation loss: ([0-9.]+) at the start)"))
               ? std::stod(m[1])
               : -1.0;
  };
  const std::string first = logged("first", {"--max_train_steps=1", "--max_validation_steps=1"});
  ASSERT_GT(start(every), 0) << every;
  ASSERT_GT(start(first), 0) << first;
  EXPECT_NE(start(first), start(every)) << "one batch of held-out images of two weighs differently";
  // kohya validates through its training's noise: --noise_offset moves the validation loss.
  const std::string offset =
      logged("offset", {"--max_train_steps=1", "--max_validation_steps=1", "--noise_offset=0.5"});
  ASSERT_GT(start(offset), 0) << offset;
  EXPECT_NE(start(offset), start(first)) << "--noise_offset left the validation noise alone";
}

// kohya's --prior_loss_weight weighs the loss of regularization images: at 0, a step on a reg
// image (batches of 1) has loss 0 and a step on a training image does not; at 1 none is 0. Two
// training images and two reg images (kohya balances reg images to the training count) make an
// epoch of four steps, two of them on reg images. The file records the weight as kohya does.
TEST_F(TrainRunTest, PriorLossWeightWeighsRegularizationImages) {
  const fs::path cache = work_ / "cache";
  add_manifest(cache, "reg", [](wire::Manifest& m) {
    keep_images(m, 4);
    m.mutable_entries(2)->set_is_reg(true);
    m.mutable_entries(3)->set_is_reg(true);
  });
  auto zero_losses = [&](const std::string& tag, const std::string& weight) {
    fs::create_directories(work_ / tag);
    std::vector<std::string> a = args(work_ / tag, {"--max_train_steps=4", "--train_batch_size=1",
                                                    "--prior_loss_weight=" + weight});
    a[2] = "--cache_dir=" + cache.string();
    a[3] = "--dataset_id=reg";
    EXPECT_EQ(wait_exit(spawn(a, work_ / tag / "out", work_ / tag / "err")), 0)
        << read_text(work_ / tag / "err");
    const std::vector<double> losses = tensorboard_losses(work_ / tag);
    EXPECT_EQ(losses.size(), 4u) << tag;
    return std::count(losses.begin(), losses.end(), 0.0);
  };
  EXPECT_EQ(zero_losses("zero", "0"), 2);
  EXPECT_EQ(zero_losses("one", "1"), 0);
  const auto meta =
      models::SafetensorsFile::open(work_ / "zero" / "lora" / "tiny.safetensors").metadata();
  EXPECT_EQ(meta.at("ss_prior_loss_weight"), "0.0");
}

// kohya's --save_n_epoch_ratio=N saves every max(1, floor(epochs / N)) epochs: three images at
// batch 1 are 3 steps an epoch, 6 epochs at ratio 3 save at epochs 2 and 4 (6 is the final save).
TEST_F(TrainRunTest, SaveNEpochRatioSavesAsKohya) {
  const fs::path cache = work_ / "cache";
  add_manifest(cache, "three", [](wire::Manifest& m) { keep_images(m, 3); });
  std::vector<std::string> a = args(work_, {"--max_train_epochs=6", "--train_batch_size=1",
                                            "--save_n_epoch_ratio=3"});
  a[2] = "--cache_dir=" + cache.string();
  a[3] = "--dataset_id=three";
  const pid_t pid = spawn(a, work_ / "out", work_ / "err");
  ASSERT_EQ(wait_exit(pid), 0) << read_text(work_ / "err");
  const fs::path lora = work_ / "lora";
  EXPECT_TRUE(fs::exists(lora / "tiny-000002.safetensors")) << read_text(work_ / "err");
  EXPECT_FALSE(fs::exists(lora / "tiny-000003.safetensors"));
  EXPECT_TRUE(fs::exists(lora / "tiny-000004.safetensors"));
  EXPECT_FALSE(fs::exists(lora / "tiny-000006.safetensors")) << "the last epoch is the final save";
  EXPECT_TRUE(fs::exists(lora / "tiny.safetensors"));
  EXPECT_NE(read_text(work_ / "err").find("a LoRA every 2 epochs of 6"), std::string::npos);
}

// Without --output_name kohya names each kind of save apart (train_util's get_*_ckpt_name): step
// saves at-stepNNNNNNNN, epoch saves epoch-NNNNNN, the final save last; each state is its save's
// name and -state. The metadata says no name was given (ss_output_name None, a title of
// "LoRA@" and the time, as kohya's sai_model_spec writes it).
TEST_F(TrainRunTest, WithoutOutputNameSavesAreNamedAsKohyaNamesThem) {
  const fs::path cache = work_ / "cache";
  add_manifest(cache, "three", [](wire::Manifest& m) { keep_images(m, 3); });
  std::vector<std::string> a = args(work_, {"--max_train_epochs=2", "--train_batch_size=1",
                                            "--save_every_n_epochs=1", "--save_every_n_steps=2",
                                            "--save_state"});
  a[2] = "--cache_dir=" + cache.string();
  a[3] = "--dataset_id=three";
  a.erase(std::find(a.begin(), a.end(), "--output_name=tiny"));
  const pid_t pid = spawn(a, work_ / "out", work_ / "err");
  ASSERT_EQ(wait_exit(pid), 0) << read_text(work_ / "err");
  // Three steps an epoch, six in all: steps 2 and 4, epoch 1 (step 3), and the final save.
  std::set<std::string> loras, states;
  for (const auto& f : fs::directory_iterator(work_ / "lora")) {
    if (f.is_regular_file()) loras.insert(f.path().filename().string());
  }
  for (const auto& f : fs::directory_iterator(work_ / "state")) {
    states.insert(f.path().filename().string());
  }
  EXPECT_EQ(loras, (std::set<std::string>{"at-step00000002.safetensors",
                                          "at-step00000004.safetensors",
                                          "epoch-000001.safetensors", "last.safetensors"}));
  EXPECT_EQ(states, (std::set<std::string>{"at-step00000002-state", "at-step00000004-state",
                                           "epoch-000001-state", "last-state"}));
  const auto meta = models::SafetensorsFile::open(work_ / "lora" / "last.safetensors").metadata();
  EXPECT_EQ(meta.at("ss_output_name"), "None");
  // ss_epoch as kohya's save_model is given it: a step save the epoch its loop counts from 0, an
  // epoch save and the last the epochs done. The session id is kohya's random.randint(0, 2**32),
  // one per run.
  auto epoch_of = [this](const char* file) {
    return models::SafetensorsFile::open(work_ / "lora" / file).metadata().at("ss_epoch");
  };
  EXPECT_EQ(epoch_of("at-step00000002.safetensors"), "0");
  EXPECT_EQ(epoch_of("at-step00000004.safetensors"), "1");
  EXPECT_EQ(epoch_of("epoch-000001.safetensors"), "1");
  EXPECT_EQ(meta.at("ss_epoch"), "2");
  EXPECT_TRUE(std::regex_match(meta.at("ss_session_id"), std::regex("[0-9]+"))) << meta.at("ss_session_id");
  EXPECT_LE(std::stoull(meta.at("ss_session_id")), uint64_t{1} << 32);
  EXPECT_EQ(models::SafetensorsFile::open(work_ / "lora" / "at-step00000002.safetensors")
                .metadata()
                .at("ss_session_id"),
            meta.at("ss_session_id"));
  EXPECT_EQ(meta.at("ss_lr_warmup_steps"), "0");
  EXPECT_TRUE(std::regex_match(meta.at("modelspec.title"), std::regex("LoRA@[0-9]+\\.[0-9]+")))
      << meta.at("modelspec.title");
}

// --weighted_captions reads the A1111 attention syntax in captions. Three copies of the demo
// manifest, each caption led by "glossy": as plain text, as "(glossy:1.0)" and as "(glossy:1.5)".
// Weighted at 1.0 the run is the plain one bit for bit (the same ids, every state times 1); at
// 1.5 it trains another LoRA. Without the flag "(glossy:1.5)" would be tokenized as text.
TEST_F(TrainRunTest, WeightedCaptionsWeighTheirTokens) {
  const fs::path cache = work_ / "cache";
  fs::copy(dir_ / "cache", cache, fs::copy_options::recursive);
  {
    cacher::StoreOptions o;
    o.dir = cache;
    cacher::Store store = cacher::Store::open(o);
    wire::Manifest manifest;
    ASSERT_TRUE(manifest.ParseFromString(*store.get(cacher::Table::kManifests, kDataset)));
    std::vector<std::pair<std::string, std::string>> records;
    for (const auto& [id, prefix] : std::vector<std::pair<std::string, std::string>>{
             {"plain", "glossy "}, {"one", "(glossy:1.0) "}, {"more", "(glossy:1.5) "},
             {"broken", "(glossy:1.2.3) "}}) {
      wire::Manifest m = manifest;
      for (auto& e : *m.mutable_entries()) e.set_caption(prefix + e.caption());
      records.emplace_back(id, m.SerializeAsString());
    }
    store.put(cacher::Table::kManifests, records);
  }
  auto train = [&](const std::string& id, bool weighted, int expected_exit = 0) {
    std::vector<std::string> a = args(work_ / id, {"--max_train_steps=3"});
    a[2] = "--cache_dir=" + cache.string();
    a[3] = "--dataset_id=" + id;
    if (weighted) a.push_back("--weighted_captions");
    fs::create_directories(work_ / id);
    const pid_t pid = spawn(a, work_ / id / "out", work_ / id / "err");
    EXPECT_EQ(wait_exit(pid), expected_exit) << read_text(work_ / id / "err");
    return work_ / id / "lora" / "tiny.safetensors";
  };
  const fs::path plain = train("plain", false);
  const fs::path one = train("one", true);
  const fs::path more = train("more", true);
  EXPECT_NE(read_text(work_ / "one" / "err").find("--weighted_captions: captions are encoded online"),
            std::string::npos);
  expect_identical(plain, one);
  const auto x = lora(plain), y = lora(more);
  double largest = 0;
  for (const auto& [name, t] : x) largest = std::max(largest, (t - y.at(name)).abs().max().item<double>());
  EXPECT_GT(largest, 0) << "a weight of 1.5 trained the same LoRA as 1.0";
  // A weight that is no number is refused before any compute, naming the image.
  train("broken", true, /*expected_exit=*/2);
  const std::string err = read_text(work_ / "broken" / "err");
  EXPECT_NE(err.find("--weighted_captions"), std::string::npos) << err;
  EXPECT_NE(err.find(".png"), std::string::npos) << err;
  EXPECT_FALSE(fs::exists(work_ / "broken" / "lora" / "tiny.safetensors"));
}

// Cached text made by another text encoder is not used: the trainer tries each dtype the cacher
// may have encoded in, finds none matching, and encodes online through the weights as loaded,
// fp32, not the last dtype it tried (bf16 rounds them). The run equals one whose manifest has no
// cached text at all, bit for bit.
TEST_F(TrainRunTest, TextEncodedOnlineAfterAFingerprintMismatchUsesTheLoadedWeights) {
  const fs::path cache = work_ / "cache";
  add_manifest(cache, "other",
               [](wire::Manifest& m) { m.set_text_encoder_fingerprint("another text encoder"); });
  add_manifest(cache, "online", [](wire::Manifest& m) { m.set_text_cached(false); });
  auto train = [&](const std::string& id) {
    std::vector<std::string> a =
        args(work_ / id, {"--max_train_steps=2", "--network_train_unet_only"});
    a[2] = "--cache_dir=" + cache.string();
    a[3] = "--dataset_id=" + id;
    fs::create_directories(work_ / id);
    const pid_t pid = spawn(a, work_ / id / "out", work_ / id / "err");
    EXPECT_EQ(wait_exit(pid), 0) << read_text(work_ / id / "err");
    return work_ / id / "lora" / "tiny.safetensors";
  };
  const fs::path other = train("other");
  const fs::path online = train("online");
  EXPECT_NE(read_text(work_ / "other" / "err").find("cached text was made by another text encoder"),
            std::string::npos)
      << read_text(work_ / "other" / "err");
  expect_identical(other, online);
}

// kohya's fp8 tiers cache text from float8 encoders: the cacher under --fp8_base (plain and
// scaled) keys its text by the float8 weights (another fingerprint than the fp32 cache's), and
// the trainer under the same flags finds that text rather than encoding online; without them it
// does not take it.
TEST_F(TrainRunTest, TextCachedFromFloat8EncodersIsTakenUnderTheSameFlags) {
  auto manifest_fingerprint = [](const fs::path& cache) {
    cacher::StoreOptions o;
    o.dir = cache;
    cacher::Store store = cacher::Store::open(o);
    wire::Manifest m;
    EXPECT_TRUE(m.ParseFromString(*store.get(cacher::Table::kManifests, kDataset)));
    return m.text_encoder_fingerprint();
  };
  const std::string plain = manifest_fingerprint(dir_ / "cache");
  std::set<std::string> seen{plain};
  for (const std::vector<std::string>& flags :
       std::vector<std::vector<std::string>>{{"--fp8_base"}, {"--fp8_base", "--fp8_scaled"}}) {
    const std::string tag = flags.size() == 1 ? "fp8" : "fp8-scaled";
    const fs::path cache = cache_with(tag, flags);
    EXPECT_NE(read_text(work_ / (tag + "-cacher.err")).find("float8_e4m3fn"), std::string::npos)
        << read_text(work_ / (tag + "-cacher.err"));
    EXPECT_TRUE(seen.insert(manifest_fingerprint(cache)).second) << tag << ": the same text key";
    for (const bool same : {true, false}) {
      std::vector<std::string> extra{"--max_train_steps=2", "--network_train_unet_only"};
      if (same) extra.insert(extra.end(), flags.begin(), flags.end());
      std::vector<std::string> a = args(work_ / (tag + (same ? "-same" : "-other")), extra);
      a[2] = "--cache_dir=" + cache.string();
      const fs::path out = work_ / (tag + (same ? "-same" : "-other"));
      fs::create_directories(out);
      ASSERT_EQ(wait_exit(spawn(a, out / "out", out / "err")), 0) << read_text(out / "err");
      const bool online = read_text(out / "err").find("captions are encoded online") !=
                          std::string::npos;
      EXPECT_EQ(online, !same) << tag << (same ? " with" : " without") << " its flags: "
                               << read_text(out / "err");
    }
  }
}

// A cache made in half precision (the cacher's --dtype fp16 or bf16, from the tiny model's fp32
// files) is the trainer's in fp32: it finds the VAE and the text encoder the cacher used, each
// converted once from the weights as loaded, as the cacher converted them. Converting bf16's try
// from fp16's (fp32 -> fp16 -> bf16 rounds twice) refused the VAE and ignored the text.
TEST_F(TrainRunTest, CacheMadeInHalfPrecisionIsTakenByTheTrainer) {
  for (const std::string dtype : {"fp16", "bf16"}) {
    const fs::path cache = cache_with(dtype, {"--dtype=" + dtype});
    const TrainRun r = run_on(cache, kDataset, work_ / ("train-" + dtype),
                              {"--max_train_steps=2", "--network_train_unet_only"});
    EXPECT_EQ(r.exit, 0) << dtype << ": " << r.err;
    EXPECT_EQ(r.err.find("captions are encoded online"), std::string::npos) << dtype << ": " << r.err;
  }
}

// kohya's alpha_mask masks the loss with the cache's masks (the cacher's LatentRecord.mask; the
// values are checked against kohya's interpolation in TrainParity.AlphaMasksWeighTheLossAsKohyas).
// Three copies of the demo cache: masks of ones train the unmasked run's LoRA bit for bit;
// masks of zeros leave no loss, so the LoRA's up matrices stay at their initial zeros;
// --masked_loss with no masks says so.
TEST_F(TrainRunTest, AlphaMasksMaskTheLoss) {
  auto cache_with = [&](const std::string& tag, std::optional<float> fill) {
    const fs::path cache = work_ / ("cache-" + tag);
    fs::copy(dir_ / "cache", cache, fs::copy_options::recursive);
    if (!fill) return cache;
    cacher::StoreOptions o;
    o.dir = cache;
    cacher::Store store = cacher::Store::open(o);
    std::vector<std::pair<std::string, std::string>> rewritten;
    store.for_each(cacher::Table::kLatents, [&](std::string_view key, std::string_view value) {
      wire::LatentRecord record;
      EXPECT_TRUE(record.ParseFromArray(value.data(), static_cast<int>(value.size())));
      const int64_t h = record.mean().shape(1), w = record.mean().shape(2);
      const std::vector<float> mask(static_cast<size_t>(h * w), *fill);
      wire::Tensor* t = record.mutable_mask();
      t->set_dtype(wire::Tensor::F32);
      t->add_shape(h);
      t->add_shape(w);
      t->set_data(reinterpret_cast<const char*>(mask.data()), mask.size() * sizeof(float));
      rewritten.emplace_back(std::string(key), record.SerializeAsString());
      return true;
    });
    store.put(cacher::Table::kLatents, rewritten);
    return cache;
  };
  auto train = [&](const std::string& tag, std::optional<float> fill, bool flag) {
    std::vector<std::string> a =
        args(work_ / tag, {"--max_train_steps=3", "--network_train_unet_only"});
    a[2] = "--cache_dir=" + cache_with(tag, fill).string();
    if (flag) a.push_back("--masked_loss");
    fs::create_directories(work_ / tag);
    const pid_t pid = spawn(a, work_ / tag / "out", work_ / tag / "err");
    EXPECT_EQ(wait_exit(pid), 0) << read_text(work_ / tag / "err");
    return work_ / tag / "lora" / "tiny.safetensors";
  };
  const fs::path plain = train("plain", std::nullopt, false);
  const fs::path ones = train("ones", 1.0f, true);
  const fs::path zeros = train("zeros", 0.0f, true);
  const fs::path unmasked = train("unmasked", std::nullopt, true);
  expect_identical(plain, ones);
  expect_identical(plain, unmasked);
  EXPECT_NE(read_text(work_ / "ones" / "err").find("36 of 36 images carry an alpha mask"),
            std::string::npos)
      << read_text(work_ / "ones" / "err");
  EXPECT_NE(read_text(work_ / "unmasked" / "err").find("--masked_loss: no image of manifest"),
            std::string::npos)
      << read_text(work_ / "unmasked" / "err");
  int ups = 0;
  for (const auto& [name, t] : lora(zeros)) {
    if (!name.ends_with(".lora_up.weight")) continue;
    ++ups;
    EXPECT_EQ(t.abs().max().item<float>(), 0.0f) << name << " learned from a fully masked loss";
  }
  EXPECT_GT(ups, 0);
  const auto plain_lora = lora(plain);
  double moved = 0;
  for (const auto& [name, t] : plain_lora) {
    if (name.ends_with(".lora_up.weight")) moved = std::max(moved, t.abs().max().item<double>());
  }
  EXPECT_GT(moved, 0) << "the unmasked run learns";
  EXPECT_EQ(models::SafetensorsFile::open(ones).metadata().at("ss_masked_loss"), "True");
  EXPECT_EQ(models::SafetensorsFile::open(plain).metadata().at("ss_masked_loss"), "False");
}

// kohya's process_caption runs on every micro-batch with the step it belongs to: the token
// warm-up's tag count follows the real step count across gradient accumulation and epochs that
// end mid-step, and wildcards are drawn each time. Three images, batch 1, accumulation 2: each
// epoch is 2 steps (2 micro-batches, then 1), 8 steps are 4 epochs. Captions "{sks|xyz}, t1..t7",
// one tag kept, warm-up over 0.5 of 8 steps from 1 tag: floor(done * 6 / 4) + 1 of the 7.
TEST_F(TrainRunTest, CaptionsAreDrawnPerStepAsKohya) {
  const fs::path cache = work_ / "cache";
  add_manifest(cache, "warmup", [](wire::Manifest& m) {
    m.set_text_cached(false);
    keep_images(m, 3);
    for (auto& e : *m.mutable_entries()) {
      e.clear_text_key();
      e.set_caption("{sks|xyz}, t1, t2, t3, t4, t5, t6, t7");
      wire::CaptionSettings* c = e.mutable_caption_settings();
      c->set_keep_tokens(1);
      c->set_enable_wildcard(true);
      c->set_token_warmup_min(1);
      c->set_token_warmup_step(0.5);
      c->set_caption_separator(",");
    }
  });
  std::vector<std::string> a =
      args(work_, {"--max_train_steps=8", "--train_batch_size=1", "--gradient_accumulation_steps=2",
                   "--console_log_level=debug"});
  a[2] = "--cache_dir=" + cache.string();
  a[3] = "--dataset_id=warmup";
  const pid_t pid = spawn(a, work_ / "out", work_ / "err");
  ASSERT_EQ(wait_exit(pid), 0) << read_text(work_ / "err");
  const std::string log = read_text(work_ / "err") + read_text(work_ / "out");
  const std::regex line(R"(step (\d+) \(epoch (\d+), batch (\d+)\) captions: '([^']*)')");
  std::map<int, int> micro_batches;  // per step
  std::set<std::string> kept;
  for (auto it = std::sregex_iterator(log.begin(), log.end(), line); it != std::sregex_iterator();
       ++it) {
    const int step = std::stoi((*it)[1]);
    const std::string caption = (*it)[4];
    ++micro_batches[step];
    const int done = step - 1;
    const size_t flexible = done < 4 ? static_cast<size_t>(done * 6 / 4 + 1) : 7;
    std::string expected;
    for (size_t t = 1; t <= flexible; ++t) expected += ", t" + std::to_string(t);
    const std::string first = caption.substr(0, caption.find(','));
    EXPECT_EQ(caption, first + expected) << "step " << step;
    kept.insert(first);
    EXPECT_EQ(std::stoi((*it)[2]), (step + 1) / 2) << "2 steps an epoch";
  }
  ASSERT_EQ(micro_batches.size(), 8u) << log;
  for (const auto& [step, count] : micro_batches) {
    EXPECT_EQ(count, step % 2 == 1 ? 2 : 1) << "step " << step << ": 2 micro-batches, then 1";
  }
  EXPECT_EQ(kept, (std::set<std::string>{"sks", "xyz"})) << "the wildcard drawn each time";

  // kohya's --debug_dataset prints the same batches, with the same captions, and trains nothing.
  std::vector<std::string> shown = a;
  shown[4] = "--output_dir=" + (work_ / "shown").string();
  shown.push_back("--debug_dataset");
  fs::create_directories(work_ / "shown");
  const pid_t show = spawn(shown, work_ / "shown" / "out", work_ / "shown" / "err");
  ASSERT_EQ(wait_exit(show), 0) << read_text(work_ / "shown" / "err");
  const std::string printed = read_text(work_ / "shown" / "out");
  std::vector<std::string> trained_captions, shown_captions;
  for (auto it = std::sregex_iterator(log.begin(), log.end(), line); it != std::sregex_iterator();
       ++it) {
    trained_captions.push_back((*it)[1].str() + "/" + (*it)[2].str() + "/" + (*it)[3].str() +
                               ": " + (*it)[4].str());
  }
  const std::regex step_line(
      R"(step (\d+)/8  epoch (\d+)  batch (\d+)\n  \S+  \d+x\d+  '([^']*)')");
  for (auto it = std::sregex_iterator(printed.begin(), printed.end(), step_line);
       it != std::sregex_iterator(); ++it) {
    shown_captions.push_back((*it)[1].str() + "/" + (*it)[2].str() + "/" + (*it)[3].str() +
                             ": " + (*it)[4].str());
  }
  EXPECT_EQ(shown_captions, trained_captions) << printed;
  EXPECT_NE(printed.find("--debug_dataset: 8 steps of 4 epochs shown; nothing trained"),
            std::string::npos)
      << printed;
  EXPECT_FALSE(fs::exists(work_ / "shown" / "lora")) << "nothing saved";

  // kohya's --cache_text_encoder_outputs asks for text these captions cannot be cached as:
  // refused as kohya refuses it, before the model loads, naming the dataset.
  std::vector<std::string> cached = a;
  cached[4] = "--output_dir=" + (work_ / "cached").string();
  cached.insert(cached.end(), {"--cache_text_encoder_outputs", "--network_train_unet_only"});
  fs::create_directories(work_ / "cached");
  const pid_t refused = spawn(cached, work_ / "cached" / "out", work_ / "cached" / "err");
  EXPECT_EQ(wait_exit(refused), 2);
  EXPECT_NE(read_text(work_ / "cached" / "err")
                .find("--cache_text_encoder_outputs: dataset 'warmup' draws its captions anew at "
                      "every step"),
            std::string::npos)
      << read_text(work_ / "cached" / "err");
  // Wildcards alone kohya trains from the text cached once, without them: lorapipe keeps them,
  // encoding those captions as they train, and says so (_to_disk asks the same, as in kohya).
  add_manifest(cache, "wild", [](wire::Manifest& m) {
    m.set_text_cached(false);
    keep_images(m, 2);
    for (auto& e : *m.mutable_entries()) {
      e.clear_text_key();
      e.set_caption("{sks|xyz}, t1");
      e.mutable_caption_settings()->set_enable_wildcard(true);
    }
  });
  std::vector<std::string> wild = args(work_ / "wild", {"--max_train_steps=1",
                                                        "--cache_text_encoder_outputs_to_disk",
                                                        "--network_train_unet_only"});
  wild[2] = "--cache_dir=" + cache.string();
  wild[3] = "--dataset_id=wild";
  fs::create_directories(work_ / "wild");
  const pid_t taken = spawn(wild, work_ / "wild" / "out", work_ / "wild" / "err");
  EXPECT_EQ(wait_exit(taken), 0) << read_text(work_ / "wild" / "err");
  EXPECT_NE(read_text(work_ / "wild" / "err").find("draw wildcards or caption_dropout_every_n_epochs"),
            std::string::npos)
      << read_text(work_ / "wild" / "err");
  // With a text-encoder LoRA, SD's every encoder trains: no text can come from the cache, and the
  // flag is refused as kohya refuses it (FLUX.1 caches T5 then: LauncherRun.FluxModel...).
  std::vector<std::string> trains_text = wild;
  trains_text.erase(std::find(trains_text.begin(), trains_text.end(), "--network_train_unet_only"));
  trains_text[4] = "--output_dir=" + (work_ / "trains_text").string();
  fs::create_directories(work_ / "trains_text");
  const pid_t with_lora = spawn(trains_text, work_ / "trains_text" / "out",
                                work_ / "trains_text" / "err");
  EXPECT_EQ(wait_exit(with_lora), 2);
  EXPECT_NE(read_text(work_ / "trains_text" / "err")
                .find("--cache_text_encoder_outputs with a text-encoder LoRA: cached text cannot "
                      "train Stable Diffusion 1.5's text encoders"),
            std::string::npos)
      << read_text(work_ / "trains_text" / "err");
}

// Validation captions are the captions as written: a wildcard drawn once, but no shuffle, no
// dropped tag and no dropped caption, whatever the subset draws in training (kohya validates on
// the text as it stands).
TEST_F(TrainRunTest, ValidationCaptionsDrawTheirWildcardsAndNothingElse) {
  const fs::path cache = work_ / "cache";
  add_manifest(cache, "validate", [](wire::Manifest& m) {
    m.set_text_cached(false);
    keep_images(m, 4);
    for (auto& e : *m.mutable_entries()) {
      e.clear_text_key();
      e.set_caption("{sks|xyz}, t1, t2, t3, t4");
      wire::CaptionSettings* c = e.mutable_caption_settings();
      c->set_enable_wildcard(true);
      c->set_shuffle_caption(true);
      c->set_caption_tag_dropout_rate(0.5);
      c->set_caption_dropout_rate(0.5);
      c->set_caption_separator(",");
    }
  });
  std::vector<std::string> a = args(work_, {"--max_train_steps=1", "--train_batch_size=1",
                                            "--validation_split=0.5", "--console_log_level=debug"});
  a[2] = "--cache_dir=" + cache.string();
  a[3] = "--dataset_id=validate";
  const pid_t pid = spawn(a, work_ / "out", work_ / "err");
  ASSERT_EQ(wait_exit(pid), 0) << read_text(work_ / "err");
  const std::string log = read_text(work_ / "err");
  const std::regex line(R"(validation image (\d+) caption: '([^']*)')");
  std::set<std::string> images;
  for (auto it = std::sregex_iterator(log.begin(), log.end(), line); it != std::sregex_iterator();
       ++it) {
    images.insert((*it)[1]);
    const std::string caption = (*it)[2];
    const std::string first = caption.substr(0, caption.find(','));
    EXPECT_TRUE(first == "sks" || first == "xyz") << caption;
    EXPECT_EQ(caption, first + ", t1, t2, t3, t4");
  }
  EXPECT_EQ(images.size(), 2u) << log;
}

// --network_train_text_encoder_only: kohya's network without U-Net modules; the text encoder's
// LoRA trains alone (through the frozen U-Net's loss).
TEST_F(TrainRunTest, TextEncoderOnlyTrainsTheTextEncodersLoraAlone) {
  // It continues from a LoRA of both sides, leaving the U-Net's modules out as kohya does.
  const TrainRun full = run(work_ / "full", {"--max_train_steps=2", "--learning_rate=1e-2"});
  ASSERT_EQ(full.exit, 0) << full.err;
  const TrainRun r =
      run(work_, {"--max_train_steps=2", "--learning_rate=1e-2", "--network_train_text_encoder_only",
                  "--network_weights=" + (work_ / "full" / "lora" / "tiny.safetensors").string()});
  ASSERT_EQ(r.exit, 0) << r.err;
  EXPECT_NE(r.err.find("tensors of modules this network does not train are not loaded"),
            std::string::npos)
      << r.err;
  const auto tensors = lora(work_ / "lora" / "tiny.safetensors");
  double largest_up = 0;
  for (const auto& [name, t] : tensors) {
    EXPECT_TRUE(name.starts_with("lora_te_")) << name;
    if (name.ends_with(".lora_up.weight")) largest_up = std::max(largest_up, t.abs().max().item<double>());
  }
  EXPECT_GT(tensors.size(), 0u);
  EXPECT_GT(largest_up, 0) << "the text encoder's LoRA did not train";
}

// kohya's --no_metadata keeps its minimum ss_* keys (what a loader needs to apply the file) and
// the modelspec.* keys; --save_state_on_train_end saves the final state alone; the old
// --use_lion_optimizer switch trains Lion; --console_log_file takes the log off stderr.
TEST_F(TrainRunTest, NoMetadataKeepsKohyasMinimumAndTheEndStateIsSaved) {
  const TrainRun r = run(work_, {"--max_train_steps=2", "--no_metadata", "--save_every_n_steps=1",
                                 "--save_state_on_train_end", "--use_lion_optimizer",
                                 "--console_log_file=" + (work_ / "log.txt").string()});
  ASSERT_EQ(r.exit, 0) << r.err;
  const auto meta = models::SafetensorsFile::open(work_ / "lora" / "tiny.safetensors").metadata();
  std::set<std::string> ss;
  for (const auto& [key, value] : meta) {
    if (!key.starts_with("modelspec.")) ss.insert(key);
  }
  EXPECT_EQ(ss, (std::set<std::string>{"ss_v2", "ss_base_model_version", "ss_network_module",
                                       "ss_network_dim", "ss_network_alpha", "sshs_model_hash",
                                       "sshs_legacy_hash"}));
  EXPECT_EQ(meta.at("ss_network_dim"), "4");
  EXPECT_EQ(meta.at("modelspec.title"), "tiny");
  EXPECT_TRUE(fs::exists(work_ / "state" / "tiny-state"));
  EXPECT_FALSE(fs::exists(work_ / "state" / "tiny-step00000001-state")) << "no --save_state";
  const std::string log = read_text(work_ / "log.txt");
  EXPECT_NE(log.find("saved"), std::string::npos) << log;
  EXPECT_EQ(r.err.find("saved"), std::string::npos) << r.err;
  EXPECT_NE(log.find("; optimizer lion_pytorch.lion_pytorch.Lion"), std::string::npos) << log;
}

// kohya's --base_weights merges LoRAs into the base model for good before training: the
// validation loss at step 0 (before any update) is the merged model's. At multiplier 0 the
// merge adds exact zeros and the model is the plain one bit for bit; at 1 it is another.
TEST_F(TrainRunTest, BaseWeightsAreMergedIntoTheModelBeforeTraining) {
  const TrainRun trained = run(work_ / "a", {"--max_train_steps=3", "--learning_rate=1e-2"});
  ASSERT_EQ(trained.exit, 0) << trained.err;
  const std::string file = (work_ / "a" / "lora" / "tiny.safetensors").string();
  auto start = [&](const std::string& tag, std::vector<std::string> extra) {
    extra.insert(extra.end(), {"--max_train_steps=1", "--validation_split=0.25",
                               "--validation_seed=5", "--max_validation_steps=1"});
    const TrainRun r = run(work_ / tag, extra);
    EXPECT_EQ(r.exit, 0) << r.err;
    std::smatch m;
    return std::regex_search(r.out, m, std::regex(R"(validation loss: ([0-9.]+) at the start)"))
               ? std::stod(m[1])
               : -1.0;
  };
  const double plain = start("plain", {});
  const double zero = start("zero", {"--base_weights", file, "--base_weights_multiplier", "0"});
  const double merged = start("merged", {"--base_weights", file});
  const double twice = start("twice", {"--base_weights", file, file});
  // kohya's separate words: a path with a space in it is one file.
  fs::create_directories(work_ / "my loras");
  const fs::path spaced = work_ / "my loras" / "tiny copy.safetensors";
  fs::copy_file(file, spaced);
  const double spaced_merge = start("spaced", {"--base_weights", spaced.string()});
  // The same LoRA in and out again: the weights come back up to fp32 rounding (about 1e-7 of
  // each weight), which moves the loss by far less than 1e-5 of it; a wrong sign or a lost
  // second multiplier would leave the whole LoRA in.
  const double undone = start("undone", {"--base_weights", file, file,
                                         "--base_weights_multiplier", "1", "-1"});
  ASSERT_GT(plain, 0);
  EXPECT_EQ(zero, plain);
  EXPECT_NE(merged, plain);
  EXPECT_NE(twice, merged) << "the second file is merged too";
  EXPECT_EQ(spaced_merge, merged);
  EXPECT_NEAR(undone, plain, 1e-5 * plain);
  // Measured: the merge moves the loss by 1.9, the round trip by nothing at the printed
  // precision; 100x keeps the two cases far apart whatever the exact figures.
  EXPECT_GT(std::abs(merged - plain), 100 * std::abs(undone - plain));
  std::printf("[base-weights] loss moved by the merge %.3g, left after undoing it %.3g\n",
              std::abs(merged - plain), std::abs(undone - plain));
}

// kohya's --dim_from_weights builds the network as the file to continue from is: its modules
// (3x3 convs where it has them), each at the file's rank and alpha, whatever --network_dim and
// --network_alpha say. A file resized to mixed ranks (one module cut to rank 3 here) continues
// as it is; without the flag the same file is refused for its shapes.
TEST_F(TrainRunTest, DimFromWeightsBuildsTheNetworkAsTheFileIs) {
  const TrainRun first = run(work_ / "a", {"--max_train_steps=2", "--learning_rate=1e-2",
                                           "--network_args", "conv_dim=2", "conv_alpha=1"});
  ASSERT_EQ(first.exit, 0) << first.err;
  auto tensors = lora(work_ / "a" / "lora" / "tiny.safetensors");
  std::string cut;  // the first linear module, cut to rank 3 with alpha 1.5
  for (const auto& [key, t] : tensors) {
    if (key.ends_with(".lora_down.weight") && t.dim() == 2) {
      cut = key.substr(0, key.find('.'));
      break;
    }
  }
  ASSERT_FALSE(cut.empty());
  tensors[cut + ".lora_down.weight"] = tensors[cut + ".lora_down.weight"].slice(0, 0, 3).clone();
  tensors[cut + ".lora_up.weight"] = tensors[cut + ".lora_up.weight"].slice(1, 0, 3).clone();
  tensors[cut + ".alpha"] = torch::tensor(1.5f);
  const fs::path resized = work_ / "resized.safetensors";
  trainer::write_lora_file(resized, tensors, {});

  const TrainRun refused = run(work_ / "b", {"--max_train_steps=1", "--network_weights=" +
                                             resized.string()});
  EXPECT_NE(refused.exit, 0);
  EXPECT_NE(refused.err.find("other shapes"), std::string::npos) << refused.err;

  const TrainRun r = run(work_ / "c", {"--max_train_steps=2", "--network_dim=8",
                                       "--network_alpha=8", "--dim_from_weights",
                                       "--network_weights=" + resized.string()});
  ASSERT_EQ(r.exit, 0) << r.err;
  const auto out = lora(work_ / "c" / "lora" / "tiny.safetensors");
  ASSERT_EQ(out.size(), tensors.size()) << "exactly the file's modules";
  for (const auto& [key, t] : tensors) {
    ASSERT_TRUE(out.count(key)) << key;
    EXPECT_EQ(out.at(key).sizes(), t.sizes()) << key;
    if (key.ends_with(".alpha")) {
      EXPECT_EQ(out.at(key).item<float>(), t.item<float>()) << key;
    }
  }
  EXPECT_EQ(out.at(cut + ".lora_down.weight").size(0), 3);
  // The metadata describes the file's network (its widest module: rank 4, alpha 4), not the
  // flags' dim 8.
  const auto meta = models::SafetensorsFile::open(work_ / "c" / "lora" / "tiny.safetensors").metadata();
  EXPECT_EQ(meta.at("ss_network_dim"), "4");
  EXPECT_EQ(meta.at("ss_network_alpha"), "4.0");  // a float, as kohya's str(args.network_alpha)

  const TrainRun unset = run(work_ / "d", {"--max_train_steps=1", "--dim_from_weights"});
  EXPECT_NE(unset.exit, 0);
  EXPECT_NE(unset.err.find("--dim_from_weights takes the ranks from --network_weights"),
            std::string::npos)
      << unset.err;
}

// Each bad input: a clear message naming what is wrong, a non-zero exit, before any compute.
TEST_F(TrainRunTest, BadFlagsAreRefusedByName) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--network_dim=0"}, "--network_dim=0"},
      {{"--learning_rate=-1"}, "--learning_rate"},
      // Not taken for "not given" (its default), which would train at --learning_rate.
      {{"--unet_lr=-0.0001"}, "--unet_lr=-0.0001"},
      {{"--text_encoder_lr=1e-4,nan"},
       "--text_encoder_lr=nan: a learning rate must be a finite number, 0 or more"},
      {{"--train_batch_size=0"}, "--train_batch_size=0"},
      {{"--optimizer_type=Lion9000"}, "Lion9000"},
      {{"--optimizer_type=DAdaptation"}, "kohya runs dadaptation's DAdaptAdamPreprint"},
      {{"--lr_scheduler=sometimes"}, "sometimes"},
      {{"--loss_type=l3"}, "l3"},
      {{"--mixed_precision=fp8"}, "fp8"},
      {{"--network_args", "conv_rank=4"}, "conv_rank"},
      {{"--no_such_flag=1"}, "no_such_flag"},
      {{"--resolution=512"}, "kohya's dataset, bucket, caption, caching and sample flags go to "
                             "`lorapipe run`"},
      {{"--lr_scheduler=constant", "--lr_warmup_steps=10"}, "constant_with_warmup"},
      {{"--lr_scheduler=polynomial", "--learning_rate=0"}, "--lr_scheduler=polynomial"},
      {{"--adaptive_noise_scale=0.01"}, "--adaptive_noise_scale needs --noise_offset"},
      {{"--timestep_sampling=sigmoid"}, "--timestep_sampling is a flow-matching option"},
      {{"--scale_v_pred_loss_like_noise_pred"}, "needs --v_parameterization"},
      {{"--min_timestep=600", "--max_timestep=500"}, "need 0 <= min <= max <= 1000"},
      {{"--dataset_id=nope"}, "no manifest 'nope'"},
      {{"--dataset_id=dmeo"},
       "no manifest 'dmeo' in cache " + (dir_ / "cache").string() + " (did you mean demo?)"},
      {{"--network_module=lycoris.kohya"}, "--network_module=lycoris.kohya"},
      {{"--save_model_as=ckpt"}, "--save_model_as=ckpt"},
      {{"--log_with=comet"}, "--log_with=comet"},
      {{"--max_token_length=100"}, "--max_token_length=100"},
      {{"--network_train_unet_only", "--network_train_text_encoder_only"},
       "together they leave nothing to train"},
      {{"--optimizer_type=Prodigy", "--learning_rate=1", "--unet_lr=0.5"},
       "learning rates must be equal"},
      {{"--optimizer_args", "d_coef=2"}, "d_coef: AdamW does not take it"},
      // kohya's flags lorapipe does not act on: refused at any value but kohya's default.
      {{"--v2"}, "--v2=true: Stable Diffusion 2.x"},
      {{"--vae=/m/vae.safetensors"}, "/m/vae.safetensors (--vae): no such file"},
      {{"--cpu_offload_checkpointing"},
       "--cpu_offload_checkpointing: Stable Diffusion 1.5 has no offloaded checkpoints"},
      {{"--fp8_scaled"}, "--fp8_scaled scales the float8 weights of --fp8_base"},
      {{"--fp8_base", "--fp8_fast"}, "--fp8_fast multiplies scaled float8 weights in float8"},
      {{"--blocks_to_swap=99"}, "it swaps the last N of them, at most 6"},
      {{"--blocks_to_swap=-1"}, "--blocks_to_swap=-1: must be 0 or more"},
      {{"--lr_scheduler_args", "T_max=100", "--seed=1"}, "--lr_scheduler_args 'T_max=100'"},
      {{"--lr_scheduler=cosine_with_min_lr"}, "needs --lr_scheduler_min_lr_ratio"},
      {{"--lr_scheduler=cosine", "--lr_warmup_steps=lots"}, "--lr_warmup_steps=lots: not a number"},
      {{"--lr_scheduler=cosine", "--lr_warmup_steps=1.5"},
       "--lr_warmup_steps=1.5: expected a count of steps, a ratio below 1"},
      {{"--network_args", "rank_dropout=1.5"}, "--network_args rank_dropout=1.500000: must be in"},
      {{"--network_args", "conv_dim=2", "conv_alpha=-1"}, "--network_args conv_alpha must be >= 0"},
      {{"--base_weights=/no/such/lora.safetensors"}, "/no/such/lora.safetensors"},
      {{"--lr_scheduler=piecewise_constant", "--lr_scheduler_args", "step_rules='1:2,0.5'",
        "--lr_decay_steps=100%"},
       "--lr_decay_steps=100%: expected a count of steps, a ratio below 1 or a percentage below"},
      {{"--lr_scheduler_type=CosineAnnealingLR"}, "--lr_scheduler_type=CosineAnnealingLR: "},
      {{"--use_lion_optimizer", "--optimizer_type=AdamW"}, "choose one optimizer"},
      {{"--use_8bit_adam", "--optimizer_type=Prodigy"},
       "--use_8bit_adam with --optimizer_type=Prodigy: choose one optimizer"},
      {{"--metadata_thumbnail=/no/such/thumb.png"}, "--metadata_thumbnail=/no/such/thumb.png"},
      {{"--console_log_level=LOUD"}, "--console_log_level=LOUD"},
      {{"--console_log_file=/no/such/dir/log.txt"}, "--console_log_file=/no/such/dir/log.txt"},
      {{"--initial_step=100"}, "--initial_step=100"},
      {{"--train_data_dir=/photos"}, "--train_data_dir=/photos: the trainer trains from the cache"},
      {{"--dim_from_weights", "--network_weights=/no/such/lora.safetensors", "--network_args",
        "down_lr_weight=zeros"},
       "block-wise network_args (block_dims, *_lr_weight) shape a new network"},
  };
  // What --check_flags (lorapipe run's check before any stage starts) cannot know: these need the
  // cache, the model's groups or a file the check does not read.
  const std::set<std::string> beyond_the_flags = {"--dataset_id=nope", "--dataset_id=dmeo",
                                                  "--optimizer_type=Prodigy",
                                                  "--blocks_to_swap=99"};
  // Its own message for a file that is not there (the run's comes from the loader).
  const std::map<std::string, std::string> check_says = {
      {"--vae=/m/vae.safetensors", "/m/vae.safetensors (--vae): no such file or folder"},
      {"--base_weights=/no/such/lora.safetensors",
       "/no/such/lora.safetensors (--base_weights): no such file or folder"}};
  for (const auto& [flags, expected] : cases) {
    const TrainRun r = run(work_, flags);
    EXPECT_NE(r.exit, 0) << flags[0];
    EXPECT_NE(r.err.find(expected), std::string::npos) << flags[0] << ": " << r.err;
    EXPECT_FALSE(fs::exists(work_ / "lora" / "tiny.safetensors")) << flags[0];
    if (beyond_the_flags.count(flags[0])) continue;
    std::vector<std::string> check = flags;
    check.push_back("--check_flags");
    const TrainRun c = run(work_ / "check", check);
    EXPECT_EQ(c.exit, 2) << flags[0] << " passed --check_flags: " << c.out << c.err;
    const auto own = check_says.find(flags[0]);
    EXPECT_NE(c.err.find(own == check_says.end() ? expected : own->second), std::string::npos)
        << flags[0] << ": " << c.err;
  }
  const TrainRun fine = run(work_ / "check", {"--check_flags"});
  EXPECT_EQ(fine.exit, 0) << fine.err;
  EXPECT_NE(fine.out.find("trainer: the flags are fine"), std::string::npos) << fine.out;
  EXPECT_FALSE(fs::exists(work_ / "check" / "lora")) << "--check_flags wrote something";
  // A model whose folder declares v-prediction (its scheduler config) wants --v_parameterization
  // before any stage starts, not at its load after the cacher's hours.
  const fs::path vpred = work_ / "vpred-model";
  fs::copy(tiny_.diffusers, vpred, fs::copy_options::recursive);
  fs::create_directories(vpred / "scheduler");
  std::ofstream(vpred / "scheduler" / "scheduler_config.json")
      << R"({"_class_name": "DDPMScheduler", "prediction_type": "v_prediction"})";
  const std::string model = "--pretrained_model_name_or_path=" + vpred.string();
  const TrainRun epsilon = run(work_ / "check", {model, "--check_flags"});
  EXPECT_EQ(epsilon.exit, 2) << epsilon.out << epsilon.err;
  EXPECT_NE(epsilon.err.find(vpred.string() + " declares itself a v-prediction model (its "
                                              "scheduler config: prediction_type v_prediction): "
                                              "pass --v_parameterization"),
            std::string::npos)
      << epsilon.err;
  const TrainRun v = run(work_ / "check", {model, "--v_parameterization", "--check_flags"});
  EXPECT_EQ(v.exit, 0) << v.err;
  // Weights shared on a GPU under an allocator whose memory CUDA IPC cannot open
  // (common/cuda_alloc_conf.h): refused before the model loads, naming the setting. On the CPU
  // (shared memory, not IPC) the setting does not matter.
  setenv("PYTORCH_ALLOC_CONF", "expandable_segments:True", 1);
  const std::vector<std::string> share = {"--share_weights=" + (work_ / "shared.json").string(),
                                          "--device=cuda", "--check_flags"};
  const TrainRun on_gpu = run(work_ / "check", share);
  const TrainRun on_cpu = run(work_ / "check", {share[0], "--check_flags"});
  unsetenv("PYTORCH_ALLOC_CONF");
  EXPECT_EQ(on_gpu.exit, 2) << on_gpu.out << on_gpu.err;
  EXPECT_NE(on_gpu.err.find("--share_weights: PYTORCH_ALLOC_CONF=expandable_segments:True"),
            std::string::npos) << on_gpu.err;
  EXPECT_EQ(on_cpu.exit, 0) << on_cpu.err;
}

TEST_F(TrainRunTest, ManifestFromAnotherVaeIsRefused) {
  const auto other = models::write_tiny_checkpoint(work_ / "other", /*seed=*/11);
  std::vector<std::string> a = args(work_, {"--max_train_steps=1"});
  a[1] = "--pretrained_model_name_or_path=" + other.diffusers.string();
  const pid_t pid = spawn(a, work_ / "out", work_ / "err");
  EXPECT_EQ(wait_exit(pid), 2);
  EXPECT_NE(read_text(work_ / "err").find("another VAE"), std::string::npos)
      << read_text(work_ / "err");
}

// The latents' fingerprint is the VAE's encoder's (and quant conv's): a checkpoint whose VAE
// differs in its decoder alone (sd-vae-ft-mse baked in) trains on latents the other cached; one
// whose encoder differs is refused.
TEST_F(TrainRunTest, CachedLatentsServeAVaeWithAnotherDecoderOnly) {
  const fs::path decoder = work_ / "decoder";
  lorapipe::testing::copy_with_a_weight_changed(tiny_.diffusers, decoder, "vae", "decoder.", 0.5f);
  std::vector<std::string> a = args(work_ / "d", {"--max_train_steps=1"});
  a[1] = "--pretrained_model_name_or_path=" + decoder.string();
  fs::create_directories(work_ / "d");
  EXPECT_EQ(wait_exit(spawn(a, work_ / "d" / "out", work_ / "d" / "err")), 0)
      << read_text(work_ / "d" / "err");
  const fs::path encoder = work_ / "encoder";
  lorapipe::testing::copy_with_a_weight_changed(tiny_.diffusers, encoder, "vae", "encoder.", 0.5f);
  a = args(work_ / "e", {"--max_train_steps=1"});
  a[1] = "--pretrained_model_name_or_path=" + encoder.string();
  fs::create_directories(work_ / "e");
  EXPECT_EQ(wait_exit(spawn(a, work_ / "e" / "out", work_ / "e" / "err")), 2);
  EXPECT_NE(read_text(work_ / "e" / "err").find("another VAE"), std::string::npos)
      << read_text(work_ / "e" / "err");
}

// kohya's --vae: the trainer checks the manifest against the VAE it is given. A checkpoint
// whose own VAE is another trains on this suite's cache when --vae names the VAE the cache was
// made with (here in the original layout, alone, as VAE downloads ship), and the LoRA records
// it as kohya does; the suite's own checkpoint with the other VAE is refused, naming --vae.
TEST_F(TrainRunTest, VaeTheCacheWasMadeWithIsGivenWithVae) {
  const auto other = models::write_tiny_checkpoint(work_ / "other", /*seed=*/11);
  auto alone = models::read_tensors(models::SafetensorsFile::open(tiny_.single_file),
                                    "first_stage_model.");
  ASSERT_GT(alone.size(), 10u);
  const fs::path own_vae = work_ / "own-vae.safetensors";
  trainer::write_lora_file(own_vae, alone, {});  // a plain safetensors file of these tensors

  std::vector<std::string> a = args(work_ / "a", {"--max_train_steps=1", "--vae=" + own_vae.string()});
  a[1] = "--pretrained_model_name_or_path=" + other.diffusers.string();
  fs::create_directories(work_ / "a");
  EXPECT_EQ(wait_exit(spawn(a, work_ / "a" / "out", work_ / "a" / "err")), 0)
      << read_text(work_ / "a" / "err");
  const auto meta =
      models::SafetensorsFile::open(work_ / "a" / "lora" / "tiny.safetensors").metadata();
  EXPECT_EQ(meta.at("ss_vae_name"), "own-vae.safetensors");
  EXPECT_EQ(meta.at("ss_new_vae_hash"), sha256_file(own_vae));

  const TrainRun refused =
      run(work_ / "b", {"--max_train_steps=1", "--vae=" + (other.diffusers / "vae").string()});
  EXPECT_EQ(refused.exit, 2);
  EXPECT_NE(refused.err.find("another VAE"), std::string::npos) << refused.err;
  EXPECT_NE(refused.err.find("--vae=" + (other.diffusers / "vae").string()), std::string::npos)
      << refused.err;
}

// The pre-flight reads every record the manifest names before any compute: a missing one and a
// corrupt one are each named, with the reason.
TEST_F(TrainRunTest, MissingRecordsAreListedBeforeTraining) {
  // A copy of the cache with one latent removed and another overwritten with garbage.
  const fs::path cache = work_ / "cache";
  fs::copy(dir_ / "cache", cache, fs::copy_options::recursive);
  std::string removed, corrupted;
  {
    cacher::StoreOptions o;
    o.dir = cache;
    cacher::Store store = cacher::Store::open(o);
    wire::Manifest manifest;
    ASSERT_TRUE(manifest.ParseFromString(*store.get(cacher::Table::kManifests, kDataset)));
    removed = manifest.entries(3).latent_key();
    ASSERT_EQ(store.erase(cacher::Table::kLatents, {removed}), 1u);
    corrupted = manifest.entries(5).latent_key();
    ASSERT_NE(corrupted, removed);
    store.put(cacher::Table::kLatents, {{corrupted, "this is not a protobuf"}});
  }
  std::vector<std::string> a = args(work_ / "out", {"--max_train_steps=1"});
  a[2] = "--cache_dir=" + cache.string();
  fs::create_directories(work_ / "out");
  const pid_t pid = spawn(a, work_ / "out" / "o", work_ / "out" / "e");
  EXPECT_EQ(wait_exit(pid), 2);
  const std::string err = read_text(work_ / "out" / "e");
  EXPECT_NE(err.find(removed + ": missing"), std::string::npos) << err;
  EXPECT_NE(err.find(corrupted + ": not a LatentRecord"), std::string::npos) << err;
  EXPECT_FALSE(fs::exists(work_ / "out" / "lora" / "tiny.safetensors"));
}

TEST_F(TrainRunTest, CheckpointWithMissingKeysIsRefused) {
  const fs::path broken = work_ / "broken.safetensors";
  {
    const auto file = models::SafetensorsFile::open(tiny_.single_file);
    std::vector<models::TensorToWrite> keep;
    for (const auto& info : file.tensors()) {
      if (info.name.find("model.diffusion_model.out.2.weight") != std::string::npos) continue;
      keep.push_back({info.name, info.dtype, info.shape, file.bytes(info)});
    }
    models::write_safetensors(broken, keep, file.metadata());
  }
  std::vector<std::string> a =
      args(work_, {"--max_train_steps=1", "--tokenizer=" + tiny_.tokenizer.string()});
  a[1] = "--pretrained_model_name_or_path=" + broken.string();
  const pid_t pid = spawn(a, work_ / "out", work_ / "err");
  EXPECT_EQ(wait_exit(pid), 2);
  EXPECT_NE(read_text(work_ / "err").find("missing conv_out.weight"), std::string::npos)
      << read_text(work_ / "err");
}

// A learning rate that blows the weights up: every loss is NaN, each step is skipped and counted,
// and after --max_bad_steps in a row the run stops with a message and a saved state.
TEST_F(TrainRunTest, NonFiniteLossesStopWithASavedState) {
  const TrainRun r = run(work_, {"--max_train_steps=20", "--learning_rate=1e30",
                                 "--max_grad_norm=0", "--max_bad_steps=3"});
  EXPECT_EQ(r.exit, 2);
  EXPECT_NE(r.err.find("3 steps in a row had a non-finite loss or gradient"), std::string::npos)
      << r.err;
  // Every weight is still finite (AdamW's steps of about the rate, 1e30, fit in fp32; the
  // activations overflow): the advice is the learning rate's, and no weight is blamed.
  EXPECT_NE(r.err.find("(lower the learning rate, or try another --mixed_precision"),
            std::string::npos)
      << r.err;
  EXPECT_EQ(r.err.find("weight '"), std::string::npos) << r.err;
  // The third bad step in a row, N, stops the run after N-2 and N-1 (the first step is finite:
  // the LoRA starts with up = 0); the state saved there counts the three skipped steps.
  std::smatch m;
  const std::regex third(R"(step (\d+): \w+ (is|are) not finite, skipped \(3 in a row\))");
  ASSERT_TRUE(std::regex_search(r.err, m, third)) << r.err;
  const int last = std::stoi(m[1]);
  for (int before : {1, 2}) {
    EXPECT_NE(r.err.find("step " + std::to_string(last - before) + ": "), std::string::npos)
        << r.err;
    EXPECT_NE(r.err.find("skipped (" + std::to_string(3 - before) + " in a row)"),
              std::string::npos)
        << r.err;
  }
  const fs::path state = work_ / "state" / "tiny-state" / "trainer.json";
  ASSERT_TRUE(fs::exists(state)) << r.err;
  const auto saved = nlohmann::json::parse(read_text(state));
  EXPECT_EQ(saved["skipped_steps"], 3);
  EXPECT_EQ(saved["global_step"], last);
}

// An update that overflows the LoRA itself stops the run without a state: saved, the broken
// LoRA would replace the good state of the same name that an earlier run left, and resuming
// would reload it. The overflow: a LoRA whose downs are 10 and ups 0 (it changes nothing yet),
// under a weight decay whose factor 1 - lr * wd is -1e38, which the first update takes past
// float32's range.
TEST_F(TrainRunTest, NonFiniteLoraKeepsTheGoodStateSavedBefore) {
  const TrainRun good = run(work_, {"--max_train_steps=2", "--save_state"});
  ASSERT_EQ(good.exit, 0) << good.err;
  const fs::path state = work_ / "state" / "tiny-state" / "trainer.json";
  const std::string before = read_text(state);
  auto tensors = lora(work_ / "lora" / "tiny.safetensors");
  for (auto& [key, t] : tensors) {
    if (key.ends_with(".lora_down.weight")) t = torch::full_like(t, 10.0);
    if (key.ends_with(".lora_up.weight")) t = torch::zeros_like(t);
  }
  const fs::path start = work_ / "start.safetensors";
  trainer::write_lora_file(start, tensors, {});
  const TrainRun r = run(work_, {"--max_train_steps=20", "--network_weights=" + start.string(),
                                 "--optimizer_args=weight_decay=1e41", "--max_bad_steps=2",
                                 "--save_state"});
  EXPECT_EQ(r.exit, 2) << r.err;
  EXPECT_NE(r.err.find("no state saved, the states saved before are as they were"),
            std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find("The LoRA's weight '"), std::string::npos) << r.err;
  EXPECT_EQ(read_text(state), before) << "the good state was replaced";
  // Such a LoRA given to a run is named at the load, not after --max_bad_steps of NaN steps.
  std::string broken_key;
  for (auto& [key, t] : tensors) {
    if (key.ends_with(".lora_up.weight")) {
      t = torch::full_like(t, std::numeric_limits<float>::quiet_NaN());
      broken_key = key;
      break;
    }
  }
  const fs::path broken = work_ / "broken.safetensors";
  trainer::write_lora_file(broken, tensors, {});
  const TrainRun refused = run(work_, {"--max_train_steps=2", "--network_weights=" +
                                       broken.string()});
  EXPECT_EQ(refused.exit, 2);
  EXPECT_NE(refused.err.find(broken.string() + ": '" + broken_key + "' holds NaN or infinity"),
            std::string::npos)
      << refused.err;
}

// A save killed mid-write leaves a full-size ".NAME.safetensors.tmp-PID": the next run in the
// folder removes those whose writer is gone, and leaves one whose writer is alive (this test).
TEST_F(TrainRunTest, SavesKilledMidWriteAreRemovedByTheNextRun) {
  fs::create_directories(work_ / "lora" / "sample_only");
  const fs::path gone = work_ / "lora" / ".tiny.safetensors.tmp-999999999";  // past pid_max
  const fs::path gone_sample =
      work_ / "lora" / "sample_only" / ".tiny-step00000001.safetensors.tmp-999999999";
  const fs::path alive = work_ / "lora" / (".tiny.safetensors.tmp-" + std::to_string(getpid()));
  for (const fs::path& file : {gone, gone_sample, alive}) std::ofstream(file) << "half a file";
  const TrainRun r = run(work_, {"--max_train_steps=1"});
  ASSERT_EQ(r.exit, 0) << r.err;
  EXPECT_FALSE(fs::exists(gone)) << r.err;
  EXPECT_FALSE(fs::exists(gone_sample)) << r.err;
  EXPECT_TRUE(fs::exists(alive)) << "a live writer's file was removed";
}

// A model file with a NaN in one of its weights (a damaged download) gives the same symptom as a
// learning rate too high, but lowering the rate never cures it: when the run stops, it names the
// weight and the file, and does not send the user after the learning rate.
TEST_F(TrainRunTest, NonFiniteStepsFromADamagedModelNameItsWeight) {
  const fs::path damaged = work_ / "damaged";
  const std::string poisoned =
      lorapipe::testing::copy_with_a_nan_weight(tiny_.diffusers, damaged, "mid_block.");
  std::vector<std::string> a = args(work_, {"--max_train_steps=5", "--max_bad_steps=2",
                                            "--tokenizer=" + tiny_.tokenizer.string()});
  a[1] = "--pretrained_model_name_or_path=" + damaged.string();
  const pid_t pid = spawn(a, work_ / "out", work_ / "err");
  EXPECT_EQ(wait_exit(pid), 2);
  const std::string err = read_text(work_ / "err");
  EXPECT_NE(err.find("2 steps in a row had a non-finite loss"), std::string::npos) << err;
  EXPECT_NE(err.find("The model's own weight '" + poisoned + "' (its denoiser, from "),
            std::string::npos)
      << err;
  EXPECT_NE(err.find("the model file is damaged"), std::string::npos) << err;
  EXPECT_EQ(err.find("lower the learning rate"), std::string::npos) << err;
}

// The same with the damaged weight in a block --blocks_to_swap keeps on the host: the only copy of
// its values is the host copy (the U-Net's own tensor is empty while the block is in no slot), and
// the look finds it there. --blocks_to_swap=5 swaps the blocks of the tiny U-Net's last five
// Transformer2Ds through two slots; the damaged one is the middle of the five, in no slot once a
// pass ends in either direction (forward leaves the last two in the slots, backward the first two).
TEST_F(TrainRunTest, NonFiniteStepsNameADamagedWeightThatBlockSwapKeepsOnTheHost) {
  const fs::path damaged = work_ / "damaged";
  const std::string poisoned = lorapipe::testing::copy_with_a_nan_weight(
      tiny_.diffusers, damaged, "up_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q.");
  std::vector<std::string> a =
      args(work_, {"--max_train_steps=5", "--max_bad_steps=2", "--blocks_to_swap=5",
                   "--tokenizer=" + tiny_.tokenizer.string()});
  a[1] = "--pretrained_model_name_or_path=" + damaged.string();
  const pid_t pid = spawn(a, work_ / "out", work_ / "err");
  EXPECT_EQ(wait_exit(pid), 2);
  const std::string err = read_text(work_ / "err");
  EXPECT_NE(err.find("block swap (--blocks_to_swap=5)"), std::string::npos) << err;
  EXPECT_NE(err.find("2 steps in a row had a non-finite loss"), std::string::npos) << err;
  EXPECT_NE(err.find("The model's own weight '" + poisoned + "' (its denoiser, from "),
            std::string::npos)
      << err;
  EXPECT_EQ(err.find("lower the learning rate"), std::string::npos) << err;
}

// Every save (LoRA files, state folders) is written under a temporary name and renamed into
// place, so a crash or a kill at any instant leaves the old save or the new one whole, never a
// partial file under a final name. strace(1) records every open and rename of a run with step
// saves, state saves and pruning: no path under lora/ or state/ is opened for writing unless one
// of its components is a temporary name ('.NAME.tmp...'), and every save left there arrived by
// a rename.
TEST_F(TrainRunTest, SavesAppearUnderTheirNamesOnlyByRename) {
  std::vector<std::string> a = args(work_, {"--max_train_steps=6", "--save_every_n_steps=2",
                                            "--save_last_n_steps=2", "--save_state"});
  const fs::path trace = work_ / "trace";
  a.insert(a.begin(), {"/usr/bin/strace", "-f", "-qq", "-o", trace.string(), "-e",
                       "trace=open,openat,creat,rename,renameat,renameat2"});
  ASSERT_EQ(wait_exit(spawn(a, work_ / "out", work_ / "err")), 0) << read_text(work_ / "err");
  const std::string lora = (work_ / "lora").string() + "/";
  const std::string state = (work_ / "state").string() + "/";
  auto saved_here = [&](const std::string& path) {
    return path.starts_with(lora) || path.starts_with(state);
  };
  auto temporary = [](const std::string& path) {
    for (const auto& part : fs::path(path)) {
      const std::string name = part.string();
      if (name.starts_with(".") && name.find(".tmp") != std::string::npos) return true;
    }
    return false;
  };
  const std::regex open_call(R"re((?:open|openat)\((?:AT_FDCWD, )?"([^"]+)", ([A-Z_|]+))re");
  const std::regex creat_call(R"re(creat\("([^"]+)")re");
  const std::regex rename_call(
      R"re(rename(?:at2?)?\((?:AT_FDCWD, )?"([^"]+)", (?:AT_FDCWD, )?"([^"]+)")re");
  std::set<std::string> renamed_to;
  int writes = 0;
  std::istringstream lines(read_text(trace));
  for (std::string line; std::getline(lines, line);) {
    std::smatch m;
    if (std::regex_search(line, m, rename_call)) {
      renamed_to.insert(m[2]);
      continue;
    }
    std::string written;
    if (std::regex_search(line, m, open_call)) {
      const std::string flags = m[2];
      for (const char* mode : {"O_WRONLY", "O_RDWR", "O_CREAT"}) {
        if (flags.find(mode) != std::string::npos) written = m[1];
      }
    } else if (std::regex_search(line, m, creat_call)) {
      written = m[1];
    }
    if (written.empty() || !saved_here(written)) continue;
    ++writes;
    EXPECT_TRUE(temporary(written)) << "written under its final name: " << line;
  }
  EXPECT_GT(writes, 0) << "the trace saw no save being written";
  // What the run left: step 4's LoRA file and state (step 2's pruned; step 6 is the final save)
  // and the final ones; each arrived by a rename.
  std::vector<std::string> left;
  for (const fs::path& dir : {work_ / "lora", work_ / "state"}) {
    for (const auto& entry : fs::directory_iterator(dir)) left.push_back(entry.path().string());
  }
  EXPECT_GE(left.size(), 4u);
  for (const std::string& path : left) {
    EXPECT_TRUE(renamed_to.count(path)) << path << " did not arrive by a rename";
  }
}

// A single-file checkpoint is named and hashed in the metadata as kohya's train_network does it:
// ss_sd_model_name its file name, ss_sd_model_hash train_util.model_hash (the first 8 hex of the
// sha256 of the 64 KiB at 1 MiB), ss_new_sd_model_hash the whole file's sha256; hashlib computes
// both here from the file.
TEST_F(TrainRunTest, SingleFileModelIsNamedAndHashedAsKohya) {
  std::vector<std::string> a =
      args(work_, {"--max_train_steps=1", "--tokenizer=" + tiny_.tokenizer.string()});
  a[1] = "--pretrained_model_name_or_path=" + tiny_.single_file.string();
  ASSERT_EQ(wait_exit(spawn(a, work_ / "out", work_ / "err")), 0) << read_text(work_ / "err");
  const auto meta =
      models::SafetensorsFile::open(work_ / "lora" / "tiny.safetensors").metadata();
  // Past 1 MiB + 64 KiB, so the legacy hash reads the whole window (of a shorter file it would
  // be the hash of nothing, which any constant could match).
  ASSERT_GT(fs::file_size(tiny_.single_file), 0x110000u);
  const char* python = std::getenv("LORAPIPE_PYTHON");
  ASSERT_NE(python, nullptr) << "LORAPIPE_PYTHON (the test venv's python) is unset";
  const std::string command =
      std::string(python) +
      " -c \"import hashlib, sys; d = open(sys.argv[1], 'rb').read(); "
      "print(hashlib.sha256(d[0x100000:0x110000]).hexdigest()[:8], "
      "hashlib.sha256(d).hexdigest())\" '" +
      tiny_.single_file.string() + "' > '" + (work_ / "hashes").string() + "'";
  ASSERT_EQ(std::system(command.c_str()), 0) << command;
  std::istringstream hashes(read_text(work_ / "hashes"));
  std::string legacy, full;
  hashes >> legacy >> full;
  EXPECT_EQ(meta.at("ss_sd_model_name"), tiny_.single_file.filename().string());
  EXPECT_EQ(meta.at("ss_sd_model_hash"), legacy);
  EXPECT_EQ(meta.at("ss_new_sd_model_hash"), full);
}

// On a terminal the trainer draws one live progress line, rewritten in place (\r, then cleared to
// the line's end) with step/total, loss, s/it and ETA, and ends it at the last step; off a
// terminal (every other test here) it logs plain lines. The terminal is a real pty: util-linux's
// script(1) (Debian's essential bsdutils) runs the trainer on one, its own input /dev/null so
// that a developer's terminal is left alone.
TEST_F(TrainRunTest, ATerminalGetsOneLiveProgressLine) {
  std::string command;
  for (const std::string& a : args(work_, {"--max_train_steps=3"})) command += "'" + a + "' ";
  const pid_t pid = spawn(
      {"/bin/sh", "-c", "exec /usr/bin/script -qfec \"$0\" /dev/null < /dev/null", command},
      work_ / "tty", work_ / "tty.err");
  ASSERT_EQ(wait_exit(pid), 0) << read_text(work_ / "tty") << read_text(work_ / "tty.err");
  const std::string tty = read_text(work_ / "tty");
  for (int step = 1; step <= 3; ++step) {
    const std::regex line("\rstep " + std::to_string(step) +
                          R"(/3  loss [0-9.]+  avg [0-9.]+  [0-9.]+ s/it  ETA [0-9]+ s\x1b\[K)");
    EXPECT_TRUE(std::regex_search(tty, line)) << "step " << step << " in: " << tty;
  }
  EXPECT_TRUE(std::regex_search(tty, std::regex(R"(step 3/3 [^\r\n]*ETA 0 s\x1b\[K\r?\n)")))
      << "the last step's line is not ended: " << tty;
  EXPECT_EQ(tty.find("] step 1/3"), std::string::npos) << "a plain log line on a terminal";
}

// A sampler that (re)starts mid-run hears of the newest checkpoint without waiting for the next
// save: the trainer sends its newest CheckpointReady again every --checkpoint_reannounce_s.
TEST_F(TrainRunTest, ReannouncesTheNewestCheckpointForLateSamplers) {
  const std::string endpoint = "ipc://" + (work_ / "events.sock").string();
  zmq::context_t context;
  zmq::socket_t sub = wire::make_socket(context, zmq::socket_type::sub);
  sub.set(zmq::sockopt::subscribe, wire::type_name(wire::CheckpointReady()));
  sub.connect(endpoint);
  const pid_t pid = spawn(args(work_, {"--max_train_steps=40", "--save_every_n_steps=10",
                                       "--checkpoint_reannounce_s=0", "--pub=" + endpoint}),
                          work_ / "trainer.out", work_ / "trainer.err");
  std::map<uint64_t, int> heard;
  bool done = false;
  for (int i = 0; i < 600 && !done; ++i) {
    const wire::Received r = wire::receive(sub, std::chrono::milliseconds(100));
    if (const auto* c = r.as<wire::CheckpointReady>()) {
      ++heard[c->step()];
      done = c->final();
    }
  }
  EXPECT_EQ(wait_exit(pid), 0) << read_text(work_ / "trainer.err");
  // With an interval of 0 every step's progress after a save repeats it, up to and including the
  // step of the next save (its progress goes out before it saves): 1 + 10 times for 20 and 30.
  // (Step 10 is left out: a subscriber may join after the first messages, as ZeroMQ's do.)
  EXPECT_EQ(heard[20], 11) << "step 20 was announced " << heard[20] << " times";
  EXPECT_EQ(heard[30], 11) << "step 30 was announced " << heard[30] << " times";
  EXPECT_EQ(heard[40], 1) << "the final save ends the run";
}

// Progress and checkpoint events over a real PUB socket: every step's TrainProgress with each of
// its fields, and a CheckpointReady per save whose sha256 is the file's.
TEST_F(TrainRunTest, PublishesProgressAndCheckpoints) {
  const std::string endpoint = "ipc://" + (work_ / "events.sock").string();
  zmq::context_t context;
  zmq::socket_t sub = wire::make_socket(context, zmq::socket_type::sub);
  sub.set(zmq::sockopt::subscribe, "");
  sub.connect(endpoint);
  const pid_t pid = spawn(
      args(work_, {"--max_train_steps=30", "--save_every_n_steps=10", "--pub=" + endpoint,
                   "--validation_split=0.25", "--validate_every_n_steps=10"}),
      work_ / "trainer.out", work_ / "trainer.err");
  std::set<uint64_t> steps;
  std::vector<wire::CheckpointReady> checkpoints;
  std::map<uint64_t, double> validations;  // step: loss (the gallery's validation curve)
  bool done = false;
  const auto take_validation = [&](const wire::Received& r) {
    if (const auto* v = r.as<wire::ValidationLoss>()) {
      EXPECT_FALSE(v->run_id().empty());
      EXPECT_TRUE(std::isfinite(v->loss()) && v->loss() > 0) << v->loss();
      validations[v->step()] = v->loss();
    }
  };
  for (int i = 0; i < 600 && !done; ++i) {
    const wire::Received r = wire::receive(sub, std::chrono::milliseconds(100));
    take_validation(r);
    if (const auto* p = r.as<wire::TrainProgress>()) {
      steps.insert(p->step());
      EXPECT_FALSE(p->run_id().empty());
      EXPECT_EQ(p->total_steps(), 30u);
      EXPECT_GE(p->epoch(), 1u);
      EXPECT_TRUE(std::isfinite(p->loss()));
      EXPECT_TRUE(std::isfinite(p->average_loss()) && p->average_loss() > 0);
      EXPECT_DOUBLE_EQ(p->learning_rate(), 1e-3);  // the suite's --learning_rate, constant
      EXPECT_GT(p->seconds_per_step(), 0);
      // The demo set in batches of 1: a sample per step.
      EXPECT_NEAR(p->samples_per_second(), 1 / p->seconds_per_step(),
                  1e-9 * p->samples_per_second());
      EXPECT_GE(p->data_wait_ms(), 0);
      EXPECT_GT(p->peak_memory_bytes(), 0u);
      // The steps left at the step's pace: none after the last.
      EXPECT_NEAR(p->eta_seconds(), static_cast<double>(30 - p->step()) * p->seconds_per_step(),
                  1e-9 * (1 + p->eta_seconds()));
      EXPECT_EQ(p->skipped_steps(), 0u);
    }
    if (const auto* c = r.as<wire::CheckpointReady>()) {
      checkpoints.push_back(*c);
      done = c->final();
    }
  }
  EXPECT_EQ(wait_exit(pid), 0) << read_text(work_ / "trainer.err");
  for (wire::Received r = wire::receive(sub, std::chrono::milliseconds(500)); r.ok();
       r = wire::receive(sub, std::chrono::milliseconds(500))) {
    take_validation(r);  // the end of the run's, sent after the final checkpoint
  }
  // Every validation the log reports is published, with its loss as logged (to its digits).
  const std::string log = read_text(work_ / "trainer.err");
  for (uint64_t step : {10u, 20u, 30u}) {
    ASSERT_TRUE(validations.count(step)) << "no validation at step " << step;
    std::smatch m;
    ASSERT_TRUE(std::regex_search(
        log, m, std::regex("validation loss at step " + std::to_string(step) + ": ([0-9.e-]+)")))
        << log;
    EXPECT_NEAR(validations[step], std::stod(m[1]), 1e-5 * std::stod(m[1])) << step;
  }
  // A subscriber can miss what was sent before it joined; the rest arrives in order.
  ASSERT_FALSE(steps.empty());
  EXPECT_EQ(*steps.rbegin(), 30u);
  EXPECT_EQ(steps.size(), 30 - *steps.begin() + 1);
  ASSERT_EQ(checkpoints.size(), 3u);  // steps 10, 20 and the final save
  EXPECT_EQ(checkpoints[0].step(), 10u);
  EXPECT_EQ(checkpoints[2].step(), 30u);
  for (const auto& c : checkpoints) {
    EXPECT_EQ(c.sha256(), sha256_file(c.path())) << c.path();
  }
}

// kohya's sample schedule: --sample_every_n_steps or --sample_every_n_epochs announce a
// checkpoint at each such step that is not a save (a sample-only LoRA, the newest three kept),
// --sample_at_first one of the untrained network before step 1; saves announce themselves and no
// other step announces anything. With both, kohya samples on the epochs alone
// (train_util.sample_images_common ignores the steps), and so does the trainer, saying so.
// `every` and `epochs` are the flags' values (0: not given).
void TrainRunTest::expect_sample_schedule(int64_t every, int64_t epochs) {
  const std::string endpoint = "ipc://" + (work_ / "events.sock").string();
  zmq::context_t context;
  zmq::socket_t sub = wire::make_socket(context, zmq::socket_type::sub);
  sub.set(zmq::sockopt::subscribe, wire::type_name(wire::CheckpointReady()));
  // The first 30 images once each make epochs short enough to end inside the run (about 30
  // steps). The subscriber connects once the trainer has bound (its ipc file is there): before,
  // ZeroMQ would retry at growing intervals (up to 2 s) and could join after step 20 on a fast
  // machine; from the bind, the first announcement after step 0 comes after the model's load.
  const fs::path cache = work_ / "cache";
  add_manifest(cache, "some", [](wire::Manifest& m) { keep_images(m, 30); });
  const int64_t total = 70, save = 40;
  std::vector<std::string> a =
      args(work_, {"--max_train_steps=" + std::to_string(total), "--train_batch_size=1",
                   "--save_every_n_steps=" + std::to_string(save),
                   "--sample_every_n_steps=" + std::to_string(every),
                   "--sample_every_n_epochs=" + std::to_string(epochs), "--sample_at_first",
                   "--pub=" + endpoint});
  a[2] = "--cache_dir=" + cache.string();
  a[3] = "--dataset_id=some";
  // The folder holds another run's sample-only save (kohya's habit: one --output_dir, a name a
  // run) and a stale one of an earlier run under this name, past this run's steps.
  fs::create_directories(work_ / "lora" / "sample_only");
  std::ofstream(work_ / "lora" / "sample_only" / "zeta-step00000001.safetensors") << "other run";
  std::ofstream(work_ / "lora" / "sample_only" / "tiny-step00009999.safetensors") << "stale";
  const pid_t pid = spawn(a, work_ / "trainer.out", work_ / "trainer.err");
  for (int i = 0; i < 12000 && !fs::exists(work_ / "events.sock"); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  sub.connect(endpoint);
  std::set<int64_t> heard;
  std::map<int64_t, std::string> path_of;
  bool done = false;
  for (int i = 0; i < 1200 && !done; ++i) {
    const wire::Received r = wire::receive(sub, std::chrono::milliseconds(100));
    if (const auto* c = r.as<wire::CheckpointReady>()) {
      heard.insert(static_cast<int64_t>(c->step()));
      path_of[static_cast<int64_t>(c->step())] = c->path();
      done = c->final();
    }
  }
  ASSERT_EQ(wait_exit(pid), 0) << read_text(work_ / "trainer.err");
  const std::string log = read_text(work_ / "trainer.err");
  std::smatch m;
  ASSERT_TRUE(std::regex_search(log, m, std::regex(R"((\d+) steps per epoch)"))) << log;
  const int64_t per_epoch = std::stoll(m[1]);
  ASSERT_LT(per_epoch, total) << "no epoch ends inside the run: the epoch schedule goes untested";
  std::set<int64_t> expected = {total}, sample_only = {0};
  for (int64_t s = 1; s < total; ++s) {
    const bool saves = s % save == 0;
    if (saves) expected.insert(s);
    const bool sample = epochs > 0 ? s % per_epoch == 0 && (s / per_epoch) % epochs == 0
                                   : every > 0 && s % every == 0;
    if (sample && !saves) {
      expected.insert(s);
      sample_only.insert(s);
    }
  }
  heard.erase(0);  // sent before the subscriber may have joined; the log says it was written
  EXPECT_EQ(heard, expected) << per_epoch << " steps per epoch";
  EXPECT_NE(log.find("sample_only/tiny-step00000000.safetensors"), std::string::npos) << log;
  for (int64_t step : expected) {
    const bool only = sample_only.count(step) > 0;
    EXPECT_EQ(path_of[step].find("/lora/sample_only/tiny-step") != std::string::npos, only)
        << "step " << step << ": " << path_of[step];
  }
  // The newest three sample-only saves are kept, another run's too; the stale one is gone.
  std::set<std::string> kept, newest = {"zeta-step00000001.safetensors"};
  for (const auto& e : fs::directory_iterator(work_ / "lora" / "sample_only")) {
    kept.insert(e.path().filename().string());
  }
  auto it = sample_only.rbegin();
  for (int k = 0; k < 3 && it != sample_only.rend(); ++k, ++it) {
    char name[64];
    std::snprintf(name, sizeof name, "tiny-step%08lld.safetensors", static_cast<long long>(*it));
    newest.insert(name);
  }
  EXPECT_EQ(kept, newest);
  EXPECT_EQ(log.find("--sample_every_n_steps is ignored") != std::string::npos,
            every > 0 && epochs > 0)
      << log;
}

TEST_F(TrainRunTest, SampleScheduleAnnouncesCheckpointsBetweenSaves) {
  expect_sample_schedule(/*every=*/20, /*epochs=*/0);
}

TEST_F(TrainRunTest, SampleScheduleOfEpochsIgnoresTheStepsAsKohyas) {
  expect_sample_schedule(/*every=*/20, /*epochs=*/1);
}

// A remote cacher (lorapipe-cacher --serve over tcp) that dies mid-run: the trainer says it is
// waiting, and carries on when the cacher is back; the LoRA is the one a run that never lost its
// cacher gives (records and every random draw are the same).
TEST_F(TrainRunTest, RemoteCacherThatGoesAwayIsWaitedFor) {
  const int port = 20000 + getpid() % 20000;
  const std::string rep = "tcp://127.0.0.1:" + std::to_string(port);
  auto serve = [&](const std::string& tag) { return serve_cache(rep, tag); };
  pid_t cacher = serve("a");
  const std::vector<std::string> extra{"--max_train_steps=60", "--timeout_s=120",
                                       "--cacher=" + rep};
  const pid_t pid = spawn(args(work_, extra), work_ / "trainer.out", work_ / "trainer.err");
  auto wait_for = [&](const std::string& text) {
    for (int i = 0; i < 1200; ++i) {
      if (read_text(work_ / "trainer.err").find(text) != std::string::npos) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return false;
  };
  ASSERT_TRUE(wait_for("step 20/60")) << read_text(work_ / "trainer.err");
  ::kill(cacher, SIGKILL);
  wait_exit(cacher);
  ASSERT_TRUE(wait_for("does not answer; waiting")) << read_text(work_ / "trainer.err");
  cacher = serve("b");
  EXPECT_EQ(wait_exit(pid), 0) << read_text(work_ / "trainer.err");
  EXPECT_NE(read_text(work_ / "trainer.err").find("is back"), std::string::npos);
  ::kill(cacher, SIGTERM);
  wait_exit(cacher);
  const TrainRun local = run(work_ / "local", {"--max_train_steps=60"});
  ASSERT_EQ(local.exit, 0) << local.err;
  expect_identical(work_ / "lora" / "tiny.safetensors",
                   work_ / "local" / "lora" / "tiny.safetensors");
}

// A dataset preprocess named from its path gets a manifest named after its content
// (`<name>-<12 hex>`); the trainer given the bare name finds the one manifest of that name, in
// the local cache and through a remote cacher (ListManifests) alike, and names every candidate
// when there are several.
TEST_F(TrainRunTest, BareDatasetNameResolvesLocallyAndThroughARemoteCacher) {
  const fs::path cache = work_ / "cache";
  fs::copy(dir_ / "cache", cache, fs::copy_options::recursive);
  auto add_manifest = [&](const std::string& name) {
    cacher::StoreOptions o;
    o.dir = cache;
    cacher::Store store = cacher::Store::open(o);
    const auto manifest = store.get(cacher::Table::kManifests, kDataset);
    ASSERT_TRUE(manifest.has_value());
    store.put(cacher::Table::kManifests, {{name, *manifest}});
  };
  add_manifest("shared-0123456789ab");
  const int port = 20000 + (getpid() * 3 + 11) % 20000;
  const std::string rep = "tcp://127.0.0.1:" + std::to_string(port);
  auto train = [&](const std::string& tag, bool remote) {
    std::vector<std::string> a = args(work_ / tag, {"--max_train_steps=2", "--dataset_id=shared"});
    a.push_back(remote ? "--cacher=" + rep : "--cache_dir=" + cache.string());
    fs::create_directories(work_ / tag);
    TrainRun r;
    r.exit = wait_exit(spawn(a, work_ / tag / "out", work_ / tag / "err"));
    r.err = read_text(work_ / tag / "err");
    return r;
  };
  auto serve = [&] { return serve_cache(rep, "shared", cache); };
  const std::string resolved = "manifest shared-0123456789ab";
  {
    const TrainRun local = train("local", false);
    ASSERT_EQ(local.exit, 0) << local.err;
    EXPECT_NE(local.err.find(resolved), std::string::npos) << local.err;
    const pid_t cacher = serve();
    const TrainRun remote = train("remote", true);
    ::kill(cacher, SIGTERM);
    wait_exit(cacher);
    ASSERT_EQ(remote.exit, 0) << remote.err << read_text(work_ / "cacher-shared.err");
    EXPECT_NE(remote.err.find(resolved), std::string::npos) << remote.err;
  }
  // A second manifest of that name: refused, both named, on either side.
  add_manifest("shared-ba9876543210");
  const TrainRun local = train("local2", false);
  EXPECT_EQ(local.exit, 2);
  const pid_t cacher = serve();
  const TrainRun remote = train("remote2", true);
  ::kill(cacher, SIGTERM);
  wait_exit(cacher);
  EXPECT_EQ(remote.exit, 2);
  for (const TrainRun* r : {&local, &remote}) {
    EXPECT_NE(r->err.find("shared-0123456789ab"), std::string::npos) << r->err;
    EXPECT_NE(r->err.find("shared-ba9876543210"), std::string::npos) << r->err;
    EXPECT_NE(r->err.find("pass the full name"), std::string::npos) << r->err;
  }
}

// A cacher that stays away longer than --timeout_s: a clear message and exit 2, with a state
// saved at the last completed step, from which a resume on the local cache ends with the LoRA
// of a run that never stopped.
TEST_F(TrainRunTest, RemoteCacherGoneForGoodGivesUpWithAState) {
  const int port = 20000 + (getpid() + 7919) % 20000;
  const std::string rep = "tcp://127.0.0.1:" + std::to_string(port);
  const pid_t cacher = serve_cache(rep, "a");
  const std::vector<std::string> common{"--max_train_steps=40", "--train_batch_size=2",
                                        "--gradient_accumulation_steps=2"};
  auto remote = common;
  remote.insert(remote.end(), {"--timeout_s=2", "--cacher=" + rep});
  const pid_t pid = spawn(args(work_, remote), work_ / "trainer.out", work_ / "trainer.err");
  for (int i = 0; i < 1200; ++i) {
    if (read_text(work_ / "trainer.err").find("step 20/40") != std::string::npos) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ::kill(cacher, SIGKILL);
  wait_exit(cacher);
  EXPECT_EQ(wait_exit(pid), 2);
  const std::string err = read_text(work_ / "trainer.err");
  EXPECT_NE(err.find("giving up"), std::string::npos) << err;
  const fs::path state = work_ / "state" / "tiny-state";
  ASSERT_TRUE(fs::exists(state / "trainer.json")) << err;

  auto resumed = common;
  resumed.push_back("--resume=" + state.string());
  const TrainRun r = run(work_, resumed);
  ASSERT_EQ(r.exit, 0) << r.err;
  // It continued from the state saved on giving up, not from step 0.
  std::smatch at;
  ASSERT_TRUE(std::regex_search(r.err, at, std::regex(R"(resumed from \S+ at step (\d+), epoch)")))
      << r.err;
  EXPECT_GE(std::stoi(at[1]), 20);
  EXPECT_EQ(losses(r.err).size(), 40u - std::stoul(at[1])) << r.err;
  const TrainRun straight = run(work_ / "straight", common);
  ASSERT_EQ(straight.exit, 0) << straight.err;
  expect_identical(work_ / "lora" / "tiny.safetensors",
                   work_ / "straight" / "lora" / "tiny.safetensors");
}

// Ctrl-C while the trainer waits for a remote cacher that stopped answering ends the run at once,
// as a Ctrl-C between steps does (a state saved, exit 130), not after --timeout_s (here 600 s).
// The cacher is frozen (SIGSTOP), so its socket stays up and says nothing.
TEST_F(TrainRunTest, InterruptWhileTheCacherDoesNotAnswerStopsAtOnce) {
  const int port = 20000 + (getpid() + 104729) % 20000;
  const std::string rep = "tcp://127.0.0.1:" + std::to_string(port);
  const pid_t cacher = serve_cache(rep, "a");
  const pid_t pid = spawn(args(work_, {"--max_train_steps=100000", "--timeout_s=600",
                                       "--cacher=" + rep}),
                          work_ / "trainer.out", work_ / "trainer.err");
  for (int i = 0; i < 1200; ++i) {
    if (read_text(work_ / "trainer.err").find("step 5/") != std::string::npos) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ::kill(cacher, SIGSTOP);
  for (int i = 0; i < 1200; ++i) {
    if (read_text(work_ / "trainer.err").find("waiting for it to come back") != std::string::npos) {
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  const std::string waiting = read_text(work_ / "trainer.err");
  ASSERT_NE(waiting.find("waiting for it to come back"), std::string::npos) << waiting;
  // The batches queued before the freeze are trained; then the trainer waits: its log stops.
  for (size_t before = 0, i = 0; i < 600; ++i) {
    std::this_thread::sleep_for(std::chrono::seconds(2));
    const size_t now = read_text(work_ / "trainer.err").size();
    if (now == before) break;
    before = now;
  }
  const auto interrupted = std::chrono::steady_clock::now();
  ::kill(pid, SIGINT);
  std::optional<int> exit_code;
  while (!exit_code && std::chrono::steady_clock::now() - interrupted < std::chrono::seconds(60)) {
    exit_code = runtime::try_wait(pid);
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  if (!exit_code) ::kill(pid, SIGKILL), wait_exit(pid);
  ::kill(cacher, SIGKILL);
  ::kill(cacher, SIGCONT);
  wait_exit(cacher);
  const std::string err = read_text(work_ / "trainer.err");
  ASSERT_TRUE(exit_code.has_value()) << "still waiting a minute after Ctrl-C: " << err;
  EXPECT_EQ(*exit_code, 130) << err;
  EXPECT_TRUE(fs::exists(work_ / "state" / "tiny-state" / "trainer.json")) << err;
}

// --mixed_precision keeps the frozen base in bf16 or fp16 (LoRA in fp32, fp16 with a loss
// scale) and learns the same thing: over 6 steps each loss is within 3% of the fp32 run's.
// bf16 keeps 8 mantissa bits (0.4% per rounding); through the tiny UNet's dozen layers that
// accumulates to about 1% (measured: under 0.1% for fp16, under 1% for bf16); 3% would still
// catch a wrong cast, a scale not undone or a step skipped. --fp8_base over bf16 stores the
// weights with 3 mantissa bits (up to 6% off each, 2% on average): measured 2% on the losses,
// held to 8%, which a weight read wrong (its bits, or unscaled) is far beyond; the parity of
// float8 storage itself is TrainParity.Float8BaseLoConCheckpointedTwoSteps'. --fp8_scaled the
// same (its layers are Float8Weights.ScaledLayersComputeWhatALayerHoldingTheDequantisedWeight-
// Computes'), and --fp8_fast, whose float8 matmuls round the inputs too (about 1.4 times scaled
// float8's error per layer, Float8Weights.ScaledErrorIsBelowPlainOnEveryFamilysLayers); the
// LoRA's metadata says which float8 it trained over.
TEST_F(TrainRunTest, MixedPrecisionLearnsLikeFp32) {
  const std::vector<std::string> common{"--max_train_steps=6", "--train_batch_size=2",
                                        "--gradient_checkpointing"};
  const TrainRun full = run(work_ / "fp32", common);
  ASSERT_EQ(full.exit, 0) << full.err;
  for (const auto& [precision, float8, tolerance] :
       std::vector<std::tuple<std::string, std::string, double>>{{"bf16", "", 0.03},
                                                                 {"fp16", "", 0.03},
                                                                 {"bf16", "fp8", 0.08},
                                                                 {"bf16", "fp8-scaled", 0.08},
                                                                 {"bf16", "fp8-fast", 0.08}}) {
    const bool fp8 = !float8.empty();
    auto extra = common;
    extra.push_back("--mixed_precision=" + precision);
    if (fp8) extra.push_back("--fp8_base");
    if (float8 != "fp8" && fp8) extra.push_back("--fp8_scaled");
    if (float8 == "fp8-fast") extra.push_back("--fp8_fast");
    const std::string tag = precision + (fp8 ? "-" + float8 : "");
    const TrainRun r = run(work_ / tag, extra);
    ASSERT_EQ(r.exit, 0) << tag << ": " << r.err;
    const auto a = losses(full.err), b = losses(r.err);
    ASSERT_EQ(a.size(), 6u);
    ASSERT_EQ(b.size(), 6u) << r.err;
    double worst = 0;
    for (size_t i = 0; i < a.size(); ++i) {
      worst = std::max(worst, std::abs(b[i] - a[i]) / a[i]);
      EXPECT_NEAR(b[i], a[i], tolerance * a[i]) << tag << " step " << i + 1;
    }
    std::printf("[precision] %s: losses within %.3g of fp32's\n", tag.c_str(), worst);
    // And the flag took effect: TensorBoard's float32 losses (the log rounds to 4 decimals,
    // which fp16's differences stay under) are not fp32's.
    EXPECT_NE(tensorboard_losses(work_ / tag), tensorboard_losses(work_ / "fp32"))
        << tag << " trained exactly as fp32 did";
    if (fp8) {
      EXPECT_NE(r.err.find("the U-Net's"), std::string::npos) << r.err;
      const bool scaled = float8 != "fp8", fast = float8 == "fp8-fast";
      EXPECT_EQ(r.err.find("scaled float8_e4m3fn") != std::string::npos, scaled) << r.err;
      EXPECT_EQ(r.err.find("float8 matmuls (--fp8_fast)") != std::string::npos, fast) << r.err;
      const auto meta = models::SafetensorsFile::open(work_ / tag / "lora" / "tiny.safetensors")
                            .metadata();
      EXPECT_EQ(meta.at("ss_fp8_scaled"), scaled ? "True" : "False");
      EXPECT_EQ(meta.at("ss_fp8_fast"), fast ? "True" : "False");
    }
  }
}

// --blocks_to_swap through the trainer on the CPU, where the CPU is both "device" and "host" of
// the same ring the GPU uses: the run says what it swapped, turns checkpointing on (a swapped
// block's weights come back for its recompute), and trains bit-identically to checkpointing
// without the swap, with the validation pass (no gradients) through the ring too.
TEST_F(TrainRunTest, BlockSwapTrainsBitIdenticallyToNoSwap) {
  const std::vector<std::string> common{"--max_train_steps=4", "--train_batch_size=2",
                                        "--validation_split=0.25", "--validation_seed=5"};
  auto plain = common;
  plain.push_back("--gradient_checkpointing");
  const TrainRun a = run(work_ / "plain", plain);
  ASSERT_EQ(a.exit, 0) << a.err;
  auto swapped = common;
  swapped.push_back("--blocks_to_swap=4");
  const TrainRun b = run(work_ / "swap", swapped);
  ASSERT_EQ(b.exit, 0) << b.err;
  EXPECT_NE(
      b.err.find("block swap (--blocks_to_swap=4): the transformer blocks of the last 4 of 6"),
      std::string::npos)
      << b.err;
  EXPECT_NE(b.err.find("--blocks_to_swap=4: gradient checkpointing on"), std::string::npos)
      << b.err;
  EXPECT_EQ(losses(a.err), losses(b.err));
  ASSERT_EQ(losses(b.err).size(), 4u) << b.err;
  expect_identical(work_ / "plain" / "lora" / "tiny.safetensors",
                   work_ / "swap" / "lora" / "tiny.safetensors");
  EXPECT_EQ(models::SafetensorsFile::open(work_ / "swap" / "lora" / "tiny.safetensors")
                .metadata()
                .at("ss_blocks_to_swap"),
            "4");
}

#ifdef LORAPIPE_WITH_SAMPLER
// The trainer with a sampler following it (suite named for the sampler's promise).
class SamplerWithTrainer : public TrainRunTest {
 protected:
  void preview_beside_the_trainer(const std::string& mode,
                                  const std::function<std::string(const fs::path&)>& trainer_flag,
                                  const std::function<std::string(const fs::path&)>& sampler_flag,
                                  const std::string& sampler_ready, const std::string& trainer_says,
                                  const std::string& sampler_says);
};

// A sampler that takes 10 s per image leaves the trainer's time unchanged: the trainer publishes
// and never waits. Measured as the trainer's wall time with such a sampler subscribed, against
// the same run with none, in three back-to-back pairs, the median pair's ratio compared (40 steps,
// a save every 5). Tolerance 1.3: the sampler's own work while the trainer runs is one render of
// two 64x64 images in 4 steps and then sleep; a trainer that waited on it even once would take
// 10 s more, over four times its time. In a real run the sampler has a device of its own; here it
// shares two CPU cores with the trainer and with the test ctest runs beside this one, so it runs
// under `nice -n 19`: the test measures waiting, not the sharing of a core (un-niced, a busy
// machine once measured 1.49 for that render's CPU alone).
TEST_F(SamplerWithTrainer, SlowSamplerLeavesTheTrainersTimeUnchanged) {
  std::ofstream(work_ / "prompts.txt") << "a red circle --w 64 --h 64 --s 4\n"
                                       << "a blue square --w 64 --h 64 --s 4\n";
  auto timed_run = [&](const std::string& tag, bool with_sampler) {
    const fs::path out = work_ / tag;
    fs::create_directories(out);
    const std::string endpoint = "ipc://" + (out / "pub.sock").string();
    pid_t sampler = 0;
    if (with_sampler) {
      sampler = spawn(
          {"/usr/bin/nice", "-n", "19", LORAPIPE_SAMPLER_BIN,
           "--pretrained_model_name_or_path=" + tiny_.diffusers.string(),
           "--sample_prompts=" + (work_ / "prompts.txt").string(), "--output_dir=" + out.string(),
           "--sub=" + endpoint, "--device=cpu", "--threads=1", "--delay_per_image_s=10"},
          out / "sampler.out", out / "sampler.err");
      // Timing starts once it has loaded its model and subscribed (its log says "following"),
      // so its start-up is not counted against the trainer.
      for (int wait = 0; wait < 600; ++wait) {
        if (read_text(out / "sampler.err").find("following") != std::string::npos) break;
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
      }
    }
    const auto start = std::chrono::steady_clock::now();
    const TrainRun r =
        run(out, {"--max_train_steps=40", "--save_every_n_steps=5", "--pub=" + endpoint});
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    EXPECT_EQ(r.exit, 0) << r.err;
    if (with_sampler) {
      // The niced sampler may not have had a core yet on a busy machine: it must render, but
      // not necessarily before the trainer is done.
      bool rendered = false;
      for (int wait = 0; wait < 600 && !rendered; ++wait) {
        std::error_code ec;
        for (const auto& entry : fs::directory_iterator(out / "samples", ec)) {
          rendered |= entry.path().extension() == ".png";
        }
        if (!rendered) std::this_thread::sleep_for(std::chrono::milliseconds(100));
      }
      ::kill(sampler, SIGKILL);
      wait_exit(sampler);
      EXPECT_TRUE(rendered) << "the sampler never rendered: " << read_text(out / "sampler.err");
    }
    return seconds;
  };
  // ctest runs this test alone (tests/CMakeLists.txt). Three pairs, each a run without and a run
  // with the sampler back to back (in turn which first), so a change in the machine's load
  // between pairs cancels within each pair's ratio; the median pair decides. A trainer that
  // waited for this sampler would wait 10 s per image, 8 checkpoints a run: a ratio of 10 or more
  // in every pair. The 1.3 allows for the sampler's own start of each render on a second core.
  std::vector<double> ratios;
  for (int pair = 0; pair < 3; ++pair) {
    const std::string n = std::to_string(pair);
    double alone = 0, with = 0;
    if (pair % 2 == 0) {
      alone = timed_run("alone" + n, false);
      with = timed_run("with" + n, true);
    } else {
      with = timed_run("with" + n, true);
      alone = timed_run("alone" + n, false);
    }
    ratios.push_back(with / alone);
    std::printf("[sampler] pair %d: trainer alone %.2f s, with a 10 s/image sampler %.2f s: "
                "ratio %.2f\n", pair, alone, with, with / alone);
  }
  std::sort(ratios.begin(), ratios.end());
  EXPECT_LT(ratios[1], 1.3) << "the median pair's ratio";
}

// A run so short that it ends before a sampler started with it has loaded its model and
// subscribed: the final checkpoint, announced once, must still reach the sampler (it subscribes
// before it loads, and the trainer announces the final one again until a sampler retrying the
// endpoint has joined). Otherwise the sampler waits for it forever, and so does `lorapipe run`.
TEST_F(SamplerWithTrainer, AShortRunsFinalCheckpointReachesASamplerStillStarting) {
  std::ofstream(work_ / "prompts.txt") << "a red circle --w 64 --h 64 --s 2\n";
  const fs::path out = work_ / "short";
  fs::create_directories(out);
  const std::string endpoint = "ipc://" + (out / "pub.sock").string();
  const pid_t sampler =
      spawn({LORAPIPE_SAMPLER_BIN, "--pretrained_model_name_or_path=" + tiny_.diffusers.string(),
             "--sample_prompts=" + (work_ / "prompts.txt").string(), "--output_dir=" + out.string(),
             "--sub=" + endpoint, "--device=cpu", "--threads=1", "--idle_timeout_s=60"},
            out / "sampler.out", out / "sampler.err");
  // Without --output_name (the final save is last.safetensors): kohya names such a run's samples
  // by their step alone.
  std::vector<std::string> a = args(out, {"--max_train_steps=1", "--pub=" + endpoint});
  a.erase(std::find(a.begin(), a.end(), "--output_name=tiny"));
  const pid_t trainer = spawn(a, out / "trainer.out", out / "trainer.err");
  ASSERT_EQ(wait_exit(trainer), 0) << read_text(out / "trainer.err");
  ASSERT_EQ(wait_exit(sampler), 0) << read_text(out / "sampler.err");
  const std::string err = read_text(out / "sampler.err");
  EXPECT_NE(err.find("rendered the run's final checkpoint"), std::string::npos)
      << "the sampler never heard of the final checkpoint: " << err;
  EXPECT_TRUE(fs::exists(out / "samples" / "000001_00.png")) << err;
  EXPECT_TRUE(fs::exists(out / "samples" / "000001_sheet.png")) << err;
}

// A process's private memory (USS): the pages no other process maps, from
// /proc/PID/smaps_rollup (Private_Clean + Private_Dirty), in bytes; -1 once it is gone.
int64_t private_bytes(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/smaps_rollup");
  if (!in) return -1;
  int64_t kib = 0;
  std::string line;
  bool any = false;
  while (std::getline(in, line)) {
    if (line.rfind("Private_Clean:", 0) == 0 || line.rfind("Private_Dirty:", 0) == 0) {
      kib += std::stoll(line.substr(line.find(':') + 1));
      any = true;
    }
  }
  return any ? kib * 1024 : -1;
}

// A trainer and a sampler following it on this CPU, the U-Net widened to 2.4 GB, each given its
// flag of the mode under test; what each must log, and what the sampler logs once it waits or
// follows (before the trainer starts).
void SamplerWithTrainer::preview_beside_the_trainer(
    const std::string& mode, const std::function<std::string(const fs::path&)>& trainer_flag,
    const std::function<std::string(const fs::path&)>& sampler_flag,
    const std::string& sampler_ready, const std::string& trainer_says,
    const std::string& sampler_says) {
  const models::TinyCheckpoint wide =
      models::write_tiny_checkpoint(work_ / "wide", /*seed=*/3, /*unet_width=*/768);
  const int64_t unet_bytes = static_cast<int64_t>(
      fs::file_size(wide.diffusers / "unet" / "diffusion_pytorch_model.safetensors"));
  std::ofstream(work_ / "prompts.txt") << "a red circle --w 64 --h 64 --s 3 --l 1\n";
  const fs::path out = work_ / "run";
  fs::create_directories(out);
  const std::string endpoint = "ipc://" + (out / "pub.sock").string();
  const std::string model = "--pretrained_model_name_or_path=" + wide.diffusers.string();
  const pid_t sampler =
      spawn({LORAPIPE_SAMPLER_BIN, model, "--sample_prompts=" + (work_ / "prompts.txt").string(),
             "--output_dir=" + out.string(), "--sub=" + endpoint, "--device=cpu", "--threads=1",
             "--idle_timeout_s=120", sampler_flag(out)},
            out / "sampler.out", out / "sampler.err");
  // The sampler follows once loaded; over shared weights it loads once the trainer has published
  // them, and says it waits for them first.
  for (int wait = 0; wait < 1200; ++wait) {
    if (read_text(out / "sampler.err").find(sampler_ready) != std::string::npos) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  std::vector<std::string> a =
      args(out, {"--max_train_steps=6", "--save_every_n_steps=2", "--pub=" + endpoint,
                 trainer_flag(out)});
  *std::find(a.begin(), a.end(), "--pretrained_model_name_or_path=" + tiny_.diffusers.string()) =
      model;
  const pid_t trainer = spawn(a, out / "trainer.out", out / "trainer.err");
  // The sampler's private memory, sampled from the trainer's first step (its forward has touched
  // the pages it maps: from then on they are the sampler's and the trainer's) until its last
  // (a trainer on its way out unmaps them, and the pages only the sampler maps then are its own:
  // a sample counts only when the trainer had not reached its last step once it was taken), and
  // whether a render finished meanwhile.
  int64_t most = 0;
  int samples = 0;
  bool rendered_beside_the_trainer = false;
  for (;;) {
    int status = 0;
    if (waitpid(trainer, &status, WNOHANG) == trainer) {
      ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << read_text(out / "trainer.err");
      break;
    }
    const bool stepped =
        std::regex_search(read_text(out / "trainer.err"), std::regex(R"(step [0-9]+/6 )"));
    const int64_t uss = stepped ? private_bytes(sampler) : -1;
    const bool training = read_text(out / "trainer.err").find("step 6/6") == std::string::npos;
    if (uss > 0 && training) {
      most = std::max(most, uss);
      ++samples;
    }
    rendered_beside_the_trainer |=
        training && read_text(out / "sampler.err").find(" images in ") != std::string::npos;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  const int sampler_exit = wait_exit(sampler);  // it renders the final checkpoint, then idles out
  const std::string sampler_err = read_text(out / "sampler.err");
  ASSERT_EQ(sampler_exit, 0) << sampler_err;
  const std::string trainer_err = read_text(out / "trainer.err");
  EXPECT_NE(trainer_err.find(trainer_says), std::string::npos) << trainer_err;
  EXPECT_NE(sampler_err.find(sampler_says), std::string::npos) << sampler_err;
  EXPECT_TRUE(rendered_beside_the_trainer)
      << "no render finished while the trainer ran: " << sampler_err;
  std::printf("[shared weights, %s] U-Net %.0f MiB; the sampler's private memory at most %.0f MiB "
              "(%.2f of it) over %d samples while the trainer ran\n",
              mode.c_str(), unet_bytes / 1048576.0, most / 1048576.0, static_cast<double>(most) / unet_bytes,
              samples);
  EXPECT_GT(samples, 0);
  EXPECT_LT(most, unet_bytes / 4);

  // The final LoRA's image, beside the shared weights, against the merged render.
  const fs::path merged = work_ / "merged";
  const pid_t one_shot =
      spawn({LORAPIPE_SAMPLER_BIN, model, "--sample_prompts=" + (work_ / "prompts.txt").string(),
             "--output_dir=" + merged.string(), "--device=cpu", "--threads=1", "--merge_lora",
             "--lora=" + (out / "lora" / "tiny.safetensors").string()},
            work_ / "merged.out", work_ / "merged.err");
  ASSERT_EQ(wait_exit(one_shot), 0) << read_text(work_ / "merged.err");
  std::vector<fs::path> shared_images, merged_images;
  for (const auto& e : fs::directory_iterator(out / "samples")) {
    if (e.path().filename().string().find("000006_00.png") != std::string::npos) {
      shared_images.push_back(e.path());
    }
  }
  for (const auto& e : fs::directory_iterator(merged / "samples")) {
    if (e.path().filename().string().ends_with("_00.png")) merged_images.push_back(e.path());
  }
  ASSERT_EQ(shared_images.size(), 1u) << sampler_err;
  ASSERT_EQ(merged_images.size(), 1u) << read_text(work_ / "merged.err");
  ASSERT_EQ(VIPS_INIT("trainer_run_test"), 0);
  const vips::VImage x = vips::VImage::new_from_file(shared_images[0].c_str());
  const vips::VImage y = vips::VImage::new_from_file(merged_images[0].c_str());
  ASSERT_EQ(x.width(), y.width());
  ASSERT_EQ(x.height(), y.height());
  const int worst = static_cast<int>((x.cast(VIPS_FORMAT_INT) - y.cast(VIPS_FORMAT_INT)).abs().max());
  std::printf("[shared weights, %s] the final LoRA beside the shared weights against merged: "
              "largest difference %d of 255\n", mode.c_str(), worst);
  EXPECT_LE(worst, 2);
  EXPECT_GT(x.deviate(), 1.0) << "a flat image compares trivially";}

// Previews beside the training on one machine's CPU hold no second copy of the model: with
// --map_weights (which lorapipe run sets when both share the CPU) the trainer and a sampler
// following it both take the base weights as the checkpoint file's mapped pages. Here the U-Net is
// widened to 2.4 GB (the VAE and text encoder are the suite's, so its cache serves): while the
// trainer trains and the sampler renders its checkpoints, the sampler's private memory stays
// under a quarter of the U-Net's bytes (a copy of it would be all of them; what is private is
// LibTorch's own heap, about 200 MB in any process, the tiny VAE and text encoder and the
// render's activations). And its image of the final LoRA, applied beside the shared weights,
// equals the render with that LoRA merged into a private copy of the weights (the sampler's
// --merge_lora, one shot, no mapping) within 2 of 255 per channel: the two orders of the same
// fp32 sums differ in their last bits, which may cross a rounding boundary of the 8-bit image
// (measured: the largest difference is printed).
TEST_F(SamplerWithTrainer, SharedWeightsKeepTheSamplersOwnMemoryUnderAQuarterOfTheModel) {
  preview_beside_the_trainer(
      "mapped file", [](const fs::path&) { return std::string("--map_weights"); },
      [](const fs::path&) { return std::string("--map_weights"); }, "following",
      "--map_weights: ", "are the model file's pages");
}

// The same over the trainer's placed weights (--share_weights / --shared_weights, the machinery
// of previews on the training GPU, here with the CPU's shared memory in place of CUDA IPC): the
// trainer publishes its U-Net, the sampler attaches it read-only and holds no copy of it, and its
// render of the final LoRA equals the merged render as above.
TEST_F(SamplerWithTrainer, SamplerOverTheTrainersPublishedWeightsHoldsNoCopyOfThem) {
  preview_beside_the_trainer(
      "published", [](const fs::path& out) {
        return "--share_weights=" + (out / "shared_weights.json").string();
      },
      [](const fs::path& out) {
        return "--shared_weights=" + (out / "shared_weights.json").string();
      },
      "waiting for the trainer's shared weights", "published ", "attached ");
}
#endif

// Data-parallel ranks: real trainer processes joining a c10d Gloo group on this machine, as the
// launcher's deployments (torchrun, Slurm, Kubernetes) start them.
class LauncherRanks : public TrainRunTest {
 protected:
  // Starts rank `rank` of `world` (the environment torchrun sets) training into `out`.
  pid_t start_rank(int rank, int world, int port, const fs::path& out,
                   std::vector<std::string> extra) const {
    fs::create_directories(out);
    setenv("RANK", std::to_string(rank).c_str(), 1);
    setenv("WORLD_SIZE", std::to_string(world).c_str(), 1);
    setenv("LOCAL_RANK", std::to_string(rank).c_str(), 1);
    setenv("MASTER_ADDR", "127.0.0.1", 1);
    setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
    const std::string tag = "rank" + std::to_string(rank);
    const pid_t pid = spawn(args(out, std::move(extra)), out / (tag + ".out"), out / (tag + ".err"));
    for (const char* name : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"}) {
      unsetenv(name);
    }
    return pid;
  }
  // A port for this test's rendezvous, apart from other tests running at the same time.
  static int port(int offset) { return 20000 + (getpid() * 7 + offset) % 20000; }
};

// Where a rank trains and how the ranks reduce: with several ranks, --device auto or cuda means
// the GPU that LOCAL_RANK names (one rank per GPU, as torchrun and Slurm start them), and ranks on
// GPUs reduce over NCCL where this build has it; on the CPU, or without GPUs, Gloo.
// A dataset TOML's batch_size is per rank, as kohya's is per process: with two ranks a step takes
// twice as many samples, and --train_batch_size the same.
TEST(TrainBatches, DatasetBatchSizeIsPerRank) {
  wire::Manifest manifest;
  manifest.set_dataset_id("per-rank");
  for (int i = 0; i < 8; ++i) {
    wire::ManifestEntry* e = manifest.add_entries();
    e->mutable_bucket()->set_width(64);
    e->mutable_bucket()->set_height(64);
    e->set_repeats(1);
  }
  EXPECT_EQ(trainer::BatchScheduler(manifest, 3, 0, false, 2).batch_size(), 6);
  for (auto& e : *manifest.mutable_entries()) e.set_batch_size(2);
  EXPECT_EQ(trainer::BatchScheduler(manifest, 3, 0, false, 1).batch_size(), 2);
  const trainer::BatchScheduler two_ranks(manifest, 3, 0, false, 2);
  EXPECT_EQ(two_ranks.batch_size(), 4);
  EXPECT_EQ(two_ranks.batches_per_epoch(), 2u) << "8 samples, 4 a step";
}

// Two ranks with batch 2 each against one rank with batch 4: the same global batches, noise and
// timesteps, so the runs agree up to fp32 rounding. What differs is summation order (each rank
// sums its rows and the ranks' gradients are summed, where one rank reduces the whole batch at
// once), about 1e-7 of the largest gradient. Every step's loss (printed to 4 decimals) must be
// the same. In the weights AdamW divides each element's step by that element's own gradient
// scale, so for elements whose gradient is near zero the rounding becomes a visible share of a
// step: measured 2.1e-4 of each tensor's scale after 8 steps at lr 1e-3. Tolerance 1e-3, still
// over a thousand times below what a different global batch makes (one rank with batch 2,
// measured 1.4; required above 1e-1 so the comparison can tell). The rate warms up over 2
// steps: --lr_warmup_steps=2 on one rank, 4 on two, which kohya's schedule counts once per
// process (a warmup counted in optimizer steps on two ranks would train other weights).
// With --clip_skip=2 the text encoder's last layer is never reached: its LoRA gets no gradient on
// any rank and must stay exactly as initialised, as on one rank (AdamW skips it; a zero gradient
// would still decay it).
TEST_F(LauncherRanks, TwoCpuRanksTrainLikeOneRankWithTheGlobalBatch) {
  const std::vector<std::string> common = {"--max_train_steps=8", "--save_every_n_steps=1000",
                                           "--clip_skip=2", "--lr_scheduler=constant_with_warmup"};
  auto with = [&](std::vector<std::string> extra) {
    extra.insert(extra.end(), common.begin(), common.end());
    return extra;
  };
  // kohya's schedule steps once per process: a warmup of 4 steps on two ranks is one of 2 on one.
  const TrainRun one = run(work_ / "one", with({"--train_batch_size=4", "--lr_warmup_steps=2"}));
  ASSERT_EQ(one.exit, 0) << one.err;
  const TrainRun half =
      run(work_ / "half", with({"--train_batch_size=2", "--lr_warmup_steps=2"}));
  ASSERT_EQ(half.exit, 0) << half.err;
  // Rank 1 is given an output folder of its own, and a PUB endpoint: rank 0 alone saves and
  // publishes, so both must stay empty.
  const fs::path two = work_ / "two", two_rank1 = work_ / "two-rank1";
  const std::string rank1_pub = "ipc://" + (work_ / "rank1.sock").string();
  const int p = port(1);
  const pid_t r0 = start_rank(0, 2, p, two, with({"--train_batch_size=2", "--lr_warmup_steps=4"}));
  const pid_t r1 = start_rank(1, 2, p, two_rank1,
                              with({"--train_batch_size=2", "--lr_warmup_steps=4",
                                    "--pub=" + rank1_pub}));
  ASSERT_EQ(wait_exit(r0), 0) << read_text(two / "rank0.err");
  ASSERT_EQ(wait_exit(r1), 0) << read_text(two_rank1 / "rank1.err");
  EXPECT_NE(read_text(two / "rank0.err").find("rank 0 of 2 over gloo"), std::string::npos);

  const auto a = lora(work_ / "one" / "lora" / "tiny.safetensors");
  const auto b = lora(two / "lora" / "tiny.safetensors");
  const auto c = lora(work_ / "half" / "lora" / "tiny.safetensors");
  ASSERT_EQ(a.size(), b.size());
  double worst = 0, other_batch = 0;
  for (const auto& [name, t] : a) {
    if (t.dim() == 0) continue;  // alpha
    const double scale = t.abs().max().item<double>();
    worst = std::max(worst, (b.at(name) - t).abs().max().item<double>() / scale);
    other_batch = std::max(other_batch, (c.at(name) - t).abs().max().item<double>() / scale);
  }
  std::printf("[ranks] two ranks vs one rank, global batch 4, 8 steps: %.2e of the weights' "
              "scale (tolerance 1e-3); one rank with batch 2: %.2e\n",
              worst, other_batch);
  EXPECT_LE(worst, 1e-3);
  EXPECT_GE(other_batch, 1e-1) << "the global batch must matter, or the comparison says nothing";
  int last_layer = -1;
  const std::regex layer(R"(lora_te_text_model_encoder_layers_(\d+)_)");
  for (const auto& [name, t] : a) {
    std::smatch m;
    if (std::regex_search(name, m, layer)) last_layer = std::max(last_layer, std::stoi(m[1]));
  }
  ASSERT_GE(last_layer, 1) << "no text-encoder LoRA to check";
  int unreached = 0;
  for (const auto& [name, t] : a) {
    if (name.find("encoder_layers_" + std::to_string(last_layer) + "_") == std::string::npos) {
      continue;
    }
    ++unreached;
    EXPECT_TRUE(torch::equal(b.at(name), t)) << name << ": a layer no rank reached was updated";
  }
  EXPECT_GT(unreached, 0);
  const auto one_losses = losses(one.err), two_losses = losses(read_text(two / "rank0.err"));
  ASSERT_EQ(one_losses.size(), 8u) << one.err;
  ASSERT_EQ(two_losses.size(), 8u);
  for (size_t i = 0; i < one_losses.size(); ++i) {
    EXPECT_NEAR(two_losses[i], one_losses[i], 1e-4) << "step " << i + 1;
  }
  // Rank 0 saved, once; rank 1 saved, logged and bound nothing.
  EXPECT_EQ(std::distance(fs::directory_iterator(two / "lora"), fs::directory_iterator()), 1);
  for (const auto& entry : fs::directory_iterator(two_rank1)) {
    EXPECT_TRUE(entry.path().filename().string().starts_with("rank1."))
        << "rank 1 wrote " << entry.path();
  }
  EXPECT_FALSE(fs::exists(work_ / "rank1.sock")) << "rank 1 bound its PUB endpoint";
}

// kill -9 of one rank mid-run: the other stops at once with an error naming the lost rank and
// saves a state (rank 0); both ranks started again with --resume finish the run.
TEST_F(LauncherRanks, KilledRankStopsTheOtherAndTheRunResumes) {
  const fs::path out = work_ / "run";
  const std::vector<std::string> extra = {"--max_train_steps=60", "--train_batch_size=2",
                                          "--save_every_n_steps=1000", "--save_state"};
  int p = port(2);
  const pid_t r0 = start_rank(0, 2, p, out, extra);
  const pid_t r1 = start_rank(1, 2, p, out, extra);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (read_text(out / "rank0.out").find("step 5/60") == std::string::npos &&
         read_text(out / "rank0.err").find("step 5/60") == std::string::npos &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  kill(r1, SIGKILL);
  EXPECT_EQ(wait_exit(r1), 128 + SIGKILL);
  EXPECT_EQ(wait_exit(r0), 2) << "rank 0 did not stop";
  const std::string err = read_text(out / "rank0.err");
  EXPECT_NE(err.find("another trainer rank is gone"), std::string::npos) << err;
  EXPECT_NE(err.find("state saved in"), std::string::npos) << err;
  const fs::path state = out / "state" / "tiny-state";
  ASSERT_TRUE(fs::exists(state / "trainer.json")) << err;
  const nlohmann::json saved = nlohmann::json::parse(read_text(state / "trainer.json"));
  const int saved_at = saved["global_step"];
  EXPECT_GE(saved_at, 5);
  EXPECT_LT(saved_at, 60);
  // The data cursor is where the saved step count is (one batch a step here): a cursor a step
  // behind would train that step's batches again after the resume. (The rank is mostly found
  // gone inside a step, where the cursor always was right; found at the next step's stop check,
  // it was a step behind before the cursor moved with every finished step.)
  std::smatch m;
  ASSERT_TRUE(std::regex_search(err, m, std::regex(R"((\d+) batches and \d+ steps per epoch)")))
      << err;
  const int batches = std::stoi(m[1]);
  EXPECT_EQ((saved["epoch"].get<int>() - 1) * batches + saved["next_index"].get<int>(), saved_at)
      << saved.dump();

  std::vector<std::string> again = extra;
  again.push_back("--resume=" + state.string());
  p = port(3);
  const pid_t s0 = start_rank(0, 2, p, out, again);
  const pid_t s1 = start_rank(1, 2, p, out, again);
  EXPECT_EQ(wait_exit(s0), 0) << read_text(out / "rank0.err");
  EXPECT_EQ(wait_exit(s1), 0) << read_text(out / "rank1.err");
  EXPECT_NE(read_text(out / "rank0.err").find("resumed from " + state.string() + " at step " +
                                                std::to_string(saved_at)),
            std::string::npos);
  EXPECT_TRUE(fs::exists(out / "lora" / "tiny.safetensors"));
}

}  // namespace
}  // namespace lorapipe
