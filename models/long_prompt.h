#pragma once
// kohya's long prompts, on the conditioner's side of the tokenizer: how a caption's ids are laid
// out for the text encoder at kohya's --max_token_length (75, 150 or 225), in chunks the encoder
// takes one at a time (BaseDataset.get_input_ids in kohya's library/train_util.py, the SD1.x
// branch where the padding id is EOS). The tokenizer only turns text into ids; the layout is the
// family's conditioning, so a tokenizer that pads otherwise (SDXL's second) gets its own here.
// No LibTorch.

#include <cstdint>
#include <string_view>
#include <vector>

#include "models/clip_tokenizer.h"

namespace lorapipe::models {

// ids = tokenizer.encode_padded(text, max_token_length + 2), cut into max_token_length / 75 chunks
// of 75 ids, each written as BOS + chunk + EOS; the chunks concatenated (n_chunks * 77 ids). A
// chunk past the end of the prompt is BOS followed by 76 EOS, as in kohya. At 75 this is
// encode_padded(text). Throws InputError for a max_token_length kohya does not offer.
//
// A tokenizer that pads with another id than EOS (SDXL's second, whose pad token "!" is id 0:
// ClipTokenizer::set_pad_token) takes kohya's other branch (pad != eos): each chunk is BOS + 75
// ids + the sequence's last id (padding, or EOS when the caption fills it); a chunk whose 75th
// id is neither EOS nor padding ends in EOS, and one that starts in the padding starts with EOS
// (BOS EOS pad ...).
std::vector<int32_t> kohya_long_prompt_ids(const ClipTokenizer& tokenizer, std::string_view text,
                                           int max_token_length);

// kohya's --weighted_captions tokenization (TokenizeStrategy._get_weighted_input_ids, then the
// chunks above): the caption's A1111 attention syntax read (models/prompt_attention.h), each
// piece encoded on its own, the ids cut at max_token_length; laid out and chunked as
// kohya_long_prompt_ids. `weights` has one entry per id: its piece's weight, 1 for BOS, EOS and
// padding.
struct WeightedIds {
  std::vector<int32_t> ids;
  std::vector<float> weights;
};
WeightedIds kohya_weighted_long_prompt_ids(const ClipTokenizer& tokenizer, std::string_view text,
                                           int max_token_length);

}  // namespace lorapipe::models
