// Parity of models/clip_tokenizer with Hugging Face transformers' slow CLIPTokenizer on the real
// CLIP vocabulary (open_clip's bpe_simple_vocab_16e6.txt.gz), and with kohya sd-scripts'
// long-prompt chunking. The reference ids are generated per run by
// models/reference/clip_tokenizer_reference.py with the test venv's Python (LORAPIPE_PYTHON).
//
// Tolerance: exact equality of every id of every case, 0 mismatches. The one exception is the
// cases in kFtfyGaps, where ftfy's mojibake repair (fix_encoding, which fix_text() does not
// implement) changes transformers' ids; for those the ids must equal transformers' with that
// ftfy step switched off, and the reference must agree that they are the only such cases.
#include "models/clip_tokenizer.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "common/error.h"
#include "models/long_prompt.h"
#include "tests/paths.h"

namespace lorapipe::models {
namespace {
namespace fs = std::filesystem;
using nlohmann::json;

// Mojibake that ftfy.fix_encoding repairs and the C++ tokenizer leaves as it stands.
const std::set<std::string> kFtfyGaps = {"mojibake/utf8_as_latin1", "mojibake/utf8_as_cp1252"};

std::string show(const std::vector<int32_t>& ids, size_t around = std::string::npos) {
  std::ostringstream out;
  const size_t begin = around == std::string::npos || around < 8 ? 0 : around - 8;
  const size_t end = std::min(ids.size(), around == std::string::npos ? 40 : around + 8);
  out << "[" << (begin > 0 ? "... " : "");
  for (size_t i = begin; i < end; ++i) out << ids[i] << (i + 1 < end ? ", " : "");
  out << (end < ids.size() ? " ..." : "") << "] (" << ids.size() << " ids)";
  return out.str();
}

// Empty when equal, else a description of the first difference.
std::string compare(const std::vector<int32_t>& actual, const json& expected_json) {
  const auto expected = expected_json.get<std::vector<int32_t>>();
  if (actual == expected) return "";
  size_t i = 0;
  while (i < actual.size() && i < expected.size() && actual[i] == expected[i]) ++i;
  return "first difference at " + std::to_string(i) + "\n    expected " + show(expected, i) +
         "\n    actual   " + show(actual, i);
}

class ClipTokenizerParity : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = fs::temp_directory_path() / ("lorapipe-clip-tokenizer-" + std::to_string(getpid()));
    fs::remove_all(dir_);
    const char* python = std::getenv("LORAPIPE_PYTHON");
    ASSERT_TRUE(python != nullptr && *python != '\0')
        << "LORAPIPE_PYTHON (the test venv's python) is not set";
    const std::string command = std::string(python) + " " + LORAPIPE_SOURCE_DIR +
                                "/models/reference/clip_tokenizer_reference.py " + dir_.string();
    ASSERT_EQ(std::system(command.c_str()), 0) << command;
    std::ifstream in(dir_ / "reference.json");
    reference_ = new json(json::parse(in));
    tokenizer_ =
        new ClipTokenizer(ClipTokenizer::from_file((*reference_)["vocab_gz"].get<std::string>()));
    // SDXL's second tokenizer: the same vocabulary, padding with "!".
    tokenizer_2_ =
        new ClipTokenizer(ClipTokenizer::from_file((*reference_)["vocab_gz"].get<std::string>()));
    tokenizer_2_->set_pad_token("!");
  }
  static void TearDownTestSuite() {
    delete tokenizer_;
    tokenizer_ = nullptr;
    delete tokenizer_2_;
    tokenizer_2_ = nullptr;
    delete reference_;
    reference_ = nullptr;
    fs::remove_all(dir_);
  }
  void SetUp() override {
    ASSERT_NE(tokenizer_, nullptr) << "the reference or the vocabulary failed to load";
  }

  static const json& cases() { return (*reference_)["cases"]; }

  static fs::path dir_;
  static json* reference_;
  static ClipTokenizer* tokenizer_;
  static ClipTokenizer* tokenizer_2_;
};
fs::path ClipTokenizerParity::dir_;
json* ClipTokenizerParity::reference_ = nullptr;
ClipTokenizer* ClipTokenizerParity::tokenizer_ = nullptr;
ClipTokenizer* ClipTokenizerParity::tokenizer_2_ = nullptr;

TEST_F(ClipTokenizerParity, EncodeMatchesTransformersOnEveryCase) {
  const json& ref = *reference_;
  EXPECT_EQ(tokenizer_->vocab_size(), ref["vocab_size"].get<size_t>());
  EXPECT_EQ(tokenizer_->bos(), ref["bos"].get<int32_t>());
  EXPECT_EQ(tokenizer_->eos(), ref["eos"].get<int32_t>());
  EXPECT_EQ(tokenizer_->pad(), ref["pad"].get<int32_t>());
  EXPECT_EQ(tokenizer_->vocab_size(), 49408u);

  ASSERT_GE(cases().size(), 200u);
  int mismatches = 0;
  int fix_text_mismatches = 0;
  std::set<std::string> gaps_seen;
  for (const json& c : cases()) {
    const std::string name = c["name"];
    const std::string text = c["text"];
    const std::string fixed = fix_text(text);
    if (fixed != c["fixed_text"].get<std::string>()) {
      ++fix_text_mismatches;
      ADD_FAILURE() << name << ": fix_text differs from ftfy.fix_text(fix_encoding=False)\n"
                    << "    expected '" << c["fixed_text"].get<std::string>() << "'\n"
                    << "    actual   '" << fixed << "'";
    }
    const std::vector<int32_t> ids = tokenizer_->encode(text);
    std::string diff;
    if (c["ftfy_gap"].get<bool>()) {
      gaps_seen.insert(name);
      // A gap: ids equal transformers' without ftfy's mojibake repair, and differ from it with.
      diff = compare(ids, c["ids_without_fix_encoding"]);
      EXPECT_FALSE(compare(ids, c["ids"]).empty()) << name;
    } else {
      diff = compare(ids, c["ids"]);
    }
    if (!diff.empty()) {
      ++mismatches;
      ADD_FAILURE() << name << ": '" << text << "'\n  " << diff;
    }
  }
  EXPECT_EQ(gaps_seen, kFtfyGaps) << "cases where ftfy's mojibake repair changes the ids";
  EXPECT_EQ(fix_text_mismatches, 0);
  EXPECT_EQ(mismatches, 0) << "of " << cases().size() << " cases";
}

// Also SDXL's second tokenizer (pad token "!", id 0): transformers' padding and kohya's
// long-prompt chunks.
TEST_F(ClipTokenizerParity, PaddedMatchesTransformersAndLongMatchesKohya) {
  int mismatches = 0;
  int checked = 0;
  for (const json& c : cases()) {
    const std::string name = c["name"];
    // padded/long expectations come from the tokenizer with mojibake repair; a gap case is
    // checked on its plain ids in the test above.
    if (kFtfyGaps.contains(name)) continue;
    const std::string text = c["text"];
    ++checked;
    const struct {
      const char* key;
      std::vector<int32_t> actual;
    } variants[] = {
        {"padded_77", tokenizer_->encode_padded(text)},
        {"padded_77", kohya_long_prompt_ids(*tokenizer_, text, /*max_token_length=*/75)},
        {"long_150", kohya_long_prompt_ids(*tokenizer_, text, /*max_token_length=*/150)},
        {"long_225", kohya_long_prompt_ids(*tokenizer_, text, /*max_token_length=*/225)},
        // SDXL's second tokenizer pads with "!" (id 0, an added token: split out of the text)
        // and takes kohya's pad != eos branch.
        {"sdxl2_77", tokenizer_2_->encode_padded(text)},
        {"sdxl2_77", kohya_long_prompt_ids(*tokenizer_2_, text, 75)},
        {"sdxl2_150", kohya_long_prompt_ids(*tokenizer_2_, text, 150)},
        {"sdxl2_225", kohya_long_prompt_ids(*tokenizer_2_, text, 225)},
    };
    for (const auto& v : variants) {
      const std::string diff = compare(v.actual, c[v.key]);
      if (!diff.empty()) {
        ++mismatches;
        ADD_FAILURE() << name << " " << v.key << ": '" << text << "'\n  " << diff;
      }
    }
  }
  EXPECT_GE(checked, 200);
  EXPECT_EQ(mismatches, 0);
}

// kohya's --weighted_captions tokenization at each max_token_length, on every case (those without
// attention syntax must give kohya_long_prompt_ids' ids with all weights 1; the "weights/" cases carry
// nested, escaped, glued, negative and chunk-crossing weights). Weights are compared as the fp32
// values kohya's torch.tensor makes of its Python floats: exactly.
TEST_F(ClipTokenizerParity, WeightedCaptionsMatchKohya) {
  int mismatches = 0, weighted = 0;
  for (const json& c : cases()) {
    const std::string name = c["name"];
    if (kFtfyGaps.contains(name)) continue;
    const std::string text = c["text"];
    for (int length : {75, 150, 225}) {
      const json& expected = c["weighted_" + std::to_string(length)];
      if (expected.is_null()) {
        EXPECT_THROW(kohya_weighted_long_prompt_ids(*tokenizer_, text, length), InputError) << name;
        continue;
      }
      const WeightedIds actual = kohya_weighted_long_prompt_ids(*tokenizer_, text, length);
      std::string diff = compare(actual.ids, expected["ids"]);
      std::vector<float> weights;
      for (double w : expected["weights"]) weights.push_back(static_cast<float>(w));
      if (diff.empty() && actual.weights != weights) diff = "weights differ";
      for (float w : weights) weighted += length == 75 && w != 1.0f;
      if (!diff.empty()) {
        ++mismatches;
        ADD_FAILURE() << name << " weighted_" << length << ": '" << text << "'\n  " << diff;
      }
    }
  }
  EXPECT_GT(weighted, 50) << "too few weighted tokens to test the weights";
  EXPECT_EQ(mismatches, 0);
}

// Every code point of planes 0 and 1 (and the newer letters and numbers) through the character
// tables, NFC, lower-casing and byte-level BPE; the reference runs without mojibake repair here.
TEST_F(ClipTokenizerParity, UnicodeSweepMatchesTransformers) {
  const json& sweep = (*reference_)["sweep"];
  ASSERT_GT(sweep.size(), 50u);
  int mismatches = 0;
  for (const json& c : sweep) {
    const std::string diff = compare(tokenizer_->encode(c["text"].get<std::string>()), c["ids"]);
    if (!diff.empty()) {
      ++mismatches;
      ADD_FAILURE() << c["name"].get<std::string>() << ": " << diff;
    }
  }
  EXPECT_EQ(mismatches, 0) << "of " << sweep.size() << " sweep cases";
}

// The same vocabulary as a diffusers tokenizer/ folder, a diffusers model folder, and a plain
// merges.txt: ids identical to the gz file's on every case.
TEST_F(ClipTokenizerParity, LoadsDiffusersFolderAndPlainMerges) {
  fs::create_directories(dir_ / "model");
  fs::copy(dir_ / "tokenizer", dir_ / "model" / "tokenizer");
  for (const fs::path& path :
       {dir_ / "tokenizer", dir_ / "model", dir_ / "tokenizer" / "merges.txt"}) {
    SCOPED_TRACE(path.string());
    const ClipTokenizer other = ClipTokenizer::from_file(path);
    EXPECT_EQ(other.vocab_size(), tokenizer_->vocab_size());
    EXPECT_EQ(other.bos(), tokenizer_->bos());
    EXPECT_EQ(other.eos(), tokenizer_->eos());
    int mismatches = 0;
    for (const json& c : cases()) {
      const std::string text = c["text"];
      if (other.encode(text) != tokenizer_->encode(text)) ++mismatches;
    }
    EXPECT_EQ(mismatches, 0);
  }
}

// The vocabulary built into lorapipe (for single files without --tokenizer) is open_clip's file
// byte for byte, and tokenizes every case as that file does (and so as transformers does).
TEST_F(ClipTokenizerParity, BuiltInVocabularyIsOpenClipsFile) {
  std::ifstream in((*reference_)["vocab_gz"].get<std::string>(), std::ios::binary);
  const std::string file((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ASSERT_FALSE(ClipTokenizer::builtin_vocabulary().empty())
      << "this build has no built-in CLIP vocabulary: scripts/deps.sh installs open_clip_torch "
         "for the build to embed";
  EXPECT_TRUE(ClipTokenizer::builtin_vocabulary() == file) << "the built-in bytes differ";
  const ClipTokenizer builtin = ClipTokenizer::builtin();
  EXPECT_EQ(builtin.vocab_size(), tokenizer_->vocab_size());
  int mismatches = 0;
  for (const json& c : cases()) {
    const std::string text = c["text"];
    if (builtin.encode(text) != tokenizer_->encode(text)) ++mismatches;
  }
  EXPECT_EQ(mismatches, 0);
}

// clip_tokenizer_tables.inc is what make_clip_tokenizer_tables.py writes with the test venv's
// regex, ftfy and Python: a venv upgrade that changes a character class is caught here.
TEST(ClipTokenizerParityTables, GeneratedTablesAreCurrent) {
  const char* python = std::getenv("LORAPIPE_PYTHON");
  ASSERT_TRUE(python != nullptr && *python != '\0')
      << "LORAPIPE_PYTHON (the test venv's python) is not set";
  const std::string source = LORAPIPE_SOURCE_DIR;
  const std::string command = std::string(python) + " " + source +
                              "/models/reference/make_clip_tokenizer_tables.py --check " + source +
                              "/models/clip_tokenizer_tables.inc";
  EXPECT_EQ(std::system(command.c_str()), 0) << command;
}

// Small files written here; no Python needed.
class ClipTokenizerParityTinyVocab : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("lorapipe-clip-tokenizer-bad-" + std::to_string(getpid()) + "-" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  fs::path write(const std::string& name, const std::string& bytes) {
    const fs::path path = dir_ / name;
    fs::create_directories(path.parent_path());
    std::ofstream(path, std::ios::binary) << bytes;
    return path;
  }

  // "hello" is one token: merges h e, l l, he ll, hell o</w>.
  ClipTokenizer tiny() {
    return ClipTokenizer::from_file(
        write("merges.txt", "#version: 0.2\nh e\nl l\nhe ll\nhell o</w>\n"));
  }

  template <typename F>
  static std::string error_of(F&& f) {
    try {
      f();
    } catch (const InputError& e) {
      return e.what();
    }
    return "(no InputError)";
  }

  fs::path dir_;
};

TEST_F(ClipTokenizerParityTinyVocab, TinyVocabularyFollowsOpenClipLayout) {
  const ClipTokenizer t = tiny();
  // 256 bytes, 256 with </w>, 4 merges, then the two special tokens.
  EXPECT_EQ(t.vocab_size(), 518u);
  EXPECT_EQ(t.bos(), 516);
  EXPECT_EQ(t.eos(), 517);
  EXPECT_EQ(t.encode("Hello  HELLO\n"), (std::vector<int32_t>{515, 515}));
  // "hel": h e -> he; (he, l</w>) has no merge.
  EXPECT_EQ(t.encode("hel"), (std::vector<int32_t>{512, 75 + 256}));
  EXPECT_EQ(t.encode_padded("hello", 5), (std::vector<int32_t>{516, 515, 517, 517, 517}));
  EXPECT_EQ(t.encode("<|endoftext|>hello<|startoftext|>"), (std::vector<int32_t>{517, 515, 516}));
}

// Many threads share one tokenizer and its BPE cache, past the cache's size limit; each gets
// the ids a lone thread gets.
TEST_F(ClipTokenizerParityTinyVocab, ConcurrentEncodeGivesTheSameIds) {
  const ClipTokenizer t = tiny();
  auto letters = [](uint64_t n) {
    std::string word;
    for (; n > 0; n /= 26) word.push_back(static_cast<char>('a' + n % 26));
    return word;
  };
  std::vector<std::string> texts;  // about 80k distinct words
  for (uint64_t i = 1; i <= 40000; ++i) {
    texts.push_back("hello " + letters(i) + " " + letters(i * 7919) + "!");
  }
  std::vector<std::vector<int32_t>> expected;
  for (const std::string& text : texts) expected.push_back(t.encode(text));
  std::atomic<int> mismatches{0};
  std::vector<std::thread> threads;
  for (int k = 0; k < 4; ++k) {
    threads.emplace_back([&, k] {
      for (size_t i = k; i < texts.size() + k; ++i) {
        const size_t j = (i * 2654435761u) % texts.size();
        if (t.encode(texts[j]) != expected[j]) ++mismatches;
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(mismatches.load(), 0);
}

TEST_F(ClipTokenizerParityTinyVocab, MissingFileIsNamed) {
  const fs::path missing = dir_ / "nope.txt.gz";
  EXPECT_NE(error_of([&] { ClipTokenizer::from_file(missing); }).find(missing.string()),
            std::string::npos);
}

TEST_F(ClipTokenizerParityTinyVocab, CorruptGzipIsNamed) {
  const fs::path path = write("vocab.txt.gz", std::string("\x1f\x8b\x08\x00garbage", 12));
  const std::string error = error_of([&] { ClipTokenizer::from_file(path); });
  EXPECT_NE(error.find(path.string()), std::string::npos) << error;
  EXPECT_NE(error.find("gzip"), std::string::npos) << error;
}

TEST_F(ClipTokenizerParityTinyVocab, MalformedMergeLineIsNamedWithItsLine) {
  const fs::path path = write("merges.txt", "#version: 0.2\nh e\nthree parts here\n");
  const std::string error = error_of([&] { ClipTokenizer::from_file(path); });
  EXPECT_NE(error.find(path.string()), std::string::npos) << error;
  EXPECT_NE(error.find("line 3"), std::string::npos) << error;
}

TEST_F(ClipTokenizerParityTinyVocab, HeaderOnlyIsRejected) {
  const fs::path path = write("merges.txt", "#version: 0.2\n");
  EXPECT_NE(error_of([&] { ClipTokenizer::from_file(path); }).find("no BPE merges"),
            std::string::npos);
}

TEST_F(ClipTokenizerParityTinyVocab, FolderWithoutVocabJsonIsNamed) {
  write("tokenizer/merges.txt", "#version: 0.2\nh e\n");
  const std::string error = error_of([&] { ClipTokenizer::from_file(dir_ / "tokenizer"); });
  EXPECT_NE(error.find("vocab.json"), std::string::npos) << error;
}

TEST_F(ClipTokenizerParityTinyVocab, VocabWithoutSpecialTokensIsNamed) {
  write("tokenizer/merges.txt", "#version: 0.2\nh e\n");
  const fs::path vocab = write("tokenizer/vocab.json", R"({"h": 0, "e": 1, "he": 2})");
  const std::string error = error_of([&] { ClipTokenizer::from_file(dir_ / "tokenizer"); });
  EXPECT_NE(error.find(vocab.string()), std::string::npos) << error;
  EXPECT_NE(error.find("<|startoftext|>"), std::string::npos) << error;
  write("tokenizer/vocab.json", "{not json");
  EXPECT_NE(error_of([&] { ClipTokenizer::from_file(dir_ / "tokenizer"); }).find("not valid JSON"),
            std::string::npos);
}

TEST_F(ClipTokenizerParityTinyVocab, InvalidUtf8TextNamesTheByte) {
  const ClipTokenizer t = tiny();
  const std::string error = error_of([&] { t.encode("caf\xc3"); });
  EXPECT_NE(error.find("byte 3"), std::string::npos) << error;
  EXPECT_NE(error_of([&] { t.encode("\xed\xa0\x80"); }).find("byte 0"), std::string::npos);
  EXPECT_NE(error_of([&] { t.encode("\xc0\xaf"); }).find("not valid UTF-8"), std::string::npos);
  EXPECT_NE(error_of([&] { fix_text("\xff"); }).find("not valid UTF-8"), std::string::npos);
}

TEST_F(ClipTokenizerParityTinyVocab, LengthsOutsideKohyasChoicesAreRejected) {
  const ClipTokenizer t = tiny();
  EXPECT_NE(error_of([&] { kohya_long_prompt_ids(t, "hello", 100); }).find("100"), std::string::npos);
  EXPECT_NE(error_of([&] { t.encode_padded("hello", 1); }).find("max_length 1"), std::string::npos);
  EXPECT_EQ(kohya_long_prompt_ids(t, "hello", 75), t.encode_padded("hello"));
}

}  // namespace
}  // namespace lorapipe::models
