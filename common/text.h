#pragma once
// Python's string operations that kohya's caption handling is written in, for ports of it.

#include <algorithm>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace lorapipe {

// Whether `c` is whitespace to Python's str.isspace (and so to strip() and split()): ASCII's,
// the information separators 0x1C-0x1F, and Unicode's spaces and line separators (the
// ideographic space U+3000 and the no-break space U+00A0 among them; not U+200B or U+FEFF).
inline bool python_isspace(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 ||
         c == 0x1680 || (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 ||
         c == 0x202F || c == 0x205F || c == 0x3000;
}

// The code point whose UTF-8 encoding starts at s[at] and its length in bytes; a byte that does
// not start a well-formed sequence reads as itself, one byte long (never whitespace above 0x7F).
inline std::pair<char32_t, size_t> utf8_at(std::string_view s, size_t at) {
  const auto byte = [&](size_t i) { return static_cast<unsigned char>(s[i]); };
  const unsigned char b = byte(at);
  const size_t length = b < 0x80 ? 1 : (b >> 5) == 0x6 ? 2 : (b >> 4) == 0xE ? 3 : (b >> 3) == 0x1E ? 4 : 0;
  if (length <= 1 || at + length > s.size()) return {b, 1};
  char32_t c = b & (0xFF >> (length + 1));
  for (size_t i = 1; i < length; ++i) {
    if ((byte(at + i) & 0xC0) != 0x80) return {b, 1};
    c = (c << 6) | (byte(at + i) & 0x3F);
  }
  return {c, length};
}

// Python's str.strip() with no argument, on UTF-8 text: every python_isspace code point at
// either end.
inline std::string python_strip(std::string_view s) {
  size_t begin = 0;
  while (begin < s.size()) {
    const auto [c, length] = utf8_at(s, begin);
    if (!python_isspace(c)) break;
    begin += length;
  }
  size_t end = s.size();
  while (end > begin) {
    size_t start = end - 1;  // the last code point's first byte
    while (start > begin && (static_cast<unsigned char>(s[start]) & 0xC0) == 0x80) --start;
    const auto [c, length] = utf8_at(s, start);
    if (start + length != end || !python_isspace(c)) break;
    end = start;
  }
  return std::string(s.substr(begin, end - begin));
}

// Python's str.replace(from, to): every occurrence, left to right, not overlapping. `from` must
// not be empty.
inline std::string replace_all(std::string_view text, std::string_view from, std::string_view to) {
  std::string out;
  for (size_t begin = 0;;) {
    const size_t at = text.find(from, begin);
    out.append(text.substr(begin, at == std::string_view::npos ? at : at - begin));
    if (at == std::string_view::npos) return out;
    out.append(to);
    begin = at + from.size();
  }
}

// kohya's multi-word flags (--network_args a=1 b=2, --base_weights A B) reach a stage as one
// value: each word after a kWordMark, so that a word may hold spaces (a path). A value without
// the mark (typed as one argument, --optimizer_args="a=1 b=2") is split at whitespace.
inline constexpr char kWordMark = '\x1f';

inline void append_word(std::string& value, std::string_view word) {
  value += kWordMark;
  value.append(word);
}

inline std::vector<std::string> split_words(std::string_view value) {
  std::vector<std::string> out;
  const bool marked = value.find(kWordMark) != std::string_view::npos;
  const std::string_view separators = marked ? std::string_view(&kWordMark, 1) : " \t\r\n\v\f";
  for (size_t begin = 0; begin < value.size();) {
    const size_t end = std::min(value.find_first_of(separators, begin), value.size());
    if (end > begin) out.emplace_back(value.substr(begin, end - begin));
    begin = end + 1;
  }
  return out;
}

// The optimal-string-alignment distance: inserting, deleting or changing a character, or
// swapping two neighbours, each costs 1 ("netwrok_dim" is 1 from "network_dim").
inline size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<std::vector<size_t>> d(a.size() + 1, std::vector<size_t>(b.size() + 1));
  for (size_t i = 0; i <= a.size(); ++i) d[i][0] = i;
  for (size_t j = 0; j <= b.size(); ++j) d[0][j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    for (size_t j = 1; j <= b.size(); ++j) {
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1,
                          d[i - 1][j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1)});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) {
        d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
      }
    }
  }
  return d[a.size()][b.size()];
}

// For "did you mean" in a message about an unknown name: the candidates nearest `word` (at most
// three, in the candidates' order), when they are within a third of its length (at least 1, at
// most 3 edits); none otherwise.
inline std::vector<std::string> nearest_names(std::string_view word,
                                              const std::vector<std::string>& candidates) {
  const size_t limit = std::clamp<size_t>(word.size() / 3, 1, 3);
  size_t best = limit + 1;
  std::vector<std::string> out;
  for (const std::string& c : candidates) {
    if (c == word) continue;
    const size_t d = edit_distance(word, c);
    if (d > limit || d > best) continue;
    if (d < best) out.clear(), best = d;
    if (out.size() < 3 && std::find(out.begin(), out.end(), c) == out.end()) out.push_back(c);
  }
  return out;
}

// " (did you mean --a or --b?)" for nearest_names(word, candidates), each with `prefix`; empty
// when none is near.
inline std::string did_you_mean(std::string_view word, const std::vector<std::string>& candidates,
                                std::string_view prefix = "") {
  const std::vector<std::string> near = nearest_names(word, candidates);
  if (near.empty()) return "";
  std::string out = " (did you mean ";
  for (size_t i = 0; i < near.size(); ++i) {
    out += (i == 0 ? "" : i + 1 == near.size() ? " or " : ", ") + std::string(prefix) + near[i];
  }
  return out + "?)";
}

}  // namespace lorapipe
