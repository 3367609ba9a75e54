// The stage binaries on a compute device, without preprocess (so without libvips: the GPU
// machine's build has neither): lorapipe-cacher encodes samples sent to it over ZeroMQ as
// preprocess sends them, lorapipe-trainer trains on its cache with --save_state, and a second run
// resumes from the state saved halfway and ends where the straight run ended; the sampler's
// render (its library: the stage binary writes PNGs through libvips) draws the trained
// checkpoint there.
//
// The device is LORAPIPE_STAGE_DEVICE, else CUDA where torch sees it, else the CPU: CI runs the
// chain on the CPU, tests/gpu/run.sh on the GPU, where none of the stages had run before.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <map>
#include <random>
#include <thread>

#include "models/lora_merge.h"
#include "models/parity_util.h"
#include "models/placement.h"
#include "models/registry.h"
#include "models/safetensors.h"
#include "models/tiny.h"
#include "models/weights.h"
#include "process_util.h"
#include "proto/wire.h"
#include "sampler/render.h"

namespace lorapipe {
namespace {
namespace fs = std::filesystem;
using testing::read_text;
using testing::spawn;
using testing::wait_exit;

std::string stage_device() {
  if (const char* d = std::getenv("LORAPIPE_STAGE_DEVICE"); d != nullptr && *d) return d;
  return torch::cuda::is_available() ? "cuda" : "cpu";
}

using testing::trainer_losses;

class StagesOnDevice : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new fs::path(models::testing::make_temp_dir("stages-on-device"));
    tiny_ = new models::TinyCheckpoint(models::write_tiny_checkpoint(*dir_ / "model"));
  }
  static void TearDownTestSuite() {
    if (!std::getenv("LORAPIPE_KEEP")) fs::remove_all(*dir_);
    delete tiny_;
    delete dir_;
  }

  // Eight 64x64 samples of random pixels in one bucket, as preprocess sends them, and the end of
  // the stream; the cacher's exit code.
  static int cache(const fs::path& cache_dir) {
    const fs::path work = *dir_ / "cacher";
    fs::create_directories(work);
    const pid_t cacher = spawn({LORAPIPE_CACHER_BIN, "--model=" + tiny_->diffusers.string(),
                                "--cache_dir=" + cache_dir.string(), "--device=" + stage_device(),
                                "--pull=ipc://" + (work / "pull.sock").string(),
                                "--rep=ipc://" + (work / "rep.sock").string(),
                                "--idle_timeout_s=120"},
                               work / "cacher.out", work / "cacher.err");
    zmq::context_t context;
    zmq::socket_t push = wire::make_socket(context, zmq::socket_type::push);
    push.connect("ipc://" + (work / "pull.sock").string());
    std::mt19937 rng(3);
    for (int i = 0; i < 8; ++i) {
      wire::ImageSample s;
      const std::string name = "image" + std::to_string(i) + ".png";
      s.set_dataset_id("device");
      s.set_path("/photos/" + name);
      s.set_image_key("content-" + name + ".transform");
      for (auto* size : {s.mutable_bucket(), s.mutable_original_size(), s.mutable_resized()}) {
        size->set_width(64);
        size->set_height(64);
      }
      s.set_caption(i % 2 ? "a red circle" : "a blue square");
      s.set_repeats(1);
      s.set_channels(3);
      std::string pixels(64 * 64 * 3, '\0');
      for (char& c : pixels) c = static_cast<char>(rng() & 0xff);
      s.set_pixels(std::move(pixels));
      EXPECT_EQ(wire::send(push, s), wire::SendStatus::kSent);
    }
    wire::DatasetReport report;
    report.set_dataset_id("device");
    report.set_dataset_id_given(true);
    EXPECT_EQ(wire::send(push, report), wire::SendStatus::kSent);
    const int exit = wait_exit(cacher);
    EXPECT_EQ(exit, 0) << read_text(work / "cacher.err");
    return exit;
  }

  struct Run {
    int exit = -1;
    std::string err;
  };
  static Run train(const fs::path& cache_dir, const fs::path& out, std::vector<std::string> extra) {
    fs::create_directories(out);
    std::vector<std::string> args{LORAPIPE_TRAINER_BIN,
                                  "--pretrained_model_name_or_path=" + tiny_->diffusers.string(),
                                  "--cache_dir=" + cache_dir.string(),
                                  "--dataset_id=device",
                                  "--output_dir=" + out.string(),
                                  "--output_name=tiny",
                                  "--device=" + stage_device(),
                                  "--threads=1",  // ctest runs two tests at once on two cores
                                  "--learning_rate=1e-3",
                                  "--network_dim=4",
                                  "--network_alpha=4",
                                  "--train_batch_size=2",
                                  "--max_train_steps=4",
                                  "--save_state",
                                  "--save_every_n_steps=2"};
    args.insert(args.end(), extra.begin(), extra.end());
    const pid_t pid = spawn(args, out / "trainer.out", out / "trainer.err");
    Run r;
    r.exit = wait_exit(pid);
    r.err = read_text(out / "trainer.err");
    return r;
  }

  static fs::path* dir_;
  static models::TinyCheckpoint* tiny_;
};
fs::path* StagesOnDevice::dir_ = nullptr;
models::TinyCheckpoint* StagesOnDevice::tiny_ = nullptr;

// The cacher encodes on the device, the trainer trains the U-Net's LoRA there from the cache (text
// included; the text encoder stays on the CPU) and saves its state; resumed from the state of
// step 2, the run's last two losses and its final LoRA are the straight run's. A run that also
// trains the text encoder's LoRA encodes the captions online, on the device. On the CPU they are equal bit for bit (the same kernels on the same
// numbers); on CUDA some backward kernels may sum in another order from run to run, so the LoRA is
// held to 1e-5 relative and the losses to 1e-5 relative (fp32 throughout; measured equal on the
// CPU).
TEST_F(StagesOnDevice, CacherEncodesTrainerTrainsSavesAndResumes) {
  const std::string device = stage_device();
  std::printf("[stages] device %s\n", device.c_str());
  const fs::path cache_dir = *dir_ / "cache";
  ASSERT_EQ(cache(cache_dir), 0);

  const fs::path straight_dir = *dir_ / "straight";
  const Run straight = train(cache_dir, straight_dir, {"--network_train_unet_only"});
  ASSERT_EQ(straight.exit, 0) << straight.err;
  EXPECT_NE(straight.err.find("text from the cache"), std::string::npos) << straight.err;
  const fs::path half = straight_dir / "state" / "tiny-step00000002-state";
  ASSERT_TRUE(fs::exists(half / "trainer.json")) << half;

  const fs::path resumed_dir = *dir_ / "resumed";
  const Run resumed =
      train(cache_dir, resumed_dir, {"--network_train_unet_only", "--resume=" + half.string()});
  ASSERT_EQ(resumed.exit, 0) << resumed.err;
  const std::vector<double> all = trainer_losses(straight.err), after = trainer_losses(resumed.err);
  ASSERT_EQ(all.size(), 4u) << straight.err;
  ASSERT_EQ(after.size(), 2u) << resumed.err;
  const bool exact = device == "cpu";
  for (size_t i = 0; i < 2; ++i) {
    if (exact) {
      EXPECT_EQ(after[i], all[2 + i]) << "step " << 3 + i;
    } else {
      EXPECT_NEAR(after[i], all[2 + i], 1e-5 * std::abs(all[2 + i])) << "step " << 3 + i;
    }
  }
  const auto a = models::read_tensors(
      models::SafetensorsFile::open(straight_dir / "lora" / "tiny.safetensors"));
  const auto b = models::read_tensors(
      models::SafetensorsFile::open(resumed_dir / "lora" / "tiny.safetensors"));
  ASSERT_EQ(a.size(), b.size());
  ASSERT_GT(a.size(), 10u);
  for (const auto& [name, t] : a) {
    if (exact) {
      EXPECT_TRUE(torch::equal(b.at(name), t)) << name;
    } else {
      EXPECT_LE(models::testing::relative_error(b.at(name), t), 1e-5) << name;
    }
  }

  const Run both = train(cache_dir, *dir_ / "both", {});
  ASSERT_EQ(both.exit, 0) << both.err;
  EXPECT_NE(both.err.find("text encoded online"), std::string::npos) << both.err;
  EXPECT_EQ(trainer_losses(both.err).size(), 4u) << both.err;
  for (double loss : trainer_losses(both.err)) EXPECT_TRUE(std::isfinite(loss)) << both.err;

  // The sampler's render of the trained checkpoint on the device (the stage's path: load, place,
  // the LoRA in the layers' slots, then render): finite, changed by the LoRA, and the CPU's
  // image where the device is the CPU. On CUDA the pixels are held to 2 of 255 against the CPU
  // render (fp32 throughout; the kernels' summation orders differ, and four Euler-ancestral steps
  // at 64x64 carry that far less than a level; a wrong placement or a LoRA left on the CPU shows
  // up as a crash or a different image).
  sampler::RenderRequest request;
  request.prompt = "a photo of a cat";
  request.negative_prompt = "blurry";
  request.width = request.height = 64;
  request.steps = 4;
  request.cfg_scale = 5;
  request.seed = 7;
  request.sampler = "euler_a";
  auto render_on = [&](const std::string& on, bool with_lora) {
    std::unique_ptr<models::DiffusionModel> model = models::load_model(tiny_->diffusers, {});
    models::Placement placement;
    placement.device = c10::Device(on);
    models::place(*model, placement);
    std::unique_ptr<models::MergedLora> lora;
    if (with_lora) {
      lora = std::make_unique<models::MergedLora>(
          *model, straight_dir / "lora" / "tiny.safetensors", /*multiplier=*/1.0);
    }
    return sampler::render(*model, request).image;
  };
  const at::Tensor on_device = render_on(device, /*with_lora=*/true);
  const at::Tensor on_cpu = render_on("cpu", /*with_lora=*/true);
  const at::Tensor without = render_on("cpu", /*with_lora=*/false);
  ASSERT_EQ(on_device.sizes(), on_cpu.sizes());
  const int64_t most =
      (on_device.to(torch::kInt32) - on_cpu.to(torch::kInt32)).abs().max().item<int64_t>();
  std::printf("[stages] sampler on %s: most pixel difference from the CPU render %lld\n",
              device.c_str(), static_cast<long long>(most));
  if (exact) {
    EXPECT_TRUE(torch::equal(on_device, on_cpu));
  } else {
    EXPECT_LE(most, 2);
  }
  EXPECT_FALSE(torch::equal(on_cpu, without)) << "the trained LoRA left the render unchanged";
}

}  // namespace
}  // namespace lorapipe
