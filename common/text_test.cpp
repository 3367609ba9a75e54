// Python's string operations as kohya's caption code uses them, and the marked words of
// multi-word flags.
#include "common/text.h"

#include <gtest/gtest.h>

namespace lorapipe {
namespace {

TEST(CommonText, StripAndReplaceAsPython) {
  EXPECT_EQ(python_strip(" \t a b \r\n\v\f"), "a b");
  EXPECT_EQ(python_strip(" \n "), "");
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
