// FLUX.1 LoRA training steps against diffusers + transformers + peft on a tiny dev pipeline
// (models/reference/tiny_flux.py; trainer/reference/flux_train_reference.py, float64): CLIP-L's
// pooled output (its LoRA training with it) and T5's states as the conditioning, the flow's
// noising at given sigmas, dev's guidance, kohya's model_prediction_type against noise - x0,
// and kohya's fused LoRA on diffusers' split modules.
//
// kohya's img_attn.qkv LoRA is one down and one up matrix; diffusers has to_q, to_k and to_v.
// With peft, each part gets an adapter whose A is the shared down and whose B is its rows of the
// up: our up gradient must equal the B gradients stacked, our down gradient their A gradients
// summed (four parts for single_blocks.N.linear1). Twenty AdamW steps run against the reference
// training kohya's fused form directly.
//
// Tolerances, the issue's: one step's loss and every LoRA gradient within 1e-4 relative, the
// weights after 20 steps within 1e-4. Ours runs in fp32 against the float64 reference, so the
// bound also covers fp32 rounding. A gradient's error is taken against its own scale, or 1% of
// the step's largest gradient where it is smaller (as sdxl_train_parity_test.cpp).

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>

#include "common/error.h"
#include "models/attention.h"
#include "models/flux_lora.h"
#include "models/lora_merge.h"
#include "models/parity_util.h"
#include "models/registry.h"
#include "models/tiny.h"
#include "tests/paths.h"
#include "trainer/lora_file.h"
#include "trainer/lora_network.h"
#include "trainer/step.h"
#include "trainer/trainer.h"
#include "trainer/train_parity_util.h"

namespace lorapipe::trainer {
namespace {

namespace fs = std::filesystem;
constexpr double kTolerance = 1e-4;
constexpr double kAdamEps = 1e-6;
constexpr int kT5Tokens = 16;

struct Case {
  int64_t steps = 1;
  std::string prediction = "raw";
  bool train_text_encoder = true;
  double max_grad_norm = 0;
  std::string mode = "peft";  // the reference's: peft (one step), fused or split
  bool split_qkv = false;     // network_args split_qkv
  std::vector<int64_t> in_dims = {};  // network_args in_dims
};

class FluxTrainParity : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    models::set_force_math_attention(true);
    at::set_num_threads(1);  // ctest runs two tests at once on two cores
    dir_ = models::testing::make_temp_dir("flux-train-parity");
    const models::TinyCheckpoint sd = models::write_tiny_checkpoint(dir_ / "sd", /*seed=*/0);
    flux_ = models::testing::cached_reference("models/reference/tiny_flux.py", {sd.diffusers});
  }
  static void TearDownTestSuite() {
    if (!std::getenv("LORAPIPE_KEEP")) fs::remove_all(dir_);
  }

  void run(const Case& c, const std::string& tag) {
    models::LoadOptions load;
    load.parts.t5_max_length = kT5Tokens;
    const auto owned = models::load_model(flux_, load);
    models::DiffusionModel& model = *owned;
    ASSERT_EQ(model.model_family().name, "flux-dev");
    NetworkOptions net;
    net.dim = 4;
    net.alpha = 2;  // scale 0.5: a wrong scale cannot pass
    net.train_text_encoder = c.train_text_encoder;
    net.split_qkv = c.split_qkv;
    net.in_dims = c.in_dims;
    LoraNetwork network(model, net, at::make_generator<at::CPUGeneratorImpl>(7));
    const fs::path work = dir_ / tag;
    fs::create_directories(work);
    testing::start_from_random_ups(network, work / "init.safetensors");

    torch::manual_seed(1234);
    const int64_t S = c.steps, B = 2;
    std::map<std::string, torch::Tensor> in;
    in["latents"] = torch::randn({S, B, 16, 8, 8});
    in["noise"] = torch::randn({S, B, 16, 8, 8});
    in["sigmas"] = torch::rand({S, B}) * 0.9 + 0.05;
    in["loss_weights"] = torch::ones({S, B});
    in["loss_weights"].index_put_({torch::indexing::Slice(), 0}, 0.5);  // a "reg" sample
    const std::vector<std::string> captions{"a red circle", "a square on a ring, blue"};
    std::vector<std::string> all;
    for (int64_t i = 0; i < S * B; ++i) all.push_back(captions[i % 2]);
    const models::TokenBatch tokens = model.tokenize(all);
    ASSERT_EQ(tokens.ids.size(), 2u);
    ASSERT_EQ(tokens.ids[1].size(1), kT5Tokens);
    in["input_ids"] = tokens.ids[0].view({S, B, -1});
    in["t5_ids"] = tokens.ids[1].view({S, B, -1});
    write_lora_file(work / "inputs.safetensors", in, {});

    StepOptions o;
    o.objective.model_prediction_type = c.prediction;
    o.max_grad_norm = c.max_grad_norm;
    o.optimizer_groups.learning_rate = 1e-3;
    o.optimizer.eps = kAdamEps;
    o.schedule.training_steps = S;
    o.schedule.initial_lr = 1e-3;
    network.set_training(true);
    TrainingStep step(model, network, o);
    std::vector<double> losses;
    std::map<std::string, torch::Tensor> first_grads;
    const auto params = network.named_parameters();
    for (int64_t i = 0; i < S; ++i) {
      MicroBatch batch;
      batch.latents = in["latents"][i];
      batch.noise = in["noise"][i];
      batch.times = in["sigmas"][i];
      batch.loss_weights = in["loss_weights"][i];
      batch.tokens.ids = {in["input_ids"][i], in["t5_ids"][i]};
      losses.push_back(step.accumulate(batch, at::make_generator<at::CPUGeneratorImpl>(i)));
      if (first_grads.empty()) {
        for (const auto& [name, p] : params) {
          first_grads[name.substr(0, name.size() - 6) + "grad"] =
              p.grad().defined() ? p.grad().clone() : torch::zeros_like(p);
        }
      }
      EXPECT_TRUE(step.update().applied);
    }

    if (c.split_qkv) {  // the parts' ups never read another part's down
      size_t split = 0;
      for (const LoraNetwork::Module& m : network.modules()) {
        if (m.split_dims.empty()) continue;
        ++split;
        const int64_t r = m.scale_rank();
        int64_t row = 0;
        for (size_t j = 0; j < m.split_dims.size(); ++j) {
          const at::Tensor rows = m.adapter->up.narrow(0, row, m.split_dims[j]);
          for (size_t k = 0; k < m.split_dims.size(); ++k) {
            if (k == j) continue;
            EXPECT_EQ(rows.narrow(1, static_cast<int64_t>(k) * r, r).abs().max().item<double>(), 0)
                << m.target.name << " part " << j << " reads part " << k << "'s down";
          }
          row += m.split_dims[j];
        }
      }
      EXPECT_EQ(split, 4u);
    }
    if (!c.in_dims.empty()) {  // each input layer at its group's rank and --network_alpha
      std::map<std::string, int64_t> ranks;
      for (const LoraNetwork::Module& m : network.modules()) {
        if (m.target.in_dims < 0) continue;
        ranks[m.target.name] = m.adapter->down.size(0);
        EXPECT_DOUBLE_EQ(m.adapter->scale, net.alpha / static_cast<double>(ranks[m.target.name]));
      }
      const std::map<std::string, int64_t> expected{
          {"lora_unet_img_in", c.in_dims[0]},           {"lora_unet_time_in_in_layer", c.in_dims[1]},
          {"lora_unet_time_in_out_layer", c.in_dims[1]}, {"lora_unet_guidance_in_in_layer", c.in_dims[3]},
          {"lora_unet_guidance_in_out_layer", c.in_dims[3]}, {"lora_unet_txt_in", c.in_dims[4]}};
      EXPECT_EQ(ranks, expected) << "vector_in's rank is 0: no module";
    }
    nlohmann::json config{{"steps", S},
                          {"learning_rate", 1e-3},
                          {"model_prediction_type", c.prediction},
                          {"guidance", 3.5},
                          {"train_text_encoder", c.train_text_encoder},
                          {"max_grad_norm", c.max_grad_norm},
                          {"adam_eps", kAdamEps}};
    std::ofstream(work / "config.json") << config.dump(2);
    const char* python = std::getenv("LORAPIPE_PYTHON");
    ASSERT_NE(python, nullptr) << "LORAPIPE_PYTHON (the test venv's python) is unset";
    const std::string command = std::string(python) + " " + LORAPIPE_SOURCE_DIR +
                                "/trainer/reference/flux_train_reference.py --model " +
                                flux_.string() + " --lora " + (work / "init.safetensors").string() +
                                " --inputs " + (work / "inputs.safetensors").string() +
                                " --config " + (work / "config.json").string() + " --out " +
                                (work / "out.safetensors").string() + " --mode " + c.mode + " > " +
                                (work / "reference.log").string() + " 2>&1";
    ASSERT_EQ(std::system(command.c_str()), 0)
        << models::testing::read_bytes(work / "reference.log");
    const auto reference =
        models::read_tensors(models::SafetensorsFile::open(work / "out.safetensors"));

    models::testing::expect_close(tag + " loss", torch::tensor(losses, torch::kFloat64),
                                  reference.at("loss"), kTolerance);
    const testing::Worst grads =
        testing::expect_gradients_close(first_grads, reference, kTolerance);
    size_t text = 0, fused = 0;
    for (const auto& [name, grad] : first_grads) {
      text += name.rfind("lora_te", 0) == 0;
      const std::string module = name.substr(0, name.find('.'));
      if (c.mode == "peft" && name.ends_with("lora_down.grad")) {
        fused += reference.at(module + ".parts").item<double>() > 1;
      }
    }
    std::printf(
        "[flux parity] %s: every LoRA gradient (%zu tensors, %zu of CLIP-L; %zu fused "
        "modules against split peft adapters): max relative error %.3g (%s)\n",
        tag.c_str(), first_grads.size(), text, fused, grads.error, grads.name.c_str());
    if (c.mode == "peft") {
      EXPECT_EQ(fused, 4u) << "img_attn.qkv, txt_attn.qkv and two single blocks' linear1";
      return;
    }
    std::map<std::string, torch::Tensor> weights;
    for (const auto& [name, p] : params) weights[name] = p.detach();
    const testing::Worst final = testing::expect_weights_close(weights, reference, kTolerance);
    std::printf(
        "[flux parity] %s: every LoRA weight after %lld steps (%zu tensors): max relative "
        "error %.3g (%s)\n",
        tag.c_str(), static_cast<long long>(S), params.size(), final.error, final.name.c_str());
  }

  static fs::path dir_, flux_;
};
fs::path FluxTrainParity::dir_;
fs::path FluxTrainParity::flux_;

TEST_F(FluxTrainParity, OneStepRawAgainstSplitPeftAdapters) { run({.prediction = "raw"}, "raw"); }

TEST_F(FluxTrainParity, OneStepSigmaScaledAgainstSplitPeftAdapters) {
  run({.prediction = "sigma_scaled"}, "sigma_scaled");
}

TEST_F(FluxTrainParity, TwentyAdamWStepsAgainstKohyasFusedForm) {
  run({.steps = 20, .prediction = "raw", .max_grad_norm = 1.0, .mode = "fused"}, "fused20");
}

// kohya's network_args in_dims: the input layers (img_in, time_in, vector_in, guidance_in,
// txt_in) each at the rank its group is given (vector_in's 0: none), trained with the blocks'
// layers for 20 AdamW steps against the reference training kohya's fused form with the same
// modules on diffusers' x_embedder, time_text_embed and context_embedder.
TEST_F(FluxTrainParity, TwentyAdamWStepsWithInDimsAgainstKohyasFusedForm) {
  run({.steps = 20, .prediction = "raw", .max_grad_norm = 1.0, .mode = "fused",
       .in_dims = {2, 4, 0, 3, 2}},
      "in_dims20");
}

// kohya's networks.lora_flux reads none of the U-Net's block-wise network_args: refused by name,
// not applied to every module as the U-Net table's last block.
TEST_F(FluxTrainParity, BlockWiseArgsOfTheUNetAreRefusedByName) {
  for (const char* arg : {"up_lr_weight=1,1,1,1,1,1,1,1,1,1,1,0.5", "block_dims=4,4,4",
                          "mid_lr_weight=0"}) {
    Options o;
    o.model = flux_;
    o.network_args = {arg};
    try {
      apply_network_args(o);
      ADD_FAILURE() << arg << " was taken";
    } catch (const InputError& e) {
      const std::string key = std::string(arg).substr(0, std::string(arg).find('='));
      EXPECT_NE(std::string(e.what()).find("--network_args " + key + ": FLUX.1"),
                std::string::npos)
          << e.what();
      EXPECT_NE(std::string(e.what()).find("networks.lora_flux reads none"), std::string::npos)
          << e.what();
    }
    EXPECT_TRUE(o.network.block_lr_weight.empty() && o.network.block_dims.empty()) << arg;
  }
  // kohya's verbose (it prints the block-wise ranks) is taken and changes nothing.
  Options o;
  o.model = flux_;
  o.network_args = {"verbose=True", "rank_dropout=0.1"};
  apply_network_args(o);
  EXPECT_EQ(o.network.rank_dropout, 0.1);
}

// kohya's FLUX.1 trainer draws plain noise: the SD noise options a ported SDXL command carries
// are refused by name, by the check lorapipe run makes before any stage (the family from the
// model's files, nothing loaded), with the DDPM objective's flags; --ip_noise_gamma is taken.
TEST_F(FluxTrainParity, NoiseKohyasFluxTrainerDoesNotDrawIsRefusedBeforeCaching) {
  auto options = [] {
    Options o;
    o.model = flux_;
    o.dataset_id = "d";
    o.output_dir = dir_ / "check";
    return o;
  };
  Options o = options();
  o.step.noise.ip_noise_gamma = 0.1;
  EXPECT_NO_THROW(check_options(o));
  std::vector<std::pair<std::string, Options>> refused;
  refused.emplace_back("--noise_offset", options());
  refused.back().second.step.noise.noise_offset = 0.05;
  refused.emplace_back("--multires_noise_iterations", options());
  refused.back().second.step.noise.multires_noise_iterations = 6;
  refused.emplace_back("--noise_offset_random_strength", options());
  refused.back().second.step.noise.noise_offset_random_strength = true;
  refused.emplace_back("--min_snr_gamma", options());
  refused.back().second.step.objective.min_snr_gamma = 5;
  for (const auto& [flag, bad] : refused) {
    try {
      check_options(bad);
      ADD_FAILURE() << flag << " was taken";
    } catch (const InputError& e) {
      EXPECT_EQ(std::string(e.what()).rfind(flag + " is a Stable Diffusion (DDPM) option", 0), 0u)
          << e.what();
    }
  }
  // Huber's SNR schedule (kohya's default) needs a DDPM noise schedule: refused here too, not at
  // the first step; the constant and exponential schedules are taken.
  Options huber = options();
  huber.step.loss_type = "huber";
  try {
    check_options(huber);
    ADD_FAILURE() << "--huber_schedule snr was taken";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("--huber_schedule snr"), std::string::npos) << e.what();
  }
  huber.step.objective.huber_schedule = "exponential";
  EXPECT_NO_THROW(check_options(huber));
  // kohya's FLUX.1 trainer has no --weighted_captions: refused here, not at the first batch after
  // T5 has cached every caption. --cpu_offload_checkpointing is FLUX.1's and taken.
  Options weighted = options();
  weighted.weighted_captions = true;
  try {
    check_options(weighted);
    ADD_FAILURE() << "--weighted_captions was taken";
  } catch (const InputError& e) {
    EXPECT_EQ(std::string(e.what()).rfind("--weighted_captions: FLUX.1", 0), 0u) << e.what();
    EXPECT_NE(std::string(e.what()).find("captions carry no attention weights"), std::string::npos)
        << e.what();
  }
  Options offload = options();
  offload.step.cpu_offload_checkpointing = true;
  offload.step.gradient_checkpointing = true;
  EXPECT_NO_THROW(check_options(offload));
}

// in_dims as kohya reads it ("[2,4,0,3,2]" or without brackets), and refused where the list is
// not five whole numbers, where its length does not match, and for a family with no such layers.
TEST_F(FluxTrainParity, InDimsIsReadAsKohyaReadsItAndRefusedWhereItCannotApply) {
  Options o;
  o.network_args = {"in_dims=[2, 4,0,3,2]"};
  apply_network_args(o);
  EXPECT_EQ(o.network.in_dims, (std::vector<int64_t>{2, 4, 0, 3, 2}));
  o.network_args = {"in_dims=1,0,0,0,1"};
  apply_network_args(o);
  EXPECT_EQ(o.network.in_dims, (std::vector<int64_t>{1, 0, 0, 0, 1}));
  for (const char* bad : {"in_dims=[4,x,0,0,4]", "in_dims=[4,-1,0,0,4]", "in_dims=[4,,0,0,4]"}) {
    o.network_args = {bad};
    try {
      apply_network_args(o);
      ADD_FAILURE() << bad << " was taken";
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find("is not a rank"), std::string::npos) << e.what();
    }
  }
  models::LoadOptions load;
  load.parts.t5_max_length = kT5Tokens;
  const auto model = models::load_model(flux_, load);
  NetworkOptions four;
  four.in_dims = {4, 0, 0, 4};
  try {
    LoraNetwork network(*model, four, at::make_generator<at::CPUGeneratorImpl>(1));
    ADD_FAILURE() << "four in_dims were taken";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("img_in, time_in, vector_in, guidance_in, txt_in"),
              std::string::npos)
        << e.what();
  }
  // Without in_dims no input layer has a module, and a file's modules for them are not loaded
  // (kohya's load is not strict): a network continues from a file trained with in_dims.
  NetworkOptions with;
  with.in_dims = {2, 0, 0, 0, 0};
  const fs::path file = dir_ / "in_dims.safetensors";
  {
    LoraNetwork network(*model, with, at::make_generator<at::CPUGeneratorImpl>(1));
    EXPECT_EQ(network.unet_module_count(), 17u);
    std::map<std::string, torch::Tensor> tensors;
    for (const auto& [name, p] : network.named_parameters()) tensors[name] = p.detach();
    for (const LoraNetwork::Module& m : network.modules()) {
      tensors[m.target.name + ".alpha"] = torch::tensor(m.alpha);
    }
    write_lora_file(file, tensors, {});
  }
  LoraNetwork without(*model, NetworkOptions{}, at::make_generator<at::CPUGeneratorImpl>(1));
  EXPECT_EQ(without.unet_module_count(), 16u);
  EXPECT_NO_THROW(without.load(file));
  const auto sd = models::load_model(models::write_tiny_checkpoint(dir_ / "sd-in-dims", 2).diffusers);
  NetworkOptions five;
  five.in_dims = {4, 0, 0, 0, 4};
  try {
    LoraNetwork network(*sd, five, at::make_generator<at::CPUGeneratorImpl>(1));
    ADD_FAILURE() << "an SD model took in_dims";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("has no in_dims"), std::string::npos) << e.what();
  }
}

// kohya's network_args train_blocks: the double blocks' or the single blocks' modules alone
// (10 per double block, 3 per single block in the tiny model), CLIP-L's as they were; another
// choice is refused with the ones there are, and an SD model has no such argument.
// kohya's split_qkv: q, k, v (and linear1's MLP part) each with a LoRA of their own, saved merged
// (downs stacked, ups block-diagonal): 20 AdamW steps against the reference training kohya's
// split modules; the blocks off the diagonal stay zero.
TEST_F(FluxTrainParity, TwentyAdamWStepsWithSplitQkvAgainstKohyasSplitModules) {
  run({.steps = 20, .prediction = "raw", .max_grad_norm = 1.0, .mode = "split", .split_qkv = true},
      "split20");
}

// A split_qkv LoRA file holds each fused layer's parts merged at n times their rank with alpha
// unchanged, as kohya saves it. The sampler's preview (the file in the layers' slots) applies
// every layer as the network trained it (each part at alpha / its own rank), as kohya's previews
// of its live network do: every layer's output equals the trained network's (1e-5 of its scale:
// the same fp32 products in another order). Merged into the base for good (--base_weights),
// the file acts as kohya's merge reads it: alpha over the merged rank.
TEST_F(FluxTrainParity, SplitQkvPreviewAppliesEveryLayerAsTrained) {
  models::LoadOptions load;
  load.parts.t5_max_length = kT5Tokens;
  const auto trained = models::load_model(flux_, load);
  NetworkOptions net;
  net.dim = 4;
  net.alpha = 2;
  net.train_text_encoder = false;
  net.split_qkv = true;
  LoraNetwork network(*trained, net, at::make_generator<at::CPUGeneratorImpl>(7));
  const fs::path file = dir_ / "split-preview.safetensors";
  testing::start_from_random_ups(network, dir_ / "split-init.safetensors");
  write_lora_file(file, network.state_dict(),
                  {{"ss_network_args", "{\"split_qkv\": \"True\"}"}});

  const auto previewed = models::load_model(flux_, load);
  const models::MergedLora preview(*previewed, file, /*multiplier=*/1.0,
                                   models::MergedLora::Application::kInSlots);
  const auto before = previewed->lora_targets(false, true);
  std::map<std::string, const models::LoraTarget*> by_name;
  for (const models::LoraTarget& t : before) by_name[t.name] = &t;
  torch::NoGradGuard no_grad;
  torch::manual_seed(5);
  size_t split = 0;
  for (const models::LoraTarget& t : trained->lora_targets(false, true)) {
    if (t.conv || !by_name.count(t.name)) continue;
    const at::Tensor x = torch::randn({3, t.in_features()});
    const at::Tensor want = t.linear->forward(x);
    const at::Tensor got = by_name.at(t.name)->linear->forward(x);
    split += !models::flux_split_qkv_dims(t).empty();
    EXPECT_LT((got - want).abs().max().item<double>(), 1e-5 * want.abs().max().item<double>())
        << t.name;
  }
  EXPECT_GT(split, 0u) << "no split_qkv layer was compared";

  // --base_weights: kohya's merge of the same file, alpha over the merged rank (1/3 of a qkv).
  const auto base = models::load_model(flux_, load);
  const models::LoraTarget qkv = [&] {
    for (const models::LoraTarget& t : base->lora_targets(false, true)) {
      if (models::flux_split_qkv_dims(t).size() == 3) return t;
    }
    throw std::runtime_error("no qkv layer");
  }();
  const at::Tensor original = qkv.weight().clone();
  const models::MergedLora merged(*base, file, /*multiplier=*/1.0,
                                  models::MergedLora::Application::kMergedForGood);
  const auto tensors = read_tensor_file(file);
  const at::Tensor down = tensors.at(qkv.name + ".lora_down.weight");
  const at::Tensor up = tensors.at(qkv.name + ".lora_up.weight");
  const at::Tensor kohya = up.matmul(down) * (2.0 / static_cast<double>(down.size(0)));
  // fp32 products summed in another order: within 1e-5 of their size.
  EXPECT_TRUE(torch::allclose(qkv.weight() - original, kohya, /*rtol=*/1e-5, /*atol=*/1e-6))
      << qkv.name;

  // The same metadata over modules no longer split into parts (kohya's resize_lora keeps the
  // metadata and writes plain modules): each is read as the plain module it is, alpha over the
  // file's rank.
  auto resized = network.state_dict();
  for (auto& [key, t] : resized) {
    if (key.ends_with(".lora_up.weight")) t = torch::randn_like(t) * 0.05;
  }
  const fs::path resized_file = dir_ / "split-resized.safetensors";
  write_lora_file(resized_file, resized, {{"ss_network_args", "{\"split_qkv\": \"True\"}"}});
  const auto plain = models::load_model(flux_, load);
  for (const models::LoraTarget& t : plain->lora_targets(false, true)) {
    if (models::flux_split_qkv_dims(t).empty()) continue;
    const at::Tensor x = torch::randn({3, t.in_features()});
    at::Tensor with_lora;
    {
      const models::MergedLora slotted(*plain, resized_file, /*multiplier=*/1.0,
                                       models::MergedLora::Application::kInSlots);
      with_lora = t.linear->forward(x);
    }
    const at::Tensor file_down = resized.at(t.name + ".lora_down.weight");
    const at::Tensor file_up = resized.at(t.name + ".lora_up.weight");
    const double scale = 2.0 / static_cast<double>(file_down.size(0));
    const at::Tensor want =
        t.linear->forward(x) + x.matmul(file_down.t()).matmul(file_up.t()) * scale;
    EXPECT_LT((with_lora - want).abs().max().item<double>(), 1e-5 * want.abs().max().item<double>())
        << t.name;
  }
}

TEST_F(FluxTrainParity, TrainBlocksKeepsOnlyTheChosenBlocksModules) {
  models::LoadOptions load;
  load.parts.t5_max_length = kT5Tokens;
  const auto model = models::load_model(flux_, load);
  auto count = [&](const std::string& blocks, const std::string& prefix) {
    NetworkOptions net;
    net.train_blocks = blocks;
    LoraNetwork network(*model, net, at::make_generator<at::CPUGeneratorImpl>(1));
    size_t denoiser = 0, text = 0;
    for (const LoraNetwork::Module& m : network.modules()) {
      if (m.target.text_encoder) {
        ++text;
        continue;
      }
      ++denoiser;
      EXPECT_EQ(m.target.name.rfind(prefix, 0), 0u) << m.target.name;
    }
    EXPECT_GT(text, 0u) << blocks;
    return denoiser;
  };
  EXPECT_EQ(count("all", "lora_unet_"), 16u);
  EXPECT_EQ(count("double", "lora_unet_double_blocks_"), 10u);
  EXPECT_EQ(count("single", "lora_unet_single_blocks_"), 6u);
  // A file of every block continues a train_blocks=single network: the double blocks' modules
  // are left out, as kohya's non-strict load leaves them, and the single ones are read.
  NetworkOptions all;
  LoraNetwork whole(*model, all, at::make_generator<at::CPUGeneratorImpl>(2));
  NetworkOptions single_only;
  single_only.train_blocks = "single";
  LoraNetwork singles(*model, single_only, at::make_generator<at::CPUGeneratorImpl>(3));
  const auto file = whole.state_dict();
  singles.load(file, "all-blocks.safetensors");
  for (const LoraNetwork::Module& m : singles.modules()) {
    EXPECT_TRUE(torch::equal(m.adapter->down, file.at(m.target.name + ".lora_down.weight")))
        << m.target.name;
  }
  NetworkOptions wrong;
  wrong.train_blocks = "middle";
  try {
    LoraNetwork network(*model, wrong, at::make_generator<at::CPUGeneratorImpl>(1));
    ADD_FAILURE() << "train_blocks=middle was taken";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("use all, double, single"), std::string::npos) << e.what();
  }
  const auto sd =
      models::load_model(models::write_tiny_checkpoint(dir_ / "sd-blocks", 2).diffusers);
  NetworkOptions single;
  single.train_blocks = "single";
  try {
    LoraNetwork network(*sd, single, at::make_generator<at::CPUGeneratorImpl>(1));
    ADD_FAILURE() << "an SD model took train_blocks";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("has no train_blocks"), std::string::npos) << e.what();
  }
}

// kohya's networks.lora_flux ranks by kind of module (the first kind given whose words the
// name holds, 0 for none, alpha --network_alpha) and its block indices (all, none, indices and
// ranges of its 19 double and 38 single blocks), as the kohya_ss GUI writes them
// ("train_double_block_indices=all"). The tiny model has one double block (10 modules) and two
// single blocks (linear1, linear2, modulation.lin each).
TEST_F(FluxTrainParity, TypeDimsAndBlockIndicesShapeTheNetworkAsKohyas) {
  models::LoadOptions load;
  load.parts.t5_max_length = kT5Tokens;
  const auto model = models::load_model(flux_, load);
  auto ranks = [&](const std::vector<std::string>& args) {
    Options o;
    o.network_args = args;
    apply_network_args(o);
    o.network.alpha = 2;
    LoraNetwork network(*model, o.network, at::make_generator<at::CPUGeneratorImpl>(1));
    std::map<std::string, std::pair<int64_t, double>> out;  // denoiser module -> rank, alpha
    for (const LoraNetwork::Module& m : network.modules()) {
      if (!m.target.text_encoder) out[m.target.name] = {m.scale_rank(), m.alpha};
    }
    return out;
  };
  const auto all = ranks({"train_double_block_indices=all", "train_single_block_indices=all",
                          "train_t5xxl=False"});
  EXPECT_EQ(all.size(), 16u) << "all blocks, as without the arguments";
  const auto typed = ranks({"img_attn_dim=8", "txt_mlp_dim=0", "single_mod_dim=2"});
  EXPECT_EQ(typed.size(), 14u) << "txt_mlp's two layers have no module";
  EXPECT_EQ(typed.at("lora_unet_double_blocks_0_img_attn_qkv"), (std::pair<int64_t, double>{8, 2}));
  EXPECT_EQ(typed.at("lora_unet_double_blocks_0_img_attn_proj").first, 8);
  EXPECT_EQ(typed.at("lora_unet_double_blocks_0_txt_attn_qkv").first, 4) << "--network_dim";
  EXPECT_EQ(typed.at("lora_unet_double_blocks_0_img_mod_lin").first, 4);
  EXPECT_FALSE(typed.count("lora_unet_double_blocks_0_txt_mlp_0"));
  EXPECT_EQ(typed.at("lora_unet_single_blocks_1_modulation_lin").first, 2);
  EXPECT_EQ(typed.at("lora_unet_single_blocks_1_linear1").first, 4);
  const auto chosen = ranks({"train_double_block_indices=none", "train_single_block_indices=1",
                             "single_dim=3"});
  std::vector<std::string> names;
  for (const auto& [name, rank_alpha] : chosen) names.push_back(name);
  EXPECT_EQ(names, (std::vector<std::string>{"lora_unet_single_blocks_1_linear1",
                                             "lora_unet_single_blocks_1_linear2",
                                             "lora_unet_single_blocks_1_modulation_lin"}));
  EXPECT_EQ(chosen.at("lora_unet_single_blocks_1_linear2").first, 3);
  EXPECT_EQ(chosen.at("lora_unet_single_blocks_1_modulation_lin").first, 4);
  EXPECT_EQ(ranks({"train_single_block_indices=0-1", "train_double_block_indices=0"}).size(), 16u);

  for (const auto& [bad, says] : std::vector<std::pair<std::string, std::string>>{
           {"train_double_block_indices=19", "'19' is not a block index (0 to 18)"},
           {"train_single_block_indices=5-2", "'5-2' runs backwards"},
           {"img_attn_dim=x", "'x' is not a rank"},
           {"train_t5xxl=True", "is not supported yet"},
           {"network_reg_dims=double_blocks=16", "network_reg_dims is not supported yet"},
           {"ggpo_sigma=0.03", "ggpo_sigma is not supported yet"}}) {
    Options o;
    o.network_args = {bad};
    try {
      apply_network_args(o);
      ADD_FAILURE() << bad << " was taken";
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
    }
  }
  const auto sd = models::load_model(models::write_tiny_checkpoint(dir_ / "sd-types", 2).diffusers);
  NetworkOptions typed_sd;
  typed_sd.type_dims = {{"img_attn_dim", 8}};
  try {
    LoraNetwork network(*sd, typed_sd, at::make_generator<at::CPUGeneratorImpl>(1));
    ADD_FAILURE() << "an SD model took img_attn_dim";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("img_attn_dim: Stable Diffusion"), std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace lorapipe::trainer
