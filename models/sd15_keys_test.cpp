// The single-file (ldm) key table against diffusers' own converters: lorapipe writes tiny
// diffusers-layout models as one ldm-layout file through the table, and diffusers'
// convert_ldm_*_checkpoint must turn it back into exactly the original weights. Then the table's
// forward direction must map every ldm key back to the diffusers name it came from.
#include "models/sd15_keys.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <map>
#include <string>

#include "models/safetensors.h"
#include "tests/paths.h"

namespace lorapipe::models {
namespace {
namespace fs = std::filesystem;

int python(const std::string& args) {
  const char* python = std::getenv("LORAPIPE_PYTHON");
  if (python == nullptr) return -1;
  return std::system((std::string(python) + " " + LORAPIPE_SOURCE_DIR +
                      "/models/reference/ldm_keys_reference.py " + args)
                         .c_str());
}

TEST(Sd15KeysParity, TableMatchesDiffusersSingleFileConverters) {
  const fs::path dir = fs::temp_directory_path() / ("lorapipe-ldm-keys-" + std::to_string(getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  ASSERT_EQ(python("make " + dir.string()), 0);

  const UNetLayout unet_layout{{true, true, false}, {false, true, true}, 2};
  const VaeLayout vae_layout{3, 2};
  struct Part {
    fs::path file;
    KeyMap map;
  };
  std::vector<Part> parts;
  parts.push_back({dir / "unet" / "diffusion_pytorch_model.safetensors",
                   sd15_unet_key_map(unet_layout)});
  parts.push_back({dir / "vae" / "diffusion_pytorch_model.safetensors",
                   sd15_vae_key_map(vae_layout)});
  parts.push_back({dir / "text_encoder" / "model.safetensors", sd15_text_key_map()});

  std::vector<SafetensorsFile> files;
  std::vector<TensorToWrite> single;
  std::map<std::string, std::string> expected_back;  // ldm key -> diffusers key
  for (const Part& part : parts) {
    files.push_back(SafetensorsFile::open(part.file));
    for (const TensorInfo& t : files.back().tensors()) {
      const auto ldm = part.map.to_ldm(t.name);
      ASSERT_TRUE(ldm.has_value()) << "no ldm name for " << t.name;
      std::vector<int64_t> shape = t.shape;
      // ldm stores the VAE mid-block attention projections as 1x1 convolutions.
      if (ldm->find(".mid.attn_1.") != std::string::npos && shape.size() == 2) {
        shape.push_back(1);
        shape.push_back(1);
      }
      single.push_back({*ldm, t.dtype, shape, files.back().bytes(t)});
      expected_back[*ldm] = t.name;
    }
  }
  const fs::path single_file = dir / "tiny-sd15-ldm.safetensors";
  write_safetensors(single_file, single);
  EXPECT_EQ(python("check " + dir.string() + " " + single_file.string()), 0)
      << "diffusers' converters do not give back the weights lorapipe wrote";

  // Forward: every ldm key maps back to its diffusers name through the right table.
  for (const auto& [ldm, diffusers] : expected_back) {
    const Part& part = ldm.rfind(kLdmUnetPrefix, 0) == 0  ? parts[0]
                       : ldm.rfind(kLdmVaePrefix, 0) == 0 ? parts[1]
                                                          : parts[2];
    EXPECT_EQ(part.map.to_diffusers(ldm).value_or("<none>"), diffusers) << ldm;
  }
  fs::remove_all(dir);
}

// SDXL single files keep the ldm UNet layout (sgm's): three levels, no attention in the first,
// ten transformer blocks deep where SD1.5 has one (the table maps whole attention modules, so
// depth needs no entries), and label_emb for the added conditions. diffusers'
// convert_ldm_unet_checkpoint must give back exactly the tiny SDXL-shaped UNet lorapipe wrote
// through the table.
TEST(SdxlKeysParity, UNetTableMatchesDiffusersSingleFileConverter) {
  const fs::path dir =
      fs::temp_directory_path() / ("lorapipe-sdxl-keys-" + std::to_string(getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  ASSERT_EQ(python("make " + dir.string()), 0);
  UNetLayout layout{{false, true}, {true, false}, 2};
  layout.text_time = true;
  const KeyMap map = sd15_unet_key_map(layout);
  const SafetensorsFile file =
      SafetensorsFile::open(dir / "unet_sdxl" / "diffusion_pytorch_model.safetensors");
  std::vector<TensorToWrite> single;
  bool label_emb = false;
  for (const TensorInfo& t : file.tensors()) {
    const auto ldm = map.to_ldm(t.name);
    ASSERT_TRUE(ldm.has_value()) << "no ldm name for " << t.name;
    label_emb |= ldm->find("label_emb.0.") != std::string::npos;
    single.push_back({*ldm, t.dtype, t.shape, file.bytes(t)});
    EXPECT_EQ(map.to_diffusers(*ldm).value_or("<none>"), t.name) << *ldm;
  }
  EXPECT_TRUE(label_emb);
  const fs::path single_file = dir / "tiny-sdxl-unet-ldm.safetensors";
  write_safetensors(single_file, single);
  EXPECT_EQ(python("check_unet " + (dir / "unet_sdxl").string() + " " + single_file.string()), 0)
      << "diffusers' converter does not give back the SDXL UNet lorapipe wrote";
  fs::remove_all(dir);
}

TEST(Sd15KeysParity, OlderTextEncoderLayoutAndOptionalKeys) {
  const KeyMap text = sd15_text_key_map();
  EXPECT_EQ(text.to_diffusers("cond_stage_model.transformer.embeddings.token_embedding.weight"),
            "text_model.embeddings.token_embedding.weight");
  EXPECT_EQ(text.to_diffusers(
                "cond_stage_model.transformer.text_model.final_layer_norm.weight"),
            "text_model.final_layer_norm.weight");
  EXPECT_TRUE(is_known_optional_ldm_key("alphas_cumprod"));
  EXPECT_TRUE(is_known_optional_ldm_key("model_ema.decay"));
  EXPECT_TRUE(is_known_optional_ldm_key(
      "cond_stage_model.transformer.text_model.embeddings.position_ids"));
  EXPECT_FALSE(is_known_optional_ldm_key("model.diffusion_model.out.2.weight"));
  // Module boundaries: input_blocks.1 must not capture input_blocks.10.
  const KeyMap unet = sd15_unet_key_map(UNetLayout{});
  EXPECT_EQ(unet.to_diffusers("model.diffusion_model.input_blocks.10.0.in_layers.0.weight"),
            "down_blocks.3.resnets.0.norm1.weight");
  EXPECT_EQ(unet.to_diffusers("model.diffusion_model.output_blocks.2.1.conv.weight"),
            "up_blocks.0.upsamplers.0.conv.weight");
  EXPECT_EQ(unet.to_diffusers("model.diffusion_model.output_blocks.5.2.conv.bias"),
            "up_blocks.1.upsamplers.0.conv.bias");
  EXPECT_FALSE(unet.to_diffusers("model.diffusion_model.nonsense.weight").has_value());
}

}  // namespace
}  // namespace lorapipe::models
