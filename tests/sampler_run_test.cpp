// lorapipe-sampler as a real process: one shot on a LoRA file, and following a "trainer" (this
// test's own PUB socket, real ZeroMQ) that announces checkpoints faster than a slow sampler
// renders them. Images are read back with libvips (PNG text chunk included).
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>
#include <torch/torch.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <regex>
#include <set>
#include <string>
#include <thread>
#include <vector>
#include <vips/vips8>

#include <cmath>
#include <nlohmann/json.hpp>

#include "deploy/curves.h"
#include "models/pipeline.h"
#include "models/safetensors.h"
#include "models/tiny.h"
#include "models/weights.h"
#include "proto/wire.h"
#include "tests/damaged_model.h"
#include "tests/paths.h"
#include "tests/process_util.h"

namespace lorapipe {
namespace {

namespace fs = std::filesystem;
using testing::read_text;
using testing::spawn;
using testing::wait_exit;

// A random kohya-format LoRA over every layer kohya adapts in `model` (UNet and, unless
// `text_encoder` is false, the text encoder). `extra_module` adds a module of that name (a layer
// of another model).
void write_random_lora(const models::StableDiffusion& model, const fs::path& path, uint64_t seed,
                       int64_t rank = 4, bool text_encoder = true,
                       const std::string& extra_module = "") {
  auto gen = at::detail::createCPUGenerator(seed);
  std::vector<torch::Tensor> keep;
  std::vector<models::TensorToWrite> out;
  auto add = [&](const std::string& name, torch::Tensor t) {
    keep.push_back(t.contiguous());
    out.push_back(
        {name, models::Dtype::kF32, keep.back().sizes().vec(),
         std::string_view(static_cast<const char*>(keep.back().data_ptr()), keep.back().nbytes())});
  };
  if (!extra_module.empty()) {
    add(extra_module + ".lora_down.weight", torch::randn({rank, 640}, gen) * 0.2);
    add(extra_module + ".lora_up.weight", torch::randn({640, rank}, gen) * 0.2);
    add(extra_module + ".alpha", torch::tensor(static_cast<float>(rank)));
  }
  for (const models::LoraTarget& t : model.lora_targets(text_encoder, false)) {
    const auto& w = t.weight();
    std::vector<int64_t> down_shape{rank}, up_shape{w.size(0), rank};
    for (int64_t d = 1; d < w.dim(); ++d) down_shape.push_back(w.size(d));
    for (int64_t d = 2; d < w.dim(); ++d) up_shape.push_back(1);
    add(t.name + ".lora_down.weight", torch::randn(down_shape, gen) * 0.2);
    add(t.name + ".lora_up.weight", torch::randn(up_shape, gen) * 0.2);
    add(t.name + ".alpha", torch::tensor(static_cast<float>(rank)));
  }
  models::write_safetensors(path, out, {{"ss_steps", "40"}});
}

class SamplerRun : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (VIPS_INIT("sampler_run_test") != 0) FAIL() << "libvips";
    dir_ = fs::temp_directory_path() / ("lorapipe-sampler-run-" + std::to_string(getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    tiny_ = models::write_tiny_checkpoint(dir_ / "model", /*seed=*/4);
    const models::StableDiffusion model = models::load_stable_diffusion(tiny_.diffusers);
    for (int step : {10, 20, 30, 50}) {
      write_random_lora(
          model, dir_ / ("run-step" + std::to_string(100000 + step).substr(1) + ".safetensors"),
          step);
    }
    write_random_lora(model, dir_ / "one.safetensors", 1);
    std::ofstream(dir_ / "prompts.txt") << "# two prompts\n"
                                        << "a red circle --w 64 --h 64 --s 4 --d 7\n"
                                        << "a blue square, 青い四角 --n blurry --w 85 --h 64 "
                                           "--s 4 --ss euler_a\n"
                                        << "--w 64 --s 4\n";  // no prompt: skipped
  }
  static void TearDownTestSuite() {
    if (!std::getenv("LORAPIPE_KEEP")) fs::remove_all(dir_);
  }
  void SetUp() override {
    work_ = dir_ / ::testing::UnitTest::GetInstance()->current_test_info()->name();
    fs::remove_all(work_);
    fs::create_directories(work_);
  }
  std::vector<std::string> args(std::vector<std::string> extra) const {
    std::vector<std::string> a{LORAPIPE_SAMPLER_BIN,
                               "--pretrained_model_name_or_path=" + tiny_.diffusers.string(),
                               "--sample_prompts=" + (dir_ / "prompts.txt").string(),
                               "--output_dir=" + work_.string(),
                               "--device=cpu",
                               "--threads=1"};
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  }

  // A one-shot render of one.safetensors with `extra` flags into work_/tag: its exit status and
  // its log.
  std::pair<int, std::string> render_one(const std::string& tag,
                                         std::vector<std::string> extra) const {
    extra.push_back("--lora=" + (dir_ / "one.safetensors").string());
    std::vector<std::string> a = args(extra);
    a[3] = "--output_dir=" + (work_ / tag).string();
    fs::create_directories(work_ / tag);
    const int exit = wait_exit(spawn(a, work_ / tag / "out", work_ / tag / "err"));
    return {exit, read_text(work_ / tag / "err")};
  }

  // What a trainer announces when it saves dir_/run-stepNNNNN.safetensors (SetUpTestSuite
  // writes those LoRAs) with --output_name=run.
  static wire::CheckpointReady checkpoint(int step, bool final = false) {
    wire::CheckpointReady event;
    event.set_run_id("test");
    event.set_path(
        (dir_ / ("run-step" + std::to_string(100000 + step).substr(1) + ".safetensors")).string());
    event.set_step(static_cast<uint64_t>(step));
    event.set_final(final);
    event.set_output_name("run");  // the trainer's --output_name: the samples' name
    return event;
  }

  // A checkpoint's render is complete when the gallery's index lists it (written, atomically,
  // after its images and sheet).
  bool indexed(int step) const {
    const auto index =
        nlohmann::json::parse(read_text(work_ / "samples" / "samples.json"), nullptr, false);
    if (index.is_discarded() || !index.contains("checkpoints")) return false;
    for (const auto& c : index["checkpoints"]) {
      if (c["step"].get<int>() == step) return true;
    }
    return false;
  }

  // Announces `step` every 100 ms until the index lists it (true), the sampler `pid` ends (false,
  // with its exit status in `why`: a crash shows as 128 + signal, not as a 60 s wait) or 60 s pass.
  template <typename Announce>
  bool announce_until_indexed(int step, pid_t pid, Announce announce, std::string* why) const {
    for (int i = 0; i < 600 && !indexed(step); ++i) {
      if (const std::optional<int> ended = runtime::try_wait(pid)) {
        *why = "the sampler ended with " + std::to_string(*ended) + " before step " +
               std::to_string(step) + " was indexed\n";
        return indexed(step);
      }
      announce();
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    if (!indexed(step)) *why = "step " + std::to_string(step) + " not indexed within 60 s\n";
    return indexed(step);
  }

  // The trainer's side of a followed run: CheckpointReady published on ipc:// in `work`.
  struct Trainer {
    zmq::context_t context;
    zmq::socket_t pub;
    std::string endpoint;
    explicit Trainer(const fs::path& work)
        : pub(wire::make_socket(context, zmq::socket_type::pub)),
          endpoint("ipc://" + (work / "trainer.sock").string()) {
      pub.bind(endpoint);
    }
    void announce(int step, bool final = false) {
      ASSERT_EQ(wire::send(pub, checkpoint(step, final)), wire::SendStatus::kSent);
    }
  };

  static fs::path dir_;
  static models::TinyCheckpoint tiny_;
  fs::path work_;
};
fs::path SamplerRun::dir_;
models::TinyCheckpoint SamplerRun::tiny_;

TEST_F(SamplerRun, OneShotWritesImagesSheetAndGallery) {
  const pid_t pid = spawn(args({"--lora=" + (dir_ / "one.safetensors").string() + ":0.7"}),
                          work_ / "out", work_ / "err");
  ASSERT_EQ(wait_exit(pid), 0) << read_text(work_ / "err");
  const std::string err = read_text(work_ / "err");
  EXPECT_NE(err.find("prompts.txt:4: no prompt"), std::string::npos) << err;
  const fs::path samples = work_ / "samples";
  // NAME_<step>_<idx>.png, the step from the file's ss_steps.
  vips::VImage a = vips::VImage::new_from_file((samples / "one_000040_00.png").c_str());
  vips::VImage b = vips::VImage::new_from_file((samples / "one_000040_01.png").c_str());
  EXPECT_EQ(a.width(), 64);
  EXPECT_EQ(b.width(), 80) << "85 rounded down to a multiple of 8";
  const std::string parameters = a.get_string("png-comment-0-parameters");
  EXPECT_NE(parameters.find("a red circle\nSteps: 4, Sampler: DDIM, CFG scale: 7.5, Seed: 7, "
                            "Size: 64x64, Model: "),
            std::string::npos)
      << parameters;
  EXPECT_TRUE(parameters.ends_with(", Lora: one:0.7")) << parameters;
  // UTF-8 text goes into an iTXt chunk (tEXt is Latin-1), which reads back as written.
  const std::string b_parameters = b.get_string("png-comment-0-parameters");
  EXPECT_TRUE(b_parameters.starts_with("a blue square, 青い四角\nNegative prompt: blurry\n"
                                       "Steps: 4, Sampler: Euler a,"))
      << b_parameters;
  // The contact sheet holds the very pixels of each image (tiles in a row, each cell as wide as
  // the widest image plus a 4-pixel shim): libvips builds it lazily, after the renders, so a tile
  // that did not own its pixels would show whatever memory was reused by then.
  ASSERT_TRUE(fs::exists(samples / "one_000040_sheet.png"));
  vips::VImage sheet = vips::VImage::new_from_file((samples / "one_000040_sheet.png").c_str());
  EXPECT_EQ(sheet.extract_area(0, 0, 64, 64).relational(a, VIPS_OPERATION_RELATIONAL_NOTEQ).max(),
            0)
      << "the sheet's first tile differs from one_000040_00.png";
  EXPECT_EQ(sheet.extract_area(84, 0, 80, 64).relational(b, VIPS_OPERATION_RELATIONAL_NOTEQ).max(),
            0)
      << "the sheet's second tile differs from one_000040_01.png";
  EXPECT_TRUE(fs::exists(samples / "index.html"));
  const auto index = nlohmann::json::parse(read_text(samples / "samples.json"));
  ASSERT_EQ(index["checkpoints"].size(), 1u);
  EXPECT_EQ(index["checkpoints"][0]["images"].size(), 2u);
}

// A model whose file holds a NaN (a damaged download) renders black, as diffusers' and kohya's
// samplers do, but not silently: each image says that NaN came out of the denoiser, and what
// to look at. The images are still written, so the gallery keeps its slots.
TEST_F(SamplerRun, ANonFiniteRenderSaysWhereItWentBlack) {
  const fs::path damaged = work_ / "damaged";
  lorapipe::testing::copy_with_a_nan_weight(tiny_.diffusers, damaged, "mid_block.");
  std::vector<std::string> a = args({"--lora=" + (dir_ / "one.safetensors").string()});
  a[1] = "--pretrained_model_name_or_path=" + damaged.string();
  ASSERT_EQ(wait_exit(spawn(a, work_ / "out", work_ / "err")), 0) << read_text(work_ / "err");
  const std::string err = read_text(work_ / "err");
  for (const std::string prompt : {"prompt 0 ('a red circle')", "prompt 1 ('a blue square"}) {
    EXPECT_NE(err.find(", " + prompt), std::string::npos) << err;
  }
  EXPECT_NE(err.find("NaN or infinity came out of the denoiser, so the image is black"),
            std::string::npos)
      << err;
  const vips::VImage image =
      vips::VImage::new_from_file((work_ / "samples" / "one_000040_00.png").c_str());
  EXPECT_EQ(image.max(), 0) << "a NaN image is written black";
  // The same prompts over the intact model say nothing of the kind.
  const auto [exit, intact] = render_one("intact", {});
  ASSERT_EQ(exit, 0) << intact;
  EXPECT_EQ(intact.find("NaN or infinity"), std::string::npos) << intact;
}

// A checkpoint that declares itself v-prediction (ComfyUI's v_pred key, as NoobAI-XL v-pred's
// file carries) is not rendered as epsilon, which draws noise: without --v_parameterization the
// sampler says which key and which flag, and renders with it.
TEST_F(SamplerRun, ACheckpointThatDeclaresVPredictionWantsTheFlag) {
  const models::TinyCheckpoint sdxl = models::write_tiny_sdxl_checkpoint(work_ / "sdxl", 5);
  const models::SafetensorsFile file = models::SafetensorsFile::open(sdxl.single_file);
  auto tensors = models::read_tensors(file);
  tensors["v_pred"] = torch::empty({0});
  std::vector<models::TensorToWrite> out;
  for (const auto& [name, t] : tensors) {
    out.push_back({name, models::to_safetensors_dtype(t.scalar_type()), t.sizes().vec(),
                   std::string_view(static_cast<const char*>(t.data_ptr()), t.nbytes())});
  }
  const fs::path vpred = work_ / "vpred.safetensors";
  models::write_safetensors(vpred, out, file.metadata());
  std::vector<std::string> a = args({"--tokenizer=" + sdxl.tokenizer.string()});
  a[1] = "--pretrained_model_name_or_path=" + vpred.string();
  ASSERT_NE(wait_exit(spawn(a, work_ / "out", work_ / "err")), 0);
  const std::string err = read_text(work_ / "err");
  EXPECT_NE(err.find(vpred.string() + " declares itself a v-prediction model (its key v_pred): "
                                      "pass --v_parameterization"),
            std::string::npos)
      << err;
  a.push_back("--v_parameterization");
  ASSERT_EQ(wait_exit(spawn(a, work_ / "out2", work_ / "err2")), 0) << read_text(work_ / "err2");
  size_t images = 0;  // the two prompts' images (and their sheet)
  for (const auto& entry : fs::directory_iterator(work_ / "samples")) {
    images += entry.path().extension() == ".png";
  }
  EXPECT_GE(images, 2u) << read_text(work_ / "err2");
}

// After a run (--replay_dir): every LoRA of the folder renders under its step; a file that is no
// safetensors is named and left out, and the others still render. A folder that is not there is
// refused by name.
TEST_F(SamplerRun, ReplayRendersEverySavedLoraAndLeavesOutABrokenOne) {
  const fs::path lora = work_ / "lora";
  fs::create_directories(lora / "sample_only");
  fs::copy_file(dir_ / "one.safetensors", lora / "one.safetensors");
  std::ofstream(lora / "sample_only" / "one-step00000007.safetensors") << "not a safetensors file";
  ASSERT_EQ(wait_exit(spawn(args({"--replay_dir=" + lora.string()}), work_ / "out", work_ / "err")),
            0)
      << read_text(work_ / "err");
  const std::string err = read_text(work_ / "err");
  EXPECT_NE(err.find("one-step00000007.safetensors: left out"), std::string::npos) << err;
  EXPECT_TRUE(fs::exists(work_ / "samples" / "one_000040_00.png"));
  EXPECT_EQ(wait_exit(spawn(args({"--replay_dir=" + (work_ / "nothing").string()}),
                            work_ / "out2", work_ / "err2")),
            2);
  EXPECT_NE(read_text(work_ / "err2").find("(--replay_dir): no such folder"), std::string::npos)
      << read_text(work_ / "err2");
}

// The LoRA and its multiplier reach the pixels: at multiplier 0 two different LoRA files render
// the base model's very pixels (a LoRA at 0 adds exact zeros), and 0.7 and 1 each render
// other pixels. (The numbers of the merge are SamplerParity's; this is the command line's part.)
TEST_F(SamplerRun, LoraMultiplierShapesThePixels) {
  auto render = [&](const std::string& tag, const std::string& lora, bool merge = false) {
    std::vector<std::string> a = args({"--lora=" + (dir_ / lora).string()});
    if (merge) a.push_back("--merge_lora");
    a[3] = "--output_dir=" + (work_ / tag).string();
    fs::create_directories(work_ / tag);
    EXPECT_EQ(wait_exit(spawn(a, work_ / tag / "out", work_ / tag / "err")), 0)
        << read_text(work_ / tag / "err");
    std::vector<fs::path> pngs;
    for (const auto& e : fs::directory_iterator(work_ / tag / "samples")) {
      if (e.path().extension() == ".png" && e.path().string().ends_with("_00.png")) {
        pngs.push_back(e.path());
      }
    }
    EXPECT_EQ(pngs.size(), 1u) << tag;
    return vips::VImage::new_from_file(pngs.at(0).c_str());
  };
  auto differ = [](const vips::VImage& x, const vips::VImage& y) {
    return x.relational(y, VIPS_OPERATION_RELATIONAL_NOTEQ).max() > 0;
  };
  const vips::VImage off = render("off", "one.safetensors:0");
  const vips::VImage other_off = render("other-off", "run-step00010.safetensors:0");
  const vips::VImage part = render("part", "one.safetensors:0.7");
  const vips::VImage full = render("full", "one.safetensors:1");
  EXPECT_FALSE(differ(off, other_off)) << "multiplier 0 left some of a LoRA in the weights";
  EXPECT_TRUE(differ(off, part)) << "the LoRA at 0.7 changed nothing";
  EXPECT_TRUE(differ(part, full)) << "0.7 and 1 rendered the same pixels";
  // --merge_lora merges the LoRA into the weights instead of computing it beside them: the same
  // render but for rounding (the same products summed in another grouping, fp32: at most 1/255).
  const vips::VImage merged = render("merged", "one.safetensors:1", /*merge=*/true);
  EXPECT_LE((merged.cast(VIPS_FORMAT_INT) - full.cast(VIPS_FORMAT_INT)).abs().max(), 1.0);
}

// kohya's --vae: the sampler decodes with the VAE it is given. The same render with another
// checkpoint's VAE gives other pixels, and so does one on a base merged with --base_weights; a
// VAE that cannot be read stops it, naming the file.
TEST_F(SamplerRun, VaeAndBaseWeightsShapeTheImages) {
  const auto other = models::write_tiny_checkpoint(work_ / "other", /*seed=*/12);
  ASSERT_EQ(render_one("own", {}).first, 0);
  const auto with = render_one("with", {"--vae=" + (other.diffusers / "vae").string()});
  ASSERT_EQ(with.first, 0) << with.second;
  vips::VImage own = vips::VImage::new_from_file(
      (work_ / "own" / "samples" / "one_000040_00.png").c_str());
  vips::VImage decoded = vips::VImage::new_from_file(
      (work_ / "with" / "samples" / "one_000040_00.png").c_str());
  EXPECT_GT(own.relational(decoded, VIPS_OPERATION_RELATIONAL_NOTEQ).max(), 0)
      << "the other VAE decoded the same pixels";
  // And it is that VAE's decode, loaded into the right modules: a model folder holding this
  // model's UNet and text encoder beside the other VAE renders the very same pixels.
  const fs::path combined = work_ / "combined-model";
  fs::copy(tiny_.diffusers, combined, fs::copy_options::recursive);
  fs::remove_all(combined / "vae");
  fs::copy(other.diffusers / "vae", combined / "vae", fs::copy_options::recursive);
  {
    std::vector<std::string> a = args({"--lora=" + (dir_ / "one.safetensors").string()});
    a[1] = "--pretrained_model_name_or_path=" + combined.string();
    a[3] = "--output_dir=" + (work_ / "combined").string();
    fs::create_directories(work_ / "combined");
    ASSERT_EQ(wait_exit(spawn(a, work_ / "combined" / "out", work_ / "combined" / "err")), 0)
        << read_text(work_ / "combined" / "err");
  }
  vips::VImage from_folder = vips::VImage::new_from_file(
      (work_ / "combined" / "samples" / "one_000040_00.png").c_str());
  EXPECT_EQ(from_folder.relational(decoded, VIPS_OPERATION_RELATIONAL_NOTEQ).max(), 0)
      << "--vae decoded otherwise than the same VAE inside the model";
  // --base_weights (the trainer's, routed here by lorapipe run): renders on the merged base.
  const auto based =
      render_one("based", {"--base_weights=" + (dir_ / "run-step00010.safetensors").string()});
  ASSERT_EQ(based.first, 0) << based.second;
  vips::VImage on_merged = vips::VImage::new_from_file(
      (work_ / "based" / "samples" / "one_000040_00.png").c_str());
  EXPECT_GT(own.relational(on_merged, VIPS_OPERATION_RELATIONAL_NOTEQ).max(), 0)
      << "the merged base rendered the same pixels";
  const auto missing = render_one("missing", {"--vae=" + (work_ / "none.safetensors").string()});
  EXPECT_NE(missing.first, 0);
  EXPECT_NE(missing.second.find("none.safetensors (--vae): no such file"), std::string::npos)
      << missing.second;
}

// --mixed_precision and --fp8_base reach the render: in bf16 over float8 weights (the LoRA beside
// them) the images come out, of the same sizes, and not the fp32 render's pixels; an unknown
// precision stops the sampler, naming it. (SamplerParityRender.DdimWithLoraOverFloat8Weights
// holds the float8 render to diffusers'.)
TEST_F(SamplerRun, MixedPrecisionAndFloat8WeightsRender) {
  ASSERT_EQ(render_one("fp32", {}).first, 0);
  const auto narrow = render_one("fp8", {"--mixed_precision=bf16", "--fp8_base"});
  ASSERT_EQ(narrow.first, 0) << narrow.second;
  for (const char* name : {"one_000040_00.png", "one_000040_01.png"}) {
    vips::VImage wide = vips::VImage::new_from_file((work_ / "fp32" / "samples" / name).c_str());
    vips::VImage small = vips::VImage::new_from_file((work_ / "fp8" / "samples" / name).c_str());
    ASSERT_EQ(small.width(), wide.width()) << name;
    ASSERT_EQ(small.height(), wide.height()) << name;
    EXPECT_GT(wide.relational(small, VIPS_OPERATION_RELATIONAL_NOTEQ).max(), 0)
        << name << ": bf16 over float8 rendered the fp32 pixels";
  }
  // --fp8_scaled: other float8 weights, so other pixels; alone it is refused by name.
  const auto scaled = render_one("fp8s", {"--mixed_precision=bf16", "--fp8_base", "--fp8_scaled"});
  ASSERT_EQ(scaled.first, 0) << scaled.second;
  vips::VImage plain = vips::VImage::new_from_file((work_ / "fp8" / "samples" / "one_000040_00.png").c_str());
  vips::VImage fine = vips::VImage::new_from_file((work_ / "fp8s" / "samples" / "one_000040_00.png").c_str());
  EXPECT_GT(plain.relational(fine, VIPS_OPERATION_RELATIONAL_NOTEQ).max(), 0)
      << "--fp8_scaled rendered plain float8's pixels";
  // --fp8_fast: float8 matmuls (the inputs rounded too), so other pixels again.
  const auto fast = render_one(
      "fp8f", {"--mixed_precision=bf16", "--fp8_base", "--fp8_scaled", "--fp8_fast"});
  ASSERT_EQ(fast.first, 0) << fast.second;
  EXPECT_NE(fast.second.find("float8 matmuls (--fp8_fast)"), std::string::npos) << fast.second;
  vips::VImage faster =
      vips::VImage::new_from_file((work_ / "fp8f" / "samples" / "one_000040_00.png").c_str());
  EXPECT_GT(fine.relational(faster, VIPS_OPERATION_RELATIONAL_NOTEQ).max(), 0)
      << "--fp8_fast rendered --fp8_scaled's pixels";
  const auto fast_alone = render_one("fp8f-alone", {"--fp8_base", "--fp8_fast"});
  EXPECT_NE(fast_alone.first, 0);
  EXPECT_NE(fast_alone.second.find("--fp8_fast multiplies scaled float8 weights"),
            std::string::npos)
      << fast_alone.second;
  const auto alone = render_one("fp8s-alone", {"--fp8_scaled"});
  EXPECT_NE(alone.first, 0);
  EXPECT_NE(alone.second.find("--fp8_scaled scales the float8 weights"), std::string::npos)
      << alone.second;
  const auto bad = render_one("bad", {"--mixed_precision=fp8"});
  EXPECT_NE(bad.first, 0);
  EXPECT_NE(bad.second.find("--mixed_precision=fp8"), std::string::npos) << bad.second;
}

// --blocks_to_swap (kohya's, the run's): the weights of the U-Net's last blocks' transformers in
// host memory and the text encoders kept there, encoding on the CPU. On the CPU this is the GPU's
// machinery but for its copy stream, so a render must give the unswapped one's pixels exactly:
// with the LoRA (U-Net and text encoder modules) in the layers' slots, the swapped layers' among
// them, and over float8 weights. --merge_lora would write weights the swap keeps in host memory,
// so it is refused with it, by name.
TEST_F(SamplerRun, BlockSwapRendersTheSameImagesWithTheEncodersOnTheCpu) {
  const std::vector<std::pair<std::string, std::vector<std::string>>> cases = {
      {"plain", {}}, {"fp8", {"--mixed_precision=bf16", "--fp8_base"}}};
  for (const auto& [tag, flags] : cases) {
    ASSERT_EQ(render_one(tag, flags).first, 0) << tag;
    std::vector<std::string> swap_flags = flags;
    swap_flags.push_back("--blocks_to_swap=2");
    const auto swapped = render_one(tag + "-swap", swap_flags);
    ASSERT_EQ(swapped.first, 0) << swapped.second;
    EXPECT_NE(swapped.second.find("block swap (--blocks_to_swap=2)"), std::string::npos)
        << swapped.second;
    for (const char* name : {"one_000040_00.png", "one_000040_01.png"}) {
      vips::VImage kept = vips::VImage::new_from_file((work_ / tag / "samples" / name).c_str());
      vips::VImage moved =
          vips::VImage::new_from_file((work_ / (tag + "-swap") / "samples" / name).c_str());
      ASSERT_EQ(moved.width(), kept.width()) << tag << " " << name;
      EXPECT_EQ(kept.relational(moved, VIPS_OPERATION_RELATIONAL_NOTEQ).max(), 0)
          << tag << " " << name << ": block swap changed the pixels";
    }
  }
  const auto merge = render_one("merge", {"--blocks_to_swap=2", "--merge_lora"});
  EXPECT_NE(merge.first, 0);
  EXPECT_NE(merge.second.find("--merge_lora writes the base weights, and --blocks_to_swap=2"),
            std::string::npos)
      << merge.second;
}

// --device_share=0.25: after each model call the sampler waits three times that call's time, so
// a trainer on the same GPU keeps three quarters of it: the log says how long of the render it
// left, which is 3/4 of the render's whole time up to the work outside the model calls' span and
// the sleeps' overshoot (held to 0.6-0.8: the measure is of the sampler's own clock, not of the
// machine's speed). The same images as without it. Out-of-range shares are refused by name.
TEST_F(SamplerRun, DeviceShareLeavesTheRestOfTheDevicesTimeToTheTrainer) {
  const auto whole = render_one("whole", {});
  ASSERT_EQ(whole.first, 0) << whole.second;
  const auto quarter = render_one("quarter", {"--device_share=0.25"});
  ASSERT_EQ(quarter.first, 0) << quarter.second;
  EXPECT_NE(quarter.second.find("renders take 25% of cpu's time"), std::string::npos)
      << quarter.second;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(quarter.second, m,
                                std::regex(R"(images in ([0-9.e+-]+) s \([0-9.e+-]+ s per image, of )"
                                           R"(it ([0-9.e+-]+) s left to the trainer)")))
      << quarter.second;
  const double total = std::stod(m[1].str()), left = std::stod(m[2].str());
  std::printf("[device share] 0.25: %.3f s of a %.3f s render left to the trainer (%.2f)\n", left,
              total, left / total);
  EXPECT_GT(left / total, 0.6);
  EXPECT_LT(left / total, 0.8);
  EXPECT_EQ(whole.second.find("left to the trainer"), std::string::npos) << "1 waits for nothing";
  for (const char* name : {"one_000040_00.png", "one_000040_01.png"}) {
    EXPECT_EQ(read_text(work_ / "whole" / "samples" / name),
              read_text(work_ / "quarter" / "samples" / name))
        << name;
  }
  for (const char* bad : {"--device_share=0", "--device_share=1.5"}) {
    const auto refused = render_one(std::string("bad") + bad[15], {bad});
    EXPECT_NE(refused.first, 0) << bad;
    EXPECT_NE(refused.second.find(std::string(bad) + ": a share of the device's time"),
              std::string::npos)
        << refused.second;
  }
}


// --shared_weights names a manifest no trainer writes (a wrong path): the sampler waits for it,
// saying so, and gives up once --idle_timeout_s has passed, naming the file; a render with
// --merge_lora over shared weights is refused before anything loads.
TEST_F(SamplerRun, SharedWeightsNobodyPublishesAreNamedNotWaitedForForever) {
  const auto nobody = render_one(
      "nobody", {"--shared_weights=" + (work_ / "no-trainer.json").string(), "--idle_timeout_s=1"});
  EXPECT_NE(nobody.first, 0);
  EXPECT_NE(nobody.second.find("waiting for the trainer's shared weights"), std::string::npos)
      << nobody.second;
  EXPECT_NE(nobody.second.find("no-trainer.json (--shared_weights): no trainer published"),
            std::string::npos)
      << nobody.second;
  const auto merged = render_one(
      "merged", {"--shared_weights=" + (work_ / "no-trainer.json").string(), "--merge_lora"});
  EXPECT_NE(merged.first, 0);
  EXPECT_NE(merged.second.find("--merge_lora writes the base weights"), std::string::npos)
      << merged.second;
}

// The trainer announces 10; while the sampler (1 s per image) renders it, 20, 30, a corrupt 40
// and then the final 50 arrive. Newest wins: 20 and 30 are never rendered, the corrupt one is
// reported by name and skipped, the final one is rendered, and the sampler exits 0.
TEST_F(SamplerRun, FollowsARunRenderingOnlyTheNewestAndTheFinal) {
  zmq::context_t context;
  zmq::socket_t pub = wire::make_socket(context, zmq::socket_type::pub);
  const std::string endpoint = "ipc://" + (work_ / "trainer.sock").string();
  pub.bind(endpoint);
  // The sampler's own status, as the launcher hears it: a skipped checkpoint and why.
  const std::string status_endpoint = "ipc://" + (work_ / "sampler.sock").string();
  zmq::socket_t status = wire::make_socket(context, zmq::socket_type::sub);
  status.set(zmq::sockopt::subscribe, wire::type_name(wire::StageStatus()));
  status.connect(status_endpoint);
  const pid_t pid =
      spawn(args({"--sub=" + endpoint, "--delay_per_image_s=1", "--idle_timeout_s=60",
                  "--pub=" + status_endpoint}),
            work_ / "out", work_ / "err");
  auto announce = [&](int step, const fs::path& file, bool final = false) {
    wire::CheckpointReady event;
    event.set_run_id("test");
    event.set_path(file.string());
    event.set_step(static_cast<uint64_t>(step));
    event.set_final(final);
    event.set_output_name("run");  // the trainer's --output_name: the samples' name
    ASSERT_EQ(wire::send(pub, event), wire::SendStatus::kSent);
  };
  auto step_file = [&](int step) {
    return dir_ / ("run-step" + std::to_string(100000 + step).substr(1) + ".safetensors");
  };
  const fs::path first = work_ / "samples" / "run_000010_00.png";
  // Until the subscription is up (ZeroMQ drops what a PUB sends before), announce 10 again.
  for (int i = 0; i < 600 && !fs::exists(first); ++i) {
    announce(10, step_file(10));
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  ASSERT_TRUE(fs::exists(first)) << read_text(work_ / "err");
  announce(20, step_file(20));
  announce(30, step_file(30));
  const fs::path corrupt = work_ / "run-step00040.safetensors";
  std::ofstream(corrupt) << "not a safetensors file";
  announce(40, corrupt);
  // The final one after the sampler has picked up 40 (it is still on 10's second image).
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  const pid_t status_pid = pid;
  for (int i = 0;
       i < 100 && read_text(work_ / "err").find("step 40 not rendered") == std::string::npos; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  announce(50, step_file(50), /*final=*/true);
  const int exit_code = wait_exit(status_pid);
  const std::string err = read_text(work_ / "err");
  ASSERT_EQ(exit_code, 0) << err;
  EXPECT_NE(err.find("step 40 not rendered"), std::string::npos) << err;
  EXPECT_NE(err.find(corrupt.string()), std::string::npos) << "the bad file is named: " << err;
  EXPECT_TRUE(fs::exists(work_ / "samples" / "run_000050_00.png")) << err;
  EXPECT_FALSE(fs::exists(work_ / "samples" / "run_000020_00.png")) << "stale 20 was rendered";
  EXPECT_FALSE(fs::exists(work_ / "samples" / "run_000030_00.png")) << "stale 30 was rendered";
  const std::string out = read_text(work_ / "out");
  EXPECT_NE(out.find("2 checkpoints rendered, 1 skipped"), std::string::npos) << out;
  std::string said;
  for (;;) {
    const wire::Received r = wire::receive(status, std::chrono::milliseconds(200));
    const auto* st = r.as<wire::StageStatus>();
    if (st == nullptr) break;
    if (st->state() == wire::StageStatus::READY &&
        st->message().starts_with("step 40 skipped: ")) {
      said = st->message();
    }
  }
  EXPECT_NE(said.find(corrupt.string()), std::string::npos)
      << "no READY status naming the skipped checkpoint and why: '" << said << "'";
}

// A checkpoint whose images cannot be written (here a folder stands where its first PNG goes;
// a full or read-only disk fails the same way) is reported and skipped: the sampler keeps
// following the run and renders the final checkpoint.
TEST_F(SamplerRun, AnUnwritableSampleSkipsThatCheckpointAndKeepsServing) {
  Trainer trainer(work_);
  const std::string& endpoint = trainer.endpoint;
  auto announce = [&](int step, bool final = false) { trainer.announce(step, final); };
  fs::create_directories(work_ / "samples" / "run_000020_00.png" / "in the way");
  const pid_t pid = spawn(args({"--sub=" + endpoint, "--idle_timeout_s=60"}), work_ / "out",
                          work_ / "err");
  std::string why;
  ASSERT_TRUE(announce_until_indexed(10, pid, [&] { announce(10); }, &why))
      << why << read_text(work_ / "err");
  announce(20);
  for (int i = 0;
       i < 600 && read_text(work_ / "err").find("step 20 not rendered") == std::string::npos; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  announce(50, /*final=*/true);
  ASSERT_EQ(wait_exit(pid), 0) << read_text(work_ / "err");
  const std::string err = read_text(work_ / "err");
  EXPECT_NE(err.find("step 20 not rendered"), std::string::npos) << err;
  EXPECT_NE(err.find("run_000020_00.png"), std::string::npos) << "the file is named: " << err;
  EXPECT_TRUE(fs::exists(work_ / "samples" / "run_000050_00.png")) << err;
  EXPECT_FALSE(fs::exists(work_ / "samples" / "run_000020_00.png.tmp.png"))
      << "the unfinished image is removed";
  EXPECT_NE(read_text(work_ / "out").find("2 checkpoints rendered, 1 skipped"), std::string::npos)
      << read_text(work_ / "out");
}

// The gallery's index written to a full disk (its temporary name points at /dev/full, where
// every write fails with ENOSPC): the failure is reported naming the file, the checkpoint's
// images still count as rendered, and samples.json keeps the checkpoints it listed (a truncated
// index would read as an empty gallery after a restart). The failed write removes its temporary
// (here the link), so the next checkpoint's index is written and lists every one rendered.
TEST_F(SamplerRun, AGalleryIndexThatCannotBeWrittenKeepsThePreviousOne) {
  Trainer trainer(work_);
  const std::string& endpoint = trainer.endpoint;
  auto announce = [&](int step, bool final = false) { trainer.announce(step, final); };
  const pid_t pid = spawn(args({"--sub=" + endpoint, "--idle_timeout_s=60"}), work_ / "out",
                          work_ / "err");
  std::string why;
  ASSERT_TRUE(announce_until_indexed(10, pid, [&] { announce(10); }, &why))
      << why << read_text(work_ / "err");
  const fs::path index = work_ / "samples" / "samples.json";
  const fs::path full = index.string() + ".tmp";
  fs::create_symlink("/dev/full", full);
  announce(20);
  const std::string failed = "step 20: the gallery's index is not updated: cannot write " +
                             full.string() + ": No space left on device";
  for (int i = 0; i < 600 && read_text(work_ / "err").find(failed) == std::string::npos; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_NE(read_text(work_ / "err").find(failed), std::string::npos) << read_text(work_ / "err");
  EXPECT_TRUE(fs::exists(work_ / "samples" / "run_000020_00.png"));
  ASSERT_TRUE(fs::is_regular_file(fs::symlink_status(index))) << "the index was replaced";
  const auto listed = [&] {
    std::set<uint64_t> steps;
    const nlohmann::json json = nlohmann::json::parse(read_text(index));
    for (const auto& c : json.at("checkpoints")) {
      steps.insert(c.at("step").get<uint64_t>());
    }
    return steps;
  };
  EXPECT_EQ(listed(), std::set<uint64_t>({10}));
  EXPECT_FALSE(fs::exists(fs::symlink_status(full))) << "the failed write left its temporary";
  announce(50, /*final=*/true);
  ASSERT_EQ(wait_exit(pid), 0) << read_text(work_ / "err");
  EXPECT_EQ(listed(), std::set<uint64_t>({10, 20, 50}));
  EXPECT_NE(read_text(work_ / "out").find("3 checkpoints rendered"), std::string::npos)
      << read_text(work_ / "out");
}

// kohya reads the prompt file at every sampling: edited during a run, the next checkpoint renders
// the new prompts (here three where there were two). A file that no longer reads keeps the
// prompts read before, and says so.
TEST_F(SamplerRun, AnEditedPromptFileIsReadForTheNextCheckpoint) {
  Trainer trainer(work_);
  const std::string& endpoint = trainer.endpoint;
  auto announce = [&](int step, bool final = false) { trainer.announce(step, final); };
  const fs::path prompts = work_ / "prompts.txt";
  fs::copy_file(dir_ / "prompts.txt", prompts);
  std::vector<std::string> a = args({"--sub=" + endpoint, "--idle_timeout_s=60"});
  a[2] = "--sample_prompts=" + prompts.string();
  const pid_t pid = spawn(a, work_ / "out", work_ / "err");
  std::string why;
  ASSERT_TRUE(announce_until_indexed(10, pid, [&] { announce(10); }, &why))
      << why << read_text(work_ / "err");
  EXPECT_FALSE(fs::exists(work_ / "samples" / "run_000010_02.png"));
  std::ofstream(prompts) << "a ring --w 64 --h 64 --s 2\na dot --w 64 --h 64 --s 2\n"
                         << "a cross --w 64 --h 64 --s 2\n";
  ASSERT_TRUE(announce_until_indexed(20, pid, [&] { announce(20); }, &why))
      << why << read_text(work_ / "err");
  EXPECT_TRUE(fs::exists(work_ / "samples" / "run_000020_02.png")) << read_text(work_ / "err");
  const auto index = nlohmann::json::parse(read_text(work_ / "samples" / "samples.json"));
  EXPECT_EQ(index.at("prompts"), nlohmann::json({"a ring", "a dot", "a cross"}));
  // Each checkpoint keeps the prompts it rendered: the gallery names step 10's images by them.
  ASSERT_EQ(index.at("checkpoints").size(), 2u);
  EXPECT_EQ(index.at("checkpoints")[0].at("prompts"),
            nlohmann::json({"a red circle", "a blue square, 青い四角"}));
  EXPECT_EQ(index.at("checkpoints")[1].at("prompts"), index.at("prompts"));
  std::ofstream(prompts) << "# nothing to render\n";
  announce(50, /*final=*/true);
  ASSERT_EQ(wait_exit(pid), 0) << read_text(work_ / "err");
  const std::string err = read_text(work_ / "err");
  EXPECT_NE(err.find("changed: 3 prompts from now on"), std::string::npos) << err;
  EXPECT_NE(err.find("no prompt could be read: rendering the 3 prompts read before"),
            std::string::npos)
      << err;
  EXPECT_TRUE(fs::exists(work_ / "samples" / "run_000050_02.png")) << err;
}

// Killed with -9 after rendering step 10 and started again: it renders the newest checkpoint the
// trainer announces (the trainer repeats its newest CheckpointReady, --checkpoint_reannounce_s;
// here the test does), then the final one.
TEST_F(SamplerRun, RestartedAfterKillNineRendersTheNewest) {
  zmq::context_t context;
  zmq::socket_t pub = wire::make_socket(context, zmq::socket_type::pub);
  const std::string endpoint = "ipc://" + (work_ / "trainer.sock").string();
  pub.bind(endpoint);
  auto announce = [&](int step, bool final = false) {
    ASSERT_EQ(wire::send(pub, checkpoint(step, final)), wire::SendStatus::kSent);
  };
  // The kill below must come after step 10 is indexed, or the index rightly never heard of it.
  std::string why;
  auto until_rendered = [&](int step, pid_t pid) {
    return announce_until_indexed(step, pid, [&] { announce(step); }, &why);
  };
  const std::vector<std::string> follow = args({"--sub=" + endpoint, "--idle_timeout_s=60"});
  const pid_t first = spawn(follow, work_ / "out1", work_ / "err1");
  ASSERT_TRUE(until_rendered(10, first)) << why << read_text(work_ / "err1");
  ::kill(first, SIGKILL);
  EXPECT_EQ(wait_exit(first), 128 + SIGKILL);
  announce(20);  // nobody listens: lost, as a real trainer's would be
  const pid_t second = spawn(follow, work_ / "out2", work_ / "err2");
  ASSERT_TRUE(until_rendered(20, second)) << why << read_text(work_ / "err2");
  announce(50, /*final=*/true);
  ASSERT_EQ(wait_exit(second), 0) << read_text(work_ / "err2");
  EXPECT_TRUE(fs::exists(work_ / "samples" / "run_000050_00.png")) << read_text(work_ / "err2");
  // The gallery keeps what the first process rendered.
  const auto index = nlohmann::json::parse(read_text(work_ / "samples" / "samples.json"));
  std::vector<uint64_t> steps;
  for (const auto& c : index["checkpoints"]) steps.push_back(c["step"].get<uint64_t>());
  EXPECT_EQ(steps, (std::vector<uint64_t>{10, 20, 50}));
}

// The gallery as a user sees it: samples/index.html opened from disk in headless Chromium
// (Debian's chromium, which test.sh installs), driven by tests/gallery_check.py over the DevTools
// protocol. The page must show step 10 with every image loaded, then, while it stays open, pick
// up step 20 once the sampler renders it, without a reload. Above them it plots the run's curves
// that the launcher writes beside the samples (deploy/curves.h, from the trainer's events: here
// 20 steps and three validations, written by the launcher's own writer): loss with its average
// and validation, learning rate, and peak memory, each line with every point. The screenshot is
// kept in build/test-artifacts/gallery.png.
TEST_F(SamplerRun, GalleryInChromiumShowsEachStepAndTheNextWithoutAReload) {
  const fs::path chromium = "/usr/bin/chromium";
  ASSERT_TRUE(fs::exists(chromium)) << "no " << chromium << ": scripts/deps.sh installs it for tests";
  zmq::context_t context;
  zmq::socket_t pub = wire::make_socket(context, zmq::socket_type::pub);
  const std::string endpoint = "ipc://" + (work_ / "trainer.sock").string();
  pub.bind(endpoint);
  auto announce = [&](int step, bool final) {
    wire::CheckpointReady event;
    event.set_run_id("test");
    event.set_path(
        (dir_ / ("run-step" + std::to_string(100000 + step).substr(1) + ".safetensors")).string());
    event.set_step(static_cast<uint64_t>(step));
    event.set_final(final);
    event.set_output_name("run");  // the trainer's --output_name: the samples' name
    ASSERT_EQ(wire::send(pub, event), wire::SendStatus::kSent);
  };
  const pid_t sampler =
      spawn(args({"--sub=" + endpoint, "--idle_timeout_s=120"}), work_ / "out", work_ / "err");
  std::string why;
  ASSERT_TRUE(announce_until_indexed(10, sampler, [&] { announce(10, false); }, &why))
      << why << read_text(work_ / "err");

  launcher::RunCurves curves;
  for (int step = 1; step <= 20; ++step) {
    // As events.jsonl has them: protobuf's JSON, 64-bit integers as strings.
    curves.add({{"event", "TrainProgress"},
                {"step", std::to_string(step)},
                {"loss", 0.2 + 0.1 * std::sin(step) + 0.5 / step},
                {"average_loss", 0.2 + 0.5 / step},
                {"learning_rate", 1e-4 * (0.5 + 0.5 * std::cos(3.14159 * step / 20))},
                {"peak_memory_bytes", std::to_string((900 + 5 * step) << 20)}});
  }
  for (int step : {0, 10, 20}) {
    curves.add({{"event", "ValidationLoss"}, {"step", std::to_string(step)},
                {"loss", 0.6 - 0.01 * step}});
  }
  curves.write(work_ / "samples", std::chrono::seconds(0));
  const fs::path screenshot = fs::path(LORAPIPE_ARTIFACT_DIR) / "gallery.png";
  fs::remove(screenshot);
  const fs::path ready = work_ / "page-shows-10";
  const pid_t check =
      spawn({"/usr/bin/python3", std::string(LORAPIPE_SOURCE_DIR) + "/tests/gallery_check.py",
             "--chromium=" + chromium.string(),
             "--gallery=" + (work_ / "samples" / "index.html").string(),
             "--screenshot=" + screenshot.string(), "--first=10", "--then=20",
             "--ready=" + ready.string()},
            work_ / "check.out", work_ / "check.err");
  for (int i = 0; i < 1200 && !fs::exists(ready); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  ASSERT_TRUE(fs::exists(ready)) << read_text(work_ / "check.out") << read_text(work_ / "check.err");
  // The page is open and shows 10: now the sampler renders the final 20.
  const bool rendered_20 = announce_until_indexed(20, sampler, [&] { announce(20, true); }, &why);
  EXPECT_TRUE(rendered_20) << why << read_text(work_ / "err");
  EXPECT_EQ(wait_exit(check), 0) << read_text(work_ / "check.out") << read_text(work_ / "check.err");
  if (why.empty()) {
    EXPECT_EQ(wait_exit(sampler), 0) << read_text(work_ / "err");
  }
  const std::string said = read_text(work_ / "check.out");
  std::printf("[gallery] %s", said.c_str());
  EXPECT_NE(said.find("without a reload: 2 checkpoints, 4 of 4 images shown"), std::string::npos)
      << said;
  EXPECT_NE(said.find("curves: loss: average loss 20, loss 20, validation loss 3; learning rate: "
                      "learning rate 20; peak memory: peak memory, GiB 20"),
            std::string::npos)
      << said;
  ASSERT_TRUE(fs::exists(screenshot));
  vips::VImage shot = vips::VImage::new_from_file(screenshot.c_str());
  EXPECT_EQ(shot.width(), 1200);
  // Something was drawn: a blank page (or one colour) has no deviation at all; the gallery's
  // text and four renders of noise give tens of levels.
  std::printf("[gallery] screenshot %dx%d, pixel deviation %.1f\n", shot.width(), shot.height(),
              shot.deviate());
  EXPECT_GT(shot.deviate(), 5.0) << "the screenshot is blank";
}

// The size of `pid`'s address space, from /proc/PID/status (VmSize, in kB).
uint64_t address_space_bytes(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmSize:", 0) == 0) return std::stoull(line.substr(7)) * 1024;
  }
  return 0;
}

// Faults while following a run, each named and each costing only its checkpoint:
// - the device out of memory, a real one: once the sampler has loaded, the test caps its address
//   space (prlimit(2), RLIMIT_AS) at what it holds plus 32 MiB. The LoRA's merge fits in that;
//   the 512x512 render does not (the tiny VAE's full-resolution activations are 32 MiB each,
//   several alive at once). One thread, so no thread is started under the cap;
// - with the cap lifted, a LoRA made for another base model (an SDXL LoRA's key among this
//   model's): the key is named.
// Then the next checkpoint renders and its SampleReady carries its step, images and seconds per
// image, and the final one ends the run.
TEST_F(SamplerRun, OutOfMemoryAndAForeignLoraSkipOnlyTheirCheckpoints) {
  std::ofstream(work_ / "big.txt") << "a red circle --w 512 --h 512 --s 1 --d 3\n";
  const models::StableDiffusion model = models::load_stable_diffusion(tiny_.diffusers);
  const std::string foreign_key = "lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q";
  write_random_lora(model, work_ / "foreign.safetensors", 3, 4, true, foreign_key);
  zmq::context_t context;
  zmq::socket_t pub = wire::make_socket(context, zmq::socket_type::pub);
  const std::string endpoint = "ipc://" + (work_ / "trainer.sock").string();
  pub.bind(endpoint);
  const std::string samples_endpoint = "ipc://" + (work_ / "sampler.sock").string();
  zmq::socket_t samples = wire::make_socket(context, zmq::socket_type::sub);
  samples.set(zmq::sockopt::subscribe, wire::type_name(wire::SampleReady()));
  samples.connect(samples_endpoint);
  auto announce = [&](int step, const fs::path& file, bool final = false) {
    wire::CheckpointReady event = checkpoint(step, final);
    event.set_path(file.string());
    ASSERT_EQ(wire::send(pub, event), wire::SendStatus::kSent);
  };
  auto step_file = [&](int step) {
    return dir_ / ("run-step" + std::to_string(100000 + step).substr(1) + ".safetensors");
  };
  std::vector<std::string> a =
      args({"--sub=" + endpoint, "--pub=" + samples_endpoint, "--idle_timeout_s=120"});
  a[2] = "--sample_prompts=" + (work_ / "big.txt").string();
  const pid_t pid = spawn(a, work_ / "out", work_ / "err");
  auto log_says = [&](const std::string& text, const std::function<void()>& meanwhile) {
    for (int i = 0; i < 600; ++i) {
      if (read_text(work_ / "err").find(text) != std::string::npos) return true;
      if (runtime::try_wait(pid)) return false;
      meanwhile();
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    return false;
  };
  ASSERT_TRUE(log_says("following ", [] {})) << read_text(work_ / "err");

  rlimit unlimited{};
  ASSERT_EQ(prlimit(pid, RLIMIT_AS, nullptr, &unlimited), 0) << std::strerror(errno);
  const rlimit cap{address_space_bytes(pid) + (32u << 20), unlimited.rlim_max};
  ASSERT_GT(cap.rlim_cur, 32u << 20);
  ASSERT_EQ(prlimit(pid, RLIMIT_AS, &cap, nullptr), 0) << std::strerror(errno);
  // Announced every 2 s, not every 100 ms: the fewer messages ZeroMQ's own thread takes in under
  // the cap, the better (the subscription is up since the "following" line, so once is enough).
  int polls = 0;
  ASSERT_TRUE(log_says("step 10 not rendered", [&] {
    if (polls++ % 20 == 0) announce(10, step_file(10));
  })) << read_text(work_ / "err");
  ASSERT_EQ(prlimit(pid, RLIMIT_AS, &unlimited, nullptr), 0) << std::strerror(errno);
  std::string err = read_text(work_ / "err");
  EXPECT_NE(err.find("step 10 not rendered: out of memory on cpu"), std::string::npos) << err;

  ASSERT_TRUE(log_says("step 20 not rendered",
                       [&] { announce(20, work_ / "foreign.safetensors"); }))
      << read_text(work_ / "err");
  err = read_text(work_ / "err");
  EXPECT_NE(err.find(foreign_key), std::string::npos) << "the foreign key is named: " << err;
  EXPECT_NE(err.find("fit no layer of this model"), std::string::npos) << err;

  std::string why;
  ASSERT_TRUE(announce_until_indexed(30, pid, [&] { announce(30, step_file(30)); }, &why))
      << why << read_text(work_ / "err");
  std::optional<wire::SampleReady> ready;
  for (int i = 0; i < 100 && !ready; ++i) {
    const wire::Received received = wire::receive(samples, std::chrono::milliseconds(100));
    if (const auto* r = received.as<wire::SampleReady>(); r != nullptr && r->step() == 30) {
      ready = *r;
    }
  }
  ASSERT_TRUE(ready.has_value()) << "no SampleReady for step 30";
  ASSERT_EQ(ready->image_paths_size(), 1);
  EXPECT_TRUE(fs::exists(ready->image_paths(0))) << ready->image_paths(0);
  EXPECT_TRUE(ready->image_paths(0).ends_with("run_000030_00.png")) << ready->image_paths(0);
  EXPECT_TRUE(fs::exists(ready->contact_sheet())) << ready->contact_sheet();
  EXPECT_GT(ready->seconds_per_image(), 0.0);
  EXPECT_NE(read_text(work_ / "err").find("step 30: 1 images in "), std::string::npos);

  announce(50, step_file(50), /*final=*/true);
  ASSERT_EQ(wait_exit(pid), 0) << read_text(work_ / "err");
  EXPECT_TRUE(fs::exists(work_ / "samples" / "run_000050_00.png"));
  EXPECT_FALSE(fs::exists(work_ / "samples" / "run_000010_00.png"));
  EXPECT_FALSE(fs::exists(work_ / "samples" / "run_000020_00.png"));
  const std::string out = read_text(work_ / "out");
  EXPECT_NE(out.find("2 checkpoints rendered, 2 skipped"), std::string::npos) << out;
  // The faults left the model as it was: step 30's image is the pixels a fresh one-shot process
  // renders for that LoRA.
  std::vector<std::string> alone = args({"--lora=" + step_file(30).string()});
  alone[2] = "--sample_prompts=" + (work_ / "big.txt").string();
  alone[3] = "--output_dir=" + (work_ / "alone").string();
  fs::create_directories(work_ / "alone");
  ASSERT_EQ(wait_exit(spawn(alone, work_ / "alone" / "out", work_ / "alone" / "err")), 0)
      << read_text(work_ / "alone" / "err");
  vips::VImage followed =
      vips::VImage::new_from_file((work_ / "samples" / "run_000030_00.png").c_str());
  vips::VImage fresh =
      vips::VImage::new_from_file((work_ / "alone" / "samples" / "run_000040_00.png").c_str());
  EXPECT_EQ(followed.relational(fresh, VIPS_OPERATION_RELATIONAL_NOTEQ).max(), 0)
      << "after the faults, step 30 rendered otherwise than a fresh process";
}

// Prompts are encoded once per prompt set: checkpoints whose LoRA has no text encoder modules
// share the base text encoder's conditionings, however many they are, while a LoRA with text
// encoder modules (kohya's default for SD1.5) has its prompts encoded once for it. The run goes
// U-Net-only 10, with-text-encoder 20, U-Net-only 30 and 50 (final): two prompts, encoded twice
// for the base and twice for 20. Each image is the pixels a fresh one-shot process renders for
// that LoRA, so no checkpoint was conditioned by another's text encoder.
TEST_F(SamplerRun, PromptsAreEncodedOncePerPromptSet) {
  const models::StableDiffusion model = models::load_stable_diffusion(tiny_.diffusers);
  std::map<int, fs::path> files;
  for (int step : {10, 20, 30, 50}) {
    files[step] = work_ / ("lora" + std::to_string(step) + ".safetensors");
    write_random_lora(model, files[step], 100 + step, 4, /*text_encoder=*/step == 20);
  }
  zmq::context_t context;
  zmq::socket_t pub = wire::make_socket(context, zmq::socket_type::pub);
  const std::string endpoint = "ipc://" + (work_ / "trainer.sock").string();
  pub.bind(endpoint);
  auto announce = [&](int step, bool final = false) {
    wire::CheckpointReady event = checkpoint(step, final);
    event.set_path(files.at(step).string());
    ASSERT_EQ(wire::send(pub, event), wire::SendStatus::kSent);
  };
  const pid_t pid = spawn(args({"--sub=" + endpoint, "--idle_timeout_s=120"}), work_ / "out",
                          work_ / "err");
  std::string why;
  for (int step : {10, 20, 30}) {
    ASSERT_TRUE(announce_until_indexed(step, pid, [&] { announce(step); }, &why))
        << why << read_text(work_ / "err");
  }
  announce(50, /*final=*/true);
  ASSERT_EQ(wait_exit(pid), 0) << read_text(work_ / "err");
  const std::string out = read_text(work_ / "out");
  EXPECT_NE(out.find("4 checkpoints rendered"), std::string::npos) << out;
  EXPECT_NE(out.find("prompts encoded 4 times"), std::string::npos) << out;

  for (int step : {10, 20, 30, 50}) {
    const std::string tag = "alone" + std::to_string(step);
    std::vector<std::string> a = args({"--lora=" + files.at(step).string()});
    a[3] = "--output_dir=" + (work_ / tag).string();
    fs::create_directories(work_ / tag);
    ASSERT_EQ(wait_exit(spawn(a, work_ / tag / "out", work_ / tag / "err")), 0)
        << read_text(work_ / tag / "err");
    for (const char* index : {"00", "01"}) {
      char followed[64];
      std::snprintf(followed, sizeof followed, "run_%06d_%s.png", step, index);
      const std::string alone =
          "lora" + std::to_string(step) + "_000040_" + std::string(index) + ".png";
      vips::VImage x = vips::VImage::new_from_file((work_ / "samples" / followed).c_str());
      vips::VImage y = vips::VImage::new_from_file((work_ / tag / "samples" / alone).c_str());
      EXPECT_EQ(x.relational(y, VIPS_OPERATION_RELATIONAL_NOTEQ).max(), 0)
          << followed << " differs from a one-shot render of its LoRA";
    }
  }
}

}  // namespace
}  // namespace lorapipe
