#pragma once
// The parts of a model that kohya takes by flag where a family's files hold the denoiser alone
// (FLUX.1: --clip_l, --t5xxl, --ae), and the settings of its T5 text encoder. Every stage that
// loads a model takes these flags (model_parts_flags.cpp) and hands them to models::load_model.
// No LibTorch.

#include <filesystem>
#include <string>
#include <vector>

namespace lorapipe::models {

struct ModelParts {
  // kohya's files: CLIP-L (transformers' names), T5 XXL (transformers' names, any storage dtype)
  // and the AE (Black Forest Labs' names). Each also takes the place of a diffusers folder's own.
  std::filesystem::path clip_l, t5xxl, ae;
  // T5's SentencePiece model (spiece.model, or a folder holding one: a FLUX.1 diffusers folder's
  // tokenizer_2/, or google/t5-v1_1-xxl's), which none of kohya's files carries.
  std::filesystem::path t5_tokenizer;
  // kohya's --t5xxl_max_token_length (0: the family's, 512 for dev and 256 for schnell) and
  // --apply_t5_attn_mask.
  int t5_max_length = 0;
  bool apply_t5_attn_mask = false;

  // The flags that are set, by kohya's names ("--clip_l", ...), for a family that takes none.
  std::vector<std::string> given() const {
    std::vector<std::string> out;
    if (!clip_l.empty()) out.push_back("--clip_l");
    if (!t5xxl.empty()) out.push_back("--t5xxl");
    if (!ae.empty()) out.push_back("--ae");
    if (!t5_tokenizer.empty()) out.push_back("--t5_tokenizer");
    if (t5_max_length != 0) out.push_back("--t5xxl_max_token_length");
    if (apply_t5_attn_mask) out.push_back("--apply_t5_attn_mask");
    return out;
  }
};

// The parts as this process's flags give them (defined in model_parts_flags.cpp: link
// lorapipe_model_flags).
ModelParts model_parts_from_flags();

}  // namespace lorapipe::models
