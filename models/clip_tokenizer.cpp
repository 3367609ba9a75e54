#include "models/clip_tokenizer.h"

#include <unicode/locid.h>
#include <unicode/normalizer2.h>
#include <unicode/unistr.h>
#include <zlib.h>

#include <algorithm>
#include <array>
#include <climits>
#include <cstring>
#include <fstream>
#include <iterator>
#include <limits>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>

#include "common/error.h"

namespace lorapipe::models {
namespace fs = std::filesystem;

namespace {

struct CodePointRange {
  char32_t first;
  char32_t last;
};
struct HtmlEntity {
  const char* name;
  const char* utf8;
};
struct InvalidCharref {
  char32_t code;
  const char* utf8;
};

#include "models/clip_tokenizer_tables.inc"

constexpr std::string_view kStartOfText = "<|startoftext|>";
constexpr std::string_view kEndOfText = "<|endoftext|>";
constexpr std::string_view kEndOfWord = "</w>";
// open_clip and transformers read merges [1, 49152 - 256 - 2 + 1) of the file's lines.
constexpr size_t kNumMerges = 49152 - 256 - 2;
// ftfy.TextFixerConfig.max_decode_length: a longer line is fixed in pieces of this many.
constexpr size_t kMaxDecodeLength = 1000000;
// Distinct words the BPE cache keeps before it starts over (bounds memory, not results).
constexpr size_t kMaxCacheEntries = 1 << 16;

template <size_t N>
bool in_ranges(const CodePointRange (&table)[N], char32_t c) {
  const CodePointRange* end = table + N;
  const CodePointRange* it = std::upper_bound(
      table, end, c, [](char32_t value, const CodePointRange& r) { return value < r.first; });
  return it != table && c <= (it - 1)->last;
}

// ---- UTF-8 ---------------------------------------------------------------------------------

// Strict UTF-8 (as Python's codec: no overlongs, surrogates or code points past U+10FFFF).
// Returns the offset of the first invalid byte, or npos.
size_t decode_utf8(std::string_view s, std::u32string* out) {
  size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c < 0x80) {
      if (out) out->push_back(c);
      ++i;
      continue;
    }
    size_t n = 0;
    char32_t cp = 0;
    char32_t min = 0;
    if ((c & 0xE0) == 0xC0) {
      n = 1, cp = c & 0x1F, min = 0x80;
    } else if ((c & 0xF0) == 0xE0) {
      n = 2, cp = c & 0x0F, min = 0x800;
    } else if ((c & 0xF8) == 0xF0) {
      n = 3, cp = c & 0x07, min = 0x10000;
    } else {
      return i;
    }
    if (i + n >= s.size()) return i;
    for (size_t k = 1; k <= n; ++k) {
      const auto cc = static_cast<unsigned char>(s[i + k]);
      if ((cc & 0xC0) != 0x80) return i;
      cp = (cp << 6) | (cc & 0x3F);
    }
    if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return i;
    if (out) out->push_back(cp);
    i += n + 1;
  }
  return std::string_view::npos;
}

void append_utf8(char32_t c, std::string* out) {
  if (c < 0x80) {
    out->push_back(static_cast<char>(c));
  } else if (c < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (c >> 6)));
    out->push_back(static_cast<char>(0x80 | (c & 0x3F)));
  } else if (c < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (c >> 12)));
    out->push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (c & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (c >> 18)));
    out->push_back(static_cast<char>(0x80 | ((c >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (c & 0x3F)));
  }
}

std::string to_utf8(std::u32string_view s) {
  std::string out;
  out.reserve(s.size());
  for (char32_t c : s) append_utf8(c, &out);
  return out;
}

// Decodes text handed in by a caller; `what` names it in the error.
std::u32string decode_or_throw(std::string_view s, std::string_view what) {
  std::u32string out;
  const size_t bad = decode_utf8(s, &out);
  if (bad != std::string_view::npos) {
    std::ostringstream msg;
    msg << what << " is not valid UTF-8 at byte " << bad << " (0x" << std::hex
        << static_cast<int>(static_cast<unsigned char>(s[bad])) << ")";
    throw InputError(msg.str());
  }
  return out;
}

// A table string (UTF-8 known good) as code points.
std::u32string from_table(const char* utf8) {
  std::u32string out;
  decode_utf8(utf8, &out);
  return out;
}

// ---- ICU -----------------------------------------------------------------------------------

icu::UnicodeString to_icu(const std::u32string& s) {
  return icu::UnicodeString::fromUTF32(reinterpret_cast<const UChar32*>(s.data()),
                                       static_cast<int32_t>(s.size()));
}

std::u32string from_icu(const icu::UnicodeString& u) {
  std::u32string out;
  out.reserve(u.length());
  for (int32_t i = 0; i < u.length(); i = u.moveIndex32(i, 1)) {
    out.push_back(static_cast<char32_t>(u.char32At(i)));
  }
  return out;
}

const icu::Normalizer2& normalizer(bool compatibility) {
  UErrorCode status = U_ZERO_ERROR;
  const icu::Normalizer2* n = compatibility ? icu::Normalizer2::getNFKCInstance(status)
                                            : icu::Normalizer2::getNFCInstance(status);
  if (U_FAILURE(status) || n == nullptr) {
    throw Error(std::string("ICU normalizer unavailable: ") + u_errorName(status));
  }
  return *n;
}

// unicodedata.normalize("NFC", s).
std::u32string nfc(const std::u32string& s) {
  const icu::Normalizer2& n = normalizer(/*compatibility=*/false);
  UErrorCode status = U_ZERO_ERROR;
  const icu::UnicodeString u = to_icu(s);
  if (n.isNormalized(u, status) && U_SUCCESS(status)) return s;
  status = U_ZERO_ERROR;
  const icu::UnicodeString normalized = n.normalize(u, status);
  if (U_FAILURE(status)) throw Error(std::string("ICU NFC failed: ") + u_errorName(status));
  return from_icu(normalized);
}

// str.lower(): full case mappings with Final_Sigma, no locale tailoring.
std::u32string lower(const std::u32string& s) {
  icu::UnicodeString u = to_icu(s);
  u.toLower(icu::Locale::getRoot());
  return from_icu(u);
}

// ---- ftfy (6.3) without fix_encoding ---------------------------------------------------------

bool is_ascii_alnum(char32_t c) {
  return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z');
}

bool is_ascii_letter(char32_t c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); }

// html.unescape's _replace_charref for a numeric reference to `num` (already capped).
std::u32string charref(uint32_t num) {
  for (const InvalidCharref& r : kInvalidCharrefs) {
    if (r.code == num) return from_table(r.utf8);
  }
  if ((num >= 0xD800 && num <= 0xDFFF) || num > 0x10FFFF) return U"\uFFFD";
  if (in_ranges(kInvalidCodepoints, num)) return U"";
  return std::u32string(1, static_cast<char32_t>(num));
}

// ftfy's _unescape_fixup for "&#<body>;": html.unescape decodes the whole reference only when
// the body is all decimal digits, or x/X followed by hex digits; anything else leaves a ';' in
// its output, and so does a reference to ';' itself, and ftfy then keeps the original text.
std::optional<std::u32string> numeric_reference(std::u32string_view body) {
  int base = 10;
  if (body[0] == 'x' || body[0] == 'X') {
    base = 16;
    body.remove_prefix(1);
    if (body.empty()) return std::nullopt;
  }
  uint32_t num = 0;
  for (char32_t c : body) {
    int digit = -1;
    if (c >= '0' && c <= '9') digit = static_cast<int>(c - '0');
    if (base == 16 && c >= 'a' && c <= 'f') digit = static_cast<int>(c - 'a' + 10);
    if (base == 16 && c >= 'A' && c <= 'F') digit = static_cast<int>(c - 'A' + 10);
    if (digit < 0) return std::nullopt;
    num = std::min<uint32_t>(num * base + digit, 0x110000);  // past U+10FFFF all read the same
  }
  std::u32string out = charref(num);
  if (out.find(U';') != std::u32string::npos) return std::nullopt;
  return out;
}

std::optional<std::u32string> named_reference(std::u32string_view name) {
  std::string key;
  for (char32_t c : name) key.push_back(static_cast<char>(c));  // ASCII alphanumerics
  const HtmlEntity* end = kHtmlEntities + std::size(kHtmlEntities);
  const HtmlEntity* it = std::lower_bound(
      kHtmlEntities, end, key,
      [](const HtmlEntity& e, const std::string& k) { return std::strcmp(e.name, k.c_str()) < 0; });
  if (it == end || key != it->name) return std::nullopt;
  return from_table(it->utf8);
}

// ftfy.fixes.unescape_html: re.sub(r"&#?[0-9A-Za-z]{1,24};", _unescape_fixup, text).
std::u32string unescape_html(const std::u32string& s) {
  std::u32string out;
  out.reserve(s.size());
  size_t i = 0;
  while (i < s.size()) {
    if (s[i] != '&') {
      out.push_back(s[i++]);
      continue;
    }
    const bool hash = i + 1 < s.size() && s[i + 1] == '#';
    const size_t body = i + 1 + (hash ? 1 : 0);
    size_t end = body;
    while (end < s.size() && end - body <= 24 && is_ascii_alnum(s[end])) ++end;
    const size_t length = end - body;
    if (length < 1 || length > 24 || end >= s.size() || s[end] != ';') {
      out.push_back(s[i++]);
      continue;
    }
    const std::u32string_view name(s.data() + body, length);
    const std::optional<std::u32string> replacement =
        hash ? numeric_reference(name) : named_reference(name);
    if (replacement) {
      out += *replacement;
    } else {
      out.append(s, i, end + 1 - i);
    }
    i = end + 1;
  }
  return out;
}

// ftfy.fixes.fix_c1_controls: U+0080..U+009F decoded as (sloppy) Windows-1252.
constexpr std::array<char32_t, 32> kWindows1252C1 = {
    0x20AC, 0x0081, 0x201A, 0x0192, 0x201E, 0x2026, 0x2020, 0x2021, 0x02C6, 0x2030, 0x0160,
    0x2039, 0x0152, 0x008D, 0x017D, 0x008F, 0x0090, 0x2018, 0x2019, 0x201C, 0x201D, 0x2022,
    0x2013, 0x2014, 0x02DC, 0x2122, 0x0161, 0x203A, 0x0153, 0x009D, 0x017E, 0x0178};

// ftfy.chardata.LIGATURES.
struct Ligature {
  char32_t from;
  const char32_t* to;
};
constexpr Ligature kLigatures[] = {
    {0x0132, U"IJ"},      {0x0133, U"ij"},      {0x0149, U"\u02BCn"}, {0x01C4, U"D\u017D"},
    {0x01C5, U"D\u017E"}, {0x01C6, U"d\u017E"}, {0x01C7, U"LJ"},      {0x01C8, U"Lj"},
    {0x01C9, U"lj"},      {0x01CA, U"NJ"},      {0x01CB, U"Nj"},      {0x01CC, U"nj"},
    {0x01F1, U"DZ"},      {0x01F2, U"Dz"},      {0x01F3, U"dz"},      {0xFB00, U"ff"},
    {0xFB01, U"fi"},      {0xFB02, U"fl"},      {0xFB03, U"ffi"},     {0xFB04, U"ffl"},
    {0xFB05, U"\u017Ft"}, {0xFB06, U"st"},
};

// ftfy.chardata.WIDTH_MAP: U+3000 -> ' ', and NFKC of each of U+FF01..U+FFEF that NFKC changes.
constexpr char32_t kWidthFirst = 0xFF01;
constexpr char32_t kWidthLast = 0xFFEF;
const std::array<std::u32string, kWidthLast - kWidthFirst + 1>& width_map() {
  static const auto* table = [] {
    auto* t = new std::array<std::u32string, kWidthLast - kWidthFirst + 1>();
    const icu::Normalizer2& nfkc = normalizer(/*compatibility=*/true);
    for (char32_t c = kWidthFirst; c <= kWidthLast; ++c) {
      UErrorCode status = U_ZERO_ERROR;
      const std::u32string one(1, c);
      const std::u32string mapped = from_icu(nfkc.normalize(to_icu(one), status));
      if (U_SUCCESS(status) && mapped != one) (*t)[c - kWidthFirst] = mapped;
    }
    return t;
  }();
  return *table;
}

// One pass of each of ftfy's character fixers, in fix_and_explain's order.
std::u32string fix_characters(const std::u32string& s) {
  std::u32string a;  // fix_c1_controls, fix_latin_ligatures, fix_character_width, uncurl_quotes
  a.reserve(s.size());
  const auto& width = width_map();
  for (char32_t c : s) {
    if (c >= 0x80 && c <= 0x9F) c = kWindows1252C1[c - 0x80];
    const Ligature* lig = std::find_if(std::begin(kLigatures), std::end(kLigatures),
                                       [c](const Ligature& l) { return l.from == c; });
    std::u32string piece =
        lig != std::end(kLigatures) ? std::u32string(lig->to) : std::u32string(1, c);
    std::u32string widened;
    for (char32_t p : piece) {
      if (p == 0x3000) {
        widened.push_back(' ');
      } else if (p >= kWidthFirst && p <= kWidthLast && !width[p - kWidthFirst].empty()) {
        widened += width[p - kWidthFirst];
      } else {
        widened.push_back(p);
      }
    }
    for (char32_t p : widened) {
      if (p == 0x02BC || (p >= 0x2018 && p <= 0x201B)) {
        p = '\'';
      } else if (p >= 0x201C && p <= 0x201F) {
        p = '"';
      }
      a.push_back(p);
    }
  }

  std::u32string b;  // fix_line_breaks
  b.reserve(a.size());
  for (size_t i = 0; i < a.size(); ++i) {
    const char32_t c = a[i];
    if (c == '\r') {
      if (i + 1 < a.size() && a[i + 1] == '\n') ++i;
      b.push_back('\n');
    } else if (c == 0x2028 || c == 0x2029 || c == 0x85) {
      b.push_back('\n');
    } else {
      b.push_back(c);
    }
  }

  std::u32string d;  // remove_terminal_escapes: \033\[((?:\d|;)*)([a-zA-Z])
  d.reserve(b.size());
  for (size_t i = 0; i < b.size(); ++i) {
    if (b[i] == 0x1B && i + 1 < b.size() && b[i + 1] == '[') {
      size_t k = i + 2;
      while (k < b.size() && (b[k] == ';' || in_ranges(kDecimalDigit, b[k]))) ++k;
      if (k < b.size() && is_ascii_letter(b[k])) {
        i = k;
        continue;
      }
    }
    d.push_back(b[i]);
  }

  std::u32string e;  // remove_control_chars
  e.reserve(d.size());
  for (char32_t c : d) {
    const bool control = c <= 0x08 || c == 0x0B || (c >= 0x0E && c <= 0x1F) || c == 0x7F ||
                         (c >= 0x206A && c <= 0x206F) || c == 0xFEFF ||
                         (c >= 0xFFF9 && c <= 0xFFFC);
    if (!control) e.push_back(c);
  }
  return e;
}

// ftfy.fix_and_explain with fix_encoding=False: all fixers then NFC, until nothing changes.
std::u32string fix_segment(std::u32string text, bool unescape) {
  while (true) {
    const std::u32string original = text;
    if (unescape) text = unescape_html(text);
    text = nfc(fix_characters(text));
    if (text == original) return text;
  }
}

// ftfy.fix_text: line by line; HTML unescaping ("auto") stops for good at the first line with '<'.
std::u32string ftfy_fix_text(const std::u32string& text) {
  std::u32string out;
  bool unescape = true;
  size_t pos = 0;
  while (pos < text.size()) {
    const size_t newline = text.find(U'\n', pos);
    size_t end = newline == std::u32string::npos ? text.size() : newline + 1;
    end = std::min(end, pos + kMaxDecodeLength);
    const std::u32string segment = text.substr(pos, end - pos);
    if (unescape && segment.find(U'<') != std::u32string::npos) unescape = false;
    out += fix_segment(segment, unescape);
    pos = end;
  }
  return out;
}

// ---- CLIPTokenizer._tokenize ----------------------------------------------------------------

// whitespace_clean: re.sub(r"\s+", " ", text).strip().
std::u32string whitespace_clean(const std::u32string& s) {
  std::u32string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    if (in_ranges(kSpace, s[i])) {
      while (i < s.size() && in_ranges(kSpace, s[i])) ++i;
      out.push_back(' ');
    } else {
      out.push_back(s[i++]);
    }
  }
  size_t first = 0;
  size_t last = out.size();
  while (first < last && in_ranges(kStripSpace, out[first])) ++first;
  while (last > first && in_ranges(kStripSpace, out[last - 1])) --last;
  return out.substr(first, last - first);
}

enum class CharClass { kLetter, kNumber, kOther, kSkipped };

CharClass classify(char32_t c) {
  if (in_ranges(kLetter, c)) return CharClass::kLetter;
  if (in_ranges(kNumber, c)) return CharClass::kNumber;
  if (in_ranges(kSpace, c) || in_ranges(kUnmatched, c)) return CharClass::kSkipped;
  return CharClass::kOther;
}

// A literal of the pattern at s[i] under IGNORECASE: ASCII case-insensitive, and 'ſ' (U+017F)
// matches 's' (the only other code point the regex module folds onto these letters).
bool matches_literal(const std::u32string& s, size_t i, std::string_view literal) {
  if (s.size() - i < literal.size()) return false;
  for (size_t k = 0; k < literal.size(); ++k) {
    const char32_t c = s[i + k];
    const auto p = static_cast<char32_t>(literal[k]);
    const char32_t folded = (c >= 'A' && c <= 'Z') ? c + ('a' - 'A') : c;
    if (folded != p && !(p == 's' && c == 0x017F)) return false;
  }
  return true;
}

// re.findall(pat, text) for CLIPTokenizer's pattern; returns [begin, end) spans.
std::vector<std::pair<size_t, size_t>> pre_tokenize(const std::u32string& s) {
  static constexpr std::string_view kLiterals[] = {kStartOfText, kEndOfText, "'s",  "'t", "'re",
                                                   "'ve",        "'m",       "'ll", "'d"};
  std::vector<std::pair<size_t, size_t>> spans;
  size_t i = 0;
  while (i < s.size()) {
    bool literal = false;
    for (std::string_view l : kLiterals) {
      if (matches_literal(s, i, l)) {
        spans.emplace_back(i, i + l.size());
        i += l.size();
        literal = true;
        break;
      }
    }
    if (literal) continue;
    const CharClass cls = classify(s[i]);
    if (cls == CharClass::kSkipped) {
      ++i;
    } else if (cls == CharClass::kNumber) {
      spans.emplace_back(i, i + 1);
      ++i;
    } else {
      size_t j = i + 1;
      while (j < s.size() && classify(s[j]) == cls) ++j;
      spans.emplace_back(i, j);
      i = j;
    }
  }
  return spans;
}

// ---- vocabulary files ------------------------------------------------------------------------

// bytes_to_unicode (transformers/open_clip): byte -> the code point BPE sees for it, in the order
// the vocabulary lists them.
std::vector<std::pair<int, char32_t>> bytes_to_unicode() {
  std::vector<std::pair<int, char32_t>> out;
  std::vector<bool> printable(256, false);
  for (int b = '!'; b <= '~'; ++b) printable[b] = true;
  for (int b = 0xA1; b <= 0xAC; ++b) printable[b] = true;
  for (int b = 0xAE; b <= 0xFF; ++b) printable[b] = true;
  for (int b = 0; b < 256; ++b) {
    if (printable[b]) out.emplace_back(b, static_cast<char32_t>(b));
  }
  int n = 0;
  for (int b = 0; b < 256; ++b) {
    if (!printable[b]) out.emplace_back(b, static_cast<char32_t>(256 + n++));
  }
  return out;
}

std::string read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw InputError(path.string() + ": cannot open the CLIP vocabulary file");
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) throw InputError(path.string() + ": read error");
  return bytes;
}

std::string gunzip(const std::string& bytes, const fs::path& path) {
  z_stream stream{};
  if (inflateInit2(&stream, 15 + 32) != Z_OK) throw Error("zlib inflateInit2 failed");
  stream.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(bytes.data()));
  stream.avail_in = static_cast<uInt>(bytes.size());
  std::string out;
  std::array<char, 1 << 16> buffer;
  int rc = Z_OK;
  while (rc != Z_STREAM_END) {
    stream.next_out = reinterpret_cast<Bytef*>(buffer.data());
    stream.avail_out = static_cast<uInt>(buffer.size());
    rc = inflate(&stream, Z_NO_FLUSH);
    if (rc != Z_OK && rc != Z_STREAM_END) {
      const std::string why = stream.msg ? stream.msg : "truncated data";
      inflateEnd(&stream);
      throw InputError(path.string() + ": not a valid gzip file (" + why + ")");
    }
    out.append(buffer.data(), buffer.size() - stream.avail_out);
    if (rc == Z_OK && stream.avail_in == 0 && stream.avail_out != 0) {
      inflateEnd(&stream);
      throw InputError(path.string() + ": not a valid gzip file (truncated data)");
    }
  }
  inflateEnd(&stream);
  return out;
}

bool is_ascii_space(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f';
}

std::vector<std::string> split_whitespace(std::string_view line) {
  std::vector<std::string> parts;
  size_t i = 0;
  while (i < line.size()) {
    while (i < line.size() && is_ascii_space(line[i])) ++i;
    size_t j = i;
    while (j < line.size() && !is_ascii_space(line[j])) ++j;
    if (j > i) parts.emplace_back(line.substr(i, j - i));
    i = j;
  }
  return parts;
}

// transformers: merges_handle.read().strip().split("\n")[1 : 49152 - 256 - 2 + 1], each split().
std::vector<std::pair<std::string, std::string>> parse_merges(const std::string& text,
                                                              const fs::path& path) {
  if (decode_utf8(text, nullptr) != std::string_view::npos) {
    throw InputError(path.string() + ": the BPE merges are not valid UTF-8 text");
  }
  size_t first = 0;
  size_t last = text.size();
  while (first < last && is_ascii_space(text[first])) ++first;
  while (last > first && is_ascii_space(text[last - 1])) --last;
  const std::string_view body(text.data() + first, last - first);

  std::vector<std::pair<std::string, std::string>> merges;
  size_t pos = body.find('\n');  // line 0 is the version header
  size_t line_number = 1;
  while (pos != std::string_view::npos && merges.size() < kNumMerges) {
    const size_t start = pos + 1;
    pos = body.find('\n', start);
    const std::string_view line =
        body.substr(start, pos == std::string_view::npos ? std::string_view::npos : pos - start);
    std::vector<std::string> parts = split_whitespace(line);
    if (parts.size() != 2) {
      throw InputError(path.string() + ": line " + std::to_string(line_number + 1) +
                       " is not a BPE merge (two symbols separated by a space): '" +
                       std::string(line.substr(0, 80)) + "'");
    }
    merges.emplace_back(std::move(parts[0]), std::move(parts[1]));
    ++line_number;
  }
  if (merges.empty()) throw InputError(path.string() + ": no BPE merges after the header line");
  return merges;
}

std::unordered_map<std::string, int32_t> read_vocab_json(const fs::path& path) {
  nlohmann::json json;
  try {
    json = nlohmann::json::parse(read_file(path));
  } catch (const nlohmann::json::exception& e) {
    throw InputError(path.string() + ": not valid JSON (" + e.what() + ")");
  }
  if (!json.is_object()) throw InputError(path.string() + ": expected a JSON object token -> id");
  std::unordered_map<std::string, int32_t> vocab;
  for (const auto& [token, id] : json.items()) {
    if (!id.is_number_integer() || id.get<int64_t>() < 0 ||
        id.get<int64_t>() > std::numeric_limits<int32_t>::max()) {
      throw InputError(path.string() + ": the id of token '" + token +
                       "' is not a non-negative integer");
    }
    vocab[token] = static_cast<int32_t>(id.get<int64_t>());
  }
  return vocab;
}

}  // namespace

// ---- ClipTokenizer ---------------------------------------------------------------------------

struct ClipTokenizer::Cache {
  std::mutex mutex;
  std::unordered_map<std::string, std::vector<int32_t>> words;
};

ClipTokenizer::ClipTokenizer() : cache_(std::make_unique<Cache>()) {}
ClipTokenizer::ClipTokenizer(ClipTokenizer&&) noexcept = default;
ClipTokenizer& ClipTokenizer::operator=(ClipTokenizer&&) noexcept = default;
ClipTokenizer::~ClipTokenizer() = default;

int32_t ClipTokenizer::symbol_id(const std::string& text) {
  auto [it, inserted] = symbol_ids_.try_emplace(text, static_cast<int32_t>(symbol_ids_.size()));
  if (inserted) symbol_vocab_id_.push_back(eos_);  // unk until the caller says otherwise
  return it->second;
}

ClipTokenizer ClipTokenizer::from_file(const fs::path& path) {
  fs::path merges_path = path;
  std::optional<fs::path> vocab_path;
  std::error_code ec;
  if (fs::is_directory(path, ec)) {
    fs::path folder = path;
    if (!fs::exists(folder / "vocab.json") && fs::exists(folder / "tokenizer" / "vocab.json")) {
      folder /= "tokenizer";
    }
    vocab_path = folder / "vocab.json";
    merges_path = folder / "merges.txt";
    for (const fs::path& p : {*vocab_path, merges_path}) {
      if (!fs::is_regular_file(p, ec)) {
        throw InputError(p.string() +
                         ": missing; a CLIP tokenizer folder holds vocab.json and "
                         "merges.txt");
      }
    }
  } else if (!fs::exists(path, ec)) {
    throw InputError(path.string() + ": no such CLIP vocabulary file or tokenizer folder");
  }

  return from_merges(read_file(merges_path), merges_path, vocab_path);
}

ClipTokenizer ClipTokenizer::builtin() {
  const std::string_view bytes = builtin_vocabulary();
  if (bytes.empty()) {
    throw Error("this build of lorapipe has no built-in CLIP vocabulary (configured without "
                "open_clip_torch): give --tokenizer");
  }
  return from_merges(std::string(bytes), fs::path("<built-in>") / kBuiltinName, std::nullopt);
}

ClipTokenizer ClipTokenizer::from_merges(std::string bytes, const fs::path& merges_path,
                                         const std::optional<fs::path>& vocab_path) {
  if (bytes.size() >= 2 && static_cast<unsigned char>(bytes[0]) == 0x1F &&
      static_cast<unsigned char>(bytes[1]) == 0x8B) {
    bytes = gunzip(bytes, merges_path);
  }
  const std::vector<std::pair<std::string, std::string>> merges = parse_merges(bytes, merges_path);

  const std::vector<std::pair<int, char32_t>> byte_chars = bytes_to_unicode();
  std::unordered_map<std::string, int32_t> vocab;
  if (vocab_path) {
    vocab = read_vocab_json(*vocab_path);
  } else {
    // open_clip SimpleTokenizer: bytes, bytes + </w>, merges joined, the two special tokens;
    // a repeated string keeps its last id, as {token: i for i, token in enumerate(vocab)}.
    std::vector<std::string> list;
    for (const auto& [b, c] : byte_chars) list.push_back(to_utf8(std::u32string(1, c)));
    for (size_t k = 0; k < byte_chars.size(); ++k)
      list.push_back(list[k] + std::string(kEndOfWord));
    for (const auto& [a, b] : merges) list.push_back(a + b);
    list.emplace_back(kStartOfText);
    list.emplace_back(kEndOfText);
    for (size_t id = 0; id < list.size(); ++id) vocab[list[id]] = static_cast<int32_t>(id);
  }
  const fs::path& vocab_file = vocab_path ? *vocab_path : merges_path;
  for (std::string_view special : {kStartOfText, kEndOfText}) {
    if (!vocab.contains(std::string(special))) {
      throw InputError(vocab_file.string() + ": the vocabulary has no " + std::string(special));
    }
  }

  ClipTokenizer t;
  t.bos_ = vocab.at(std::string(kStartOfText));
  t.eos_ = vocab.at(std::string(kEndOfText));
  t.pad_ = t.eos_;
  t.vocab_size_ = vocab.size();
  auto set_vocab_id = [&](int32_t symbol, const std::string& text) {
    auto it = vocab.find(text);
    t.symbol_vocab_id_[symbol] = it == vocab.end() ? t.eos_ : it->second;
  };
  t.byte_symbol_.assign(256, -1);
  t.byte_end_symbol_.assign(256, -1);
  for (const auto& [b, c] : byte_chars) {
    const std::string s = to_utf8(std::u32string(1, c));
    t.byte_symbol_[b] = t.symbol_id(s);
    set_vocab_id(t.byte_symbol_[b], s);
    t.byte_end_symbol_[b] = t.symbol_id(s + std::string(kEndOfWord));
    set_vocab_id(t.byte_end_symbol_[b], s + std::string(kEndOfWord));
  }
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const auto& [a, b] = merges[rank];
    const int32_t left = t.symbol_id(a);
    set_vocab_id(left, a);
    const int32_t right = t.symbol_id(b);
    set_vocab_id(right, b);
    const int32_t merged = t.symbol_id(a + b);
    set_vocab_id(merged, a + b);
    // dict(zip(merges, range(len(merges)))): a repeated merge keeps its last rank.
    t.merges_[(static_cast<uint64_t>(left) << 32) | static_cast<uint32_t>(right)] =
        Merge{static_cast<int32_t>(rank), merged};
  }
  return t;
}

// CLIPTokenizer.bpe on one pre-token, given as UTF-8 bytes: the byte symbols, the last one with
// </w>; then, while some adjacent pair has a rank, every occurrence of the best-ranked pair is
// merged left to right in one pass (the pass matters: pairs that pass creates wait for the next).
std::vector<int32_t> ClipTokenizer::bpe_uncached(const std::string& word) const {
  std::vector<int32_t> symbols;
  symbols.reserve(word.size());
  for (size_t k = 0; k < word.size(); ++k) {
    const auto b = static_cast<unsigned char>(word[k]);
    symbols.push_back(k + 1 == word.size() ? byte_end_symbol_[b] : byte_symbol_[b]);
  }
  std::vector<int32_t> next;
  while (symbols.size() > 1) {
    const Merge* best = nullptr;
    int32_t first = -1;
    int32_t second = -1;
    for (size_t k = 0; k + 1 < symbols.size(); ++k) {
      auto it = merges_.find((static_cast<uint64_t>(symbols[k]) << 32) |
                             static_cast<uint32_t>(symbols[k + 1]));
      if (it != merges_.end() && (best == nullptr || it->second.rank < best->rank)) {
        best = &it->second;
        first = symbols[k];
        second = symbols[k + 1];
      }
    }
    if (best == nullptr) break;
    next.clear();
    for (size_t k = 0; k < symbols.size();) {
      if (symbols[k] == first && k + 1 < symbols.size() && symbols[k + 1] == second) {
        next.push_back(best->merged);
        k += 2;
      } else {
        next.push_back(symbols[k++]);
      }
    }
    symbols.swap(next);
  }
  std::vector<int32_t> ids;
  ids.reserve(symbols.size());
  for (int32_t s : symbols) ids.push_back(symbol_vocab_id_[s]);
  return ids;
}

void ClipTokenizer::bpe(const std::string& word, std::vector<int32_t>* ids) const {
  // transformers seeds its cache with the two special tokens, which therefore never split.
  if (word == kStartOfText || word == kEndOfText) {
    ids->push_back(word == kStartOfText ? bos_ : eos_);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(cache_->mutex);
    auto it = cache_->words.find(word);
    if (it != cache_->words.end()) {
      ids->insert(ids->end(), it->second.begin(), it->second.end());
      return;
    }
  }
  std::vector<int32_t> result = bpe_uncached(word);
  ids->insert(ids->end(), result.begin(), result.end());
  std::lock_guard<std::mutex> lock(cache_->mutex);
  if (cache_->words.size() >= kMaxCacheEntries) cache_->words.clear();
  cache_->words.emplace(word, std::move(result));
}

std::vector<int32_t> ClipTokenizer::encode(std::string_view text) const {
  decode_or_throw(text, "text");
  std::vector<int32_t> ids;
  // PreTrainedTokenizer.tokenize: split on the added tokens first (exact, case-sensitive; both
  // are ASCII, so a byte search cannot land inside a multi-byte character).
  auto encode_piece = [&](std::string_view piece) {
    const std::u32string cleaned =
        lower(whitespace_clean(ftfy_fix_text(decode_or_throw(piece, "text"))));
    for (const auto& [begin, end] : pre_tokenize(cleaned)) {
      bpe(to_utf8(std::u32string_view(cleaned).substr(begin, end - begin)), &ids);
    }
  };
  size_t pos = 0;
  while (pos < text.size()) {
    const size_t bos_at = text.find(kStartOfText, pos);
    const size_t eos_at = text.find(kEndOfText, pos);
    const size_t at = std::min(bos_at, eos_at);
    if (at > pos) encode_piece(text.substr(pos, at == std::string_view::npos ? at : at - pos));
    if (at == std::string_view::npos) break;
    ids.push_back(at == bos_at ? bos_ : eos_);
    pos = at + (at == bos_at ? kStartOfText.size() : kEndOfText.size());
  }
  return ids;
}

void ClipTokenizer::set_pad_token(std::string_view token) {
  if (token == kEndOfText) {
    pad_ = eos_;
    return;
  }
  // The token's id in the vocabulary: its symbol, as the vocabulary holds it.
  const auto it = symbol_ids_.find(std::string(token));
  if (token.empty() || it == symbol_ids_.end() || symbol_vocab_id_[it->second] == eos_) {
    throw InputError("pad token '" + std::string(token) + "' is not in the tokenizer's vocabulary");
  }
  pad_ = symbol_vocab_id_[it->second];
}

std::vector<int32_t> ClipTokenizer::encode_padded(std::string_view text, int max_length) const {
  if (max_length < 2) {
    throw InputError("max_length " + std::to_string(max_length) +
                     " leaves no room for <|startoftext|> and <|endoftext|>");
  }
  const std::vector<int32_t> ids = encode(text);
  const size_t keep = std::min(ids.size(), static_cast<size_t>(max_length - 2));
  std::vector<int32_t> out;
  out.reserve(max_length);
  out.push_back(bos_);
  out.insert(out.end(), ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(keep));
  out.push_back(eos_);
  out.resize(max_length, pad());
  return out;
}

std::string fix_text(std::string_view text) {
  return to_utf8(ftfy_fix_text(decode_or_throw(text, "text")));
}

std::string python_lower(std::string_view text) {
  return to_utf8(lower(decode_or_throw(text, "text")));
}

}  // namespace lorapipe::models
