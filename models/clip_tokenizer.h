#pragma once
// The CLIP byte-level BPE tokenizer of Stable Diffusion 1.5's text encoder, matching Hugging Face
// transformers' slow `CLIPTokenizer` (models/clip/tokenization_clip.py, 4.57) with ftfy installed,
// id for id. Plain C++ (ICU for NFC and lower-casing, zlib for the gzip vocabulary): no LibTorch,
// so preprocess-side tools may use it too.
//
// encode() runs, as transformers does:
//  1. the split on the added tokens `<|startoftext|>` and `<|endoftext|>` (exact case), which
//     map to their ids; every piece between them goes through steps 2-5 on its own;
//  2. ftfy.fix_text, in the subset described at fix_text() below;
//  3. whitespace_clean: runs of regex `\s` become one space, then str.strip();
//  4. str.lower() (full Unicode lower-casing with Final_Sigma; ICU's root locale);
//  5. the pre-tokenizer pattern
//       <\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+
//     under IGNORECASE (so `'ſ` matches `'s`), and byte-level BPE of each match with the merge
//     ranks. Code points no alternative matches (regex `\s`, and U+0345 under IGNORECASE) are
//     dropped. Character classes come from clip_tokenizer_tables.inc, generated from the `regex`
//     module and Python that transformers runs on (models/reference/make_clip_tokenizer_tables.py).
//
// Known differences from transformers, none of which real prompts reach:
//  - ftfy's mojibake repair is not implemented (see fix_text()).
//  - NFC and lower-casing use ICU (Unicode 15.0 for ICU 72) where Python 3.11 uses Unicode 14.0:
//    the two agree on every single code point, but a combining mark first assigned in Unicode
//    15.0 is canonically reordered by ICU and left in place by Python, and Final_Sigma may see
//    such a character as cased where Python does not.
//  - A word (a run of letters, or of other symbols) is merged with transformers' algorithm,
//    quadratic in its length; a caption that is one 100k-letter word is slow here as it is there.
//
// Thread-safe: encode* may be called from many threads (the BPE cache takes a lock).

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace lorapipe::models {

class ClipTokenizer {
 public:
  // Stable Diffusion 1.x conditions on 77 positions: <|startoftext|>, 75 tokens, <|endoftext|>.
  static constexpr int kModelMaxLength = 77;

  // Loads the BPE merges and the vocabulary from
  //  - open_clip's `bpe_simple_vocab_16e6.txt.gz` (gzip, detected by its magic bytes) or the same
  //    file uncompressed, or a plain `merges.txt`: merges are lines 1..48894 (line 0 is a version
  //    header) as transformers and open_clip read them, and the vocabulary is built the way
  //    open_clip builds it: the 256 byte symbols, the same with `</w>`, every merge joined, then
  //    `<|startoftext|>` (49406) and `<|endoftext|>` (49407);
  //  - a folder holding `vocab.json` and `merges.txt` (a diffusers `tokenizer/` folder), or a
  //    diffusers model folder with such a `tokenizer/` inside: ids come from `vocab.json`.
  // Tokens that BPE produces but the vocabulary lacks map to `<|endoftext|>` (transformers' unk).
  // Throws lorapipe::InputError naming the file when it is missing, unreadable, not gzip/UTF-8
  // text as expected, has a malformed merge line, or a vocabulary without the two special tokens.
  static ClipTokenizer from_file(const std::filesystem::path& path);

  // CLIP's own vocabulary (open_clip's bpe_simple_vocab_16e6.txt.gz, the one SD1.x was trained
  // with), built into lorapipe at configure time from the open_clip_torch wheel that
  // scripts/deps.sh installs beside torch, so a single-file checkpoint needs no --tokenizer.
  // Empty when this build has none (configured without that wheel).
  static constexpr const char* kBuiltinName = "bpe_simple_vocab_16e6.txt.gz";
  static std::string_view builtin_vocabulary();
  // The tokenizer of builtin_vocabulary(); throws lorapipe::Error when the build has none.
  static ClipTokenizer builtin();

  ClipTokenizer(ClipTokenizer&&) noexcept;
  ClipTokenizer& operator=(ClipTokenizer&&) noexcept;
  ~ClipTokenizer();

  // transformers `tokenizer.encode(text, add_special_tokens=False)`: ids without BOS/EOS, any
  // length. Throws InputError when `text` is not valid UTF-8 (naming the byte offset).
  std::vector<int32_t> encode(std::string_view text) const;

  // transformers `tokenizer(text, padding="max_length", truncation=True, max_length=max_length)`
  // as diffusers' StableDiffusionPipeline and kohya call it: BOS, the first max_length - 2 ids,
  // EOS, then pad() up to exactly max_length ids. Throws InputError when max_length < 2.
  std::vector<int32_t> encode_padded(std::string_view text, int max_length = kModelMaxLength) const;

  int32_t bos() const { return bos_; }  // <|startoftext|>
  int32_t eos() const { return eos_; }  // <|endoftext|>
  // The padding id: <|endoftext|>, as in openai/clip-vit-large-patch14's tokenizer (SD1.x), or
  // the token set_pad_token gave.
  int32_t pad() const { return pad_; }
  // Pads with `token`'s id instead (SDXL's second tokenizer: "!", id 0), as kohya sets it
  // (tokenizer2.pad_token_id = 0) and open_clip pads: the token in a caption is text as any
  // other ("wow!!" is "wow" and the BPE token "!!"), not split out as diffusers'
  // CLIPTokenizer(pad_token="!") splits it. Throws InputError when the vocabulary has no such
  // token.
  void set_pad_token(std::string_view token);
  // Entries in the vocabulary (49408 for CLIP), transformers' `len(tokenizer.encoder)`.
  size_t vocab_size() const { return vocab_size_; }

 private:
  struct Merge {
    int32_t rank;
    int32_t merged;  // symbol id of the two symbols joined
  };
  struct Cache;

  ClipTokenizer();
  // `bytes` holds the merges (gzip or plain); `vocab_path` the vocab.json, when there is one.
  // `source` names what the bytes came from in errors.
  static ClipTokenizer from_merges(std::string bytes, const std::filesystem::path& source,
                                   const std::optional<std::filesystem::path>& vocab_path);
  int32_t symbol_id(const std::string& text);
  void bpe(const std::string& word, std::vector<int32_t>* ids) const;
  std::vector<int32_t> bpe_uncached(const std::string& word) const;

  // Symbols are the strings BPE works on (byte-mapped characters, `</w>` forms, merge results),
  // numbered densely; symbol_vocab_id_ maps each to its vocabulary id (or the unk id).
  std::unordered_map<std::string, int32_t> symbol_ids_;
  std::vector<int32_t> symbol_vocab_id_;
  std::vector<int32_t> byte_symbol_;            // byte -> symbol of its bytes_to_unicode character
  std::vector<int32_t> byte_end_symbol_;        // byte -> the same with `</w>`
  std::unordered_map<uint64_t, Merge> merges_;  // (left symbol << 32 | right symbol) -> merge
  int32_t bos_ = 0;
  int32_t eos_ = 0;
  int32_t pad_ = 0;
  size_t vocab_size_ = 0;
  std::unique_ptr<Cache> cache_;
};

// ftfy.fix_text(text) (ftfy 6.3) without its mojibake repair, on UTF-8 text: what CLIPTokenizer
// applies to each piece of a prompt. Implemented, in ftfy's order and with its fixed-point loop
// per line:
//  - unescape_html: every html5 named entity that ends in ';' (`&eacute;`, `&hellip;`, ...),
//    ftfy's upper-case variants (`&EACUTE;`, `&SZLIG;` -> "SS"), and numeric references
//    (`&#39;`, `&#x1F600;`, with html.unescape's replacements for invalid ones); skipped for a
//    line that contains '<' and every line after it, as ftfy's "auto" mode does;
//  - fix_c1_controls (U+0080..U+009F read as Windows-1252), fix_latin_ligatures (ﬁ -> fi, ...),
//    fix_character_width (fullwidth ASCII and U+3000 to ASCII, halfwidth katakana/hangul to
//    standard width), uncurl_quotes (‘ ’ ‚ ‛ ʼ -> ', “ ” „ ‟ -> "), fix_line_breaks (\r\n, \r,
//    U+2028, U+2029 -> \n; U+0085 is "…" by then), remove_terminal_escapes (ESC [ digits/; letter),
//    remove_control_chars (C0 controls but \t \n \f \r, DEL, U+206A..U+206F, U+FEFF,
//    U+FFF9..U+FFFC), then NFC.
// Not implemented: fix_encoding and the steps that only run inside it (restore_byte_a0,
// replace_lossy_sequences, decode_inconsistent_utf8): ftfy's detection and repair of mojibake,
// e.g. "cafÃ©" -> "café", "â€œ" -> "“". Such text is tokenized as it stands. fix_surrogates
// has nothing to do on valid UTF-8. Throws InputError when `text` is not valid UTF-8.
std::string fix_text(std::string_view text);

// Python's str.lower() on UTF-8 text (step 4 above), for other ports of kohya's Python. Throws
// InputError when `text` is not valid UTF-8.
std::string python_lower(std::string_view text);

}  // namespace lorapipe::models
