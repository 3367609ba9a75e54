#pragma once
// Python's string operations that kohya's caption handling is written in, for ports of it.

#include <string>
#include <string_view>

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

}  // namespace lorapipe
