#include "models/long_prompt.h"

#include <algorithm>
#include <string>

#include "common/error.h"
#include "models/prompt_attention.h"

namespace lorapipe::models {
namespace {

void check_max_token_length(int max_token_length) {
  if (max_token_length != 75 && max_token_length != 150 && max_token_length != 225) {
    throw InputError("max_token_length " + std::to_string(max_token_length) +
                     " is not one of kohya's 75, 150, 225");
  }
}

// kohya's chunking of a padded sequence of max_length ids (BOS, ids, EOS, padding) into
// (max_length - 2) / 75 chunks, each its first element + 75 elements + its last element; a
// sequence of one chunk stays as it is.
template <typename T>
std::vector<T> chunked(const std::vector<T>& padded, const T& first, const T& last) {
  constexpr int kModelMaxLength = ClipTokenizer::kModelMaxLength;
  constexpr int kChunk = kModelMaxLength - 2;
  const int max_length = static_cast<int>(padded.size());
  if (max_length <= kModelMaxLength) return padded;
  std::vector<T> out;
  for (int i = 1; i < max_length - kModelMaxLength + 2; i += kChunk) {
    out.push_back(first);
    const int end = std::min(i + kChunk, max_length);
    out.insert(out.end(), padded.begin() + i, padded.begin() + end);
    out.push_back(last);
  }
  return out;
}

// kohya's fixes of the chunks of a sequence padded with another id than EOS (get_input_ids,
// the pad != eos branch).
void fix_chunks(std::vector<int32_t>& chunks, int32_t eos, int32_t pad) {
  constexpr size_t kModelMaxLength = ClipTokenizer::kModelMaxLength;
  if (chunks.size() <= kModelMaxLength) return;
  for (size_t c = 0; c + kModelMaxLength <= chunks.size(); c += kModelMaxLength) {
    int32_t* chunk = chunks.data() + c;
    const int32_t before_last = chunk[kModelMaxLength - 2];
    if (before_last != eos && before_last != pad) chunk[kModelMaxLength - 1] = eos;
    if (chunk[1] == pad) chunk[1] = eos;
  }
}

}  // namespace

std::vector<int32_t> kohya_long_prompt_ids(const ClipTokenizer& tokenizer, std::string_view text,
                                           int max_token_length) {
  check_max_token_length(max_token_length);
  const std::vector<int32_t> ids = tokenizer.encode_padded(text, max_token_length + 2);
  std::vector<int32_t> out = chunked(ids, /*first=*/ids.front(), /*last=*/ids.back());
  if (tokenizer.pad() != tokenizer.eos()) fix_chunks(out, tokenizer.eos(), tokenizer.pad());
  return out;
}

WeightedIds kohya_weighted_long_prompt_ids(const ClipTokenizer& tokenizer, std::string_view text,
                                           int max_token_length) {
  check_max_token_length(max_token_length);
  const size_t limit = static_cast<size_t>(max_token_length);
  std::vector<int32_t> ids{tokenizer.bos()};
  std::vector<float> weights{1.0f};
  for (const WeightedText& piece : parse_prompt_attention(text)) {
    for (int32_t id : tokenizer.encode(piece.text)) {
      ids.push_back(id);
      weights.push_back(static_cast<float>(piece.weight));
    }
    if (ids.size() - 1 > limit) break;
  }
  ids.resize(std::min(ids.size(), limit + 1));
  weights.resize(ids.size());
  ids.push_back(tokenizer.eos());
  ids.resize(limit + 2, tokenizer.pad());
  weights.resize(limit + 2, 1.0f);
  WeightedIds out{chunked(ids, /*first=*/ids.front(), /*last=*/ids.back()),
                  chunked(weights, /*first=*/1.0f, /*last=*/1.0f)};
  if (tokenizer.pad() != tokenizer.eos()) fix_chunks(out.ids, tokenizer.eos(), tokenizer.pad());
  return out;
}

}  // namespace lorapipe::models
