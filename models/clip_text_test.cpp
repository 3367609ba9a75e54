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
#include "models/parity_util.h"

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

  static ClipTextModel load() {
    std::ifstream in(dir_ / "text_encoder" / "config.json");
    const std::string json{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
    ClipTextModel model(ClipTextConfig::from_json(json));
    load_clip_text(model, dir_ / "text_encoder");
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
