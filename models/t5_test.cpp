// The T5 v1.1 encoder against transformers' T5EncoderModel on a tiny random encoder
// (models/reference/t5_reference.py): fp32, bf16 and fp16 (wo kept in fp32, as transformers
// keeps it), with and without the attention mask; the relative position buckets at T5-XXL's
// settings; the tied embeddings under either name; the full-size XXL layout without weights.
//
// Tolerances: fp32 within 1e-4 of the largest reference magnitude (the issue's bound; both run
// the same ops in the same order, so the error is near 1e-7). In bf16 and fp16 both sides round
// the same ops to the same 16-bit grid, so the outputs agree to within a few units of the last
// place: 2^-7 (bf16's) and 2^-10 (fp16's) of the scale.

#include "models/t5.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <nlohmann/json.hpp>

#include "common/error.h"
#include "models/float8.h"
#include "models/loading.h"
#include "models/parity_util.h"
#include "models/safetensors.h"

namespace lorapipe::models {
namespace {

namespace fs = std::filesystem;
using testing::expect_close;

class T5EncoderParity : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    ref_ = testing::reference_output("models/reference/t5_reference.py");
    io_ = testing::read_all(ref_ / "io.safetensors");
  }

  static T5Encoder load(const fs::path& file, at::ScalarType dtype) {
    const T5Config config = T5Config::from_json(read_text(ref_ / "t5" / "config.json"),
                                                (ref_ / "t5" / "config.json").string());
    T5Encoder encoder(config, at::TensorOptions().dtype(dtype));
    load_t5_encoder(*encoder, SafetensorsFile::open(file));
    return encoder;
  }

  static void check(T5Encoder& encoder, const std::string& prefix, double tolerance) {
    torch::NoGradGuard no_grad;
    expect_close(prefix + "out", encoder(io_.at("ids")).to(at::kFloat), io_.at(prefix + "out"),
                 tolerance);
    expect_close(prefix + "masked_out", encoder(io_.at("ids"), io_.at("mask")).to(at::kFloat),
                 io_.at(prefix + "masked_out"), tolerance);
  }

  static fs::path ref_;
  static std::map<std::string, at::Tensor> io_;
};
fs::path T5EncoderParity::ref_;
std::map<std::string, at::Tensor> T5EncoderParity::io_;

TEST_F(T5EncoderParity, Fp32MatchesTransformersWithAndWithoutMask) {
  T5Encoder encoder = load(ref_ / "t5" / "model.safetensors", at::kFloat);
  EXPECT_EQ(encoder->config.num_layers, 3);
  EXPECT_EQ(encoder->config.relative_attention_num_buckets, 8);
  check(encoder, "", 1e-4);
  // The mask matters: padding attended changes the states.
  EXPECT_GT(testing::relative_error(io_.at("masked_out"), io_.at("out")), 1e-3);
}

TEST_F(T5EncoderParity, Bf16MatchesTransformers) {
  T5Encoder encoder = load(ref_ / "t5" / "model.safetensors", at::kBFloat16);
  auto* block = (*encoder->blocks)[0]->as<T5BlockImpl>();
  EXPECT_EQ(block->wo->weight.scalar_type(), at::kBFloat16);
  check(encoder, "bf16_", 1.0 / 128);
}

TEST_F(T5EncoderParity, Fp16KeepsWoInFp32AndMatchesTransformers) {
  T5Encoder encoder = load(ref_ / "t5" / "model.safetensors", at::kHalf);
  auto* block = (*encoder->blocks)[0]->as<T5BlockImpl>();
  EXPECT_EQ(block->wo->weight.scalar_type(), at::kFloat);
  EXPECT_EQ(block->wi_0->weight.scalar_type(), at::kHalf);
  check(encoder, "fp16_", 1.0 / 1024);
}

// The stages load in one dtype and convert with Module::to (models/placement.cpp): converted to
// fp16, `wo` stays fp32 as when built in fp16, and the outputs are those of the fp16 build, bit
// for bit; back to fp32, every weight is fp32 again.
TEST_F(T5EncoderParity, ConvertedToFp16KeepsWoInFp32AsTheFp16Build) {
  T5Encoder built = load(ref_ / "t5" / "model.safetensors", at::kHalf);
  T5Encoder converted = load(ref_ / "t5" / "model.safetensors", at::kFloat);
  converted->to(at::kHalf);
  auto* block = (*converted->blocks)[0]->as<T5BlockImpl>();
  EXPECT_EQ(block->wo->weight.scalar_type(), at::kFloat);
  EXPECT_EQ(block->wi_0->weight.scalar_type(), at::kHalf);
  torch::NoGradGuard no_grad;
  EXPECT_TRUE(torch::equal(converted(io_.at("ids")), built(io_.at("ids"))));
  converted->to(at::kFloat);
  for (const auto& p : converted->parameters()) EXPECT_EQ(p.scalar_type(), at::kFloat);
}

// --fp8_base reaches T5 too: its Linear weights, `wo` included, in float8 (plain or scaled). A
// float8 `wo` computes in fp32 beside fp16 (what transformers keeps it in) and in the blocks'
// dtype beside bf16; before, it cast its input to float8, which no kernel takes. Each encoder
// computes, bit for bit, what the same encoder holding the dequantised weights in the same dtype
// computes (the encoder itself matches transformers above). Against fp32 the tiny random T5 is
// no yardstick: rounding one layer of it to float8 moves transformers' own output by 34%.
TEST_F(T5EncoderParity, Float8WeightsComputeWhatTheDequantisedWeightsCompute) {
  for (const at::ScalarType dtype : {at::kHalf, at::kBFloat16}) {
    for (const bool scaled : {false, true}) {
      T5Encoder encoder = load(ref_ / "t5" / "model.safetensors", at::kFloat);
      encoder->to(dtype);
      const Float8Storage s = store_weights_in_float8(*encoder, scaled);
      auto* block = (*encoder->blocks)[0]->as<T5BlockImpl>();
      ASSERT_TRUE(is_float8(block->wo->weight));
      EXPECT_EQ(block->wo->weight_scale.defined(), scaled);
      EXPECT_EQ(s.tensors, 7 * encoder->config.num_layers);  // q, k, v, o, wi_0, wi_1, wo
      T5Encoder dequantised = load(ref_ / "t5" / "model.safetensors", at::kFloat);
      std::vector<std::shared_ptr<LinearImpl>> from, to;
      for (const auto& m : encoder->modules()) {
        if (auto l = std::dynamic_pointer_cast<LinearImpl>(m)) from.push_back(l);
      }
      for (const auto& m : dequantised->modules()) {
        if (auto l = std::dynamic_pointer_cast<LinearImpl>(m)) to.push_back(l);
      }
      ASSERT_EQ(from.size(), to.size());
      torch::NoGradGuard no_grad;
      for (size_t i = 0; i < from.size(); ++i) {
        to[i]->weight.set_data(
            dequantize_float8(from[i]->weight, from[i]->weight_scale, at::kFloat));
      }
      dequantised->to(dtype);
      const std::string what = std::string(dtype == at::kHalf ? "fp16" : "bf16") +
                               (scaled ? " scaled" : " plain");
      const at::Tensor out = encoder(io_.at("ids"), io_.at("mask"));
      EXPECT_EQ(out.scalar_type(), dtype) << what;
      EXPECT_TRUE(torch::isfinite(out).all().item<bool>()) << what;
      EXPECT_TRUE(torch::equal(out, dequantised(io_.at("ids"), io_.at("mask")))) << what;
    }
  }
}

TEST_F(T5EncoderParity, TiedEmbeddingsLoadUnderEitherName) {
  T5Encoder encoder = load(ref_ / "t5_both.safetensors", at::kFloat);
  check(encoder, "", 1e-4);
}

// A whole T5ForConditionalGeneration file (the decoder and the LM head beside the encoder) loads
// its encoder, as kohya's strict=False load takes it; a weight stored as integers, which a copy
// would convert without a word, is refused by its key.
TEST_F(T5EncoderParity, WholeModelFileLoadsItsEncoderAndIntegerWeightsAreRefused) {
  const auto tensors = testing::read_all(ref_ / "t5" / "model.safetensors");
  const fs::path dir = testing::make_temp_dir("t5-whole");
  auto whole = tensors;
  whole["decoder.block.0.layer.0.SelfAttention.q.weight"] = torch::zeros({32, 32});
  whole["decoder.final_layer_norm.weight"] = torch::ones({32});
  whole["lm_head.weight"] = torch::zeros({64, 32});
  testing::write_all(dir / "whole.safetensors", whole);
  T5Encoder encoder = load(dir / "whole.safetensors", at::kFloat);
  check(encoder, "", 1e-4);

  const std::string key = "encoder.block.0.layer.1.DenseReluDense.wi_0.weight";
  auto ints = tensors;
  ASSERT_TRUE(ints.count(key));
  ints[key] = (ints[key] * 100).to(at::kInt);
  testing::write_all(dir / "ints.safetensors", ints);
  try {
    (void)load(dir / "ints.safetensors", at::kFloat);
    ADD_FAILURE() << "an int32 weight was loaded";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find(key), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("floating-point"), std::string::npos) << e.what();
  }
  fs::remove_all(dir);
}

TEST_F(T5EncoderParity, RelativePositionBucketsAreTransformers) {
  const at::Tensor relative = torch::arange(-300, 301);
  EXPECT_TRUE(t5_relative_position_bucket(relative, 32, 128).equal(io_.at("buckets_32_128")));
  EXPECT_TRUE(t5_relative_position_bucket(relative, 8, 16).equal(io_.at("buckets_8_16")));
}

TEST_F(T5EncoderParity, RefusesAnotherFeedForwardByName) {
  try {
    T5Config::from_json(R"({"feed_forward_proj": "relu"})", "t5/config.json");
    FAIL() << "a ReLU T5 was accepted";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("t5/config.json: feed_forward_proj 'relu'"),
              std::string::npos)
        << e.what();
  }
}

// T5 v1.1 XXL (google/t5-v1_1-xxl, Flux.1's text_encoder_2) built on the meta device in bf16: no
// memory, and every key with the shape transformers' T5EncoderModel gives it.
TEST_F(T5EncoderParity, FullSizeXxlKeysAndShapesMatchTransformers) {
  const nlohmann::json theirs = nlohmann::json::parse(read_text(ref_ / "full_xxl.json"));
  T5Encoder encoder(T5Config::xxl(), at::TensorOptions().dtype(at::kBFloat16).device(at::kMeta));
  int64_t parameters = 0, their_parameters = 0;
  size_t matched = 0;
  for (const auto& item : encoder->named_parameters()) {
    EXPECT_TRUE(item.value().is_meta()) << item.key();
    parameters += item.value().numel();
    ASSERT_TRUE(theirs.contains(item.key())) << item.key();
    EXPECT_EQ(item.value().sizes().vec(), theirs[item.key()].get<std::vector<int64_t>>())
        << item.key();
    ++matched;
  }
  for (const auto& [key, shape] : theirs.items()) {
    int64_t n = 1;
    for (int64_t d : shape.get<std::vector<int64_t>>()) n *= d;
    their_parameters += n;
  }
  std::printf("[t5] XXL: %zu tensors, %lld parameters (transformers: %zu, %lld)\n", matched,
              static_cast<long long>(parameters), theirs.size(),
              static_cast<long long>(their_parameters));
  EXPECT_EQ(matched, theirs.size());
  EXPECT_EQ(parameters, their_parameters);
}

}  // namespace
}  // namespace lorapipe::models
