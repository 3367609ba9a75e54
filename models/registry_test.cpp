// The model seam's entry points (models/registry.h, models/family.h, models/placement.h): a
// checkpoint's family told by its keys, its model_index.json or its metadata; a file of no family
// refused with what it holds; loading straight into the storage dtype; one placement call.
#include "models/registry.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "common/error.h"
#include "models/ddpm.h"
#include "models/parity_util.h"
#include "models/placement.h"
#include "models/safetensors.h"
#include "models/tiny.h"

namespace lorapipe::models {
namespace {
namespace fs = std::filesystem;

class ModelRegistry : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new fs::path(testing::make_temp_dir("registry"));
    tiny_ = new TinyCheckpoint(write_tiny_checkpoint(*dir_ / "model"));
  }
  static void TearDownTestSuite() {
    fs::remove_all(*dir_);
    delete tiny_;
    delete dir_;
  }

  // A copy of `from`'s tensors under other names (`rename` maps a name to its new one, or to ""
  // to leave it out), with `metadata`.
  static fs::path rewrite(const fs::path& from, const std::string& name,
                          const std::function<std::string(const std::string&)>& rename,
                          const std::map<std::string, std::string>& metadata = {}) {
    const SafetensorsFile file = SafetensorsFile::open(from);
    std::vector<TensorToWrite> tensors;
    for (const TensorInfo& t : file.tensors()) {
      const std::string to = rename(t.name);
      if (!to.empty()) tensors.push_back({to, t.dtype, t.shape, file.bytes(t)});
    }
    const fs::path path = *dir_ / name;
    write_safetensors(path, tensors, metadata);
    return path;
  }

  static std::string refusal(const fs::path& path, std::string_view override = {}) {
    try {
      const FamilyDetection d = detect_family(path, override);
      ADD_FAILURE() << path << " detected as " << d.family << " (" << d.reason << ")";
    } catch (const InputError& e) {
      return e.what();
    }
    return "";
  }

  static fs::path* dir_;
  static TinyCheckpoint* tiny_;
};
fs::path* ModelRegistry::dir_ = nullptr;
TinyCheckpoint* ModelRegistry::tiny_ = nullptr;

// lorapipe's own single file says its family in its metadata; a single file as users have it
// (no lorapipe metadata) is told by its keys.
TEST_F(ModelRegistry, DetectsTheTinySd15SingleFileByItsMetadataOrItsKeys) {
  const FamilyDetection own = detect_family(tiny_->single_file);
  EXPECT_EQ(own.family, "sd15");
  EXPECT_NE(own.reason.find("lorapipe.family"), std::string::npos) << own.reason;

  const fs::path plain =
      rewrite(tiny_->single_file, "plain.safetensors", [](const std::string& n) { return n; });
  ASSERT_TRUE(SafetensorsFile::open(plain).metadata().empty());
  const FamilyDetection by_keys = detect_family(plain);
  EXPECT_EQ(by_keys.family, "sd15");
  EXPECT_NE(by_keys.reason.find("keys"), std::string::npos) << by_keys.reason;

  const std::unique_ptr<DiffusionModel> model = load_model(tiny_->single_file);
  EXPECT_EQ(model->model_family().name, "sd15");
  EXPECT_EQ(model->source(), tiny_->single_file.string());
}

// A diffusers folder by its model_index.json, and without one by its unet/config.json beside one
// text encoder.
TEST_F(ModelRegistry, DetectsTheTinySd15DiffusersFolder) {
  const FamilyDetection folder = detect_family(tiny_->diffusers);
  EXPECT_EQ(folder.family, "sd15");
  EXPECT_NE(folder.reason.find("StableDiffusionPipeline"), std::string::npos) << folder.reason;

  const fs::path bare = *dir_ / "bare";
  fs::copy(tiny_->diffusers, bare, fs::copy_options::recursive);
  fs::remove(bare / "model_index.json");
  const FamilyDetection by_config = detect_family(bare);
  EXPECT_EQ(by_config.family, "sd15");
  EXPECT_NE(by_config.reason.find("unet/config.json"), std::string::npos) << by_config.reason;

  const std::unique_ptr<DiffusionModel> model = load_model(tiny_->diffusers);
  EXPECT_EQ(model->model_family().name, "sd15");
  EXPECT_TRUE(model->has_tokenizer());
}

// A file of no family is refused naming the file, what it holds and the families known; one of
// a family lorapipe does not train yet says which. --model_family takes any file as the family
// it names, and an unknown name is refused with the known ones.
TEST_F(ModelRegistry, RefusesAFileOfNoFamilyWithWhatItFoundAndTheFamiliesKnown) {
  const fs::path other = rewrite(tiny_->single_file, "other.safetensors", [](const std::string& n) {
    return n.rfind("model.diffusion_model.", 0) == 0 ? "net." + n.substr(22) : std::string();
  });
  const std::string why = refusal(other);
  for (const std::string& part : {other.string(), std::string("no known model family"),
                                  std::string("net.*"), std::string("known families: sd15, sdxl, flux-dev, flux-schnell"),
                                  std::string("--model_family")}) {
    EXPECT_NE(why.find(part), std::string::npos) << "'" << part << "' not in: " << why;
  }

  // The SDXL refiner's layout: OpenCLIP alone under conditioner.embedders.0.model.
  const fs::path refiner = rewrite(tiny_->single_file, "refiner.safetensors", [](const std::string& n) {
    if (n.rfind("cond_stage_model.transformer.", 0) == 0) {
      return "conditioner.embedders.0.model." + n.substr(29);
    }
    return n;
  });
  const std::string refiner_why = refusal(refiner);
  EXPECT_NE(refiner_why.find("SDXL refiner"), std::string::npos) << refiner_why;
  EXPECT_NE(refiner_why.find("does not train yet"), std::string::npos) << refiner_why;

  const FamilyDetection forced = detect_family(other, "sd15");
  EXPECT_EQ(forced.family, "sd15");
  EXPECT_EQ(forced.reason, "--model_family");
  const std::string unknown = refusal(other, "flux1");
  EXPECT_NE(unknown.find("unknown model family 'flux1' (known: sd15, sdxl, flux-dev, flux-schnell)"), std::string::npos)
      << unknown;

  EXPECT_THROW(load_model(other), InputError);
  const std::string missing = refusal(*dir_ / "nothing-here.safetensors");
  EXPECT_NE(missing.find("no such file or folder"), std::string::npos) << missing;
}

TEST_F(ModelRegistry, RefusesAFolderOfAnotherPipelineNamingIt) {
  const fs::path folder = *dir_ / "xl";
  fs::create_directories(folder);
  std::ofstream(folder / "model_index.json")
      << nlohmann::json{{"_class_name", "StableDiffusionXLPipeline"}}.dump();
  const std::string why = refusal(folder);
  EXPECT_NE(why.find("StableDiffusionXLPipeline"), std::string::npos) << why;
  EXPECT_NE(why.find("does not train yet"), std::string::npos) << why;
  EXPECT_NE(why.find("known families: sd15"), std::string::npos) << why;
  // A hand-made model_index.json that is no object, or whose pipeline name is no text: an
  // InputError naming the file or folder, not a bare JSON type error.
  std::ofstream(folder / "model_index.json") << "[\"StableDiffusionXLPipeline\"]";
  const std::string array = refusal(folder);
  EXPECT_NE(array.find((folder / "model_index.json").string() + ": not a JSON object"),
            std::string::npos)
      << array;
  std::ofstream(folder / "model_index.json") << nlohmann::json{{"_class_name", 7}}.dump();
  const std::string number = refusal(folder);
  EXPECT_NE(number.find(folder.string() + ": a config of this folder is not as diffusers writes"),
            std::string::npos)
      << number;
}

// FLUX.1 is told dev from schnell: a FluxPipeline folder by its transformer's guidance_embeds, a
// single-file transformer by guidance_in (with or without model.diffusion_model.). A transformer
// of any other key layout is no FLUX.1.
TEST_F(ModelRegistry, TellsFluxDevFromSchnellInFoldersAndSingleFiles) {
  for (const bool dev : {true, false}) {
    const fs::path folder = *dir_ / (dev ? "flux-dev" : "flux-schnell");
    fs::create_directories(folder / "transformer");
    std::ofstream(folder / "model_index.json")
        << nlohmann::json{{"_class_name", "FluxPipeline"}}.dump();
    std::ofstream(folder / "transformer" / "config.json")
        << nlohmann::json{{"_class_name", "FluxTransformer2DModel"}, {"guidance_embeds", dev}}.dump();
    EXPECT_EQ(detect_family(folder).family, dev ? "flux-dev" : "flux-schnell");
    for (const std::string prefix : {"", "model.diffusion_model."}) {
      std::vector<std::string> names = {"img_in.weight", "double_blocks.0.img_attn.qkv.weight",
                                        "single_blocks.0.linear1.weight"};
      if (dev) names.push_back("guidance_in.in_layer.weight");
      std::vector<TensorToWrite> tensors;
      static const float zero = 0;
      for (const std::string& n : names) {
        TensorToWrite t;
        t.name = prefix + n;
        t.shape = {1};
        t.bytes = std::string_view(reinterpret_cast<const char*>(&zero), sizeof(zero));
        tensors.push_back(t);
      }
      const fs::path file = *dir_ / ((dev ? "dev" : "schnell") + std::to_string(prefix.size()) +
                                     ".safetensors");
      write_safetensors(file, tensors);
      const FamilyDetection detected = detect_family(file);
      EXPECT_EQ(detected.family, dev ? "flux-dev" : "flux-schnell") << prefix;
      EXPECT_NE(detected.reason.find("FLUX.1 transformer"), std::string::npos) << detected.reason;
    }
  }
}

// Loading into bf16 builds every component in bf16 from the start: no parameter is fp32, and the
// weights equal the fp32 load's rounded to bf16 (one rounding, from the file's values).
TEST_F(ModelRegistry, LoadsStraightIntoTheStorageDtype) {
  LoadOptions bf16;
  bf16.dtype = torch::kBFloat16;
  const std::unique_ptr<DiffusionModel> narrow = load_model(tiny_->diffusers, bf16);
  const std::unique_ptr<DiffusionModel> wide = load_model(tiny_->diffusers);
  const auto wide_parts = wide->components();
  const auto narrow_parts = narrow->components();
  ASSERT_EQ(wide_parts.size(), 3u);
  ASSERT_EQ(narrow_parts.size(), 3u);
  for (size_t c = 0; c < wide_parts.size(); ++c) {
    const auto w = wide_parts[c].module->named_parameters();
    const auto n = narrow_parts[c].module->named_parameters();
    ASSERT_EQ(w.size(), n.size());
    for (const auto& item : w) {
      const at::Tensor& got = n[item.key()];
      EXPECT_EQ(got.scalar_type(), torch::kBFloat16) << item.key();
      EXPECT_TRUE(torch::equal(got, item.value().to(torch::kBFloat16))) << item.key();
    }
  }
  // The denoiser left out: none of its weights are read.
  LoadOptions no_denoiser;
  no_denoiser.load_denoiser = false;
  const std::unique_ptr<DiffusionModel> encoders = load_model(tiny_->diffusers, no_denoiser);
  for (const auto& c : encoders->components()) EXPECT_NE(c.role, DiffusionModel::Role::kDenoiser);
}

// One placement: dtype, float8 storage of the denoiser alone (--fp8_base_unet), the text encoder
// kept on the CPU, every base weight frozen; fp16 keeps the VAE as loaded (SD's VAE overflows in
// fp16). Block swap: the transformer blocks of the last N kohya blocks that have any (the tiny
// U-Net has 6), more refused by name.
TEST_F(ModelRegistry, PlacesComponentsAsAsked) {
  const std::unique_ptr<DiffusionModel> model = load_model(tiny_->diffusers);
  Placement p;
  p.dtype = torch::kHalf;
  p.fp8_denoiser = true;
  p.text_encoders_on_device = false;
  const PlacementReport report = place(*model, p);
  EXPECT_GT(report.float8_tensors, 0);
  EXPECT_LT(report.float8_bytes_after, report.float8_bytes_before);
  for (const auto& c : model->components()) {
    for (const auto& item : c.module->named_parameters()) {
      EXPECT_FALSE(item.value().requires_grad()) << c.name << "." << item.key();
      const c10::ScalarType t = item.value().scalar_type();
      if (c.role == DiffusionModel::Role::kVae) {
        EXPECT_EQ(t, torch::kFloat) << c.name << "." << item.key();
      } else if (c.role == DiffusionModel::Role::kTextEncoder) {
        EXPECT_EQ(t, torch::kHalf) << c.name << "." << item.key();
      } else {
        EXPECT_TRUE(t == torch::kHalf || t == at::kFloat8_e4m3fn) << c.name << "." << item.key();
      }
    }
  }
  Placement swap;
  swap.blocks_to_swap = 7;
  try {
    place(*load_model(tiny_->diffusers), swap);
    ADD_FAILURE() << "7 of 6 blocks were swapped";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("at most 6"), std::string::npos) << e.what();
  }
  swap.blocks_to_swap = 4;
  const PlacementReport swapped = place(*load_model(tiny_->diffusers), swap);
  EXPECT_GT(swapped.swap_host_bytes, 0);
}

// The trainer's noising and the sampler's schedulers share the family's one DDPM table:
// diffusers' scaled_linear betas, as DDPMScheduler computes them in fp32.
TEST_F(ModelRegistry, TheFamilysDdpmTableIsDiffusers) {
  const DdpmSchedule& s = model_family("sd15").schedule;
  EXPECT_EQ(s.steps, 1000);
  const at::Tensor betas = ddpm_betas(s);
  const at::Tensor expected =
      torch::linspace(std::sqrt(0.00085), std::sqrt(0.012), 1000, torch::kFloat32).pow(2);
  EXPECT_TRUE(torch::equal(betas, expected));
  EXPECT_TRUE(torch::equal(ddpm_alphas_cumprod(s), torch::cumprod(1.0 - expected, 0)));
}

}  // namespace
}  // namespace lorapipe::models
