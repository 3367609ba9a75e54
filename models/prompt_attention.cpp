#include "models/prompt_attention.h"

#include <cctype>
#include <cstdlib>

#include "common/error.h"

namespace lorapipe::models {
namespace {

constexpr double kRoundBracket = 1.1;
constexpr double kSquareBracket = 1 / 1.1;

// At `at`, the number of ":NUMBER)" (NUMBER = [+-]?[.0-9]+): its length up to and including ')',
// or 0 when no such weight starts there.
size_t weight_length(std::string_view s, size_t at) {
  size_t i = at + 1;
  if (i < s.size() && (s[i] == '+' || s[i] == '-')) ++i;
  const size_t digits = i;
  while (i < s.size() && (std::isdigit(static_cast<unsigned char>(s[i])) || s[i] == '.')) ++i;
  if (i == digits || i >= s.size() || s[i] != ')') return 0;
  return i + 1 - at;
}

bool is_special(char c) { return c == '\\' || c == '(' || c == ')' || c == '[' || c == ']' || c == ':'; }

}  // namespace

std::vector<WeightedText> parse_prompt_attention(std::string_view s) {
  std::vector<WeightedText> out;
  std::vector<size_t> round, square;  // where each open bracket's text begins in `out`
  auto multiply_from = [&](size_t start, double factor) {
    for (size_t p = start; p < out.size(); ++p) out[p].weight *= factor;
  };
  size_t i = 0;
  while (i < s.size()) {
    const char c = s[i];
    if (c == '\\') {
      // An escaped bracket or backslash is that character; a lone backslash adds nothing.
      const bool escaped = i + 1 < s.size() && (s[i + 1] == '(' || s[i + 1] == ')' ||
                                                s[i + 1] == '[' || s[i + 1] == ']' || s[i + 1] == '\\');
      out.push_back({escaped ? std::string(1, s[i + 1]) : std::string(), 1.0});
      i += escaped ? 2 : 1;
    } else if (c == '(') {
      round.push_back(out.size());
      ++i;
    } else if (c == '[') {
      square.push_back(out.size());
      ++i;
    } else if (c == ':' && weight_length(s, i) > 0) {
      const size_t length = weight_length(s, i);
      if (round.empty()) {
        out.push_back({std::string(s.substr(i, length)), 1.0});
      } else {
        const std::string number(s.substr(i + 1, length - 2));
        char* end = nullptr;
        const double factor = std::strtod(number.c_str(), &end);
        if (end != number.c_str() + number.size()) {
          throw InputError("prompt weight '" + number + "' is not a number");
        }
        multiply_from(round.back(), factor);
        round.pop_back();
      }
      i += length;
    } else if (c == ')' && !round.empty()) {
      multiply_from(round.back(), kRoundBracket);
      round.pop_back();
      ++i;
    } else if (c == ']' && !square.empty()) {
      multiply_from(square.back(), kSquareBracket);
      square.pop_back();
      ++i;
    } else if (is_special(c)) {  // a stray ')' or ']', or a ':' that starts no weight
      out.push_back({std::string(1, c), 1.0});
      ++i;
    } else {
      size_t end = i;
      while (end < s.size() && !is_special(s[end])) ++end;
      out.push_back({std::string(s.substr(i, end - i)), 1.0});
      i = end;
    }
  }
  for (size_t start : round) multiply_from(start, kRoundBracket);
  for (size_t start : square) multiply_from(start, kSquareBracket);
  if (out.empty()) out.push_back({"", 1.0});
  std::vector<WeightedText> joined;
  for (WeightedText& piece : out) {
    if (!joined.empty() && joined.back().weight == piece.weight) {
      joined.back().text += piece.text;
    } else {
      joined.push_back(std::move(piece));
    }
  }
  return joined;
}

}  // namespace lorapipe::models
