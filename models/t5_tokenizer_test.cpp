// T5's tokenizer against transformers' on a SentencePiece unigram model trained as T5's is made
// (models/reference/t5_tokenizer_reference.py): 240 strings with runs of spaces, leading and
// trailing whitespace, tabs and newlines, full-width and NFKC-folded characters, literal </s> and
// <extra_id_N>, characters outside the vocabulary. Exact ids, no tolerance.

#include "models/t5_tokenizer.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "common/error.h"
#include "models/parity_util.h"

namespace lorapipe::models {
namespace {

namespace fs = std::filesystem;

class T5TokenizerParity : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = testing::reference_output("models/reference/t5_tokenizer_reference.py");
    std::ifstream in(dir_ / "ids.json");
    ref_ = nlohmann::json::parse(in);
  }
  static fs::path dir_;
  static nlohmann::json ref_;
};
fs::path T5TokenizerParity::dir_;
nlohmann::json T5TokenizerParity::ref_;

std::string shown(const std::string& s) { return nlohmann::json(s).dump(); }

// T5TokenizerFast as T5's and Flux's tokenizer.json configure it: every string's ids.
TEST_F(T5TokenizerParity, IdsEqualT5TokenizerFast) {
  const T5Tokenizer tokenizer = T5Tokenizer::from_file(dir_ / "spiece.model");
  EXPECT_EQ(tokenizer.vocab_size(), ref_["vocab_size"].get<int64_t>());
  const auto& cases = ref_["cases"];
  ASSERT_GE(cases.size(), 200u);
  size_t equal = 0, legacy_457_differs = 0;
  for (const auto& c : cases) {
    const std::string text = c["text"];
    std::vector<int64_t> ids = tokenizer.encode(text);
    ids.push_back(tokenizer.eos_id());
    const auto fast = c["fast"].get<std::vector<int64_t>>();
    EXPECT_EQ(ids, fast) << shown(text);
    equal += ids == fast;
    legacy_457_differs += c["fast_457"].get<std::vector<int64_t>>() != fast;
  }
  std::printf(
      "[t5 tokenizer] %zu of %zu strings equal T5TokenizerFast's ids (transformers 4.57's "
      "conversion of a bare spiece.model differs on %zu: it drops the first word's "
      "\"\xe2\x96\x81\")\n",
      equal, cases.size(), legacy_457_differs);
}

// The slow T5Tokenizer: the same ids, but it adds no </s> after a text that ends with one
// (its _add_eos_if_not_present); that rule, and nothing else, tells them apart.
TEST_F(T5TokenizerParity, IdsEqualTheSlowT5TokenizerButForItsEndOfTextRule) {
  const T5Tokenizer tokenizer = T5Tokenizer::from_file(dir_ / "spiece.model");
  size_t differ = 0;
  for (const auto& c : ref_["cases"]) {
    const std::string text = c["text"];
    std::vector<int64_t> ids = tokenizer.encode(text);
    if (ids.empty() || ids.back() != tokenizer.eos_id()) {
      ids.push_back(tokenizer.eos_id());
    } else {
      ++differ;
    }
    EXPECT_EQ(ids, c["slow"].get<std::vector<int64_t>>()) << shown(text);
  }
  std::printf("[t5 tokenizer] the slow tokenizer adds no second </s> on %zu strings\n", differ);
  EXPECT_GT(differ, 0u);  // the cases include it
}

// padding="max_length", truncation=True at 16: </s> kept at the cut, <pad> after it.
TEST_F(T5TokenizerParity, PaddedIdsAndMaskEqualT5TokenizerFast) {
  const T5Tokenizer tokenizer = T5Tokenizer::from_file(dir_ / "spiece.model");
  size_t truncated = 0;
  for (const auto& c : ref_["cases"]) {
    const std::string text = c["text"];
    int length = 0;
    EXPECT_EQ(tokenizer.encode_padded(text, 16, &length), c["padded"].get<std::vector<int64_t>>())
        << shown(text);
    EXPECT_EQ(length, c["padded_mask"].get<int>()) << shown(text);
    truncated += c["fast"].size() > 16;
  }
  EXPECT_GT(truncated, 10u);  // the cut is exercised
}

TEST(T5TokenizerErrors, NamesTheFileThatIsNotAModel) {
  const fs::path bad = fs::temp_directory_path() / "lorapipe-not-spiece.model";
  std::ofstream(bad) << "not a model";
  try {
    T5Tokenizer::from_file(bad);
    FAIL() << "a text file loaded as a SentencePiece model";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find(bad.string()), std::string::npos) << e.what();
  }
  fs::remove(bad);
  EXPECT_THROW(T5Tokenizer::from_file(bad), InputError);
}

}  // namespace
}  // namespace lorapipe::models
