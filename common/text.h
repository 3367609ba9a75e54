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
