// Whole-checkpoint loading: lorapipe's tiny SD1.5 checkpoint, written as a diffusers folder and
// as a single file in the original layout, loads both ways to the same weights; diffusers and
// transformers load the folder as written and give the outputs we compute (1e-4 relative, fp32;
// same operations, other order); fp16/bf16 single files load exactly as their rounding of the
// weights; known extra keys are skipped, unknown ones named.
#include "models/pipeline.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <fstream>
#include <map>

#include "common/error.h"
#include "models/attention.h"
#include "models/parity_util.h"
#include "models/safetensors.h"
#include "models/tiny.h"
#include "models/weights.h"
#include "tests/paths.h"

namespace lorapipe::models {
namespace {
namespace fs = std::filesystem;
using testing::expect_close;

class PipelineParity : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = testing::make_temp_dir("pipeline");
    tiny_ = write_tiny_checkpoint(dir_, /*seed=*/5);
  }
  static void TearDownTestSuite() { fs::remove_all(dir_); }

  static void expect_same_weights(torch::nn::Module& a, torch::nn::Module& b,
                                  std::optional<torch::ScalarType> rounded = std::nullopt) {
    auto pa = a.named_parameters();
    auto pb = b.named_parameters();
    ASSERT_EQ(pa.size(), pb.size());
    for (const auto& item : pa) {
      torch::Tensor want = item.value();
      if (rounded) want = want.to(*rounded).to(torch::kFloat);
      EXPECT_TRUE(torch::equal(want, pb[item.key()])) << item.key();
    }
  }

  static fs::path dir_;
  static TinyCheckpoint tiny_;
};
fs::path PipelineParity::dir_;
TinyCheckpoint PipelineParity::tiny_;

TEST_F(PipelineParity, SingleFileAndDiffusersFolderLoadTheSameWeights) {
  StableDiffusion folder = load_stable_diffusion(tiny_.diffusers);
  LoadOptions options;
  options.tokenizer = tiny_.tokenizer;
  StableDiffusion single = load_stable_diffusion(tiny_.single_file, options);
  expect_same_weights(*folder.unet, *single.unet);
  expect_same_weights(*folder.vae, *single.vae);
  expect_same_weights(*folder.text_encoder, *single.text_encoder);
  ASSERT_TRUE(folder.tokenizer.has_value());
  ASSERT_TRUE(single.tokenizer.has_value());
  EXPECT_EQ(folder.tokenizer->encode_padded("a red circle"),
            single.tokenizer->encode_padded("a red circle"));
  EXPECT_EQ(folder.family.name, "sd15");
}

// A safetensors file of fp32 tensors, as VAE downloads are.
void write_tensors(const fs::path& path, const std::map<std::string, torch::Tensor>& tensors) {
  std::vector<torch::Tensor> keep;
  std::vector<TensorToWrite> out;
  for (const auto& [name, tensor] : tensors) {
    keep.push_back(tensor.to(torch::kFloat).contiguous());
    const torch::Tensor& t = keep.back();
    out.push_back({name, Dtype::kF32, t.sizes().vec(),
                   std::string_view(static_cast<const char*>(t.data_ptr()), t.nbytes())});
  }
  write_safetensors(path, out);
}

// kohya's --vae: another VAE's weights in place of the checkpoint's, from every layout a VAE
// comes in, bit for bit. Keys that are no VAE weight, and pickles, are refused by name.
TEST_F(PipelineParity, VaeOverrideLoadsEveryLayoutBitForBit) {
  const TinyCheckpoint other = write_tiny_checkpoint(dir_ / "other", /*seed=*/9);
  StableDiffusion want = load_stable_diffusion(other.diffusers);
  // The VAE alone in the original layout (as vae-ft-mse-840000 ships), with its training run's
  // discriminator left in, which is skipped.
  std::map<std::string, torch::Tensor> alone =
      read_tensors(SafetensorsFile::open(other.single_file), "first_stage_model.");
  ASSERT_GT(alone.size(), 10u);
  alone["loss.discriminator.main.0.weight"] = torch::ones({2, 2});
  const fs::path ldm = dir_ / "vae-alone.safetensors";
  write_tensors(ldm, alone);
  // A diffusers VAE from before diffusers renamed the attention projections (many hub VAEs).
  std::map<std::string, torch::Tensor> old_names;
  for (const auto& [key, tensor] : read_tensors(SafetensorsFile::open(
           other.diffusers / "vae" / "diffusion_pytorch_model.safetensors"))) {
    std::string name = key;
    for (const auto& [now, before] : std::vector<std::pair<std::string, std::string>>{
             {".to_q.", ".query."}, {".to_k.", ".key."}, {".to_v.", ".value."},
             {".to_out.0.", ".proj_attn."}}) {
      if (const size_t at = name.find(now); at != std::string::npos) name.replace(at, now.size(), before);
    }
    old_names[name] = tensor;
  }
  ASSERT_TRUE(old_names.count("encoder.mid_block.attentions.0.query.weight"));
  const fs::path old_diffusers = dir_ / "vae-old-names.safetensors";
  write_tensors(old_diffusers, old_names);
  for (const fs::path& vae :
       {ldm, other.single_file, other.diffusers / "vae" / "diffusion_pytorch_model.safetensors",
        other.diffusers / "vae", other.diffusers, old_diffusers}) {
    LoadOptions options;
    options.vae = vae;
    StableDiffusion sd = load_stable_diffusion(tiny_.diffusers, options);
    SCOPED_TRACE(vae.string());
    expect_same_weights(*want.vae, *sd.vae);
  }
  StableDiffusion own = load_stable_diffusion(tiny_.diffusers);
  EXPECT_FALSE(torch::equal(own.vae->parameters().front(), want.vae->parameters().front()))
      << "the two checkpoints' VAEs must differ for the comparison above to mean anything";

  auto refusal = [&](const fs::path& vae) {
    LoadOptions options;
    options.vae = vae;
    try {
      load_stable_diffusion(tiny_.diffusers, options);
    } catch (const InputError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  alone["encoder.extra.weight"] = torch::ones({1});
  write_tensors(dir_ / "junk.safetensors", alone);
  const std::string junk = refusal(dir_ / "junk.safetensors");
  EXPECT_NE(junk.find("junk.safetensors (--vae)"), std::string::npos) << junk;
  EXPECT_NE(junk.find("encoder.extra.weight"), std::string::npos) << junk;
  std::ofstream(dir_ / "vae.ckpt") << "not a pickle either";
  EXPECT_NE(refusal(dir_ / "vae.ckpt").find("pickle"), std::string::npos);
  EXPECT_NE(refusal(dir_ / "none.safetensors").find("no such file"), std::string::npos);
}

TEST_F(PipelineParity, DiffusersAndTransformersLoadTheFolderAndAgree) {
  const fs::path io_path = dir_ / "tiny_io.safetensors";
  const char* python = std::getenv("LORAPIPE_PYTHON");
  ASSERT_NE(python, nullptr);
  const std::string command = std::string(python) + " " + LORAPIPE_SOURCE_DIR +
                              "/models/reference/tiny_pipeline_reference.py " +
                              tiny_.diffusers.string() + " " + io_path.string();
  ASSERT_EQ(std::system(command.c_str()), 0) << command;
  const auto io = testing::read_all(io_path);

  set_force_math_attention(true);
  LoadOptions options;
  options.tokenizer = tiny_.tokenizer;
  StableDiffusion sd = load_stable_diffusion(tiny_.single_file, options);
  torch::NoGradGuard no_grad;
  const std::vector<std::string> prompts{"a red circle on a blue background",
                                         "a green square, BREAK (masterpiece:1.2)"};
  std::vector<int64_t> ids;
  for (const auto& p : prompts) {
    for (int32_t id : sd.tokenizer->encode_padded(p)) ids.push_back(id);
  }
  const torch::Tensor input_ids = torch::tensor(ids).view({2, 77});
  EXPECT_TRUE(torch::equal(input_ids, io.at("input_ids"))) << "tokenizer ids differ";
  const torch::Tensor hidden = sd.text_encoder->encode(io.at("input_ids"));
  constexpr double kTolerance = 1e-4;
  expect_close("tiny text encoder", hidden, io.at("hidden"), kTolerance);
  expect_close("tiny unet", sd.unet->forward(io.at("latents"), torch::tensor({10, 700}), io.at("hidden")),
               io.at("noise_pred"), kTolerance);
  const LatentDistribution dist = sd.vae->encode(io.at("image"));
  expect_close("tiny vae mean", dist.mean, io.at("mean"), kTolerance);
  expect_close("tiny vae logvar", dist.logvar, io.at("logvar"), kTolerance);
  expect_close("tiny vae decode", sd.vae->decode(io.at("latents")), io.at("decoded"), kTolerance);
}

TEST_F(PipelineParity, HalfAndBfloat16SingleFilesLoadAsTheirRounding) {
  StableDiffusion reference = load_stable_diffusion(tiny_.diffusers);
  for (const auto dtype : {torch::kHalf, torch::kBFloat16}) {
    const fs::path path = dir_ / ("tiny-" + std::string(c10::toString(dtype)) + ".safetensors");
    save_single_file(reference, path, dtype);
    StableDiffusion loaded = load_stable_diffusion(path);  // computes in fp32 by default
    expect_same_weights(*reference.unet, *loaded.unet, dtype);
    expect_same_weights(*reference.vae, *loaded.vae, dtype);
    expect_same_weights(*reference.text_encoder, *loaded.text_encoder, dtype);
    // And the compute dtype is the caller's: the same file loaded for bf16 compute.
    LoadOptions bf16_options;
    bf16_options.dtype = torch::kBFloat16;
    StableDiffusion bf16 = load_stable_diffusion(path, bf16_options);
    EXPECT_EQ(bf16.unet->conv_in->weight.scalar_type(), torch::kBFloat16);
  }
}

TEST_F(PipelineParity, KnownExtrasAreSkippedAndUnknownKeysNamed) {
  const SafetensorsFile file = SafetensorsFile::open(tiny_.single_file);
  std::vector<TensorToWrite> tensors;
  for (const TensorInfo& t : file.tensors()) tensors.push_back({t.name, t.dtype, t.shape, file.bytes(t)});
  const std::string four(16, '\0');
  auto with = [&](std::vector<TensorToWrite> extra, const std::string& name) {
    std::vector<TensorToWrite> all = tensors;
    all.insert(all.end(), extra.begin(), extra.end());
    const fs::path path = dir_ / name;
    write_safetensors(path, all, file.metadata());
    return path;
  };
  const fs::path extras = with({{"alphas_cumprod", Dtype::kF32, {4}, four},
                                {"model_ema.decay", Dtype::kF32, {}, std::string_view(four).substr(0, 4)}},
                               "extras.safetensors");
  StableDiffusion sd = load_stable_diffusion(extras);
  EXPECT_EQ(sd.skipped_keys, 2);
  const fs::path unknown = with({{"model.diffusion_model.input_blocks.99.0.weight", Dtype::kF32, {4}, four}},
                                "unknown.safetensors");
  try {
    load_stable_diffusion(unknown);
    FAIL() << "an unknown key was accepted";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("model.diffusion_model.input_blocks.99.0.weight"),
              std::string::npos)
        << e.what();
  }
  // A missing weight is named too.
  std::vector<TensorToWrite> missing;
  for (const auto& t : tensors) {
    if (t.name != "first_stage_model.decoder.conv_out.bias") missing.push_back(t);
  }
  write_safetensors(dir_ / "missing.safetensors", missing, file.metadata());
  try {
    load_stable_diffusion(dir_ / "missing.safetensors");
    FAIL() << "a checkpoint with a missing weight loaded";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("decoder.conv_out.bias"), std::string::npos) << e.what();
  }
}

// A config.json that is not JSON, or holds a field of the wrong type, is an InputError naming
// the file (not a JSON exception from deep inside).
TEST_F(PipelineParity, BadConfigsNameTheirFile) {
  const fs::path folder = dir_ / "bad-configs";
  for (const char* part : {"vae", "text_encoder"}) {
    fs::remove_all(folder);
    fs::copy(tiny_.diffusers, folder, fs::copy_options::recursive);
    for (const std::string text : {"{not json", R"({"block_out_channels": "wide", "hidden_size": [1]})"}) {
      std::ofstream(folder / part / "config.json") << text;
      try {
        load_stable_diffusion(folder);
        FAIL() << part << ": a broken config.json loaded";
      } catch (const InputError& e) {
        EXPECT_NE(std::string(e.what()).find((folder / part / "config.json").string()),
                  std::string::npos)
            << e.what();
      }
    }
  }
}

// A single file without --tokenizer takes CLIP's built-in vocabulary when its text encoder has
// CLIP's 49408 ids, and its text keys are those of the vocabulary file given by path; a text
// encoder of another size gets none, and tokenizing asks for --tokenizer.
TEST_F(PipelineParity, SingleFileTakesTheBuiltInClipVocabularyWhenItFits) {
  ASSERT_FALSE(ClipTokenizer::builtin_vocabulary().empty()) << "no built-in CLIP vocabulary";
  StableDiffusion model = load_stable_diffusion(tiny_.diffusers);
  ClipTextConfig clip_size = model.text_encoder->config();
  clip_size.vocab_size = 49408;
  model.text_encoder = ClipTextModel(clip_size);
  const fs::path file = dir_ / "clip-size.safetensors";
  save_single_file(model, file);

  const StableDiffusion builtin = load_stable_diffusion(file);
  ASSERT_TRUE(builtin.has_tokenizer());
  EXPECT_TRUE(builtin.builtin_tokenizer);
  const fs::path vocab = dir_ / ClipTokenizer::kBuiltinName;
  std::ofstream(vocab, std::ios::binary) << ClipTokenizer::builtin_vocabulary();
  LoadOptions given;
  given.tokenizer = vocab;
  const StableDiffusion by_path = load_stable_diffusion(file, given);
  EXPECT_FALSE(by_path.builtin_tokenizer);
  EXPECT_EQ(builtin.text_encoder_settings(1), by_path.text_encoder_settings(1));
  EXPECT_TRUE(torch::equal(builtin.tokenize({"a red circle, 3 blue squares"}).ids.at(0),
                           by_path.tokenize({"a red circle, 3 blue squares"}).ids.at(0)));

  const StableDiffusion tiny_vocab = load_stable_diffusion(tiny_.single_file);
  EXPECT_FALSE(tiny_vocab.has_tokenizer());
  try {
    tiny_vocab.tokenize({"a red circle"});
    FAIL() << "a model without a tokenizer tokenized";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("--tokenizer"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace lorapipe::models
