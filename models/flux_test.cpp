// The Flux.1 transformer against diffusers' FluxTransformer2DModel on tiny dev and schnell
// configs (models/reference/flux_reference.py): loaded from the diffusers folder through the key
// map and from the original single file, its output and its gradients with respect to the image
// tokens and the T5 states, with and without kohya's T5 attention mask; the full-size layouts on
// the meta device; gradient checkpointing; packing and ids; loader errors.
//
// Tolerance: 1e-4 of the largest reference magnitude (the bound). Both sides run fp32
// through SDPA on the CPU; they differ only in summation order (fused qkv against three
// projections, the rotary tables' layout), which stays near 1e-6 at these sizes.

#include "models/flux.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "common/error.h"
#include "models/flux_lora.h"
#include "models/loading.h"
#include "models/lora.h"
#include "models/parity_util.h"
#include "models/safetensors.h"
#include "models/weights.h"

namespace lorapipe::models {
namespace {

namespace fs = std::filesystem;
using testing::expect_close;

constexpr double kParity = 1e-4;

class FluxTransformerParity : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    ref_ = testing::reference_output("models/reference/flux_reference.py");
  }

  static std::map<std::string, at::Tensor> io(const std::string& variant) {
    return testing::read_all(ref_ / variant / "io.safetensors");
  }

  static FluxTransformer from_folder(const std::string& variant) {
    const fs::path folder = ref_ / variant / "transformer";
    const FluxConfig config = FluxConfig::from_diffusers_json(read_text(folder / "config.json"),
                                                              (folder / "config.json").string());
    FluxTransformer model(config, at::TensorOptions().dtype(at::kFloat));
    load_flux_diffusers(*model, folder);
    return model;
  }

  static FluxTransformer from_original(const std::string& variant) {
    const SafetensorsFile file = SafetensorsFile::open(ref_ / variant / "original.safetensors");
    const std::string prefix = "model.diffusion_model.";
    FluxTransformer model(FluxConfig::from_original_file(file, prefix),
                          at::TensorOptions().dtype(at::kFloat));
    load_flux_original(*model, file, prefix);
    return model;
  }

  // The reference's inputs, img and txt as fresh leaves that collect their gradients.
  static FluxInput inputs_of(const std::map<std::string, at::Tensor>& ref, bool masked) {
    FluxInput in;
    in.img = ref.at("img").clone().requires_grad_(true);
    in.txt = ref.at("txt").clone().requires_grad_(true);
    in.img_ids = ref.at("img_ids");
    in.txt_ids = ref.at("txt_ids");
    in.timesteps = ref.at("timesteps");
    in.y = ref.at("y");
    if (ref.count("guidance")) in.guidance = ref.at("guidance");
    if (masked) in.txt_mask = ref.at("txt_mask");
    return in;
  }

  // Output and input gradients of `model` on the reference's inputs, against its figures.
  static void check(FluxTransformer& model, const std::string& variant, const std::string& what,
                    bool masked) {
    const auto ref = io(variant);
    const FluxInput in = inputs_of(ref, masked);
    const at::Tensor &img = in.img, &txt = in.txt;
    const at::Tensor out = model(in);
    (out * ref.at("w")).sum().backward();
    const std::string p = masked ? "masked_" : "";
    const std::string tag = variant + " " + what + (masked ? " masked" : "");
    expect_close(tag + " output", out.detach(), ref.at(p + "out"), kParity);
    expect_close(tag + " d/d img", img.grad(), ref.at(p + "grad_img"), kParity);
    expect_close(tag + " d/d txt", txt.grad(), ref.at(p + "grad_txt"), kParity);
  }

  static fs::path ref_;
};
fs::path FluxTransformerParity::ref_;

TEST_F(FluxTransformerParity, DevFromDiffusersFolderMatchesDiffusers) {
  FluxTransformer model = from_folder("dev");
  EXPECT_TRUE(model->config.guidance_embed);
  check(model, "dev", "folder", /*masked=*/false);
}

TEST_F(FluxTransformerParity, DevWithT5AttentionMaskMatchesDiffusers) {
  FluxTransformer model = from_folder("dev");
  check(model, "dev", "folder", /*masked=*/true);
  // The mask matters: the second sample's last three text tokens change the unmasked output.
  const auto ref = io("dev");
  EXPECT_GT(testing::relative_error(ref.at("masked_out"), ref.at("out")), 1e-3);
}

TEST_F(FluxTransformerParity, DevFromOriginalSingleFileMatchesDiffusers) {
  FluxTransformer model = from_original("dev");
  const FluxConfig& c = model->config;
  EXPECT_EQ(c.hidden_size, 32);
  EXPECT_EQ(c.num_heads, 2);
  EXPECT_EQ(c.depth, 2);
  EXPECT_EQ(c.depth_single_blocks, 2);
  EXPECT_EQ(c.in_channels, 16);
  EXPECT_EQ(c.context_in_dim, 32);
  EXPECT_EQ(c.vec_in_dim, 24);
  EXPECT_EQ(c.axes_dim, (std::vector<int64_t>{4, 6, 6}));
  EXPECT_TRUE(c.guidance_embed);
  check(model, "dev", "single file", /*masked=*/false);
  check(model, "dev", "single file", /*masked=*/true);
}

TEST_F(FluxTransformerParity, SchnellHasNoGuidanceEmbeddingAndMatchesDiffusers) {
  FluxTransformer folder = from_folder("schnell");
  FluxTransformer original = from_original("schnell");
  EXPECT_FALSE(folder->config.guidance_embed);
  EXPECT_FALSE(original->config.guidance_embed);
  for (const auto& item : original->named_parameters()) {
    EXPECT_EQ(item.key().rfind("guidance_in", 0), std::string::npos) << item.key();
  }
  check(folder, "schnell", "folder", /*masked=*/false);
  check(original, "schnell", "single file", /*masked=*/true);
}

// Per-block recomputation gives the plain run's output and gradients, as the trainer uses it: the
// base frozen, a LoRA on every Linear of every block (the adapters are the recomputed blocks'
// explicit inputs, models/checkpoint.h). The same fp32 ops on the same inputs, recomputed in
// backward: at most the rounding of a differently scheduled reduction (1e-6 of the scale).
TEST_F(FluxTransformerParity, GradientCheckpointingGivesThePlainGradients) {
  FluxTransformer model = from_folder("dev");
  for (auto& p : model->parameters()) p.requires_grad_(false);
  std::vector<at::Tensor> adapters;
  torch::manual_seed(3);
  for (auto* blocks : {&model->double_blocks, &model->single_blocks}) {
    for (const auto& module : (*blocks)->modules(/*include_self=*/false)) {
      auto* linear = module->as<LinearImpl>();
      if (linear == nullptr) continue;
      auto lora = std::make_shared<LoraAdapter>();
      lora->down = (torch::randn({2, linear->weight.size(1)}) * 0.3).requires_grad_();
      lora->up = (torch::randn({linear->weight.size(0), 2}) * 0.3).requires_grad_();
      linear->lora = lora;
      adapters.push_back(lora->down);
      adapters.push_back(lora->up);
    }
  }
  // 2 double blocks x 10 Linears, 2 single blocks x 3 (kohya's lora_flux targets at this size).
  EXPECT_EQ(adapters.size(), 2u * (2 * 10 + 2 * 3));
  const auto ref = io("dev");
  auto run = [&](bool recompute) {
    model->gradient_checkpointing = recompute;
    for (auto& a : adapters) a.mutable_grad() = at::Tensor();
    const FluxInput in = inputs_of(ref, /*masked=*/true);
    const at::Tensor &img = in.img, &txt = in.txt;
    const at::Tensor out = model(in);
    (out * ref.at("w")).sum().backward();
    std::vector<at::Tensor> grads{out.detach(), img.grad(), txt.grad()};
    for (const auto& a : adapters) grads.push_back(a.grad().clone());
    return grads;
  };
  const auto plain = run(false);
  const auto recomputed = run(true);
  ASSERT_EQ(plain.size(), recomputed.size());
  double worst = 0;
  for (size_t i = 0; i < plain.size(); ++i) {
    ASSERT_TRUE(recomputed[i].defined()) << "tensor " << i << " got no gradient";
    worst = std::max(worst, testing::relative_error(recomputed[i], plain[i]));
  }
  std::printf("[flux] checkpointed against plain: %zu tensors, worst %.3g (limit 1e-6)\n",
              plain.size(), worst);
  EXPECT_LE(worst, 1e-6);
}

TEST_F(FluxTransformerParity, PackingAndIdsAreDiffusers) {
  const auto ref = io("dev");
  const at::Tensor latents = ref.at("latents");
  EXPECT_TRUE(pack_latents(latents).equal(ref.at("img")));
  EXPECT_TRUE(
      unpack_latents(pack_latents(latents), latents.size(2), latents.size(3)).equal(latents));
  EXPECT_TRUE(image_ids(latents.size(2), latents.size(3)).equal(ref.at("img_ids")));
  EXPECT_THROW(pack_latents(at::zeros({1, 4, 7, 6})), c10::Error);
}

// A file that lacks a tensor or holds one of another shape is refused by name.
TEST_F(FluxTransformerParity, LoaderNamesMissingAndMisshapedTensors) {
  const auto tensors = testing::read_all(ref_ / "dev" / "original.safetensors");
  const fs::path dir = testing::make_temp_dir("flux-bad");
  auto write_without = [&](const std::string& drop, const std::string& reshape) {
    std::vector<TensorToWrite> entries;
    std::vector<at::Tensor> keep;
    for (const auto& [name, t] : tensors) {
      if (name == drop) continue;
      at::Tensor c = (name == reshape ? t.narrow(0, 0, t.size(0) - 1) : t).contiguous();
      keep.push_back(c);
      entries.push_back({name, Dtype::kF32, c.sizes().vec(),
                         std::string_view(static_cast<const char*>(c.data_ptr()), c.nbytes())});
    }
    const fs::path path = dir / "bad.safetensors";
    write_safetensors(path, entries, {{"lorapipe.flux.axes_dim", "4,6,6"}});
    return path;
  };
  const std::string prefix = "model.diffusion_model.";
  auto message_of = [&](const fs::path& path) -> std::string {
    const SafetensorsFile file = SafetensorsFile::open(path);
    FluxTransformer model(FluxConfig::from_original_file(file, prefix),
                          at::TensorOptions().dtype(at::kFloat));
    try {
      load_flux_original(*model, file, prefix);
    } catch (const InputError& e) {
      return e.what();
    }
    return "";
  };
  const std::string missing =
      message_of(write_without(prefix + "single_blocks.1.linear2.weight", ""));
  EXPECT_NE(missing.find("bad.safetensors"), std::string::npos) << missing;
  EXPECT_NE(missing.find("missing single_blocks.1.linear2.weight;"), std::string::npos) << missing;
  const std::string misshaped =
      message_of(write_without("", prefix + "double_blocks.0.txt_mlp.2.bias"));
  EXPECT_NE(misshaped.find("double_blocks.0.txt_mlp.2.bias [31] (model wants [32])"),
            std::string::npos)
      << misshaped;
  fs::remove_all(dir);
}

// The full-size transformers built on the meta device in bf16 (no memory): every original key
// with diffusers' shapes mapped, and FLUX.1's parameter counts.
TEST_F(FluxTransformerParity, FullSizeKeysAndShapesMatchDiffusers) {
  for (const auto& [name, config, count] :
       {std::tuple{"dev", FluxConfig::dev(), int64_t{11901408320}},
        std::tuple{"schnell", FluxConfig::schnell(), int64_t{11891178560}}}) {
    const nlohmann::json theirs =
        nlohmann::json::parse(read_text(ref_ / (std::string("full_") + name + ".json")));
    FluxTransformer model(config, at::TensorOptions().dtype(at::kBFloat16).device(at::kMeta));
    int64_t parameters = 0;
    size_t matched = 0;
    for (const auto& item : model->named_parameters()) {
      parameters += item.value().numel();
      EXPECT_EQ(item.value().scalar_type(), at::kBFloat16);
      ASSERT_TRUE(theirs.contains(item.key())) << name << ": " << item.key();
      EXPECT_EQ(item.value().sizes().vec(), theirs[item.key()].get<std::vector<int64_t>>())
          << item.key();
      ++matched;
    }
    std::printf("[flux] full %s: %zu tensors, %lld parameters\n", name, matched,
                static_cast<long long>(parameters));
    EXPECT_EQ(matched, theirs.size()) << name;
    EXPECT_EQ(parameters, count) << name;

    // kohya's Flux LoRA on it: 304 layers, named as lora_flux names them.
    const auto expected_names =
        nlohmann::json::parse(read_text(ref_ / (std::string("lora_") + name + ".json")))
            .get<std::vector<std::string>>();
    std::vector<std::string> names;
    for (const LoraTarget& t : flux_lora_targets(model)) names.push_back(t.name);
    EXPECT_EQ(names.size(), 304u) << name;
    std::sort(names.begin(), names.end());
    EXPECT_EQ(names, expected_names) << name;
  }
}

// kohya's names and order on the tiny model, and network_args train_blocks.
TEST_F(FluxTransformerParity, LoraTargetsAreKohyasLoraFlux) {
  FluxTransformer model = from_folder("dev");
  const std::vector<LoraTarget> all = flux_lora_targets(model);
  ASSERT_EQ(all.size(), 2u * 10 + 2u * 3);
  const std::vector<std::string> first_block = {
      "lora_unet_double_blocks_0_img_mod_lin",   "lora_unet_double_blocks_0_img_attn_qkv",
      "lora_unet_double_blocks_0_img_attn_proj", "lora_unet_double_blocks_0_img_mlp_0",
      "lora_unet_double_blocks_0_img_mlp_2",     "lora_unet_double_blocks_0_txt_mod_lin",
      "lora_unet_double_blocks_0_txt_attn_qkv",  "lora_unet_double_blocks_0_txt_attn_proj",
      "lora_unet_double_blocks_0_txt_mlp_0",     "lora_unet_double_blocks_0_txt_mlp_2"};
  for (size_t i = 0; i < first_block.size(); ++i) EXPECT_EQ(all[i].name, first_block[i]);
  EXPECT_EQ(all[20].name, "lora_unet_single_blocks_0_linear1");
  EXPECT_EQ(all[21].name, "lora_unet_single_blocks_0_linear2");
  EXPECT_EQ(all[22].name, "lora_unet_single_blocks_0_modulation_lin");
  EXPECT_EQ(all[1].module_path, "double_blocks.0.img_attn.qkv");
  EXPECT_EQ(all[1].out_features(), 3 * 32);
  EXPECT_EQ(flux_lora_targets(model, "single").size(), 6u);
  EXPECT_EQ(flux_lora_targets(model, "double").size(), 20u);
  EXPECT_THROW(flux_lora_targets(model, "middle"), InputError);
}

}  // namespace
}  // namespace lorapipe::models
