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

#include <fcntl.h>
#include <sys/file.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <algorithm>
#include <map>
#include <random>
#include <thread>

#if __has_include(<c10/cuda/CUDACachingAllocator.h>)
#include <c10/cuda/CUDACachingAllocator.h>
#define LORAPIPE_TEST_CUDA_ALLOCATOR 1
#endif

#include "models/device.h"
#include "models/lora_merge.h"
#include "models/parity_util.h"
#include "models/placement.h"
#include "models/registry.h"
#include "models/safetensors.h"
#include "models/shared_weights.h"
#include "models/tiny.h"
#include "models/weights.h"
#include "process_util.h"
#include "proto/wire.h"
#include "sampler/render.h"
#include "tests/damaged_model.h"
#include "tests/paths.h"

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

// Opens `manifest` as soon as the trainer publishes it and takes a shared lock on it, as a
// sampler's attach does; -1 when the trainer ends first or two minutes pass. Polled every 5 ms:
// on a GPU the trainer's four tiny steps take well under a second after it publishes, and it
// releases its weights at its end when no lock is held.
int hold_when_published(const fs::path& manifest, pid_t trainer) {
  for (int wait = 0; wait < 24000; ++wait) {
    const int fd = open(manifest.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd >= 0) {
      while (flock(fd, LOCK_SH) != 0 && errno == EINTR) {
      }
      return fd;
    }
    int status = 0;
    if (waitpid(trainer, &status, WNOHANG) != 0) return -1;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return -1;
}

class StagesOnDevice : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    // cuDNN convolutions default to TF32 (a 10-bit mantissa) in LibTorch: the render compared
    // with the CPU's within 2 of 255 is the fp32 one, so this process's renders run in IEEE fp32.
    at::globalContext().setAllowTF32CuDNN(false);
    dir_ = new fs::path(models::testing::make_temp_dir("stages-on-device"));
    tiny_ = new models::TinyCheckpoint(models::write_tiny_checkpoint(*dir_ / "model"));
    tiny_sdxl_ = new models::TinyCheckpoint(models::write_tiny_sdxl_checkpoint(*dir_ / "sdxl"));
  }
  static void TearDownTestSuite() {
    if (!std::getenv("LORAPIPE_KEEP")) fs::remove_all(*dir_);
    delete tiny_;
    delete tiny_sdxl_;
    delete dir_;
  }

  // Eight 64x64 samples of random pixels in one bucket, as preprocess sends them, and the end of
  // the stream, cached with `model` (the tiny SD1.5 by default); the cacher's exit code.
  static int cache(const fs::path& cache_dir, const fs::path& model = {}) {
    const fs::path work = cache_dir.parent_path() / (cache_dir.filename().string() + "-cacher");
    fs::create_directories(work);
    const pid_t cacher = spawn({LORAPIPE_CACHER_BIN,
                                "--model=" + (model.empty() ? tiny_->diffusers : model).string(),
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
  static Run train(const fs::path& cache_dir, const fs::path& out, std::vector<std::string> extra,
                   const fs::path& model = {}) {
    fs::create_directories(out);
    std::vector<std::string> args{LORAPIPE_TRAINER_BIN,
                                  "--pretrained_model_name_or_path=" +
                                      (model.empty() ? tiny_->diffusers : model).string(),
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

  // The sampler's render of `lora` over `model` on `on` (the stage's path: load, place, the LoRA
  // in the layers' slots, then render); no LoRA where `lora` is empty. `blocks_to_swap`: the
  // sampler's placement under it (the blocks swapped, the text encoders on the CPU).
  static at::Tensor render_on(const fs::path& model_path, const std::string& on,
                              const fs::path& lora_path, int blocks_to_swap = 0) {
    sampler::RenderRequest request;
    request.prompt = "a photo of a cat";
    request.negative_prompt = "blurry";
    request.width = request.height = 64;
    request.steps = 4;
    request.cfg_scale = 5;
    request.seed = 7;
    request.sampler = "euler_a";
    std::unique_ptr<models::DiffusionModel> model = models::load_model(model_path, {});
    models::Placement placement;
    placement.device = models::resolve_device(on);
    // The sampler's placement under the run's --blocks_to_swap (sampler/sampler.cpp).
    placement.blocks_to_swap = blocks_to_swap;
    placement.text_encoders_on_device = blocks_to_swap == 0;
    models::place(*model, placement);
    std::unique_ptr<models::MergedLora> lora;
    if (!lora_path.empty()) {
      lora = std::make_unique<models::MergedLora>(*model, lora_path, /*multiplier=*/1.0);
    }
    return sampler::render(*model, request).image;
  }

  // The render on the device against the CPU's: equal on the CPU, within 2 of 255 on CUDA (see
  // the first test), and changed by the LoRA.
  static void expect_render_matches_cpu(const fs::path& model, const fs::path& lora,
                                        const std::string& what) {
    const std::string device = stage_device();
    const at::Tensor on_cpu = render_on(model, "cpu", lora);
    const at::Tensor without = render_on(model, "cpu", {});
    // Also with one block swapped and the text encoders on the CPU, as the sampler renders
    // under --blocks_to_swap: the swap's copy stream and the CPU's conditioning on the device.
    for (const int swap : {0, 1}) {
      const at::Tensor on_device = render_on(model, device, lora, swap);
      ASSERT_EQ(on_device.sizes(), on_cpu.sizes());
      const int64_t most =
          (on_device.to(torch::kInt32) - on_cpu.to(torch::kInt32)).abs().max().item<int64_t>();
      std::printf("[stages] %s sampler on %s, --blocks_to_swap=%d: most pixel difference from "
                  "the CPU render %lld\n",
                  what.c_str(), device.c_str(), swap, static_cast<long long>(most));
      if (device == "cpu") {
        EXPECT_TRUE(torch::equal(on_device, on_cpu)) << what << " swap " << swap;
      } else {
        EXPECT_LE(most, 2) << what << " swap " << swap;
      }
    }
    EXPECT_FALSE(torch::equal(on_cpu, without)) << what << ": the trained LoRA left the render unchanged";
  }

  static fs::path* dir_;
  static models::TinyCheckpoint* tiny_;
  static models::TinyCheckpoint* tiny_sdxl_;
};
fs::path* StagesOnDevice::dir_ = nullptr;
models::TinyCheckpoint* StagesOnDevice::tiny_ = nullptr;
models::TinyCheckpoint* StagesOnDevice::tiny_sdxl_ = nullptr;

// The cacher encodes on the device, the trainer trains the U-Net's LoRA there from the cache (text
// included; the text encoder stays on the CPU) and saves its state; resumed from the state of
// step 2, the run's last two losses and its final LoRA are the straight run's. A run that also
// trains the text encoder's LoRA encodes the captions online, on the device. On the CPU they are
// equal bit for bit (the same kernels on the same numbers). On CUDA the backward kernels (cuDNN's
// weight gradients, attention's) sum in an order that changes from run to run, and Adam's
// normalised step carries a gradient's last bits far in the elements whose gradients are near
// zero: on an H200 two straight runs' LoRA tensors differ by up to 9e-2 relative after four
// steps, a resumed run's from the straight one's by 1.4e-3 (two noisy steps instead of four). So
// on CUDA the test measures the spread of the two steps after the resume with a second resume
// from the same state, and holds the resumed run to ten times that from the straight run (a
// resume that lost the optimizer's state or the data cursor takes a different first step and
// lands far outside); the losses stay within 1e-5 relative (fp32 throughout).
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
    std::printf("[stages] step %zu loss: straight %.9g, resumed %.9g\n", 3 + i, all[2 + i], after[i]);
    if (exact) {
      EXPECT_EQ(after[i], all[2 + i]) << "step " << 3 + i;
    } else {
      EXPECT_NEAR(after[i], all[2 + i], 1e-5 * std::abs(all[2 + i])) << "step " << 3 + i;
    }
  }
  auto lora_of = [](const fs::path& run_dir) {
    return models::read_tensors(
        models::SafetensorsFile::open(run_dir / "lora" / "tiny.safetensors"));
  };
  const auto a = lora_of(straight_dir);
  const auto b = lora_of(resumed_dir);
  ASSERT_EQ(a.size(), b.size());
  ASSERT_GT(a.size(), 10u);
  // The largest relative difference between two runs' LoRA tensors.
  auto most_apart = [&a](const std::map<std::string, at::Tensor>& other) {
    double most = 0;
    for (const auto& [name, t] : a) {
      most = std::max(most, models::testing::relative_error(other.at(name), t));
    }
    return most;
  };
  if (exact) {
    for (const auto& [name, t] : a) EXPECT_TRUE(torch::equal(b.at(name), t)) << name;
  } else {
    const fs::path again_dir = *dir_ / "resumed-again";
    const Run again =
        train(cache_dir, again_dir, {"--network_train_unet_only", "--resume=" + half.string()});
    ASSERT_EQ(again.exit, 0) << again.err;
    const auto c = lora_of(again_dir);
    double spread = 0;  // between the two resumed runs
    for (const auto& [name, t] : b) {
      spread = std::max(spread, models::testing::relative_error(c.at(name), t));
    }
    const double resumed_apart = most_apart(b);
    std::printf("[stages] LoRA after 4 steps: two runs resumed from step 2 differ by %.3g relative "
                "at most, the resumed run from the straight one by %.3g\n", spread, resumed_apart);
    // 1e-6: the floor where the device's kernels happen to repeat themselves exactly.
    EXPECT_LE(resumed_apart, 10 * std::max(spread, 1e-6));
  }

  const Run both = train(cache_dir, *dir_ / "both", {});
  ASSERT_EQ(both.exit, 0) << both.err;
  EXPECT_NE(both.err.find("text encoded online"), std::string::npos) << both.err;
  EXPECT_EQ(trainer_losses(both.err).size(), 4u) << both.err;
  for (double loss : trainer_losses(both.err)) EXPECT_TRUE(std::isfinite(loss)) << both.err;

  // The sampler's render of the trained checkpoint on the device: finite, changed by the LoRA,
  // and the CPU's image where the device is the CPU. On CUDA the pixels are held to 2 of 255
  // against the CPU render (fp32 throughout; the kernels' summation orders differ, and four
  // Euler-ancestral steps at 64x64 carry that far less than a level; a wrong placement or a LoRA
  // left on the CPU shows up as a crash or a different image).
  expect_render_matches_cpu(tiny_->diffusers, straight_dir / "lora" / "tiny.safetensors", "sd15");
}

// The trainer's look for the weight behind non-finite steps, on the stage's device: a NaN in
// the model file's U-Net (tests/damaged_model.h) stops the run after --max_bad_steps with that
// weight named, its tensors read where the placement put them.
TEST_F(StagesOnDevice, NonFiniteStepsNameTheDamagedWeightOnTheDevice) {
  const fs::path cache_dir = *dir_ / "cache-damaged";
  ASSERT_EQ(cache(cache_dir), 0);
  const fs::path damaged = *dir_ / "damaged-model";
  const std::string poisoned =
      lorapipe::testing::copy_with_a_nan_weight(tiny_->diffusers, damaged, "mid_block.");
  const Run r = train(cache_dir, *dir_ / "damaged",
                      {"--network_train_unet_only", "--max_bad_steps=2"}, damaged);
  EXPECT_EQ(r.exit, 2) << r.err;
  EXPECT_NE(r.err.find("The model's own weight '" + poisoned + "' (its denoiser"),
            std::string::npos)
      << r.err;
}

// SDXL through the same stages on the device: the cacher encodes its latents and both encoders'
// text (states and pooled output) there, the trainer trains from that cache with the time ids of
// each sample (U-Net only, text from the cache; then both encoders' LoRAs with the text encoded
// online on the device), and the sampler renders the result there as on the CPU.
TEST_F(StagesOnDevice, SdxlCachesTrainsAndRendersOnTheDevice) {
  const fs::path model = tiny_sdxl_->diffusers;
  const fs::path cache_dir = *dir_ / "sdxl-cache";
  ASSERT_EQ(cache(cache_dir, model), 0);
  const Run unet_only = train(cache_dir, *dir_ / "sdxl-unet", {"--network_train_unet_only"}, model);
  ASSERT_EQ(unet_only.exit, 0) << unet_only.err;
  EXPECT_NE(unet_only.err.find("text from the cache"), std::string::npos) << unet_only.err;
  const Run both = train(cache_dir, *dir_ / "sdxl-both", {}, model);
  ASSERT_EQ(both.exit, 0) << both.err;
  EXPECT_NE(both.err.find("text encoded online"), std::string::npos) << both.err;
  for (const Run* run : {&unet_only, &both}) {
    ASSERT_EQ(trainer_losses(run->err).size(), 4u) << run->err;
    for (double loss : trainer_losses(run->err)) EXPECT_TRUE(std::isfinite(loss)) << run->err;
  }
  const fs::path lora = *dir_ / "sdxl-both" / "lora" / "tiny.safetensors";
  const auto tensors = models::read_tensors(models::SafetensorsFile::open(lora));
  size_t te1 = 0, te2 = 0;
  for (const auto& [name, t] : tensors) {
    te1 += name.rfind("lora_te1_", 0) == 0;
    te2 += name.rfind("lora_te2_", 0) == 0;
  }
  EXPECT_GT(te1, 0u);
  EXPECT_GT(te2, 0u);
  expect_render_matches_cpu(model, lora, "sdxl");
}

// Previews on the training device without a second model: the trainer publishes its placed U-Net
// (--share_weights; CUDA IPC handles on a GPU, shared memory on the CPU) and this process, as the
// sampler does, attaches its own loaded model's U-Net to them instead of placing it. On CUDA the
// attach takes under a quarter of the U-Net's bytes from its own allocator (the IPC memory is the
// trainer's),
// and the trainer, done, waits for this process to let go before it frees them. The render of the
// final LoRA over the trainer's weights equals the render over an own copy on the same device
// (bit for bit on the CPU; within 2 of 255 on CUDA, whose convolution algorithms may differ
// between two models' first calls).
TEST_F(StagesOnDevice, SamplerRendersOverTheTrainersPublishedWeights) {
  const std::string device = stage_device();
  const fs::path cache_dir = *dir_ / "shared-cache";
  ASSERT_EQ(cache(cache_dir), 0);
  const fs::path out = *dir_ / "shared";
  fs::create_directories(out);
  const fs::path manifest = out / "shared_weights.json";
  std::vector<std::string> args{LORAPIPE_TRAINER_BIN,
                                "--pretrained_model_name_or_path=" + tiny_->diffusers.string(),
                                "--cache_dir=" + cache_dir.string(), "--dataset_id=device",
                                "--output_dir=" + out.string(), "--output_name=tiny",
                                "--device=" + device, "--threads=1", "--learning_rate=1e-3",
                                "--network_dim=4", "--train_batch_size=2", "--max_train_steps=4",
                                "--share_weights=" + manifest.string()};
  const pid_t trainer = spawn(args, out / "trainer.out", out / "trainer.err");
  const fs::path lora = out / "lora" / "tiny.safetensors";
  {
    // Declared before the model it holds the weights of: it goes after the model, so the trainer
    // frees nothing this process still maps.
    std::unique_ptr<models::SharedWeightsAttachment> attachment;
    // Held until the attach holds its own lock: the trainer cannot release in between.
    const int early = hold_when_published(manifest, trainer);
    ASSERT_GE(early, 0) << read_text(out / "trainer.err");
    std::unique_ptr<models::DiffusionModel> model = models::load_model(tiny_->diffusers, {});
    models::Placement placement;
    placement.device = models::resolve_device(device);  // "cuda" -> "cuda:0", as the stages
    int64_t unet_bytes = 0;
    int64_t attach_allocated = -1;  // what the attach allocates on this process's CUDA allocator
    placement.attach_denoiser = [&](torch::nn::Module& unet) {
      for (const auto& p : unet.parameters()) unet_bytes += static_cast<int64_t>(p.nbytes());
#ifdef LORAPIPE_TEST_CUDA_ALLOCATOR
      auto allocated = [&] {
        return c10::cuda::CUDACachingAllocator::getDeviceStats(placement.device.index())
            .allocated_bytes[0].current;
      };
      const int64_t before = placement.device.is_cuda() ? allocated() : 0;
#endif
      attachment = models::attach_shared_weights(
          unet, placement.device, manifest, models::shared_weights_key(tiny_->diffusers, placement),
          [&] {
            int status = 0;
            if (waitpid(trainer, &status, WNOHANG) != 0) {
              throw std::runtime_error("the trainer ended before it published its weights: " +
                                       read_text(out / "trainer.err"));
            }
          });
#ifdef LORAPIPE_TEST_CUDA_ALLOCATOR
      if (placement.device.is_cuda()) attach_allocated = allocated() - before;
#endif
      return attachment != nullptr;
    };
    models::place(*model, placement);
    close(early);
    ASSERT_NE(attachment, nullptr) << read_text(out / "trainer.err");
    EXPECT_EQ(attachment->bytes(), unet_bytes);
#ifdef LORAPIPE_TEST_CUDA_ALLOCATOR
    if (placement.device.is_cuda()) {
      // The attach's own allocations only: place() also puts the text encoder and the VAE on
      // this device, which the sampler keeps as its own either way.
      std::printf("[stages] attached U-Net %lld bytes; the attach's own allocations %lld\n",
                  static_cast<long long>(unet_bytes), static_cast<long long>(attach_allocated));
      EXPECT_GE(attach_allocated, 0);
      EXPECT_LT(attach_allocated, unet_bytes / 4);
    }
#endif
    for (int wait = 0; wait < 6000 && !fs::exists(lora); ++wait) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    ASSERT_TRUE(fs::exists(lora)) << read_text(out / "trainer.err");
    if (placement.device.is_cuda()) {
      // Done training, the trainer waits for this process to let go of its weights.
      for (int wait = 0; wait < 600; ++wait) {
        if (read_text(out / "trainer.err").find("waiting for the sampler") != std::string::npos) {
          break;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
      }
      EXPECT_NE(read_text(out / "trainer.err").find("waiting for the sampler"), std::string::npos);
      int status = 0;
      EXPECT_EQ(waitpid(trainer, &status, WNOHANG), 0) << "the trainer freed weights in use";
    }
    sampler::RenderRequest request;
    request.prompt = "a photo of a cat";
    request.width = request.height = 64;
    request.steps = 4;
    request.seed = 7;
    request.sampler = "euler_a";
    at::Tensor over_shared;
    {
      models::MergedLora slots(*model, lora, 1.0);
      over_shared = sampler::render(*model, request).image;
    }
    std::unique_ptr<models::DiffusionModel> own = models::load_model(tiny_->diffusers, {});
    models::Placement own_placement;
    own_placement.device = placement.device;
    models::place(*own, own_placement);
    at::Tensor over_own;
    {
      models::MergedLora slots(*own, lora, 1.0);
      over_own = sampler::render(*own, request).image;
    }
    const int64_t most =
        (over_shared.to(torch::kInt32) - over_own.to(torch::kInt32)).abs().max().item<int64_t>();
    std::printf("[stages] render over the trainer's weights on %s: most pixel difference from an "
                "own copy's %lld\n", device.c_str(), static_cast<long long>(most));
    if (device == "cpu") {
      EXPECT_TRUE(torch::equal(over_shared, over_own));
    } else {
      EXPECT_LE(most, 2);
    }
  }  // the model, then the attachment: the trainer may free its weights now
  EXPECT_EQ(wait_exit(trainer), 0) << read_text(out / "trainer.err");
  EXPECT_NE(read_text(out / "trainer.err").find("published "), std::string::npos);
}

}  // namespace
}  // namespace lorapipe
