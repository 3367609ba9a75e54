// Python's string operations as kohya's caption code uses them, and the marked words of
// multi-word flags.
#include "common/text.h"

#include <gtest/gtest.h>

namespace lorapipe {
namespace {

TEST(CommonText, StripAndReplaceAsPython) {
  EXPECT_EQ(python_strip(" \t a b \r\n\v\f"), "a b");
  EXPECT_EQ(python_strip(" \n "), "");
  // Unicode's whitespace as Python's str.isspace has it (listed by Python 3 itself:
  // [c for c in range(0x110000) if chr(c).isspace()]), stripped at both ends in UTF-8.
  const std::u32string spaces = U"\x09\x0a\x0b\x0c\x0d\x1c\x1d\x1e\x1f\x20\x85\xa0\u1680"
                                U"\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008"
                                U"\u2009\u200a\u2028\u2029\u202f\u205f\u3000";
  for (char32_t c = 0; c < 0x3100; ++c) {
    EXPECT_EQ(python_isspace(c), spaces.find(c) != std::u32string::npos)
        << std::hex << static_cast<uint32_t>(c);
  }
  EXPECT_EQ(python_strip("\u3000\u00a0 青い\u3000四角 \u2029\u3000"), "青い\u3000四角");
  EXPECT_EQ(python_strip("\u3000"), "");
  EXPECT_EQ(python_strip("\u200b a \ufeff"), "\u200b a \ufeff") << "not whitespace to Python";
  EXPECT_EQ(python_strip("\xe3\x80 a"), "\xe3\x80 a") << "a cut sequence is not whitespace";
  EXPECT_EQ(replace_all("a;;b;;;c", ";;", ","), "a,b,;c") << "left to right, not overlapping";
  EXPECT_EQ(replace_all("abc", "x", "y"), "abc");
  EXPECT_EQ(replace_all("aaa", "a", "aa"), "aaaaaa");
}

// The textbook values of the optimal-string-alignment distance: Levenshtein's kitten/sitting (3),
// a swap of neighbours as one edit, and OSA's known difference from full Damerau (ca -> abc is
// 3, where Damerau counts 2); and the hints built on it.
TEST(CommonText, NearestNamesForDidYouMean) {
  EXPECT_EQ(edit_distance("kitten", "sitting"), 3u);
  EXPECT_EQ(edit_distance("netwrok_dim", "network_dim"), 1u);
  EXPECT_EQ(edit_distance("ca", "abc"), 3u);
  EXPECT_EQ(edit_distance("", "abc"), 3u);
  EXPECT_EQ(edit_distance("same", "same"), 0u);
  const std::vector<std::string> keys = {"num_repeats", "network_dim", "network_alpha", "flip_aug"};
  EXPECT_EQ(did_you_mean("num_repeat", keys, "--"), " (did you mean --num_repeats?)");
  EXPECT_EQ(did_you_mean("netwrok_dim", keys), " (did you mean network_dim?)");
  EXPECT_EQ(did_you_mean("flipaug", keys), " (did you mean flip_aug?)");
  EXPECT_EQ(did_you_mean("resolution", keys), "") << "nothing near: no hint";
  EXPECT_EQ(did_you_mean("ab", {"ax", "ay", "az", "aw"}), " (did you mean ax, ay or az?)")
      << "at most three, in order";
}

// A multi-word flag's words keep their spaces when marked (a path with a space), and a value
// typed as one argument is split at whitespace, as before.
TEST(CommonText, MarkedWordsKeepTheirSpaces) {
  std::string value;
  append_word(value, "/my loras/a.safetensors");
  append_word(value, "b.safetensors");
  EXPECT_EQ(split_words(value),
            (std::vector<std::string>{"/my loras/a.safetensors", "b.safetensors"}));
  std::string one;
  append_word(one, "/my loras/a.safetensors");
  EXPECT_EQ(split_words(one), (std::vector<std::string>{"/my loras/a.safetensors"}));
  EXPECT_EQ(split_words(" conv_dim=4  conv_alpha=1 "),
            (std::vector<std::string>{"conv_dim=4", "conv_alpha=1"}));
  EXPECT_TRUE(split_words("").empty());
}

}  // namespace
}  // namespace lorapipe
