#pragma once
// The one entry point that turns a checkpoint into a model: detects its family
// (models/family.h, detect_family) and loads it through that family's loader, straight into the
// storage dtype asked for, tensor by tensor from the mapped file. The stages call this and hold
// the DiffusionModel it returns; they never name a family.

#include <c10/core/ScalarType.h>

#include <filesystem>
#include <memory>
#include <optional>
#include <string>

#include "models/diffusion_model.h"
#include "models/model_parts.h"

namespace lorapipe::models {

struct LoadOptions {
  // --model_family: the family to load as, whatever detection would say. Empty: detect it.
  std::string family;
  // The dtype each component's weights are stored in as they load: fp32, fp16 or bf16 (float8
  // storage, --fp8_base, is the placement's: models/placement.h). A component is built in this
  // dtype from the start and each tensor converted on its way out of the file, so no fp32 copy
  // of the model ever exists when a narrower dtype is asked. Unset components take `dtype`.
  c10::ScalarType dtype = c10::kFloat;
  std::optional<c10::ScalarType> text_encoder_dtype;
  std::optional<c10::ScalarType> vae_dtype;
  // The CLIP vocabulary for a checkpoint that carries none (single files never do): open_clip's
  // bpe_simple_vocab_16e6.txt.gz, a merges.txt, or a diffusers tokenizer/ folder. Empty takes
  // the checkpoint's own, else CLIP's built-in one (ClipTokenizer::builtin) when it fits.
  std::filesystem::path tokenizer;
  // The cacher needs only the VAE and the text encoders: false leaves the denoiser out and reads
  // none of its weights.
  bool load_denoiser = true;
  // kohya's --vae: another VAE in place of the checkpoint's own.
  std::filesystem::path vae;

  // FLUX.1's separate parts and T5 settings (kohya's --clip_l, --t5xxl, --ae, ...).
  ModelParts parts;
};

// Detects the family of `path` (or takes options.family) and loads the model. Throws
// lorapipe::InputError naming the file for a checkpoint of no known family (what was found, and
// the families known), and for missing, unexpected or mis-shaped keys.
std::unique_ptr<DiffusionModel> load_model(const std::filesystem::path& path,
                                           const LoadOptions& options = {});

}  // namespace lorapipe::models
