#pragma once
// The attention syntax of A1111 prompts, as kohya's sample images read it
// (library/lpw_stable_diffusion.py, parse_prompt_attention):
//   (text)       the weight of `text` times 1.1        [text]  divided by 1.1
//   (text:1.3)   times 1.3 (a number right before ')'; nesting multiplies)
//   \( \) \[ \] \\   the literal character
// An unclosed bracket weighs everything after it; a stray ')' or ']' is plain text. Neighbours of
// equal weight are joined. No LibTorch.

#include <string>
#include <string_view>
#include <vector>

namespace lorapipe::models {

struct WeightedText {
  std::string text;
  double weight = 1.0;
};

// Never empty: a prompt without text is one empty piece of weight 1. Throws InputError for a
// weight that is not a number (such as "(a:1.2.3)").
std::vector<WeightedText> parse_prompt_attention(std::string_view prompt);

}  // namespace lorapipe::models
