// The UNet against diffusers' UNet2DConditionModel: same weights, same inputs, outputs and
// gradients compared. Reference data come from models/reference/unet_reference.py, run per test
// run with LORAPIPE_PYTHON (the test venv, diffusers installed).
//
// Tolerance: relative error = max|ours - ref| / max|ref| <= 1e-4, for outputs and gradients
// alike. Both sides run the same fp32 ATen kernels (the SDPA math path on both), so the only
// differences are summation orders inside convolutions and matmuls, which stay around 1e-6;
// 1e-4 leaves room for other BLAS builds while any wiring mistake (a swapped skip, a missing
// residual, sin/cos order, head split) shows up at 1e-1 or more.
#include "models/unet.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>

#include "common/error.h"
#include "models/attention.h"
#include "models/clip_text.h"
#include "models/linear.h"
#include "models/lora.h"
#include "models/tiny.h"
#include "models/parity_util.h"
#include "models/safetensors.h"
#include "models/sd15_lora.h"
#include "models/sdxl_lora.h"
#include "models/weights.h"

namespace lorapipe::models {
namespace {
namespace fs = std::filesystem;

constexpr double kTolerance = 1e-4;

std::string read_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// A small UNet of both block kinds, built in C++ (no Python needed).
UNetConfig tiny_config() {
  UNetConfig config;
  config.block_out_channels = {32, 64};
  config.layers_per_block = {1, 1};
  config.down_block_types = {"CrossAttnDownBlock2D", "DownBlock2D"};
  config.up_block_types = {"UpBlock2D", "CrossAttnUpBlock2D"};
  config.attention_head_dim = {4, 4};
  config.transformer_layers_per_block = {1, 1};
  config.cross_attention_dim = 16;
  return config;
}

class UNetParity : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = testing::make_temp_dir("unet-parity");
    ASSERT_TRUE(testing::run_reference("unet_reference.py", dir_));
  }
  static void TearDownTestSuite() { fs::remove_all(dir_); }

  // Runs every case of `variant` (see unet_reference.py) and compares with diffusers.
  void check_variant(const std::string& variant) {
    ASSERT_TRUE(fs::exists(dir_ / variant / "config.json")) << "reference script did not run";
    const UNetConfig config = UNetConfig::from_json(read_text(dir_ / variant / "config.json"),
                                                    (dir_ / variant / "config.json").string());
    UNet unet(config);
    load_unet_diffusers(unet, dir_ / variant);
    set_force_math_attention(true);
    unet->eval();
    // The first cross-attention key projection, as the reference picks it.
    torch::Tensor probe;
    for (const auto& item : unet->named_parameters()) {
      if (item.key().ends_with("attn2.to_k.weight")) {
        probe = item.value();
        break;
      }
    }
    ASSERT_TRUE(probe.defined());

    const auto io = testing::read_all(dir_ / (variant + "_io.safetensors"));
    std::set<std::string> cases;
    for (const auto& [name, tensor] : io) cases.insert(name.substr(0, name.find('.')));
    ASSERT_EQ(cases.size(), 3u);
    for (const std::string& c : cases) {
      SCOPED_TRACE(variant + " case " + c);
      auto ref = [&](const std::string& key) { return io.at(c + "." + key); };
      std::printf("%s case %s: sample %s timesteps %s\n", variant.c_str(), c.c_str(),
                  c10::str(ref("sample").sizes()).c_str(),
                  c10::str(ref("timesteps").sizes()).c_str());
      torch::Tensor sample = ref("sample").clone().requires_grad_(true);
      torch::Tensor context = ref("encoder_hidden_states").clone().requires_grad_(true);
      const bool added = io.count(c + ".text_embeds") > 0;
      ASSERT_EQ(added, !config.addition_embed_type.empty());
      torch::Tensor text_embeds, time_ids;
      if (added) {
        text_embeds = ref("text_embeds").clone().requires_grad_(true);
        time_ids = ref("time_ids");
      }
      unet->zero_grad();
      const torch::Tensor out = unet(sample, ref("timesteps"), context, text_embeds, time_ids);
      (out * ref("loss_weights")).sum().backward();
      const std::string prefix = variant + "." + c + ".";
      testing::expect_close(prefix + "out", out, ref("out"), kTolerance);
      testing::expect_close(prefix + "grad_sample", sample.grad(), ref("grad_sample"), kTolerance);
      testing::expect_close(prefix + "grad_encoder_hidden_states", context.grad(),
                            ref("grad_encoder_hidden_states"), kTolerance);
      testing::expect_close(prefix + "grad_to_k_weight", probe.grad(), ref("grad_to_k_weight"),
                            kTolerance);
      if (added) {
        testing::expect_close(prefix + "grad_text_embeds", text_embeds.grad(),
                              ref("grad_text_embeds"), kTolerance);
      }

      // The default backend (what the sampler and trainer run) must agree as well.
      set_force_math_attention(false);
      {
        torch::NoGradGuard no_grad;
        testing::expect_close(prefix + "out (default SDPA backend)",
                              unet(ref("sample"), ref("timesteps"), ref("encoder_hidden_states"),
                                   added ? ref("text_embeds") : torch::Tensor(),
                                   added ? ref("time_ids") : torch::Tensor()),
                              ref("out"), kTolerance);
      }
      set_force_math_attention(true);
    }
  }

  // A real-size UNet built from the published config.json has exactly diffusers' keys and shapes.
  // `dtype`: what the parameters are built in (SDXL's 2.6 billion in bf16: 5 GB, not 10).
  void check_full_size_layout(const std::string& name, const UNetConfig& expected,
                              c10::ScalarType dtype = torch::kFloat32) {
    const fs::path folder = dir_ / name;
    const UNetConfig config = UNetConfig::from_json(read_text(folder / "config.json"));
    EXPECT_EQ(config.block_out_channels, expected.block_out_channels);
    EXPECT_EQ(config.attention_head_dim, expected.attention_head_dim);
    EXPECT_EQ(config.cross_attention_dim, expected.cross_attention_dim);
    EXPECT_EQ(config.use_linear_projection, expected.use_linear_projection);
    EXPECT_EQ(config.layers_per_block, expected.layers_per_block);
    EXPECT_EQ(config.down_block_types, expected.down_block_types);
    EXPECT_EQ(config.up_block_types, expected.up_block_types);
    EXPECT_EQ(config.sample_size, expected.sample_size);
    EXPECT_EQ(config.transformer_layers_per_block, expected.transformer_layers_per_block);
    EXPECT_EQ(config.addition_embed_type, expected.addition_embed_type);
    EXPECT_EQ(config.addition_time_embed_dim, expected.addition_time_embed_dim);
    EXPECT_EQ(config.projection_class_embeddings_input_dim,
              expected.projection_class_embeddings_input_dim);

    const nlohmann::json shapes = nlohmann::json::parse(read_text(folder / "shapes.json"));
    const caffe2::TypeMeta saved = c10::get_default_dtype();
    c10::set_default_dtype(c10::scalarTypeToTypeMeta(dtype));
    UNet unet(config);
    c10::set_default_dtype(saved);
    std::map<std::string, std::vector<int64_t>> ours;
    int64_t parameters = 0;
    for (const auto& item : unet->named_parameters()) {
      ours[item.key()] = item.value().sizes().vec();
      parameters += item.value().numel();
    }
    std::map<std::string, std::vector<int64_t>> theirs;
    int64_t their_parameters = 0;
    for (const auto& [key, shape] : shapes.items()) {
      theirs[key] = shape.get<std::vector<int64_t>>();
      int64_t n = 1;
      for (int64_t d : theirs[key]) n *= d;
      their_parameters += n;
    }
    std::printf("%s: %zu tensors, %lld parameters (diffusers: %zu tensors, %lld parameters)\n",
                name.c_str(), ours.size(), static_cast<long long>(parameters), theirs.size(),
                static_cast<long long>(their_parameters));
    EXPECT_EQ(parameters, their_parameters) << name;
    last_parameters_ = parameters;
    last_unet_ = unet;
    for (const auto& [key, shape] : theirs) {
      auto it = ours.find(key);
      if (it == ours.end()) {
        ADD_FAILURE() << name << ": missing " << key;
      } else {
        EXPECT_EQ(it->second, shape) << name << ": " << key;
      }
    }
    for (const auto& [key, shape] : ours) {
      EXPECT_TRUE(theirs.count(key)) << name << ": unexpected " << key;
    }
  }

  static fs::path dir_;
  int64_t last_parameters_ = 0;  // what the last check_full_size_layout counted
  UNet last_unet_{nullptr};      // and the U-Net it built
};
fs::path UNetParity::dir_;

TEST_F(UNetParity, Sd15ShapedTinyUNetMatchesDiffusers) { check_variant("unet"); }

TEST_F(UNetParity, Sd2ShapedTinyUNetMatchesDiffusers) { check_variant("unet_linear"); }

TEST_F(UNetParity, SdxlShapedTinyUNetMatchesDiffusers) { check_variant("unet_sdxl"); }

TEST_F(UNetParity, FullSizeSd15KeysAndShapesMatchDiffusers) {
  check_full_size_layout("sd15", UNetConfig::sd15());
}

TEST_F(UNetParity, FullSizeSd21KeysAndShapesMatchDiffusers) {
  UNetConfig sd21 = UNetConfig::sd15();
  sd21.attention_head_dim = {5, 10, 20, 20};
  sd21.cross_attention_dim = 1024;
  sd21.use_linear_projection = true;
  sd21.sample_size = 96;
  check_full_size_layout("sd21", sd21);
}

// SDXL 1.0 base: the published config builds diffusers' keys and shapes, 2,567,463,684
// parameters (UNetConfig::sdxl() is that config).
TEST_F(UNetParity, FullSizeSdxlKeysAndShapesMatchDiffusers) {
  check_full_size_layout("sdxl", UNetConfig::sdxl(), torch::kBFloat16);
  EXPECT_EQ(last_parameters_, 2567463684);
  // kohya's SDXL LoRA on it: 722 layers (70 transformer blocks' 10, 11 Transformer2Ds'
  // proj_in/proj_out), named by their Stability AI paths, each in one of the 23 blocks.
  const std::vector<LoraTarget> targets = sdxl_unet_lora_targets(last_unet_, /*conv_kxk=*/false);
  EXPECT_EQ(targets.size(), 722u);
  std::set<std::string> names;
  for (const LoraTarget& t : targets) {
    names.insert(t.name);
    EXPECT_GE(t.block, 1) << t.name;
    EXPECT_LE(t.block, 21) << t.name;
  }
  EXPECT_EQ(names.size(), targets.size());
  for (const char* kohya : {"lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q",
                            "lora_unet_input_blocks_8_1_transformer_blocks_9_ff_net_2",
                            "lora_unet_middle_block_1_transformer_blocks_9_attn2_to_out_0",
                            "lora_unet_middle_block_1_proj_in",
                            "lora_unet_output_blocks_0_1_transformer_blocks_9_ff_net_0_proj",
                            "lora_unet_output_blocks_5_1_proj_out"}) {
    EXPECT_TRUE(names.count(kohya)) << kohya;
  }
}

// kohya's LoRA targets on SD1.5 at its real size: models/reference/lora_targets_reference.py
// applies networks/lora.py's rule to diffusers' UNet2DConditionModel and transformers'
// CLIPTextModel, and the names must be ours: 192 U-Net layers, 278 with LoCon, 72 in the text
// encoder.
TEST(LoraTargets, Sd15RealSizeAreKohyas) {
  const fs::path dir = testing::make_temp_dir("lora-targets");
  ASSERT_TRUE(testing::run_reference("lora_targets_reference.py", dir));
  const nlohmann::json kohya = nlohmann::json::parse(read_text(dir / "targets.json"));
  fs::remove_all(dir);
  auto names = [](const std::vector<LoraTarget>& targets) {
    std::vector<std::string> out;
    for (const LoraTarget& t : targets) out.push_back(t.name);
    std::sort(out.begin(), out.end());
    return out;
  };
  auto sorted = [](std::vector<std::string> v) {
    std::sort(v.begin(), v.end());
    return v;
  };
  std::vector<std::string> unet_names, locon_names, text_names;
  {
    const UNet unet(UNetConfig::sd15());
    unet_names = names(unet_lora_targets(unet, /*conv_kxk=*/false));
    locon_names = names(unet_lora_targets(unet, /*conv_kxk=*/true));
  }
  text_names = names(text_encoder_lora_targets(ClipTextModel(ClipTextConfig::sd15())));
  EXPECT_EQ(unet_names.size(), 192u);
  EXPECT_EQ(locon_names.size(), 278u);
  EXPECT_EQ(text_names.size(), 72u);
  EXPECT_EQ(unet_names, sorted(kohya["unet"].get<std::vector<std::string>>()));
  EXPECT_EQ(locon_names, sorted(kohya["unet_conv"].get<std::vector<std::string>>()));
  EXPECT_EQ(text_names, sorted(kohya["text_encoder"].get<std::vector<std::string>>()));
}

// ---- loading errors (no Python) ----------------------------------------------------------------

class UNetLoad : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("lorapipe-unet-load-" + std::to_string(getpid()));
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // Writes `unet`'s tensors to `path`, without `drop` and with an extra tensor `extra`.
  void write(const UNet& unet, const fs::path& path, const std::string& drop,
             const std::string& extra) {
    std::vector<torch::Tensor> storage;
    std::vector<TensorToWrite> tensors;
    for (TensorToWrite& t : module_tensors(*unet, storage)) {
      if (t.name != drop) tensors.push_back(std::move(t));
    }
    const torch::Tensor extra_tensor = torch::zeros({3});
    if (!extra.empty()) {
      tensors.push_back({extra,
                         Dtype::kF32,
                         {3},
                         std::string_view(static_cast<const char*>(extra_tensor.data_ptr()),
                                          extra_tensor.nbytes())});
    }
    write_safetensors(path, tensors);
  }

  std::string load_error(const fs::path& path) {
    UNet fresh(tiny_config());
    try {
      load_unet_diffusers(fresh, path);
    } catch (const InputError& e) {
      return e.what();
    }
    return "";
  }

  fs::path dir_;
};

TEST_F(UNetLoad, RoundTripThroughAFolderGivesTheSameOutput) {
  UNet unet(tiny_config());
  write(unet, dir_ / "diffusion_pytorch_model.safetensors", "", "");
  UNet loaded(tiny_config());
  load_unet_diffusers(loaded, dir_);
  torch::NoGradGuard no_grad;
  const torch::Tensor sample = torch::randn({1, 4, 8, 8});
  const torch::Tensor context = torch::randn({1, 5, 16});
  const torch::Tensor t = torch::tensor(500);
  EXPECT_TRUE(torch::equal(unet(sample, t, context), loaded(sample, t, context)));
}

TEST_F(UNetLoad, MissingKeyIsNamed) {
  UNet unet(tiny_config());
  const std::string key = "down_blocks.0.attentions.0.transformer_blocks.0.attn2.to_k.weight";
  write(unet, dir_ / "missing.safetensors", key, "");
  const std::string error = load_error(dir_ / "missing.safetensors");
  EXPECT_NE(error.find("missing " + key), std::string::npos) << error;
  EXPECT_NE(error.find("missing.safetensors"), std::string::npos) << error;
}

TEST_F(UNetLoad, ExtraKeyIsNamed) {
  UNet unet(tiny_config());
  const std::string key = "add_embedding.linear_1.weight";
  write(unet, dir_ / "extra.safetensors", "", key);
  const std::string error = load_error(dir_ / "extra.safetensors");
  EXPECT_NE(error.find("unexpected " + key), std::string::npos) << error;
}

TEST_F(UNetLoad, FolderWithoutWeightsIsNamed) {
  const std::string error = load_error(dir_);
  EXPECT_NE(error.find("diffusion_pytorch_model.safetensors"), std::string::npos) << error;
}

TEST_F(UNetLoad, OddLatentSizesKeepTheirShape) {
  UNet unet(tiny_config());
  torch::NoGradGuard no_grad;
  const torch::Tensor out =
      unet(torch::randn({2, 4, 7, 11}), torch::tensor({1, 999}), torch::randn({2, 3, 16}));
  EXPECT_EQ(out.sizes(), (std::vector<int64_t>{2, 4, 7, 11}));
}

// ---- config ----------------------------------------------------------------------------------

TEST(UNetConfigTest, MissingFieldsTakeDiffusersDefaults) {
  const UNetConfig config = UNetConfig::from_json(R"({"cross_attention_dim": 768,
      "sample_size": 64, "some_future_field": [1, 2]})");
  const UNetConfig sd15 = UNetConfig::sd15();
  EXPECT_EQ(config.block_out_channels, sd15.block_out_channels);
  EXPECT_EQ(config.attention_head_dim, sd15.attention_head_dim);
  EXPECT_EQ(config.layers_per_block, sd15.layers_per_block);
  EXPECT_EQ(config.down_block_types, sd15.down_block_types);
  EXPECT_EQ(config.norm_eps, sd15.norm_eps);
  EXPECT_TRUE(config.flip_sin_to_cos);
}

TEST(UNetConfigTest, SingleNumbersRepeatPerBlock) {
  const UNetConfig config = UNetConfig::from_json(R"({"block_out_channels": [32, 64],
      "down_block_types": ["CrossAttnDownBlock2D", "DownBlock2D"],
      "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D"], "attention_head_dim": 4,
      "layers_per_block": 1, "transformer_layers_per_block": [1, 3]})");
  EXPECT_EQ(config.attention_head_dim, (std::vector<int64_t>{4, 4}));
  EXPECT_EQ(config.layers_per_block, (std::vector<int64_t>{1, 1}));
  EXPECT_EQ(config.transformer_layers_per_block, (std::vector<int64_t>{1, 3}));
}

TEST(UNetConfigTest, UnsupportedOrMalformedConfigsNameTheField) {
  auto error_of = [](const std::string& text) -> std::string {
    try {
      UNetConfig::from_json(text, "unet/config.json");
    } catch (const InputError& e) {
      return e.what();
    }
    return "";
  };
  EXPECT_NE(error_of(R"({"addition_embed_type": "text"})").find("addition_embed_type"),
            std::string::npos);
  EXPECT_NE(error_of(R"({"addition_embed_type": "text_time"})")
                .find("projection_class_embeddings_input_dim"),
            std::string::npos);
  EXPECT_NE(error_of(R"({"act_fn": "gelu"})").find("act_fn"), std::string::npos);
  EXPECT_NE(error_of(R"({"layers_per_block": "two"})").find("layers_per_block"), std::string::npos);
  EXPECT_NE(error_of(R"({"attention_head_dim": [8, 8]})").find("attention_head_dim"),
            std::string::npos);
  EXPECT_NE(error_of(R"({"attention_head_dim": 7})").find("heads"), std::string::npos);
  EXPECT_NE(error_of("{not json").find("unet/config.json"), std::string::npos);
}

// ---- gradient checkpointing --------------------------------------------------------------------

// Checkpointing changes where activations live, never a number: a UNet whose cross-attention
// level is three transformer blocks deep (so a Transformer2D runs as a first segment holding
// the norm and proj_in, a middle one, and a last one holding proj_out and the residual) gives,
// checkpointed, the output and every gradient of the plain run: the LoRA adapters' on every
// Linear, the latents' and the text's (which requires grad, as when a text encoder trains). In
// float64 the two runs differ only where autograd adds the text's gradients from several nodes in
// another order: 1e-12 relative leaves that room and catches any segment that drops a residual,
// an adapter or an input's gradient (errors of order 1).
TEST(UNetCheckpointing, ThreeDeepTransformerLevelGivesThePlainGradients) {
  UNetConfig config = tiny_sdxl_unet_config();
  config.transformer_layers_per_block = {1, 3};
  torch::manual_seed(11);
  UNet unet(config);
  unet->to(torch::kDouble);
  for (auto& p : unet->parameters()) p.requires_grad_(false);
  std::vector<at::Tensor> adapters;
  std::map<std::string, at::Tensor> named;
  for (const auto& item : unet->named_modules()) {
    auto linear = std::dynamic_pointer_cast<LinearImpl>(item.value());
    if (!linear || item.key().find("attentions") == std::string::npos) continue;
    auto lora = std::make_shared<LoraAdapter>();
    const int64_t rank = 2;
    lora->down = torch::randn({rank, linear->weight.size(1)}, torch::kDouble).requires_grad_();
    lora->up = torch::randn({linear->weight.size(0), rank}, torch::kDouble).requires_grad_();
    lora->scale = 0.5;
    linear->lora = lora;
    named[item.key() + ".down"] = lora->down;
    named[item.key() + ".up"] = lora->up;
  }
  // proj_in, proj_out and the ten Linears of each of three blocks, in the level's two
  // Transformer2Ds down and three up and the mid block's (as deep as the last level, as diffusers
  // builds it).
  ASSERT_EQ(named.size(), 2u * 6 * (2 + 3 * 10));
  const auto opts = torch::TensorOptions().dtype(torch::kDouble);
  const at::Tensor latents = torch::randn({2, config.in_channels, 8, 8}, opts);
  const at::Tensor text = torch::randn({2, 5, config.cross_attention_dim}, opts);
  const at::Tensor pooled = torch::randn({2, 32}, opts);
  const at::Tensor time_ids = torch::rand({2, 6}, opts) * 1024;
  const at::Tensor weights = torch::randn({2, config.out_channels, 8, 8}, opts);
  const at::Tensor timesteps = torch::tensor({3.0, 700.0}, opts);

  struct Run {
    at::Tensor out;
    std::map<std::string, at::Tensor> grads;
  };
  auto run = [&](bool checkpointed) {
    unet->gradient_checkpointing = checkpointed;
    for (auto& [name, t] : named) t.mutable_grad() = at::Tensor();
    const at::Tensor x = latents.clone().requires_grad_();
    const at::Tensor context = text.clone().requires_grad_();
    const at::Tensor out = unet->forward(x, timesteps, context, pooled, time_ids);
    (out * weights).sum().backward();
    Run r{out.detach(), {{"latents", x.grad()}, {"text", context.grad()}}};
    for (const auto& [name, t] : named) r.grads[name] = t.grad().clone();
    return r;
  };
  const Run plain = run(false);
  const Run checkpointed = run(true);
  EXPECT_LE(testing::relative_error(checkpointed.out, plain.out), 1e-12);
  ASSERT_EQ(checkpointed.grads.size(), plain.grads.size());
  double worst = 0;
  for (const auto& [name, g] : plain.grads) {
    ASSERT_TRUE(g.defined() && checkpointed.grads.at(name).defined()) << name;
    ASSERT_GT(g.abs().max().item<double>(), 0) << name;
    const double e = testing::relative_error(checkpointed.grads.at(name), g);
    worst = std::max(worst, e);
    EXPECT_LE(e, 1e-12) << name;
  }
  std::printf("[checkpointing] %zu gradients, checkpointed against plain: max relative error %.3g\n",
              plain.grads.size(), worst);
}

// ---- FLOPs (the benches' MFU) --------------------------------------------------------------------

// unet_forward_flops against torch's FlopCounterMode over one forward of diffusers' UNet, built
// from the same config.json (models/reference/unet_flops_reference.py): the tiny SD1- and
// SD2-shaped UNets, odd latent sizes, and SD1.5 and SD2.1 at full size. Both count whole
// multiply-adds of the same products, so the figures must be equal; the one tolerance is double
// rounding, 1e-12 of the count.
TEST(UNetFlops, CountedAsTorchsFlopCounterOnDiffusersUNet) {
  const fs::path out = testing::reference_output("models/reference/unet_flops_reference.py");
  const auto cases = nlohmann::json::parse(read_text(out / "flops.json"));
  ASSERT_GE(cases.size(), 9u);
  for (const auto& c : cases) {
    const std::string name = c["config"].get<std::string>();
    const UNetConfig config =
        UNetConfig::from_json(read_text(out / name / "config.json"), name + "/config.json");
    const double expected = c["flops"].get<double>();
    const double counted =
        unet_forward_flops(config, c["batch"].get<int64_t>(), c["height"].get<int64_t>(),
                           c["width"].get<int64_t>(), c["tokens"].get<int64_t>());
    EXPECT_NEAR(counted, expected, 1e-12 * expected) << c.dump();
    std::printf("[flops] %s batch %lld, %lldx%lld, %lld tokens: %.4g (FlopCounterMode %.4g)\n",
                name.c_str(), static_cast<long long>(c["batch"].get<int64_t>()),
                static_cast<long long>(c["height"].get<int64_t>()),
                static_cast<long long>(c["width"].get<int64_t>()),
                static_cast<long long>(c["tokens"].get<int64_t>()), counted, expected);
  }
}

}  // namespace
}  // namespace lorapipe::models
