// SDXL LoRA training steps against diffusers + transformers + peft on lorapipe's tiny SDXL
// (trainer/reference/sdxl_train_reference.py, float64): the conditioning of both text encoders
// (their LoRAs training with them), each sample's time ids from its original size, crop and
// target size, the DDPM noising and the L2 loss against the noise or v.
//
// Tolerances, the issue's: one step's loss and every LoRA gradient within 1e-4 relative, and the
// weights after 20 AdamW steps within 1e-4. Ours runs in fp32 against the float64 reference, so
// the bound also covers fp32 rounding. A gradient's error is taken against its own scale, or 1%
// of the step's largest gradient where it is smaller (sums that nearly cancel: see
// train_parity_test.cpp's gradient_error).

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>

#include "models/attention.h"
#include "models/parity_util.h"
#include "models/registry.h"
#include "models/tiny.h"
#include "tests/paths.h"
#include "trainer/lora_file.h"
#include "common/error.h"
#include "models/family.h"
#include "proto/wire.h"
#include "trainer/lora_network.h"
#include "trainer/run.h"
#include "trainer/step.h"
#include "trainer/train_parity_util.h"

namespace lorapipe::trainer {
namespace {

namespace fs = std::filesystem;
constexpr double kTolerance = 1e-4;
constexpr double kAdamEps = 1e-6;

struct Case {
  int64_t steps = 1;
  bool v_prediction = false;
  bool train_text_encoder = true;
  double max_grad_norm = 0;
};

struct Result {
  std::vector<double> losses;
  std::map<std::string, torch::Tensor> first_grads, weights;
};

class SdxlTrainParity : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    models::set_force_math_attention(true);
    at::set_num_threads(1);  // ctest runs two tests at once on two cores
    dir_ = models::testing::make_temp_dir("sdxl-train-parity");
    tiny_ = models::write_tiny_sdxl_checkpoint(dir_ / "model", /*seed=*/4);
  }
  static void TearDownTestSuite() {
    if (!std::getenv("LORAPIPE_KEEP")) fs::remove_all(dir_);
  }

  static NetworkOptions network_options(const Case& c) {
    NetworkOptions net;
    net.dim = 4;
    net.alpha = 2;  // scale 0.5: a wrong scale cannot pass
    net.train_text_encoder = c.train_text_encoder;
    return net;
  }

  // Each sample's geometry: different original sizes and crops, flipped or not, so the time ids
  // differ per sample.
  static std::vector<models::SampleGeometry> geometry(int64_t step) {
    return {{64 + 8 * step, 48, 3, 5, 64, 64}, {96, 80 + 8 * step, 0, 8, 64, 64}};
  }

  void run(const Case& c, const std::string& tag, bool final_weights) {
    const auto owned = models::load_model(tiny_.diffusers);
    models::DiffusionModel& model = *owned;
    LoraNetwork network(model, network_options(c), at::make_generator<at::CPUGeneratorImpl>(7));
    const fs::path work = dir_ / tag;
    fs::create_directories(work);
    testing::start_from_random_ups(network, work / "init.safetensors");
    nlohmann::json names;
    bool text_modules = false;
    for (const LoraNetwork::Module& m : network.modules()) {
      const std::string component = !m.target.text_encoder ? "unet"
                                    : m.target.encoder == 0 ? "text_encoder"
                                                            : "text_encoder_2";
      names[m.target.name] = {component, m.target.module_path};
      text_modules |= m.target.text_encoder;
    }
    ASSERT_EQ(text_modules, c.train_text_encoder);
    std::ofstream(work / "names.json") << names.dump();

    // Inputs for every step, from a fixed seed.
    torch::manual_seed(1234);
    const int64_t S = c.steps, B = 2;
    std::map<std::string, torch::Tensor> in;
    in["latents"] = torch::randn({S, B, 4, 8, 8});
    in["noise"] = torch::randn({S, B, 4, 8, 8});
    in["timesteps"] = torch::randint(0, 1000, {S, B}, torch::kInt64);
    in["loss_weights"] = torch::ones({S, B});
    in["loss_weights"].index_put_({torch::indexing::Slice(), 0}, 0.5);  // a "reg" sample
    const std::vector<std::string> captions{"a red circle", "a square on a ring"};
    std::vector<std::string> all;
    for (int64_t i = 0; i < S * B; ++i) all.push_back(captions[i % 2]);
    const models::TokenBatch tokens = model.tokenize(all);
    ASSERT_EQ(tokens.ids.size(), 2u);
    in["input_ids"] = tokens.ids[0].view({S, B, -1});
    in["input_ids_2"] = tokens.ids[1].view({S, B, -1});
    std::vector<float> ids;
    for (int64_t i = 0; i < S; ++i) {
      for (const models::SampleGeometry& g : geometry(i)) {
        for (int64_t v : {g.original_height, g.original_width, g.crop_top, g.crop_left,
                          g.target_height, g.target_width}) {
          ids.push_back(static_cast<float>(v));
        }
      }
    }
    in["time_ids"] = torch::tensor(ids).view({S, B, 6});
    write_lora_file(work / "inputs.safetensors", in, {});

    // Ours.
    StepOptions o;
    o.objective.v_prediction = c.v_prediction;
    o.max_grad_norm = c.max_grad_norm;
    o.optimizer_groups.learning_rate = 1e-3;
    o.optimizer.eps = kAdamEps;
    o.schedule.training_steps = S;
    o.schedule.initial_lr = 1e-3;
    network.set_training(true);
    TrainingStep step(model, network, o);
    Result ours;
    const auto params = network.named_parameters();
    for (int64_t i = 0; i < S; ++i) {
      MicroBatch batch;
      batch.latents = in["latents"][i];
      batch.noise = in["noise"][i];
      batch.times = in["timesteps"][i];
      batch.loss_weights = in["loss_weights"][i];
      batch.tokens.ids = {in["input_ids"][i], in["input_ids_2"][i]};
      batch.geometry = geometry(i);
      ours.losses.push_back(step.accumulate(batch, at::make_generator<at::CPUGeneratorImpl>(i)));
      if (ours.first_grads.empty()) {
        for (const auto& [name, p] : params) {
          ours.first_grads[name.substr(0, name.size() - 6) + "grad"] =
              p.grad().defined() ? p.grad().clone() : torch::zeros_like(p);
        }
      }
      EXPECT_TRUE(step.update().applied);
    }
    for (const auto& [name, p] : params) ours.weights[name] = p.detach().clone();

    // The reference.
    nlohmann::json config{{"steps", S},
                          {"learning_rate", 1e-3},
                          {"prediction_type", c.v_prediction ? "v_prediction" : "epsilon"},
                          {"train_text_encoder", c.train_text_encoder},
                          {"max_grad_norm", c.max_grad_norm},
                          {"adam_eps", kAdamEps}};
    std::ofstream(work / "config.json") << config.dump(2);
    const char* python = std::getenv("LORAPIPE_PYTHON");
    ASSERT_NE(python, nullptr) << "LORAPIPE_PYTHON (the test venv's python) is unset";
    // One OpenMP thread, as this process (ctest runs two tests at once on two cores): beside
    // another test, a reference spinning threads on both took 318 s against 17 s alone. Its
    // float64 result does not depend on the thread count at this test's tolerance.
    const std::string command =
        "OMP_NUM_THREADS=1 " + std::string(python) + " " + LORAPIPE_SOURCE_DIR +
        "/trainer/reference/sdxl_train_reference.py --model " + tiny_.diffusers.string() +
        " --lora " + (work / "init.safetensors").string() + " --names " +
        (work / "names.json").string() + " --inputs " + (work / "inputs.safetensors").string() +
        " --config " + (work / "config.json").string() + " --out " +
        (work / "out.safetensors").string();
    ASSERT_EQ(std::system(command.c_str()), 0) << command;
    const auto reference =
        models::read_tensors(models::SafetensorsFile::open(work / "out.safetensors"));

    models::testing::expect_close(tag + " loss", torch::tensor(ours.losses, torch::kFloat64),
                                  reference.at("loss"), kTolerance);
    // The first encoder's last layer feeds nothing: SDXL takes its penultimate hidden state, and
    // the pooled output is the second encoder's. Its LoRA gets no gradient on either side (as in
    // kohya: its layer 11 trains for nothing); every other module's gradient must be nonzero.
    const std::string unused_layer = "lora_te1_text_model_encoder_layers_" +
                                     std::to_string(models::tiny_text_config().num_hidden_layers - 1) + "_";
    const testing::Worst grads = testing::expect_gradients_close(
        ours.first_grads, reference, kTolerance,
        [&](const std::string& name) { return name.rfind(unused_layer, 0) == 0; });
    size_t text = 0;
    for (const auto& [name, grad] : ours.first_grads) {
      text += name.rfind("lora_te", 0) == 0 && name.rfind(unused_layer, 0) != 0;
    }
    std::printf("[sdxl parity] %s: every LoRA gradient (%zu tensors, %zu of the text encoders): "
                "max relative error %.3g (%s)\n",
                tag.c_str(), ours.first_grads.size(), text, grads.error, grads.name.c_str());
    if (!final_weights) return;
    const testing::Worst final = testing::expect_weights_close(ours.weights, reference, kTolerance);
    std::printf("[sdxl parity] %s: every LoRA weight after %lld steps (%zu tensors): max "
                "relative error %.3g (%s)\n",
                tag.c_str(), static_cast<long long>(S), ours.weights.size(), final.error,
                final.name.c_str());
  }

  static fs::path dir_;
  static models::TinyCheckpoint tiny_;
};
fs::path SdxlTrainParity::dir_;
models::TinyCheckpoint SdxlTrainParity::tiny_;

TEST_F(SdxlTrainParity, OneStepEpsilonWithBothTextEncoders) {
  run({.steps = 1}, "epsilon", /*final_weights=*/false);
}

TEST_F(SdxlTrainParity, OneStepVPredictionWithBothTextEncoders) {
  run({.steps = 1, .v_prediction = true}, "vpred", /*final_weights=*/false);
}

TEST_F(SdxlTrainParity, TwentyAdamWStepsWithClipping) {
  run({.steps = 20, .train_text_encoder = false, .max_grad_norm = 1.0}, "adamw20",
      /*final_weights=*/true);
}

// An SDXL LoRA whose U-Net modules carry diffusers' module names (as some trainers write them,
// and as the sampler and --base_weights read them) continues training as kohya's
// create_network_from_weights converts them: --dim_from_weights finds every module's rank under
// either name, and the load reads it.
TEST_F(SdxlTrainParity, ALoraInDiffusersModuleNamesContinuesAsKohyas) {
  const auto model = models::load_model(tiny_.diffusers);
  NetworkOptions options;
  options.dim = 4;
  options.alpha = 2;
  options.train_text_encoder = false;
  LoraNetwork source(*model, options, at::make_generator<at::CPUGeneratorImpl>(3));
  std::map<std::string, torch::Tensor> renamed;
  size_t aliased = 0;
  for (const LoraNetwork::Module& m : source.modules()) {
    const std::string& name = m.target.alias.empty() ? m.target.name : m.target.alias;
    aliased += !m.target.alias.empty();
    renamed[name + ".lora_down.weight"] = m.adapter->down.detach().clone();
    renamed[name + ".lora_up.weight"] = torch::randn_like(m.adapter->up);
    renamed[name + ".alpha"] = torch::tensor(2.0);
  }
  ASSERT_GT(aliased, 0u);
  const fs::path file = dir_ / "diffusers-names.safetensors";
  write_lora_file(file, renamed, {});
  NetworkOptions from_file = options;
  from_file.ranks_from_weights = lora_file_ranks(file);
  LoraNetwork continued(*model, from_file, at::make_generator<at::CPUGeneratorImpl>(4));
  ASSERT_EQ(continued.modules().size(), source.modules().size());
  continued.load(file);
  for (const LoraNetwork::Module& m : continued.modules()) {
    const std::string& name = m.target.alias.empty() ? m.target.name : m.target.alias;
    EXPECT_TRUE(torch::equal(m.adapter->up, renamed.at(name + ".lora_up.weight"))) << name;
  }
  // Block-wise ranks that leave the middle block (MID01) out: its modules in the file, under
  // their diffusers names too, are left out as kohya's non-strict load leaves them.
  NetworkOptions blockwise = options;
  BlockArgs args;
  std::string dims;
  for (int b = 0; b < 23; ++b) dims += (b ? "," : "") + std::string(b == 11 ? "0" : "4");
  args.values["block_dims"] = dims;
  resolve_block_args(args, model->model_family().kohya.blocks, blockwise);
  LoraNetwork partial(*model, blockwise, at::make_generator<at::CPUGeneratorImpl>(5));
  ASSERT_LT(partial.modules().size(), source.modules().size()) << "no module left out";
  EXPECT_NO_THROW(partial.load(file));
}

// kohya's SDXL size conditioning of a cached sample: original size and crop from the record,
// the target its latents' size; a flipped sample's crop left is the target width minus
// crop_ltrb's right (kohya's BaseDataset.__getitem__), each truncated to an int.
TEST(SdxlTimeIds, FromTheRecordWithTheFlipRuleAsKohya) {
  wire::LatentRecord record;
  record.mutable_original_size()->set_width(1000);
  record.mutable_original_size()->set_height(750);
  for (double v : {12.5, 7.9, 1012.5, 775.0}) record.add_crop_ltrb(v);
  const torch::Tensor latent = torch::zeros({4, 96, 128});  // 768 x 1024 pixels
  const models::SampleGeometry plain = detail::sample_geometry(record, false, latent, 8);
  EXPECT_EQ(plain.original_height, 750);
  EXPECT_EQ(plain.original_width, 1000);
  EXPECT_EQ(plain.crop_top, 7);
  EXPECT_EQ(plain.crop_left, 12);
  EXPECT_EQ(plain.target_height, 768);
  EXPECT_EQ(plain.target_width, 1024);
  const models::SampleGeometry flipped = detail::sample_geometry(record, true, latent, 8);
  EXPECT_EQ(flipped.crop_left, 11);  // int(1024 - 1012.5)
  EXPECT_EQ(flipped.crop_top, 7);
}

// kohya's 23-block SDXL table (networks/lora.py with is_sdxl): BASE, IN00-IN08, MID00-MID02,
// OUT00-OUT08, OUT. Lists of another length are refused naming the table; the lr weights of the
// sides and the middle get BASE's and OUT's 1 around them; a block of weight 0 has no module.
TEST(SdxlBlockArgs, TheTwentyThreeBlockTableAsKohyas) {
  const models::KohyaBlocks& table = models::model_family("sdxl").kohya.blocks;
  EXPECT_EQ(table.count(), 23u);
  EXPECT_EQ(table.describe(), "BASE, IN00-IN08, MID00-MID02, OUT00-OUT08, OUT");
  NetworkOptions options;
  BlockArgs wrong;
  wrong.values["block_dims"] = "4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,4";
  try {
    resolve_block_args(wrong, table, options);
    ADD_FAILURE() << "25 block_dims were taken for SDXL";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("25 values, where the model's denoiser has 23 blocks "
                                         "(BASE, IN00-IN08, MID00-MID02, OUT00-OUT08, OUT)"),
              std::string::npos)
        << e.what();
  }
  BlockArgs args;
  args.values["down_lr_weight"] = "linear";
  args.values["mid_lr_weight"] = "1,0,0.5";
  args.values["up_lr_weight"] = "1,1,1,1,1,1,1,1,2";
  options.dim = 8;
  options.alpha = 4;
  resolve_block_args(args, table, options);
  ASSERT_EQ(options.block_lr_weight.size(), 23u);
  EXPECT_EQ(options.block_lr_weight[0], 1.0);    // BASE
  EXPECT_EQ(options.block_lr_weight[1], 0.0);    // IN00: linear starts at 0
  EXPECT_EQ(options.block_lr_weight[9], 1.0);    // IN08
  EXPECT_EQ(options.block_lr_weight[11], 0.0);   // MID01
  EXPECT_EQ(options.block_lr_weight[12], 0.5);   // MID02
  EXPECT_EQ(options.block_lr_weight[21], 2.0);   // OUT08
  EXPECT_EQ(options.block_lr_weight[22], 1.0);   // OUT
  EXPECT_EQ(options.block_dims[11], 0);          // weight 0: no module
  EXPECT_EQ(options.block_dims[12], 8);
}

// block_dims on the tiny SDXL: every U-Net module takes its kohya block's rank, and a block of
// rank 0 builds no module; --text_encoder_lr's two values give the two encoders their groups.
TEST(SdxlBlockArgs, RanksFollowTheBlocksAndEachEncoderHasItsRate) {
  const auto dir = models::testing::make_temp_dir("sdxl-blocks");
  const models::TinyCheckpoint tiny = models::write_tiny_sdxl_checkpoint(dir, 6);
  const auto model = models::load_model(tiny.diffusers);
  NetworkOptions options;
  options.dim = 4;
  options.alpha = 4;
  options.train_text_encoder = true;
  BlockArgs args;
  std::string dims;
  for (int b = 0; b < 23; ++b) dims += (b ? "," : "") + std::to_string(b == 11 ? 0 : 1 + b % 5);
  args.values["block_dims"] = dims;
  resolve_block_args(args, model->model_family().kohya.blocks, options);
  LoraNetwork network(*model, options, at::make_generator<at::CPUGeneratorImpl>(1));
  size_t unet = 0;
  for (const LoraNetwork::Module& m : network.modules()) {
    if (m.target.text_encoder) continue;
    ++unet;
    ASSERT_GE(m.target.block, 0) << m.target.name;
    EXPECT_NE(m.target.block, 11) << m.target.name << ": block 11 has rank 0";
    EXPECT_EQ(m.adapter->down.size(0), 1 + m.target.block % 5) << m.target.name;
  }
  EXPECT_GT(unet, 0u);
  StepOptions o;
  o.optimizer_groups.learning_rate = 1e-4;
  o.optimizer_groups.text_encoder_lr = 5e-5;
  o.optimizer_groups.text_encoder_2_lr = 2e-5;
  TrainingStep step(*model, network, o);
  const std::vector<std::string> names = step.group_names();
  const std::vector<double> lrs = step.initial_lrs();
  ASSERT_GE(names.size(), 3u);
  EXPECT_EQ(names[0], "text_encoder");
  EXPECT_EQ(lrs[0], 5e-5);
  EXPECT_EQ(names[1], "text_encoder_2");
  EXPECT_EQ(lrs[1], 2e-5);
  EXPECT_EQ(names[2], "unet");
  EXPECT_EQ(lrs[2], 1e-4);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace lorapipe::trainer
