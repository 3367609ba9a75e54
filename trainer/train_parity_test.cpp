// TrainParity: lorapipe's training step against diffusers + transformers + peft (the reference,
// trainer/reference/train_reference.py) on the tiny SD1.5 model: the same LoRA initial weights,
// latents, noise, timesteps and token ids, the same steps. lorapipe runs in fp32 on the CPU.
//
// Tolerance: 1e-4 relative to each tensor's scale (max |ours - reference| / max |reference|), the
// issue's bound, against the reference run in float64. Why float64: the gradients of the
// cross-attention projections (attn2 to_q / to_k) are sums that nearly cancel over a chunk of text tokens,
// so any fp32 run of them carries rounding error near 1e-4 of the tensor's scale. Measured on the
// one-step epsilon case: the fp32 reference with PyTorch's default CPU attention kernel is 1.9e-4
// from its own float64 run, lorapipe's fp32 step 5.4e-5. Comparing fp32 with fp32 would measure
// the reference's rounding as much as ours; against float64 the bound applies to lorapipe's error
// alone. A wrong scale, target, weight, schedule or optimizer rule moves the numbers by 1e-2 or
// more.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdio>
#include <fstream>
#include <numbers>
#include <nlohmann/json.hpp>

#include "cacher/encode.h"
#include "common/error.h"
#include "models/attention.h"
#include "models/ddpm.h"
#include "models/float8.h"
#include "models/objective.h"
#include "models/parity_util.h"
#include "models/placement.h"
#include "models/registry.h"
#include "models/tensor_memory.h"
#include "models/tiny.h"
#include "tests/paths.h"
#include "trainer/lora_file.h"
#include "trainer/lora_network.h"
#include "trainer/noise.h"
#include "trainer/step.h"

namespace lorapipe::trainer {
namespace {

namespace fs = std::filesystem;
using models::testing::expect_close;
using models::testing::make_temp_dir;

constexpr double kTolerance = 1e-4;
// AdamW's eps for the comparisons. Adam divides by sqrt(v) + eps, so an element whose gradient
// is near eps turns a rounding difference of 1e-10 in the gradient into up to lr * 1e-2 in its
// update; over 20 steps that alone reaches 1e-4 of a weight's scale. eps 1e-6 (a setting kohya
// users pass through --optimizer_args) keeps that amplification 100x lower while every rule of
// the update (bias correction, decoupled decay, the schedule, clipping) still acts on every
// element.
constexpr double kAdamEps = 1e-6;
// --scale_weight_norms for the max-norm scenario: inside the spread of the initial LoRA's module
// norms (measured: 0.097 to 0.63, median 0.16), so the pass shrinks some modules and leaves
// others, and both branches are compared.
constexpr double kMaxNorm = 0.15;
// GradientCheckpointingChangesNothing also checks that checkpointing happened: the checkpointed
// steps' peak tensor memory (beyond the model) at most this share of the plain steps'. Measured
// on the tiny model, batch 2: 2.2 against 11.5 MiB (0.19); a checkpointing that kept every
// activation would give 1.0.
constexpr double kCheckpointedPeakAtMost = 0.5;

struct Scenario {
  int steps = 1;
  int batch = 2;
  int accumulation = 1;
  bool v_prediction = false;
  double min_snr_gamma = 5.0;
  bool scale_v_pred_loss_like_noise_pred = false;
  double v_pred_like_loss = 0;
  bool debiased_estimation_loss = false;
  double ip_noise_gamma = 0;
  bool zero_terminal_snr = false;
  double scale_weight_norms = 0;
  bool weighted_captions = false;  // captions in A1111 attention syntax, tokenized as kohya's
  double noise_offset = 0.1;
  double learning_rate = 1e-3;
  std::string lr_scheduler = "constant";
  int warmup = 0;
  double max_grad_norm = 1.0;
  bool train_text_encoder = true;
  bool checkpointing = false;
  bool conv = false;  // LoCon: also the 3x3 convs of the resnets and samplers
  bool alpha_masks = false;  // kohya's alpha_mask: random 64x64 alphas over the 8x8 latents
  bool fp8_base = false;     // --fp8_base: both models' Linear and Conv2d weights in float8
  std::string loss_type = "l2";  // --loss_type: l1, huber, smooth_l1 (kohya's conditional_loss)
  std::string huber_schedule = "constant";  // --huber_schedule: exponential, snr
  double huber_c = 0.1;
  double adaptive_noise_scale = 0;  // --adaptive_noise_scale (with noise_offset)
  bool measure_memory = false;      // our step's peak tensor memory into Result::step_peak_bytes
  // Each step's batch in micro-batches of these many rows, weighing their shares of it, as
  // bucket batch sizes split a step (BatchScheduler); empty: the batch whole.
  std::vector<int64_t> micro_rows;
};

struct Result {
  std::vector<double> losses;
  int64_t keys_scaled = 0;  // by the max-norm passes after the updates
  std::map<std::string, torch::Tensor> first_grads;  // NAME.lora_down.grad, ...
  std::map<std::string, torch::Tensor> weights;      // NAME.lora_down.weight, ...
  size_t step_peak_bytes = 0;  // with Scenario::measure_memory: the steps' most, beyond the model
};

class TrainParity : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    models::set_force_math_attention(true);
    at::set_num_threads(1);  // ctest runs two tests at once on two cores
    dir_ = new fs::path(make_temp_dir("train-parity"));
    tiny_ = new models::TinyCheckpoint(models::write_tiny_checkpoint(*dir_ / "model"));
  }
  static void TearDownTestSuite() {
    if (!std::getenv("LORAPIPE_KEEP")) fs::remove_all(*dir_);
    delete tiny_;
    delete dir_;
  }

  static std::unique_ptr<models::DiffusionModel> load() {
    models::LoadOptions options;
    options.tokenizer = tiny_->tokenizer;
    return models::load_model(tiny_->diffusers, options);
  }

  // Inputs for every micro-batch, drawn from a fixed seed; the LoRA's initial weights with a
  // non-zero up (kohya initialises up to zero, which would leave down's gradient zero at step 0
  // and hide half of the comparison).
  static std::map<std::string, torch::Tensor> make_inputs(const Scenario& s,
                                                          models::DiffusionModel& model) {
    torch::manual_seed(1234);
    const int64_t S = s.steps, B = s.batch;
    std::map<std::string, torch::Tensor> in;
    in["latents"] = torch::randn({S, B, 4, 8, 8});
    in["noise"] = torch::randn({S, B, 4, 8, 8});
    in["offset_noise"] = torch::randn({S, B, 4, 1, 1});
    in["timesteps"] = torch::randint(0, 1000, {S, B}, torch::kInt64);
    in["loss_weights"] = torch::ones({S, B});
    in["loss_weights"].index_put_({torch::indexing::Slice(), 0}, 0.5);  // a "reg" sample
    const std::vector<std::string> captions =
        s.weighted_captions
            ? std::vector<std::string>{"a (red:1.4) circle", "a [square] on a ((ring))",
                                       "(circle:0.6)", "red square"}
            : std::vector<std::string>{"a red circle", "a square on a ring", "circle",
                                       "red square"};
    std::vector<std::string> all;
    for (int64_t i = 0; i < S * B; ++i) all.push_back(captions[i % captions.size()]);
    const models::TokenBatch tokens = model.tokenize(all, 75, s.weighted_captions);
    in["input_ids"] = tokens.ids.at(0).view({S, B, -1});
    in["token_weights"] =
        (s.weighted_captions ? tokens.weights.at(0) : torch::ones_like(tokens.ids.at(0), torch::kFloat)).view({S, B, -1});
    in["ip_noise"] = torch::randn({S, B, 4, 8, 8});  // drawn last: the others stay as they were
    // The last timestep, where a zero-terminal-SNR schedule's noising is pure noise.
    if (s.zero_terminal_snr) in["timesteps"].index_put_({0, 0}, 999);
    // kohya's alpha masks at image size, as its dataset makes them: alpha.astype(float32) / 255.
    if (s.alpha_masks) {
      in["alpha"] = torch::randint(0, 256, {S, B, 64, 64}, torch::kUInt8);
      in["alpha_masks"] = in["alpha"].to(torch::kFloat).div(255.0f);
    }
    return in;
  }

  static void write_tensors(const fs::path& path, const std::map<std::string, torch::Tensor>& t) {
    write_lora_file(path, t, {});
  }

  static Result run_ours(const Scenario& s, const std::map<std::string, torch::Tensor>& inputs,
                         const fs::path& init_lora) {
    const auto owned = load();
    models::DiffusionModel& model = *owned;
    if (s.fp8_base) {
      models::store_weights_in_float8(model.denoiser_module());
      models::store_weights_in_float8(model.text_encoder_module());
    }
    NetworkOptions net;
    net.dim = 4;
    net.alpha = 2;  // scale 0.5: a wrong scale cannot pass
    net.conv_dim = s.conv ? 2 : 0;
    net.conv_alpha = 1;
    net.train_text_encoder = s.train_text_encoder;
    LoraNetwork network(model, net, at::make_generator<at::CPUGeneratorImpl>(7));
    network.load(init_lora);
    StepOptions o;
    o.objective.v_prediction = s.v_prediction;
    o.objective.min_snr_gamma = s.min_snr_gamma;
    o.objective.scale_v_pred_loss_like_noise_pred = s.scale_v_pred_loss_like_noise_pred;
    o.objective.v_pred_like_loss = s.v_pred_like_loss;
    o.objective.debiased_estimation_loss = s.debiased_estimation_loss;
    o.objective.zero_terminal_snr = s.zero_terminal_snr;
    o.scale_weight_norms = s.scale_weight_norms;
    o.noise.ip_noise_gamma = s.ip_noise_gamma;
    o.noise.noise_offset = s.noise_offset;
    o.noise.adaptive_noise_scale = s.adaptive_noise_scale;
    o.loss_type = s.loss_type;
    o.objective.huber_schedule = s.huber_schedule;
    o.objective.huber_c = s.huber_c;
    o.gradient_accumulation_steps = s.accumulation;
    o.max_grad_norm = s.max_grad_norm;
    o.gradient_checkpointing = s.checkpointing;
    o.optimizer_groups.learning_rate = s.learning_rate;
    o.optimizer.eps = kAdamEps;
    o.schedule.name = s.lr_scheduler;
    o.schedule.warmup_steps = s.warmup;
    o.schedule.training_steps = s.steps / s.accumulation;
    o.schedule.initial_lr = s.learning_rate;
    network.set_training(true);
    TrainingStep step(model, network, o);

    Result result;
    const auto names = network.named_parameters();
    // The counter sees only what is allocated from here on: the steps' tensors, not the model.
    models::TensorMemoryCounter* memory =
        s.measure_memory ? &models::TensorMemoryCounter::install() : nullptr;
    const size_t alive_before = memory != nullptr ? memory->alive_bytes() : 0;
    if (memory != nullptr) memory->reset_peak();
    for (int64_t i = 0; i < s.steps; ++i) {
      MicroBatch batch;
      batch.latents = inputs.at("latents")[i];
      batch.noise = inputs.at("noise")[i];
      batch.offset_noise = inputs.at("offset_noise")[i];
      batch.times = inputs.at("timesteps")[i];
      if (s.ip_noise_gamma > 0) batch.ip_noise = inputs.at("ip_noise")[i];
      batch.loss_weights = inputs.at("loss_weights")[i];
      batch.tokens.ids = {inputs.at("input_ids")[i]};
      if (s.weighted_captions) batch.tokens.weights = {inputs.at("token_weights")[i]};
      if (s.alpha_masks) {  // the cacher's masks at latent size
        std::vector<torch::Tensor> masks;
        for (int64_t b = 0; b < s.batch; ++b) {
          masks.push_back(cacher::latent_mask(inputs.at("alpha")[i][b], 8, 8));
        }
        batch.masks = torch::stack(masks).unsqueeze(1);
      }
      if (s.micro_rows.empty()) {
        result.losses.push_back(
            step.accumulate(batch, at::make_generator<at::CPUGeneratorImpl>(i)));
      }
      for (size_t k = 0, begin = 0; k < s.micro_rows.size(); begin += s.micro_rows[k], ++k) {
        const int64_t n = s.micro_rows[k];
        auto rows = [&](const torch::Tensor& t) { return t.defined() ? t.narrow(0, begin, n) : t; };
        MicroBatch micro;
        micro.latents = rows(batch.latents);
        micro.noise = rows(batch.noise);
        micro.offset_noise = rows(batch.offset_noise);
        micro.times = rows(batch.times);
        micro.ip_noise = rows(batch.ip_noise);
        micro.loss_weights = rows(batch.loss_weights);
        for (const torch::Tensor& ids : batch.tokens.ids) micro.tokens.ids.push_back(rows(ids));
        for (const torch::Tensor& w : batch.tokens.weights) micro.tokens.weights.push_back(rows(w));
        micro.masks = rows(batch.masks);
        micro.share = static_cast<double>(n) / static_cast<double>(s.batch);
        micro.ends_step = k + 1 == s.micro_rows.size();
        result.losses.push_back(
            step.accumulate(micro, at::make_generator<at::CPUGeneratorImpl>(i)));
      }
      if ((i + 1) % s.accumulation != 0) continue;
      if (result.first_grads.empty()) {
        for (const auto& [name, p] : names) {
          const std::string grad_name = name.substr(0, name.size() - 6) + "grad";  // .weight
          result.first_grads[grad_name] =
              p.grad().defined() ? p.grad().clone() : torch::zeros_like(p);
        }
      }
      const UpdateResult update = step.update();
      EXPECT_TRUE(update.applied);
      EXPECT_EQ(update.max_norm.has_value(), s.scale_weight_norms > 0);
      if (update.max_norm) result.keys_scaled += update.max_norm->keys_scaled;
    }
    if (memory != nullptr) result.step_peak_bytes = memory->peak_bytes() - alive_before;
    for (const auto& [name, p] : names) result.weights[name] = p.detach().clone();
    return result;
  }

  static std::map<std::string, torch::Tensor> run_reference(
      const Scenario& s, const std::map<std::string, torch::Tensor>& inputs,
      const fs::path& init_lora, const std::string& tag) {
    const fs::path work = *dir_ / tag;
    fs::create_directories(work);
    std::map<std::string, torch::Tensor> sent = inputs;
    sent.erase("alpha");  // the reference takes kohya's float masks
    write_tensors(work / "inputs.safetensors", sent);
    nlohmann::json config{{"steps", s.steps},
                          {"prediction_type", s.v_prediction ? "v_prediction" : "epsilon"},
                          {"min_snr_gamma", s.min_snr_gamma},
                          {"scale_v_pred_loss_like_noise_pred", s.scale_v_pred_loss_like_noise_pred},
                          {"v_pred_like_loss", s.v_pred_like_loss},
                          {"debiased_estimation_loss", s.debiased_estimation_loss},
                          {"ip_noise_gamma", s.ip_noise_gamma},
                          {"zero_terminal_snr", s.zero_terminal_snr},
                          {"scale_weight_norms", s.scale_weight_norms},
                          {"noise_offset", s.noise_offset},
                          {"learning_rate", s.learning_rate},
                          {"lr_scheduler", s.lr_scheduler},
                          {"lr_warmup_steps", s.warmup},
                          {"max_grad_norm", s.max_grad_norm},
                          {"train_text_encoder", s.train_text_encoder},
                          {"gradient_accumulation_steps", s.accumulation},
                          {"loss_type", s.loss_type},
                          {"huber_schedule", s.huber_schedule},
                          {"huber_c", s.huber_c},
                          {"adaptive_noise_scale", s.adaptive_noise_scale},
                          {"adam_eps", kAdamEps},
                          {"fp8_base", s.fp8_base},
                          {"dtype", "float64"}};
    std::ofstream(work / "config.json") << config.dump(2);
    const char* python = std::getenv("LORAPIPE_PYTHON");
    EXPECT_NE(python, nullptr) << "LORAPIPE_PYTHON (the test venv's python) is unset";
    if (python == nullptr) return {};
    const std::string command = std::string(python) + " " + LORAPIPE_SOURCE_DIR +
                                "/trainer/reference/train_reference.py --model " +
                                tiny_->diffusers.string() + " --lora " + init_lora.string() +
                                " --inputs " + (work / "inputs.safetensors").string() +
                                " --config " + (work / "config.json").string() + " --out " +
                                (work / "out.safetensors").string();
    EXPECT_EQ(std::system(command.c_str()), 0) << command;
    return read_tensor_file(work / "out.safetensors");
  }

  // The initial LoRA: our network's kohya-initialised down, and an up drawn small but non-zero.
  static fs::path make_init_lora(const Scenario& s, const std::string& tag) {
    const auto owned = load();
  models::DiffusionModel& model = *owned;
    NetworkOptions net;
    net.dim = 4;
    net.alpha = 2;
    net.conv_dim = s.conv ? 2 : 0;
    net.conv_alpha = 1;
    net.train_text_encoder = s.train_text_encoder;
    LoraNetwork network(model, net, at::make_generator<at::CPUGeneratorImpl>(7));
    auto state = network.state_dict();
    torch::manual_seed(99);
    for (auto& [name, t] : state) {
      if (name.ends_with(".lora_up.weight")) t = torch::randn_like(t) * 0.05;
    }
    const fs::path path = *dir_ / (tag + "-init.safetensors");
    write_lora_file(path, state, {});
    return path;
  }

  // Gradients: max |ours - reference| / max(max |reference|, 1% of the largest LoRA gradient of
  // the step). For a tensor at least 1% of the step's largest gradient that is its own relative
  // error. A few tensors are far smaller than their neighbours because their sums nearly cancel
  // (the cross-attention to_k / to_q over a chunk of mostly identical padding tokens: about 0.5% of the
  // to_v gradient beside them), and rounding in fp32 scales with the cancelled terms, not with the
  // result: diffusers' own fp32 run is 4.3e-4 of such a tensor's scale away from its float64 run.
  // Their error is held to 1e-4 of 1% of the step's scale instead, i.e. 1e-6 of it.
  static double gradient_error(const torch::Tensor& ours, const torch::Tensor& reference,
                               double step_scale) {
    const double diff =
        (ours.to(torch::kFloat64) - reference.to(torch::kFloat64)).abs().max().item<double>();
    return diff / std::max(reference.abs().max().item<double>(), 0.01 * step_scale);
  }

  // Two of our runs that must train the same LoRA (the same update computed another way): every
  // first-step gradient (gradient_error, against `expected`'s step scale) and every final weight
  // within the parity tolerance. Returns the worst error.
  static double expect_same_training(const Result& got, const Result& expected) {
    double scale = 0;
    for (const auto& [name, g] : expected.first_grads) {
      scale = std::max(scale, g.abs().max().item<double>());
    }
    EXPECT_GT(scale, 0) << "no gradient to compare";
    double worst = 0;
    for (const auto& [name, g] : expected.first_grads) {
      const double e = gradient_error(got.first_grads.at(name), g, scale);
      worst = std::max(worst, e);
      EXPECT_LE(e, kTolerance) << name;
    }
    for (const auto& [name, w] : expected.weights) {
      const double e = models::testing::relative_error(got.weights.at(name), w);
      worst = std::max(worst, e);
      EXPECT_LE(e, kTolerance) << name;
    }
    return worst;
  }

  static void compare(const Result& ours, const std::map<std::string, torch::Tensor>& reference,
                      bool final_weights) {
    ASSERT_FALSE(reference.empty());
    const torch::Tensor ref_loss = reference.at("loss");
    ASSERT_EQ(ref_loss.numel(), static_cast<int64_t>(ours.losses.size()));
    expect_close("loss", torch::tensor(ours.losses, torch::kFloat64), ref_loss, kTolerance);
    double step_scale = 0;
    for (const auto& [name, grad] : ours.first_grads) {
      ASSERT_TRUE(reference.count(name)) << "reference has no " << name;
      step_scale = std::max(step_scale, reference.at(name).abs().max().item<double>());
    }
    double worst_grad = 0;
    std::string worst_name;
    for (const auto& [name, grad] : ours.first_grads) {
      EXPECT_GT(reference.at(name).abs().max().item<double>(), 0) << name << " is all zero";
      const double e = gradient_error(grad, reference.at(name), step_scale);
      if (e > worst_grad) worst_grad = e, worst_name = name;
      EXPECT_LE(e, kTolerance) << name;
    }
    std::printf("[parity] every LoRA gradient (%zu tensors): max relative error %.3g (%s)\n",
                ours.first_grads.size(), worst_grad, worst_name.c_str());
    if (!final_weights) return;
    double worst_weight = 0;
    for (const auto& [name, w] : ours.weights) {
      const double e = models::testing::relative_error(w, reference.at(name));
      if (e > worst_weight) worst_weight = e, worst_name = name;
      EXPECT_LE(e, kTolerance) << name;
    }
    std::printf("[parity] every LoRA weight (%zu tensors): max relative error %.3g (%s)\n",
                ours.weights.size(), worst_weight, worst_name.c_str());
  }

  static std::map<std::string, torch::Tensor> run_scenario(const Scenario& s,
                                                           const std::string& tag,
                                                           bool final_weights,
                                                           Result* ours_out = nullptr) {
    const fs::path init = make_init_lora(s, tag);
    const auto owned = load();
  models::DiffusionModel& model = *owned;
    const auto inputs = make_inputs(s, model);
    const Result ours = run_ours(s, inputs, init);
    const auto reference = run_reference(s, inputs, init, tag);
    if (ours_out) *ours_out = ours;
    // The noise schedule is diffusers' bit for bit (fp32 values, sent as float64).
    EXPECT_TRUE(reference.count("alphas_cumprod") &&
                torch::equal(models::DdpmNoiseSchedule(models::model_family("sd15").schedule,
                                                        s.zero_terminal_snr)
                                 .alphas_cumprod()
                                 .to(torch::kFloat64),
                             reference.at("alphas_cumprod")))
        << "alphas_cumprod differs from diffusers' DDPMScheduler (zero_terminal_snr "
        << s.zero_terminal_snr << ")";
    if (std::getenv("LORAPIPE_KEEP")) {  // for looking into a failure by hand
      std::map<std::string, torch::Tensor> all = ours.first_grads;
      all.insert(ours.weights.begin(), ours.weights.end());
      all["loss"] = torch::tensor(ours.losses);
      write_tensors(*dir_ / tag / "ours.safetensors", all);
    }
    compare(ours, reference, final_weights);
    return reference;
  }

  static fs::path* dir_;
  static models::TinyCheckpoint* tiny_;
};

fs::path* TrainParity::dir_ = nullptr;
models::TinyCheckpoint* TrainParity::tiny_ = nullptr;

// kohya's pyramid_noise_like sizes every level from the full latent side,
// max(1, int(side / r**i)), so with r = 3 a 64-wide latent gets levels 64, 21, 7, 2, 1 (dividing
// the previous level instead would give 64, 21, 2, 1 and lose the middle frequencies).
TEST(TrainNoise, PyramidLevelsAreSizedFromTheFullSide) {
  std::vector<int64_t> sides;
  for (int i = 0; i < 6; ++i) sides.push_back(pyramid_level_size(64, 3.0, i));
  EXPECT_EQ(sides, (std::vector<int64_t>{64, 21, 7, 2, 1, 1}));
  EXPECT_EQ(pyramid_level_size(96, 2.5, 2), 15);  // int(96 / 6.25) = int(15.36)
}

// kohya's draws for one micro-batch (get_noise_noisy_latents_and_timesteps), in its order, from one
// generator: randn_like(latents); with --noise_offset_random_strength the strength rand(1) x
// offset, then the offset's randn(B, C, 1, 1), grown by --adaptive_noise_scale x |channel mean|
// and clamped at 0 (apply_noise_offset); after the timesteps, --ip_noise_gamma's strength
// (rand(1) x gamma with random strength) and its randn_like. Rebuilt here from a generator of
// the same seed; 1e-6 absolute is fp32 rounding of the same sums.
TEST(TrainNoise, RandomStrengthsAndAdaptiveOffsetAreDrawnInKohyasOrder) {
  torch::manual_seed(2);
  const at::Tensor latents = torch::randn({2, 4, 8, 8}) + 0.3;
  NoiseOptions o;
  o.noise_offset = 0.1;
  o.noise_offset_random_strength = true;
  o.adaptive_noise_scale = 0.05;
  o.ip_noise_gamma = 0.2;
  o.ip_noise_gamma_random_strength = true;
  at::Generator drawn = at::make_generator<at::CPUGeneratorImpl>(11);
  const at::Tensor noise = draw_noise(latents, o, drawn);
  const at::Tensor input_noise = draw_input_noise(noise, o, drawn);

  at::Generator g = at::make_generator<at::CPUGeneratorImpl>(11);
  const at::Tensor base = at::randn({2, 4, 8, 8}, g);
  const double strength = at::rand({1}, g).item<double>() * 0.1;
  const at::Tensor offset_noise = at::randn({2, 4, 1, 1}, g);
  const at::Tensor offset = (strength + 0.05 * latents.mean({2, 3}, true).abs()).clamp_min(0);
  const at::Tensor expected = base + offset * offset_noise;
  EXPECT_TRUE(torch::allclose(noise, expected, 0, 1e-6))
      << (noise - expected).abs().max().item<double>();
  const double ip_strength = at::rand({1}, g).item<double>() * 0.2;
  const at::Tensor expected_input = expected + ip_strength * at::randn({2, 4, 8, 8}, g);
  EXPECT_TRUE(torch::allclose(input_noise, expected_input, 0, 1e-6))
      << (input_noise - expected_input).abs().max().item<double>();
  o.ip_noise_gamma = 0;
  EXPECT_FALSE(draw_input_noise(noise, o, drawn).defined()) << "no perturbation without a gamma";

  // A negative adaptive scale that outweighs the offset clamps it at 0: channel means near 1
  // give 0.1 - 0.5 x 1 < 0, so the noise is the plain draw, its offset draw multiplied by 0.
  o.noise_offset_random_strength = false;
  o.adaptive_noise_scale = -0.5;
  const at::Tensor bright = torch::rand({2, 4, 8, 8}) * 0.2 + 0.9;
  at::Generator clamped = at::make_generator<at::CPUGeneratorImpl>(12);
  at::Generator plain = at::make_generator<at::CPUGeneratorImpl>(12);
  EXPECT_TRUE(torch::equal(draw_noise(bright, o, clamped), at::randn({2, 4, 8, 8}, plain)))
      << "a negative offset was applied";
}

// --min_timestep / --max_timestep: kohya's torch.randint(min, max), so min is drawn and max is
// not. 20000 draws over 200 values miss one end with probability (199/200)^20000, about e^-100.
TEST(TrainNoise, TimestepsAreDrawnFromMinToMaxExclusive) {
  const models::ModelFamily& family = models::model_family("sd15");
  models::ObjectiveOptions o;
  o.min_timestep = 100;
  o.max_timestep = 300;
  const at::Tensor t = models::make_training_objective(family, o)->draw_times(
      20000, at::make_generator<at::CPUGeneratorImpl>(3), torch::kCPU);
  EXPECT_EQ(t.scalar_type(), torch::kInt64);
  EXPECT_EQ(t.min().item<int64_t>(), 100);
  EXPECT_EQ(t.max().item<int64_t>(), 299);
  const at::Tensor all = models::make_training_objective(family, {})->draw_times(
      20000, at::make_generator<at::CPUGeneratorImpl>(3), torch::kCPU);
  EXPECT_EQ(all.min().item<int64_t>(), 0);
  EXPECT_GE(all.max().item<int64_t>(), 990);  // of 1000 values: a miss of 10 has odds e^-200
  EXPECT_LE(all.max().item<int64_t>(), 999);
  // min == max: kohya's torch.full, that one timestep, with no random number drawn (the
  // generator's next draw is the one a fresh generator gives first).
  o.min_timestep = o.max_timestep = 500;
  at::Generator fixed = at::make_generator<at::CPUGeneratorImpl>(3);
  EXPECT_TRUE(torch::equal(models::make_training_objective(family, o)->draw_times(
                               4, fixed, torch::kCPU),
                           torch::full({4}, 500, torch::kInt64)));
  EXPECT_TRUE(torch::equal(at::randn({8}, fixed),
                           at::randn({8}, at::make_generator<at::CPUGeneratorImpl>(3))));
}

// The DDPM objective's validation points are kohya's, np.linspace(min, max, 6, dtype=int)[1:-1]
// (computed here by numpy itself), each a batch of int64 timesteps; its metadata says what it
// trains (kohya's keys, and ModelSpec's prediction type and timestep range); and the checks every
// objective makes name the flag.
TEST(TrainObjective, DdpmValidationPointsAndMetadataAreKohyas) {
  const char* python = std::getenv("LORAPIPE_PYTHON");
  ASSERT_NE(python, nullptr) << "LORAPIPE_PYTHON (the test venv's python) is unset";
  const models::ModelFamily& family = models::model_family("sd15");
  for (const auto& [min, max] : {std::pair<int64_t, int64_t>{0, 1000}, {100, 300}, {7, 993}, {500, 500}}) {
    const std::string command = std::string(python) +
                                " -c 'import numpy; print(*numpy.linspace(" + std::to_string(min) +
                                ", " + std::to_string(max) + ", 6, dtype=int)[1:-1])'";
    FILE* pipe = ::popen(command.c_str(), "r");
    ASSERT_NE(pipe, nullptr) << command;
    std::vector<int64_t> kohya;
    long long v = 0;
    while (std::fscanf(pipe, "%lld", &v) == 1) kohya.push_back(v);
    ASSERT_EQ(::pclose(pipe), 0) << command;
    models::ObjectiveOptions o;
    o.min_timestep = min;
    o.max_timestep = max;
    std::vector<int64_t> ours;
    for (const models::ValidationPoint& p :
         models::make_training_objective(family, o)->validation_points(3, torch::kCPU)) {
      ours.push_back(p.timestep);
      EXPECT_TRUE(torch::equal(p.time, torch::full({3}, p.timestep, torch::kInt64)));
    }
    EXPECT_EQ(ours, kohya) << min << ".." << max;
  }

  std::map<std::string, std::string> plain, v;
  models::make_training_objective(family, {})->write_metadata(plain);
  EXPECT_EQ(plain.at("ss_v_parameterization"), "False");
  EXPECT_EQ(plain.at("ss_min_snr_gamma"), "None");
  EXPECT_EQ(plain.at("modelspec.prediction_type"), "epsilon");
  EXPECT_FALSE(plain.count("modelspec.timestep_range"));
  models::ObjectiveOptions o;
  o.v_prediction = true;
  o.min_snr_gamma = 5;
  o.min_timestep = 100;
  o.max_timestep = 300;
  models::make_training_objective(family, o)->write_metadata(v);
  EXPECT_EQ(v.at("ss_v_parameterization"), "True");
  EXPECT_EQ(v.at("ss_min_snr_gamma"), "5.0");
  EXPECT_EQ(v.at("modelspec.prediction_type"), "v");
  EXPECT_EQ(v.at("modelspec.timestep_range"), "100,300");

  models::ObjectiveOptions bad;
  bad.huber_schedule = "cosine";
  try {
    models::check_objective_options(bad);
    ADD_FAILURE() << "an unknown --huber_schedule was taken";
  } catch (const lorapipe::InputError& e) {
    EXPECT_NE(std::string(e.what()).find("--huber_schedule='cosine'"), std::string::npos)
        << e.what();
  }
  for (const auto& [min, max] : {std::pair<int64_t, int64_t>{600, 500}, {1000, 1000}, {-1, 10}}) {
    bad = {};
    bad.min_timestep = min;
    bad.max_timestep = max;
    EXPECT_THROW(models::make_training_objective(family, bad), lorapipe::InputError)
        << min << ".." << max;
  }
  // kohya's verify_training_args: the v-prediction loss scale needs v-prediction, the v-like
  // loss refuses it.
  auto refused = [&family](const models::ObjectiveOptions& options, const std::string& flag) {
    try {
      models::make_training_objective(family, options);
      ADD_FAILURE() << flag << " was taken";
    } catch (const lorapipe::InputError& e) {
      EXPECT_NE(std::string(e.what()).find(flag), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("--v_parameterization"), std::string::npos) << e.what();
    }
  };
  bad = {};
  bad.scale_v_pred_loss_like_noise_pred = true;
  refused(bad, "--scale_v_pred_loss_like_noise_pred");
  bad.v_prediction = true;
  EXPECT_NO_THROW(models::make_training_objective(family, bad));
  bad = {};
  bad.v_pred_like_loss = 0.5;
  EXPECT_NO_THROW(models::make_training_objective(family, bad));
  bad.v_prediction = true;
  refused(bad, "--v_pred_like_loss");
}

// LoRA+ as kohya's prepare_optimizer_params groups it: each side's up matrices in a group of
// their own at ratio x that side's rate, a side's own ratio over loraplus_lr_ratio; every LoRA
// tensor in exactly one group. Each side's rate is its own (--unet_lr, --text_encoder_lr) where
// given, instead of --learning_rate.
TEST_F(TrainParity, LoraPlusPutsTheUpMatricesInGroupsAtTheRatio) {
  const auto owned = load();
  models::DiffusionModel& model = *owned;
  NetworkOptions net;
  LoraNetwork network(model, net, at::make_generator<at::CPUGeneratorImpl>(7));
  StepOptions o;
  o.optimizer_groups.learning_rate = 1e-4;
  o.optimizer_groups.unet_lr = 2e-4;
  o.optimizer_groups.text_encoder_lr = 5e-5;
  o.optimizer_groups.loraplus_lr_ratio = 16;
  o.optimizer_groups.loraplus_unet_lr_ratio = 4;
  TrainingStep step(model, network, o);
  EXPECT_EQ(step.group_names(), (std::vector<std::string>{"text_encoder", "text_encoder_plus",
                                                          "unet", "unet_plus"}));
  EXPECT_DOUBLE_EQ(step.optimizer().lr(0), 5e-5);
  EXPECT_DOUBLE_EQ(step.optimizer().lr(1), 5e-5 * 16);  // the general ratio
  EXPECT_DOUBLE_EQ(step.optimizer().lr(2), 2e-4);      // --unet_lr over --learning_rate
  EXPECT_DOUBLE_EQ(step.optimizer().lr(3), 2e-4 * 4);  // the U-Net's own ratio wins
  // Which tensor is in which group: with every gradient 1 and no decay, AdamW's first step moves
  // each element by its group's rate / (1 + eps).
  std::map<std::string, torch::Tensor> before;
  for (const auto& [name, t] : network.named_parameters()) {
    before[name] = t.detach().clone();
    t.mutable_grad() = torch::ones_like(t);
  }
  step.optimizer().step();
  for (const auto& [name, t] : network.named_parameters()) {
    const bool te = name.starts_with("lora_te_"), up = name.ends_with(".lora_up.weight");
    const double lr = (te ? 5e-5 : 2e-4) * (up ? (te ? 16 : 4) : 1);
    const torch::Tensor moved = (before.at(name) - t.detach()).to(torch::kFloat64);
    // AdamW's decay (0.01) adds lr * 0.01 * |w| <= 1e-2 * lr here (|w| < 1); fp32 rounding of
    // the weights (up to 2^-24 of |w| < 1) is far below that.
    EXPECT_NEAR(moved.min().item<double>(), lr, 1.1e-2 * lr) << name;
    EXPECT_NEAR(moved.max().item<double>(), lr, 1.1e-2 * lr) << name;
  }
}

// A group at rate 0 is left out of the optimizer, as kohya's assemble_params leaves it: under
// Adafactor's relative step (which takes its own step size, whatever the rate) the text
// encoder's LoRA at --text_encoder_lr=0 stays exactly as it started while the U-Net's moves.
TEST_F(TrainParity, AGroupAtRateZeroIsNotTrainedAsKohya) {
  const auto owned = load();
  models::DiffusionModel& model = *owned;
  NetworkOptions net;
  LoraNetwork network(model, net, at::make_generator<at::CPUGeneratorImpl>(7));
  StepOptions o;
  o.optimizer.type = "Adafactor";
  o.optimizer_groups.learning_rate = 1e-4;
  o.optimizer_groups.text_encoder_lr = 0;
  TrainingStep step(model, network, o);
  EXPECT_EQ(step.group_names(), (std::vector<std::string>{"unet"}));
  std::map<std::string, torch::Tensor> before;
  for (const auto& [name, t] : network.named_parameters()) {
    before[name] = t.detach().clone();
    t.mutable_grad() = torch::ones_like(t);
  }
  step.optimizer().step();
  size_t moved = 0, kept = 0;
  for (const auto& [name, t] : network.named_parameters()) {
    if (name.starts_with("lora_te_")) {
      EXPECT_TRUE(torch::equal(before.at(name), t.detach())) << name;
      ++kept;
    } else {
      moved += !torch::equal(before.at(name), t.detach());
    }
  }
  EXPECT_GT(kept, 0u);
  EXPECT_GT(moved, 0u);
  // Nor does it take gradients, which nothing would clear: they would pile up in the clipping
  // norm of every step after.
  for (const auto& [name, t] : network.named_parameters()) {
    EXPECT_EQ(t.requires_grad(), !name.starts_with("lora_te_")) << name;
  }
}

// kohya's block-wise network_args (networks/lora.py create_network): a rank and alpha per U-Net
// block, a learning-rate weight per block, and no module where either is 0. The blocks are
// kohya's for SD1.x (IN00-IN11, MID, OUT00-OUT11), written out here for every module the tiny
// U-Net has (three down and three up blocks, as SD1.5's first three); the text encoder keeps
// --network_dim and --network_alpha.
TEST_F(TrainParity, BlockArgsShapeRanksAlphasAndRatesAsKohya) {
  const std::vector<std::pair<std::string, int>> blocks = {
      {"down_blocks_0_resnets_0_", 1},     {"down_blocks_0_attentions_0_", 1},
      {"down_blocks_0_resnets_1_", 2},     {"down_blocks_0_attentions_1_", 2},
      {"down_blocks_0_downsamplers_0_", 3}, {"down_blocks_1_resnets_0_", 4},
      {"down_blocks_1_attentions_0_", 4},  {"down_blocks_1_resnets_1_", 5},
      {"down_blocks_1_attentions_1_", 5},  {"down_blocks_1_downsamplers_0_", 6},
      {"down_blocks_2_resnets_0_", 7},     {"down_blocks_2_resnets_1_", 8},
      {"mid_block_", 12},                  {"up_blocks_0_resnets_0_", 13},
      {"up_blocks_0_resnets_1_", 14},      {"up_blocks_0_resnets_2_", 15},
      {"up_blocks_0_upsamplers_0_", 15},   {"up_blocks_1_resnets_0_", 16},
      {"up_blocks_1_attentions_0_", 16},   {"up_blocks_1_resnets_1_", 17},
      {"up_blocks_1_attentions_1_", 17},   {"up_blocks_1_resnets_2_", 18},
      {"up_blocks_1_attentions_2_", 18},   {"up_blocks_1_upsamplers_0_", 18},
      {"up_blocks_2_resnets_0_", 19},      {"up_blocks_2_attentions_0_", 19},
      {"up_blocks_2_resnets_1_", 20},      {"up_blocks_2_attentions_1_", 20},
      {"up_blocks_2_resnets_2_", 21},      {"up_blocks_2_attentions_2_", 21}};
  auto block_of = [&](const std::string& name) {
    for (const auto& [part, block] : blocks) {
      if (name.starts_with("lora_unet_" + part)) return block;
    }
    ADD_FAILURE() << name << " is in no block of the table";
    return -1;
  };
  // Ranks 1-5 by block, block 5 (IN05) of rank 0; alphas b + 0.5.
  const models::KohyaBlocks& table = models::model_family("sd15").kohya.blocks;
  const size_t block_count = table.count();
  ASSERT_EQ(block_count, 25u);  // kohya's SD1.x table: IN00-IN11, MID, OUT00-OUT11
  std::vector<int64_t> dims(block_count);
  std::string dims_arg, alphas_arg;
  for (size_t b = 0; b < block_count; ++b) {
    dims[b] = b == 5 ? 0 : static_cast<int64_t>(b % 5 + 1);
    dims_arg += (b ? "," : "") + std::to_string(dims[b]);
    alphas_arg += (b ? "," : "") + std::to_string(b) + ".5";
  }
  // Down weights with an empty item (kohya reads it as 0: IN03, the first downsampler, learns
  // nothing and has no module), MID x2, and the
  // up side a sine curve over OUT00-OUT11 plus 0.05: OUT00 is 0.05, under the 0.1 threshold.
  BlockArgs args;
  args.values = {{"block_dims", dims_arg},
                 {"block_alphas", alphas_arg},
                 {"down_lr_weight", "1,1,0.5,,1,1,1,1,1,1,1,1"},
                 {"mid_lr_weight", "2"},
                 {"up_lr_weight", "sine+0.05"}};
  args.zero_threshold = 0.1;
  NetworkOptions net;
  net.dim = 4;
  net.alpha = 2;
  net.conv_dim = 2;  // kxk convs: conv_dim and conv_alpha in every block (no conv_block_dims)
  net.conv_alpha = 1;
  EXPECT_TRUE(resolve_block_args(args, table, net).empty());
  std::vector<double> weight(block_count, 1.0);
  weight[2] = 0.5, weight[3] = 0;  // down_lr_weight's items are IN00-IN11
  weight[12] = 2;
  for (int i = 0; i < 12; ++i) {
    const double w = std::sin(std::numbers::pi * (i / 11.0) / 2) + 0.05;
    weight[13 + i] = w > 0.1 ? w : 0;
  }
  ASSERT_EQ(net.block_lr_weight.size(), block_count);
  for (size_t b = 0; b < block_count; ++b) {
    EXPECT_DOUBLE_EQ(net.block_lr_weight[b], weight[b]) << "block " << b;
  }

  const auto owned = load();
  models::DiffusionModel& model = *owned;
  LoraNetwork network(model, net, at::make_generator<at::CPUGeneratorImpl>(7));
  std::map<std::string, const LoraNetwork::Module*> built;
  for (const auto& m : network.modules()) built[m.target.name] = &m;
  size_t expected_modules = 0;
  for (const models::LoraTarget& target : model.lora_targets(true, true)) {
    int64_t rank = net.dim;
    double alpha = net.alpha;
    if (!target.text_encoder) {
      const int b = block_of(target.name);
      if (b < 0) continue;
      rank = target.is_conv_kxk() ? 2 : dims[b];
      alpha = target.is_conv_kxk() ? 1.0 : b + 0.5;
      if (weight[b] == 0) rank = 0;  // a block that does not learn has no module
    }
    const auto it = built.find(target.name);
    if (rank == 0) {
      EXPECT_EQ(it, built.end()) << target.name << " has a module in a block that has none";
      continue;
    }
    ++expected_modules;
    ASSERT_NE(it, built.end()) << target.name;
    EXPECT_EQ(it->second->adapter->rank(), rank) << target.name;
    EXPECT_DOUBLE_EQ(it->second->alpha, alpha) << target.name;
    EXPECT_DOUBLE_EQ(it->second->adapter->scale, alpha / rank) << target.name;
  }
  EXPECT_EQ(network.modules().size(), expected_modules);

  // A group for each block with modules, in module order, at the U-Net's rate times its weight.
  StepOptions o;
  o.optimizer_groups.learning_rate = 1e-3;
  o.optimizer_groups.text_encoder_lr = 5e-5;
  TrainingStep step(model, network, o);
  std::vector<std::string> names = {"text_encoder"};
  std::vector<double> rates = {5e-5};
  for (const auto& m : network.modules()) {
    if (m.target.text_encoder) continue;
    const int b = block_of(m.target.name);
    const std::string name = "unet_block" + std::to_string(b);
    if (std::find(names.begin(), names.end(), name) != names.end()) continue;
    names.push_back(name);
    rates.push_back(1e-3 * weight[b]);
  }
  EXPECT_EQ(step.group_names(), names);
  for (size_t g = 0; g < rates.size(); ++g) {
    EXPECT_DOUBLE_EQ(step.optimizer().lr(g), rates[g]) << names[g];
  }

  // What kohya stops on, named; and what it ignores, said.
  NetworkOptions other;
  args.values = {{"block_dims", "1,2,3"}};
  try {
    resolve_block_args(args, table, other);
    ADD_FAILURE() << "block_dims of 3 values taken";
  } catch (const lorapipe::InputError& e) {
    EXPECT_NE(std::string(e.what()).find("block_dims=1,2,3': 3 values"), std::string::npos)
        << e.what();
  }
  args.values = {{"up_lr_weight", "0.5"}};  // one weight needs a comma, or it names a curve
  EXPECT_THROW(resolve_block_args(args, table, other), lorapipe::InputError);
  args.values = {{"conv_block_dims", dims_arg}};
  const std::vector<std::string> warnings = resolve_block_args(args, table, other);
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_NE(warnings[0].find("conv_block_dims is ignored"), std::string::npos) << warnings[0];
  EXPECT_TRUE(other.block_dims.empty());
}

// --weighted_captions past 75 tokens: kohya weighs the long-prompt states chunk by chunk,
// states[:, 75i+1 : 75i+76] *= weights[:, i, 1:-1]; written here as that loop, against
// encode_text with weights, which lays the weights out once. Equal bit for bit (the same fp32
// products); the caption's weights lie in both chunks.
TEST_F(TrainParity, WeightedCaptionsAcrossChunksWeighAsKohyasLoop) {
  const auto owned = load();
  models::DiffusionModel& model = *owned;
  std::string caption;
  for (int i = 0; i < 40; ++i) caption += i % 3 ? "(red circle:1.3), " : "[blue square], ";
  const models::TokenBatch tokens = model.tokenize({caption}, 150, /*weighted=*/true);
  const at::Tensor ids = tokens.ids.at(0), weights = tokens.weights.at(0);
  ASSERT_EQ(ids.sizes(), (std::vector<int64_t>{1, 154}));
  const int64_t chunk = model.model_family().text.max_length;  // BOS, 75 ids, EOS
  const at::Tensor per_chunk = weights.view({1, 2, chunk});
  for (int64_t i = 0; i < 2; ++i) {
    EXPECT_GT((per_chunk[0][i] != 1).sum().item<int64_t>(), 10) << "chunk " << i << " unweighted";
  }
  torch::NoGradGuard no_grad;
  at::Tensor expected = model.encode_text({{ids}, {}}, /*clip_skip=*/1).hidden_states.clone();
  ASSERT_EQ(expected.size(1), 152);
  for (int64_t i = 0; i < 2; ++i) {
    expected.narrow(1, i * 75 + 1, 75).mul_(per_chunk.select(1, i).narrow(1, 1, 75).unsqueeze(-1));
  }
  const at::Tensor actual = model.encode_text(tokens, /*clip_skip=*/1).hidden_states;
  EXPECT_TRUE(torch::equal(actual, expected))
      << "max |difference| " << (actual - expected).abs().max().item<double>();
}

TEST_F(TrainParity, OneStepEpsilonWithMinSnrAndNoiseOffset) {
  run_scenario(Scenario{}, "eps", /*final_weights=*/true);
}

TEST_F(TrainParity, OneStepVPredictionWithMinSnrAndNoiseOffset) {
  Scenario s;
  s.v_prediction = true;
  run_scenario(s, "v", /*final_weights=*/true);
}

// kohya's other SNR weightings on top of min-SNR, in train_network's order: debiased estimation
// and a v-prediction-like loss on an epsilon model; scaling like a noise prediction and debiased
// estimation (its 1 / (snr + 1) form) on a v-prediction model.
TEST_F(TrainParity, OneStepEpsilonWithDebiasedEstimationAndVPredLikeLoss) {
  Scenario s;
  s.debiased_estimation_loss = true;
  s.v_pred_like_loss = 0.5;
  s.ip_noise_gamma = 0.1;  // and kohya's input perturbation: the latents noised, the target not
  run_scenario(s, "debiased", /*final_weights=*/true);
}

TEST_F(TrainParity, OneStepVPredictionScaledLikeNoisePredictionAndDebiased) {
  Scenario s;
  s.v_prediction = true;
  s.scale_v_pred_loss_like_noise_pred = true;
  s.debiased_estimation_loss = true;
  run_scenario(s, "v_scaled", /*final_weights=*/true);
}

// kohya's --zero_terminal_snr on a v-prediction model (the pairing the paper asks for), one
// micro-batch at the last timestep, where the input is pure noise and the v target is -latents;
// min-SNR on, weighing by the schedule before the rescale, as kohya does. And --scale_weight_norms
// with a bound below the initial LoRA's module norms, so the max-norm pass shrinks modules after
// every micro-batch (accumulation 2: also after the ones that do not step), LoCon's 3x3 convs
// among them.
TEST_F(TrainParity, ZeroTerminalSnrAndMaxNormOverEightMicroBatches) {
  Scenario s;
  s.steps = 8;
  s.accumulation = 2;
  s.v_prediction = true;
  s.zero_terminal_snr = true;
  s.scale_weight_norms = kMaxNorm;
  s.conv = true;
  Result ours;
  const auto reference = run_scenario(s, "ztsnr_maxnorm", /*final_weights=*/true, &ours);
  ASSERT_TRUE(reference.count("keys_scaled"));
  EXPECT_GT(reference.at("keys_scaled").sum().item<double>(), 0)
      << "the reference scaled no module: the bound is too loose to test the pass";
  EXPECT_GT(ours.keys_scaled, 0);
}

// kohya's --weighted_captions: the text encoder's states of (red:1.4), [square], ((ring)) and
// (circle:0.6) weighed, with the gradient flowing back through the weights into the text
// encoder's LoRA. The ids and weights are lorapipe's (ClipTokenizerParity.WeightedCaptionsMatchKohya
// holds them to kohya's); the reference applies them to transformers' CLIP states.
// kohya's masked loss (alpha_mask): each element of the loss times the image's alpha mask, which
// kohya's apply_masked_loss brings to the latents' size with F.interpolate(mode="area"); ours
// comes from the cacher's latent_mask. Two micro-batches accumulated, min-SNR on.
TEST_F(TrainParity, AlphaMasksWeighTheLossAsKohyas) {
  Scenario s;
  s.steps = 2;
  s.accumulation = 2;
  s.alpha_masks = true;
  run_scenario(s, "alpha-masks", /*final_weights=*/true);
}

TEST_F(TrainParity, OneStepWithWeightedCaptions) {
  Scenario s;
  s.weighted_captions = true;
  run_scenario(s, "weighted", /*final_weights=*/true);
}

TEST_F(TrainParity, OneStepLoConUnetOnly) {
  Scenario s;
  s.conv = true;
  s.train_text_encoder = false;
  run_scenario(s, "locon", /*final_weights=*/true);
}

// --fp8_base: the weights are stored in float8 and each layer computes with its weight widened,
// so the run is the reference's on weights rounded to float8 (exactly representable in fp32 and
// fp64), to the same tolerance as any other run. Rounding to float8 moves a weight by up to 6%,
// so a layer left wide, or rounded differently, is far outside it. With LoCon on the 3x3 convs
// (a LoRA over a float8 convolution), the text encoder trained through its float8 projections,
// and gradient checkpointing (the float8 layers' backward run from the recomputation), over two
// AdamW steps.
TEST_F(TrainParity, Float8BaseLoConCheckpointedTwoSteps) {
  Scenario s;
  s.steps = 2;
  s.fp8_base = true;
  s.conv = true;
  s.checkpointing = true;
  run_scenario(s, "fp8", /*final_weights=*/true);
}

TEST_F(TrainParity, TwentyAdamWStepsCosineWithClipping) {
  Scenario s;
  s.steps = 20;
  s.lr_scheduler = "cosine";
  s.warmup = 2;
  s.max_grad_norm = 0.02;  // below every step's norm (0.039 and up), so clipping always acts
  const auto reference = run_scenario(s, "twenty", /*final_weights=*/true);
  ASSERT_TRUE(reference.count("grad_norm"));
  EXPECT_GT(reference.at("grad_norm").min().item<double>(), s.max_grad_norm)
      << "clipping never acted, so the test would not see it break";
}

TEST_F(TrainParity, GradientAccumulationTwo) {
  Scenario s;
  s.steps = 8;
  s.accumulation = 2;
  s.lr_scheduler = "linear";
  run_scenario(s, "accum", /*final_weights=*/true);
}

// Accumulating two micro-batches of B is the same update as one batch of 2B made of the same
// samples (kohya's loss is a mean over the batch, and each micro-batch's loss is divided by the
// accumulation steps): the same gradients and weights within the parity tolerance (the sums run
// in another order).
TEST_F(TrainParity, GradientAccumulationEqualsTheLargerBatch) {
  Scenario s;
  s.steps = 8;
  s.accumulation = 2;
  s.lr_scheduler = "linear";
  const fs::path init = make_init_lora(s, "accum-batch");
  const auto owned = load();
  models::DiffusionModel& model = *owned;
  const auto inputs = make_inputs(s, model);
  const Result accumulated = run_ours(s, inputs, init);
  std::map<std::string, torch::Tensor> merged;
  for (const auto& [name, t] : inputs) {
    std::vector<int64_t> shape(t.sizes().begin(), t.sizes().end());
    shape[1] *= 2;
    shape.erase(shape.begin());
    shape.insert(shape.begin(), t.size(0) / 2);
    merged[name] = t.reshape(shape);
  }
  Scenario big = s;
  big.steps = 4;
  big.batch = 4;
  big.accumulation = 1;
  const Result batched = run_ours(big, merged, init);
  const double worst = expect_same_training(accumulated, batched);
  std::printf("[parity] accumulation 2 x B against one batch of 2B: max relative error %.3g\n",
              worst);
}

// Bucket batch sizes split a step of S samples into micro-batches of uneven size (here 3 + 1 of
// 4), each backward weighed by its share of the step's samples: the same update as the batch of
// S whole, within the parity tolerance (the sums run in another order), with kohya's max-norm
// pass between the micro-batches too.
TEST_F(TrainParity, BucketBatchSharesOfAStepEqualItsWholeBatch) {
  Scenario s;
  s.steps = 4;
  s.batch = 4;
  s.lr_scheduler = "linear";
  s.scale_weight_norms = 1.0;
  const fs::path init = make_init_lora(s, "shares");
  const auto owned = load();
  const auto inputs = make_inputs(s, *owned);
  const Result whole = run_ours(s, inputs, init);
  s.micro_rows = {3, 1};
  const Result split = run_ours(s, inputs, init);
  const double worst = expect_same_training(split, whole);
  // A wrong weighing (each micro-batch's mean at full weight) doubles the gradient: not close.
  std::printf("[parity] a step of 4 as micro-batches of 3 + 1 against the whole batch: max "
              "relative error %.3g\n",
              worst);
}

// Checkpointing recomputes each UNet block in backward. The recomputation runs the same kernels
// on the same values, but in buffers at other addresses, where MKL's GEMM may take another code
// path and round differently (Intel's conditional numerical reproducibility); so the run is held
// to the parity tolerance against the run that keeps its activations (measured: 7e-6),
// and against the reference.
TEST_F(TrainParity, GradientCheckpointingChangesNothing) {
  Scenario s;
  s.steps = 4;
  s.lr_scheduler = "cosine";
  s.measure_memory = true;
  const fs::path init = make_init_lora(s, "ckpt");
  const auto owned = load();
  models::DiffusionModel& model = *owned;
  const auto inputs = make_inputs(s, model);
  // Checkpointed first: what the first run allocates once and keeps (lazy tables) counts in its
  // peak only, so the memory check below leans against passing.
  s.checkpointing = true;
  const Result checkpointed = run_ours(s, inputs, init);
  s.checkpointing = false;
  const Result plain = run_ours(s, inputs, init);
  s.checkpointing = true;
  const double worst = expect_same_training(checkpointed, plain);
  std::printf("[parity] checkpointed against plain: max relative error %.3g\n", worst);
  compare(checkpointed, run_reference(s, inputs, init, "ckpt"), /*final_weights=*/true);
  // And it did checkpoint: the steps held less at once than with every activation kept.
  std::printf("[checkpointing] the steps' peak tensor memory: %.2f MiB plain, %.2f MiB "
              "checkpointed\n",
              static_cast<double>(plain.step_peak_bytes) / (1 << 20),
              static_cast<double>(checkpointed.step_peak_bytes) / (1 << 20));
  EXPECT_LT(static_cast<double>(checkpointed.step_peak_bytes),
            kCheckpointedPeakAtMost * static_cast<double>(plain.step_peak_bytes));
}

// kohya's --loss_type l1, and huber and smooth_l1 with kohya's per-timestep thresholds
// (--huber_schedule snr, kohya's default, and exponential), against the reference's rendering of
// kohya's conditional_loss and get_huber_threshold_if_needed. The Huber cases also grow the noise
// offset with --adaptive_noise_scale (kohya's apply_noise_offset; a negative scale shrinks it).
TEST_F(TrainParity, OneStepL1Loss) {
  Scenario s;
  s.loss_type = "l1";
  run_scenario(s, "l1", /*final_weights=*/true);
}

TEST_F(TrainParity, OneStepHuberLossSnrScheduleAdaptiveNoiseOffset) {
  Scenario s;
  s.loss_type = "huber";
  s.huber_schedule = "snr";
  s.adaptive_noise_scale = 0.05;
  run_scenario(s, "huber", /*final_weights=*/true);
}

TEST_F(TrainParity, OneStepSmoothL1LossExponentialScheduleNegativeAdaptiveScale) {
  Scenario s;
  s.loss_type = "smooth_l1";
  s.huber_schedule = "exponential";
  s.huber_c = 0.2;
  s.adaptive_noise_scale = -0.05;
  run_scenario(s, "smooth_l1", /*final_weights=*/true);
}

// The LoRA network itself, on the tiny model (the fixture's).
class TrainLora : public TrainParity {};

// kohya's LoRAModule starts from down = kaiming_uniform_(a=sqrt(5)), i.e. uniform on
// +-1/sqrt(fan_in) (fan_in = in x kh x kw), and up = 0, so a fresh LoRA changes nothing. Every
// module of the tiny model with LoCon, each down scaled by sqrt(its fan_in) and pooled, must lie
// in [-1, 1], reach 0.99 (a narrower init would not), and have the uniform's standard deviation
// 1/sqrt(3) and mean 0, each to 6 standard errors of its estimate over the pool's n values (the
// std's relative error is 0.45/sqrt(n), the mean's error 0.58/sqrt(n)). kaiming with a = 0, or
// a normal init, moves the std or the range far beyond that.
TEST_F(TrainLora, StartsFromKohyasInitialisation) {
  const auto owned = load();
  models::DiffusionModel& model = *owned;
  NetworkOptions o;
  o.dim = 4;
  o.conv_dim = 4;
  LoraNetwork network(model, o, at::make_generator<at::CPUGeneratorImpl>(7));
  std::vector<at::Tensor> scaled;
  for (const auto& m : network.modules()) {
    const at::Tensor& down = m.adapter->down;
    EXPECT_TRUE(m.adapter->up.eq(0).all().item<bool>()) << m.target.name << ": up is not zero";
    EXPECT_EQ(down.scalar_type(), torch::kFloat) << m.target.name;
    scaled.push_back((down * std::sqrt(static_cast<double>(down[0].numel()))).flatten());
  }
  const at::Tensor pool = torch::cat(scaled).to(torch::kFloat64);
  ASSERT_GT(pool.numel(), 10000);
  const double largest = pool.abs().max().item<double>();
  const double sd = pool.std().item<double>(), mean = pool.mean().item<double>();
  std::printf("[lora init] %lld values x sqrt(fan_in): max |x| %.4f, std %.4f (uniform: %.4f), "
              "mean %.4f\n",
              static_cast<long long>(pool.numel()), largest, sd, 1 / std::sqrt(3.0), mean);
  EXPECT_LE(largest, 1.0 + 1e-6);
  EXPECT_GE(largest, 0.99);
  const double n = static_cast<double>(pool.numel());
  EXPECT_NEAR(sd, 1 / std::sqrt(3.0), 6 * 0.45 / std::sqrt(n) / std::sqrt(3.0));
  EXPECT_NEAR(mean, 0.0, 6 * 0.58 / std::sqrt(n));
}

// kohya's two web-UI hashes of a LoRA file, against sd-scripts' own computation
// (trainer/reference/kohya_hashes.py: the file's tensors and ss_* keys serialised again by the
// safetensors package): equal, for a file past 1 MiB whose tensors come in three dtypes and out of
// the writer's order, with metadata that JSON must escape (quotes, backslashes, control
// characters) and keys the hash leaves out; and for a file under 1 MiB (the legacy hash of no
// bytes, as kohya's).
TEST(TrainLoraFile, WebUiHashesAreKohyas) {
  const fs::path dir = make_temp_dir("lora-hashes");
  torch::manual_seed(5);
  std::map<std::string, at::Tensor> big{
      {"lora_unet_b.lora_down.weight", torch::randn({512, 1024}).to(torch::kHalf)},
      {"lora_unet_a.lora_up.weight", torch::randn({256, 512})},
      {"lora_unet_a.alpha", torch::tensor(4.0f)},
      {"lora_te_x.lora_down.weight", torch::randn({64, 64}).to(torch::kBFloat16)}};
  const std::map<std::string, std::string> metadata{
      {"ss_text", "a \"quoted\" back\\slash\nnew line\ttab \x01 \xc3\xbc \xe6\x97\xa5"},
      {"ss_network_dim", "4"},
      {"modelspec.title", "left out of the hash"}};
  std::map<std::string, at::Tensor> small{{"lora_unet_a.alpha", torch::tensor(1.0f)}};
  const char* python = std::getenv("LORAPIPE_PYTHON");
  ASSERT_NE(python, nullptr) << "LORAPIPE_PYTHON (the test venv's python) is unset";
  for (const auto& [name, tensors] : {std::pair{"big", big}, std::pair{"small", small}}) {
    const fs::path file = dir / (std::string(name) + ".safetensors");
    const WrittenLora written = write_lora_file(file, tensors, metadata);
    const fs::path out = dir / (std::string(name) + ".json");
    const std::string command = std::string(python) + " " + LORAPIPE_SOURCE_DIR +
                                "/trainer/reference/kohya_hashes.py " + file.string() + " > " +
                                out.string();
    ASSERT_EQ(std::system(command.c_str()), 0) << command;
    const nlohmann::json kohya = nlohmann::json::parse(std::ifstream(out));
    const auto meta = models::SafetensorsFile::open(file).metadata();
    EXPECT_EQ(meta.at("sshs_model_hash"), kohya["sshs_model_hash"].get<std::string>()) << name;
    EXPECT_EQ(meta.at("sshs_legacy_hash"), kohya["sshs_legacy_hash"].get<std::string>()) << name;
    EXPECT_EQ(written.sshs_legacy_hash, meta.at("sshs_legacy_hash")) << name;
    if (std::string(name) == "small") {
      EXPECT_EQ(meta.at("sshs_legacy_hash"), "e3b0c442");
    } else {
      EXPECT_NE(meta.at("sshs_legacy_hash"), "e3b0c442");
    }
  }
  fs::remove_all(dir);
}

// Adapters are built and drawn on the CPU from the CPU generator, then placed beside their layer:
// the same values whatever the base model's placement. Over a bf16 base on the CPU (what the
// trainer's --mixed_precision=bf16 places) the fp32 adapters equal those over the fp32 base bit
// for bit, and so do those over a base placed on CUDA where there is one (tests/gpu/run.sh runs
// this on a GPU; before, a CUDA run threw at the first draw: a CPU generator cannot fill a CUDA
// tensor).
TEST_F(TrainLora, AdaptersDrawTheSameValuesWhateverThePlacement) {
  NetworkOptions o;
  o.dim = 4;
  o.conv_dim = 2;
  auto adapters = [&](const models::Placement& placement, c10::Device* device_seen) {
    const auto owned = load();
    models::place(*owned, placement);
    LoraNetwork network(*owned, o, at::make_generator<at::CPUGeneratorImpl>(7));
    std::map<std::string, at::Tensor> out;
    for (const auto& m : network.modules()) {
      EXPECT_EQ(m.adapter->down.device(), m.target.weight().device()) << m.target.name;
      EXPECT_EQ(m.adapter->down.scalar_type(), torch::kFloat) << m.target.name;
      if (device_seen != nullptr) *device_seen = m.adapter->down.device();
      out[m.target.name + ".down"] = m.adapter->down.cpu();
      out[m.target.name + ".up"] = m.adapter->up.cpu();
    }
    return out;
  };
  const auto reference = adapters(models::Placement{}, nullptr);
  ASSERT_GT(reference.size(), 100u);
  auto expect_same = [&](const std::map<std::string, at::Tensor>& got, const char* where) {
    ASSERT_EQ(got.size(), reference.size()) << where;
    for (const auto& [name, t] : reference) {
      EXPECT_TRUE(torch::equal(got.at(name), t)) << where << ": " << name;
    }
  };
  models::Placement bf16;
  bf16.dtype = torch::kBFloat16;
  expect_same(adapters(bf16, nullptr), "bf16 base on the CPU");
  if (!torch::cuda::is_available()) {
    GTEST_SKIP() << "no CUDA device: the bf16 placement is checked, the CUDA one runs in "
                    "tests/gpu/run.sh";
  }
  models::Placement cuda;
  cuda.device = c10::Device(c10::kCUDA, 0);
  c10::Device seen(c10::kCPU);
  expect_same(adapters(cuda, &seen), "base on cuda:0");
  EXPECT_TRUE(seen.is_cuda()) << "the adapters live beside their layers";
}

// --network_alpha=0 means alpha = rank (scale 1), as kohya reads it. A LoRA file without .alpha
// keys (kohya's oldest) is read the same way, as kohya's create_network_from_weights reads it
// (kohya's --network_weights path would keep --network_alpha's scale instead: README's
// continuing rule), and continuing from such a file saves alpha = rank.
TEST_F(TrainLora, AlphaZeroOrAMissingAlphaMeansTheRank) {
  const auto owned = load();
  models::DiffusionModel& model = *owned;
  NetworkOptions zero;
  zero.dim = 4;
  zero.alpha = 0;
  {
    LoraNetwork network(model, zero, at::make_generator<at::CPUGeneratorImpl>(7));
    for (const auto& m : network.modules()) {
      EXPECT_DOUBLE_EQ(m.alpha, 4) << m.target.name;
      EXPECT_DOUBLE_EQ(m.adapter->scale, 1.0) << m.target.name;
    }
  }
  NetworkOptions plain;
  plain.dim = 4;
  plain.alpha = 1;
  std::map<std::string, at::Tensor> old_file;
  {
    LoraNetwork source(model, plain, at::make_generator<at::CPUGeneratorImpl>(8));
    old_file = source.state_dict();
  }
  const size_t dropped =
      std::erase_if(old_file, [](const auto& item) { return item.first.ends_with(".alpha"); });
  ASSERT_GT(dropped, 0u);
  LoraNetwork network(model, plain, at::make_generator<at::CPUGeneratorImpl>(9));
  network.load(old_file, "old.safetensors");
  const auto saved = network.state_dict();
  for (const auto& m : network.modules()) {
    EXPECT_DOUBLE_EQ(m.alpha, 4) << m.target.name;
    EXPECT_DOUBLE_EQ(m.adapter->scale, 1.0) << m.target.name;
    EXPECT_EQ(saved.at(m.target.name + ".alpha").item<double>(), 4.0) << m.target.name;
    EXPECT_TRUE(torch::equal(m.adapter->down, old_file.at(m.target.name + ".lora_down.weight")))
        << m.target.name;
  }
  // A file whose alphas are 0 reads as kohya's LoRAModule reads it: the rank, scale 1 (not a
  // network that never acts nor learns).
  for (auto& [name, t] : old_file) {
    if (name.ends_with(".lora_down.weight")) {
      old_file[name.substr(0, name.size() - 17) + ".alpha"] = torch::tensor(0.0);
    }
  }
  LoraNetwork zeroed(model, plain, at::make_generator<at::CPUGeneratorImpl>(10));
  zeroed.load(old_file, "zero-alpha.safetensors");
  for (const auto& m : zeroed.modules()) {
    EXPECT_DOUBLE_EQ(m.alpha, 4) << m.target.name;
    EXPECT_DOUBLE_EQ(m.adapter->scale, 1.0) << m.target.name;
  }
  // A file in diffusers' PEFT naming is refused by name (previews and --base_weights read it).
  try {
    zeroed.load({{"unet.down_blocks.0.attentions.0.proj_in.lora_A.weight", torch::zeros({4, 4})}},
                "peft.safetensors");
    ADD_FAILURE() << "continued from a PEFT-named file";
  } catch (const lorapipe::InputError& e) {
    EXPECT_NE(std::string(e.what()).find("peft.safetensors: a LoRA in diffusers' PEFT naming"),
              std::string::npos)
        << e.what();
  }
  // So is one in ComfyUI's naming, lora_A / lora_B or not.
  try {
    zeroed.load({{"diffusion_model.input_blocks.1.1.proj_in.lora_A.weight", torch::zeros({4, 4})}},
                "comfy.safetensors");
    ADD_FAILURE() << "continued from a ComfyUI-named file";
  } catch (const lorapipe::InputError& e) {
    EXPECT_NE(std::string(e.what()).find("comfy.safetensors: a LoRA in ComfyUI's naming"),
              std::string::npos)
        << e.what();
  }
}

// --mixed_precision fp16's loss scale, kept as torch's GradScaler keeps it (kohya's, through
// accelerate): it starts at 2^16; a step whose gradients overflow is skipped, leaving the LoRA as
// it was, and halves the scale; 2000 applied steps in a row double it. The tiny model in fp16 on
// the CPU; the overflow is made by setting the scale to 1e38, the growth by starting the count at
// 1999.
class TrainMixedPrecision : public TrainParity {};

TEST_F(TrainMixedPrecision, Fp16LossScaleBacksOffAndGrowsAsTorchsGradScaler) {
  models::LoadOptions load_options;
  load_options.tokenizer = tiny_->tokenizer;
  load_options.dtype = torch::kHalf;
  const auto owned = models::load_model(tiny_->diffusers, load_options);
  models::DiffusionModel& model = *owned;
  LoraNetwork network(model, NetworkOptions{}, at::make_generator<at::CPUGeneratorImpl>(7));
  network.set_training(true);
  StepOptions o;
  o.base_dtype = torch::kHalf;
  o.optimizer_groups.learning_rate = 1e-3;
  o.schedule.initial_lr = 1e-3;
  o.schedule.training_steps = 10;
  TrainingStep step(model, network, o);
  EXPECT_EQ(step.loss_scale(), 65536.0);
  EXPECT_EQ(step.scale_growth_tracker(), 0);
  const auto inputs = make_inputs(Scenario{}, model);
  auto micro_batch = [&](int64_t i) {
    MicroBatch b;
    b.latents = inputs.at("latents")[i];
    b.noise = inputs.at("noise")[i];
    b.times = inputs.at("timesteps")[i];
    b.tokens.ids = {inputs.at("input_ids")[i]};
    b.loss_weights = inputs.at("loss_weights")[i];
    return b;
  };
  auto weights = [&] {
    std::map<std::string, at::Tensor> out;
    for (const auto& [name, t] : network.named_parameters()) out[name] = t.detach().clone();
    return out;
  };

  step.set_scaler(1e38, 5);
  const auto before = weights();
  step.accumulate(micro_batch(0), at::make_generator<at::CPUGeneratorImpl>(0));
  const UpdateResult overflowed = step.update();
  EXPECT_FALSE(overflowed.applied) << "an overflowing step was applied";
  EXPECT_EQ(step.loss_scale(), 5e37);
  EXPECT_TRUE(overflowed.scale_lowered);
  EXPECT_EQ(overflowed.loss_scale, 5e37);
  EXPECT_TRUE(overflowed.finding_the_scale()) << "counted toward --max_bad_steps";
  EXPECT_EQ(step.scale_growth_tracker(), 0);
  for (const auto& [name, t] : weights()) {
    EXPECT_TRUE(torch::equal(t, before.at(name))) << name << " moved on a skipped step";
  }

  step.set_scaler(1024, 1999);
  step.accumulate(micro_batch(0), at::make_generator<at::CPUGeneratorImpl>(1));
  EXPECT_TRUE(step.update().applied);
  EXPECT_EQ(step.loss_scale(), 2048.0) << "the 2000th applied step in a row doubles the scale";
  EXPECT_EQ(step.scale_growth_tracker(), 0);
  step.accumulate(micro_batch(0), at::make_generator<at::CPUGeneratorImpl>(2));
  EXPECT_TRUE(step.update().applied);
  EXPECT_EQ(step.loss_scale(), 2048.0);
  EXPECT_EQ(step.scale_growth_tracker(), 1);
}

}  // namespace
}  // namespace lorapipe::trainer
