// The flags of models::ModelParts, shared by every stage that loads a model (cacher, trainer,
// sampler), so each reads them under kohya's names with one meaning.
#include <gflags/gflags.h>

#include "models/model_parts.h"

DEFINE_string(clip_l, "",
              "FLUX.1: CLIP-L's weights (kohya's --clip_l, e.g. clip_l.safetensors), needed with a "
              "single-file transformer; replaces a diffusers folder's text_encoder/");
DEFINE_string(
    t5xxl, "",
    "FLUX.1: T5 XXL's weights (kohya's --t5xxl, e.g. t5xxl_fp16.safetensors), needed with "
    "a single-file transformer; replaces a diffusers folder's text_encoder_2/");
DEFINE_string(ae, "",
              "FLUX.1: the AE's weights (kohya's --ae, ae.safetensors), needed with a single-file "
              "transformer; replaces a diffusers folder's vae/");
DEFINE_string(t5_tokenizer, "",
              "FLUX.1: T5's spiece.model, or a folder holding one (a FLUX.1 diffusers folder's "
              "tokenizer_2/ or google/t5-v1_1-xxl); a diffusers folder's own is the default");
DEFINE_int32(t5xxl_max_token_length, 0,
             "FLUX.1: T5 tokens per caption, padding included (kohya's; 0: 512 for dev, 256 for "
             "schnell)");
DEFINE_bool(apply_t5_attn_mask, false,
            "FLUX.1: T5 and the transformer attend only to the caption's tokens, not the padding "
            "(kohya's); the cache then keeps only those states");

namespace lorapipe::models {

ModelParts model_parts_from_flags() {
  ModelParts p;
  p.clip_l = FLAGS_clip_l;
  p.t5xxl = FLAGS_t5xxl;
  p.ae = FLAGS_ae;
  p.t5_tokenizer = FLAGS_t5_tokenizer;
  p.t5_max_length = FLAGS_t5xxl_max_token_length;
  p.apply_t5_attn_mask = FLAGS_apply_t5_attn_mask;
  return p;
}

}  // namespace lorapipe::models
