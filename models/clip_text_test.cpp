// CLIP text encoder against transformers' CLIPTextModel on the same tiny random weights.
// Tolerance 1e-4 relative (fp32): both sides do the same float32 operations in a different
// order; measured errors are around 1e-6.
#include "models/clip_text.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <fstream>
#include <iterator>

#include "common/error.h"
#include "models/attention.h"
#include "models/open_clip_keys.h"
#include "models/parity_util.h"
#include "models/sd15_lora.h"

namespace lorapipe::models {
namespace {
namespace fs = std::filesystem;
using testing::expect_close;

class ClipTextParity : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = testing::make_temp_dir("clip-text-parity");
    ASSERT_TRUE(testing::run_reference("clip_text_reference.py", dir_));
  }
  static void TearDownTestSuite() { fs::remove_all(dir_); }

  static ClipTextModel load(const std::string& folder = "text_encoder") {
    std::ifstream in(dir_ / folder / "config.json");
    const std::string json{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
    ClipTextModel model(ClipTextConfig::from_json(json));
    load_clip_text(model, dir_ / folder);
    model->eval();
    return model;
  }

  static fs::path dir_;
};
fs::path ClipTextParity::dir_;

TEST_F(ClipTextParity, HiddenStatesPooledAndClipSkipMatchTransformers) {
  set_force_math_attention(true);
  ClipTextModel model = load();
  const auto io = testing::read_all(dir_ / "clip_text_io.safetensors");
  torch::NoGradGuard no_grad;
  const torch::Tensor ids = io.at("input_ids");
  const ClipTextOutput out = model->forward(ids);
  constexpr double kTolerance = 1e-4;
  expect_close("clip last_hidden_state", out.last_hidden_state, io.at("last_hidden_state"),
               kTolerance);
  expect_close("clip pooled", out.pooled, io.at("pooled"), kTolerance);
  expect_close("clip penultimate hidden state", out.hidden_states.end()[-2], io.at("penultimate"),
               kTolerance);
  expect_close("clip skip 1", model->encode(ids, 1), io.at("last_hidden_state"), kTolerance);
  expect_close("clip skip 2", model->encode(ids, 2), io.at("clip_skip2"), kTolerance);
  // The default attention path (SDPA kernels) agrees too.
  set_force_math_attention(false);
  expect_close("clip last_hidden_state (sdpa)", model->forward(ids).last_hidden_state,
               io.at("last_hidden_state"), kTolerance);
}

// Prompts over 75 tokens, as kohya conditions them (--max_token_length 225, and the sampler's
// long prompts): three chunks of 77 encoded on their own and joined to 227 states. The reference
// follows kohya's train_util.get_hidden_states on transformers' model; same 1e-4 tolerance.
TEST_F(ClipTextParity, LongPromptsChunkedAsKohya) {
  set_force_math_attention(true);
  ClipTextModel model = load();
  const auto io = testing::read_all(dir_ / "clip_text_io.safetensors");
  torch::NoGradGuard no_grad;
  const torch::Tensor ids = io.at("long_input_ids");
  ASSERT_EQ(ids.size(1), 3 * 77);
  torch::Tensor pooled;
  const torch::Tensor last = model->encode_chunked(ids, 1, &pooled);
  EXPECT_EQ(last.size(1), 227);
  constexpr double kTolerance = 1e-4;
  expect_close("long prompt, clip skip 1", last, io.at("long_last_hidden_state"), kTolerance);
  expect_close("long prompt, clip skip 2", model->encode_chunked(ids, 2),
               io.at("long_clip_skip2"), kTolerance);
  expect_close("long prompt, first chunk pooled", pooled, io.at("long_pooled"), kTolerance);
  // One chunk is the plain conditioning.
  expect_close("one chunk", model->encode_chunked(io.at("input_ids"), 1),
               io.at("last_hidden_state"), kTolerance);
  set_force_math_attention(false);
}

// SDXL's second text encoder (CLIPTextModelWithProjection, gelu): its states, SDXL's
// penultimate conditioning (no final layer norm), the pooled state at the end-of-text token with
// padding 0 after it, and text_projection of it. Same 1e-4 tolerance.
class SdxlTextEncoderParity : public ClipTextParity {};

TEST_F(SdxlTextEncoderParity, ProjectedPooledAndPenultimateMatchTransformers) {
  set_force_math_attention(true);
  ClipTextModel model = load("text_encoder_2");
  ASSERT_TRUE(model->config().with_projection);
  ASSERT_TRUE(model->text_projection);
  EXPECT_EQ(model->config().hidden_act, "gelu");
  const auto io = testing::read_all(dir_ / "clip_text_io.safetensors");
  torch::NoGradGuard no_grad;
  const ClipTextOutput out = model->forward(io.at("g_input_ids"));
  constexpr double kTolerance = 1e-4;
  expect_close("clip-g last_hidden_state", out.last_hidden_state, io.at("g_last_hidden_state"),
               kTolerance);
  expect_close("clip-g penultimate", out.hidden_states.end()[-2], io.at("g_penultimate"),
               kTolerance);
  expect_close("clip-g pooled", out.pooled, io.at("g_pooled"), kTolerance);
  expect_close("clip-g text_embeds", out.text_embeds, io.at("g_text_embeds"), kTolerance);
  set_force_math_attention(false);
  // The first encoder has no projection: its config (a CLIPTextModel) builds none.
  EXPECT_FALSE(load()->text_projection);
}

// SDXL single files hold the second encoder in OpenCLIP's layout: converted as diffusers'
// convert_open_clip_checkpoint converts it (the same names, the same values bit for bit), it
// loads into the encoder and gives transformers' outputs; a key OpenCLIP does not have is named.
TEST_F(SdxlTextEncoderParity, OpenClipSingleFileLayoutConvertsAsDiffusers) {
  const auto single = testing::read_all(dir_ / "openclip_single_file.safetensors");
  const auto diffusers = testing::read_all(dir_ / "openclip_converted.safetensors");
  const auto ours = open_clip_to_transformers(single, kSdxlOpenClipPrefix, "single.safetensors");
  ASSERT_EQ(ours.size(), diffusers.size());
  for (const auto& [key, tensor] : diffusers) {
    ASSERT_TRUE(ours.count(key)) << "missing " << key;
    EXPECT_TRUE(torch::equal(ours.at(key), tensor)) << key;
  }
  std::ifstream in(dir_ / "text_encoder_2" / "config.json");
  const std::string json{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  ClipTextModel model(ClipTextConfig::from_json(json));
  load_into(*model, ours, "single.safetensors");
  model->eval();
  set_force_math_attention(true);
  torch::NoGradGuard no_grad;
  const auto io = testing::read_all(dir_ / "clip_text_io.safetensors");
  expect_close("clip-g from the single file, text_embeds",
               model->forward(io.at("g_input_ids")).text_embeds, io.at("g_text_embeds"), 1e-4);
  set_force_math_attention(false);

  auto edited = single;
  edited[std::string(kSdxlOpenClipPrefix) + "transformer.resblocks.0.attn.q_weight"] =
      torch::zeros({4});
  try {
    (void)open_clip_to_transformers(edited, kSdxlOpenClipPrefix, "single.safetensors");
    ADD_FAILURE() << "an unknown OpenCLIP key was taken";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("single.safetensors: conditioner.embedders.1.model."
                                         "transformer.resblocks.0.attn.q_weight"),
              std::string::npos)
        << e.what();
  }
}

// Full size, without weights read: SDXL's second encoder has OpenCLIP ViT-bigG's 694,659,840
// parameters (transformers' count for CLIPTextModelWithProjection at its published config).
TEST(SdxlTextEncoder, FullSizeClipGHasBigGsParameterCount) {
  const caffe2::TypeMeta saved = c10::get_default_dtype();
  c10::set_default_dtype(c10::scalarTypeToTypeMeta(torch::kBFloat16));
  ClipTextModel model(ClipTextConfig::sdxl_clip_g());
  c10::set_default_dtype(saved);
  int64_t parameters = 0;
  for (const torch::Tensor& p : model->parameters()) parameters += p.numel();
  EXPECT_EQ(parameters, 694659840);
  EXPECT_EQ(model->text_projection->weight.sizes(), (std::vector<int64_t>{1280, 1280}));
  // kohya's lora_te2: 32 layers' q, k, v, out_proj, fc1, fc2 (CLIP-L's lora_te1: 12 x 6 = 72).
  EXPECT_EQ(text_encoder_lora_targets(model, "lora_te2", 1).size(), 192u);
  EXPECT_EQ(text_encoder_lora_targets(ClipTextModel(ClipTextConfig::sd15()), "lora_te1", 0).size(),
            72u);
}

TEST_F(ClipTextParity, MissingOrUnexpectedKeysAreNamed) {
  const SafetensorsFile good = SafetensorsFile::open(dir_ / "text_encoder" / "model.safetensors");
  auto tensors = read_tensors(good);
  tensors.erase("text_model.encoder.layers.3.mlp.fc2.bias");
  tensors["text_model.encoder.layers.9.mlp.fc2.bias"] = torch::zeros({32});
  std::ifstream in(dir_ / "text_encoder" / "config.json");
  const std::string json{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  ClipTextModel model(ClipTextConfig::from_json(json));
  try {
    load_into(*model, tensors, "edited.safetensors");
    FAIL() << "loaded weights with a missing key";
  } catch (const InputError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("missing text_model.encoder.layers.3.mlp.fc2.bias"), std::string::npos)
        << what;
    EXPECT_NE(what.find("unexpected text_model.encoder.layers.9.mlp.fc2.bias"), std::string::npos)
        << what;
  }
}

}  // namespace
}  // namespace lorapipe::models
