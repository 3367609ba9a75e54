// The attention syntax against the examples kohya's parse_prompt_attention documents
// (library/lpw_stable_diffusion.py), and what it does with escapes, stray brackets and bad weights.
#include "models/prompt_attention.h"

#include <gtest/gtest.h>

#include "common/error.h"

namespace lorapipe::models {
namespace {

using Pieces = std::vector<std::pair<std::string, double>>;

Pieces parse(std::string_view prompt) {
  Pieces out;
  for (const WeightedText& piece : parse_prompt_attention(prompt)) {
    out.emplace_back(piece.text, piece.weight);
  }
  return out;
}

// Weights are products of the same factors in the same order as Python's, so they are equal to
// the last bit (1.1 * 1.1 * 1.3 is 1.5730000000000004 on both sides).
TEST(PromptAttention, KohyasDocumentedExamples) {
  EXPECT_EQ(parse("normal text"), (Pieces{{"normal text", 1.0}}));
  EXPECT_EQ(parse("an (important) word"),
            (Pieces{{"an ", 1.0}, {"important", 1.1}, {" word", 1.0}}));
  EXPECT_EQ(parse("(unbalanced"), (Pieces{{"unbalanced", 1.1}}));
  EXPECT_EQ(parse("\\(literal\\]"), (Pieces{{"(literal]", 1.0}}));
  EXPECT_EQ(parse("(unnecessary)(parens)"), (Pieces{{"unnecessaryparens", 1.1}}));
  EXPECT_EQ(parse("a (((house:1.3)) [on] a (hill:0.5), sun, (((sky)))."),
            (Pieces{{"a ", 1.0},
                    {"house", 1.3 * 1.1 * 1.1},
                    {" ", 1.1},
                    {"on", 1.0},
                    {" a ", 1.1},
                    {"hill", 0.5 * 1.1},
                    {", sun, ", 1.1},
                    {"sky", 1.1 * 1.1 * 1.1 * 1.1},
                    {".", 1.1}}));
}

TEST(PromptAttention, EscapesStrayBracketsAndColons) {
  EXPECT_EQ(parse(""), (Pieces{{"", 1.0}}));
  EXPECT_EQ(parse("style: anime, ratio 2:3"), (Pieces{{"style: anime, ratio 2:3", 1.0}}));
  EXPECT_EQ(parse("a) b] \\\\ c"), (Pieces{{"a) b] \\ c", 1.0}}));
  EXPECT_EQ(parse("x\\y"), (Pieces{{"xy", 1.0}})) << "a lone backslash adds nothing";
  EXPECT_EQ(parse("no bracket:1.2)"), (Pieces{{"no bracket:1.2)", 1.0}}));
  EXPECT_EQ(parse("[dim"), (Pieces{{"dim", 1 / 1.1}}));
  EXPECT_THROW(parse("(a:1.2.3)"), InputError);
}

}  // namespace
}  // namespace lorapipe::models
