#pragma once
// Python's string operations that kohya's caption handling is written in, for ports of it.

#include <algorithm>
#include <string>
#include <string_view>
#include <vector>

namespace lorapipe {

// Python's str.strip() with no argument, for ASCII whitespace.
inline std::string python_strip(std::string_view s) {
  constexpr std::string_view kSpace = " \t\r\n\v\f";
  const size_t begin = s.find_first_not_of(kSpace);
  if (begin == std::string_view::npos) return {};
  const size_t end = s.find_last_not_of(kSpace);
  return std::string(s.substr(begin, end - begin + 1));
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

}  // namespace lorapipe
