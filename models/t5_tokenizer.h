#pragma once
// T5's tokenizer: a SentencePiece unigram model (spiece.model) read and applied here, giving the
// ids of transformers' slow T5Tokenizer (legacy, T5's own behaviour, SentencePiece's Encode) and
// of T5TokenizerFast as the tokenizer.json files shipped with T5 and with Flux's text_encoder_2
// configure it. No LibTorch, no SentencePiece library.
//
// Why not Debian's libsentencepiece: it carries its own copy of protobuf-lite and exports it, and
// a process that also links libprotobuf (every lorapipe stage, for its messages) dies in
// protobuf's static initialisation (measured: train_parity_test segfaulted before main). What it
// would do for T5 is small and fixed, and is written out here from SentencePiece's own algorithms
// (normalizer.cc, unigram_model.cc), tested id for id against the library (Python sentencepiece
// trains the test's model) and against transformers:
//  - special tokens are matched in the raw text first (</s>, <pad>, <unk>, <extra_id_0> ...
//    <extra_id_99>: a literal "</s>" in a caption is the end-of-text id);
//  - the text between them is normalised as SentencePiece normalises: the model's precompiled
//    character map (a Darts double-array trie of NFKC-like rewrites, longest match first),
//    leading, trailing and repeated whitespace removed, "▁" for every space and before the text;
//  - then segmented by the unigram model's Viterbi path over the pieces' scores, a character no
//    piece covers as <unk> (scored 10 below the lowest piece), runs of <unk> merged into one;
//  - encode_padded appends </s> and pads with <pad> (0), as padding="max_length" does.
//
// Not followed: T5TokenizerFast built by transformers 4.57 from a bare spiece.model (no
// tokenizer.json) converts with prepend_scheme "never", so a caption's first word loses its "▁"
// ("a cat" -> "a", "▁cat" instead of "▁a", "▁cat"), unlike the tokenizer T5 was trained with.

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace lorapipe::models {

class T5Tokenizer {
 public:
  // Throws InputError naming `path` when it is not a SentencePiece unigram model (or one with
  // options T5's does not use: byte fallback, whitespace as suffix).
  static T5Tokenizer from_file(const std::filesystem::path& path);
  // The same from a model's bytes; `source` names it in messages.
  static T5Tokenizer from_serialized(std::string_view bytes, const std::string& source);
  ~T5Tokenizer();
  T5Tokenizer(T5Tokenizer&&) noexcept;
  T5Tokenizer& operator=(T5Tokenizer&&) noexcept;

  // The ids of `text` without </s>.
  std::vector<int64_t> encode(std::string_view text) const;

  // T5TokenizerFast(text, max_length=max_length, padding="max_length", truncation=True): the
  // ids cut to max_length - 1, </s>, then <pad> up to max_length. `length` receives the count of
  // ids before the padding (</s> included): the attention mask's ones.
  std::vector<int64_t> encode_padded(std::string_view text, int max_length,
                                     int* length = nullptr) const;

  int64_t eos_id() const { return eos_id_; }
  int64_t pad_id() const { return pad_id_; }
  int64_t unk_id() const { return unk_id_; }
  // SentencePiece's pieces plus T5's 100 extra ids (<extra_id_99> first), as transformers counts.
  int64_t vocab_size() const { return pieces_ + kExtraIds; }

  static constexpr int kExtraIds = 100;

 private:
  T5Tokenizer();
  // SentencePiece's Normalize and its unigram Encode (see above).
  std::string normalize(std::string_view text) const;
  void segment(const std::string& normalized, std::vector<int64_t>& ids) const;

  struct Model;
  std::unique_ptr<Model> model_;
  int64_t pieces_ = 0, eos_id_ = 1, pad_id_ = 0, unk_id_ = 2;
  // Special tokens and their ids, longest first for matching.
  std::vector<std::pair<std::string, int64_t>> specials_;
  std::string source_;
};

}  // namespace lorapipe::models
