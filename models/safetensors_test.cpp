// safetensors: round trips with the real Python `safetensors` package in both directions, a
// refusal (never a crash or a huge allocation) for each kind of malformed file, and
// lorapipe-inspect on real files.
#include "models/safetensors.h"

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>

#include "common/error.h"
#include "models/inspect.h"
#include "tests/paths.h"

namespace lorapipe::models {
namespace {
namespace fs = std::filesystem;

// The content models/reference/safetensors_roundtrip.py expects (see its docstring).
const char* kDtypeOrder[] = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2",
                             "I64", "I32", "I16", "I8",   "U8",      "BOOL"};
const std::vector<int64_t> kShape{3, 5, 7};

std::string pattern(int k, std::string_view name, size_t n) {
  std::string out(n, '\0');
  for (size_t i = 0; i < n; ++i) {
    out[i] = static_cast<char>(name == "BOOL" ? i % 2 : (i * 7 + k) % 256);
  }
  return out;
}

class SafetensorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("lorapipe-safetensors-" + std::to_string(getpid()));
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  static int python(const std::string& args) {
    const char* python = std::getenv("LORAPIPE_PYTHON");
    if (python == nullptr) return -1;
    const std::string command = std::string(python) + " " + LORAPIPE_SOURCE_DIR +
                                "/models/reference/safetensors_roundtrip.py " + args;
    return std::system(command.c_str());
  }

  // A file whose header is `json` (padded as given) followed by `data_size` zero bytes.
  fs::path raw_file(const std::string& json, size_t data_size, uint64_t declared = UINT64_MAX) {
    const fs::path path = dir_ / ("raw-" + std::to_string(counter_++) + ".safetensors");
    std::ofstream out(path, std::ios::binary);
    const uint64_t length = declared == UINT64_MAX ? json.size() : declared;
    for (int i = 0; i < 8; ++i) out.put(static_cast<char>(length >> (8 * i)));
    out << json << std::string(data_size, '\0');
    return path;
  }

  void expect_refused(const fs::path& path, const std::string& reason) {
    try {
      SafetensorsFile::open(path);
      FAIL() << "accepted a malformed file; expected: " << reason;
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find(reason), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(path.string()), std::string::npos) << e.what();
    }
  }

  fs::path dir_;
  int counter_ = 0;
};

TEST_F(SafetensorsTest, ReadsWhatThePythonPackageWrites) {
  const fs::path path = dir_ / "python.safetensors";
  ASSERT_EQ(python("write " + path.string()), 0);
  const SafetensorsFile file = SafetensorsFile::open(path);
  EXPECT_EQ(file.metadata().at("ss_network_dim"), "16");
  EXPECT_EQ(file.metadata().at("lorapipe"), "caf\xc3\xa9");
  ASSERT_EQ(file.tensors().size(), 14u);
  for (int k = 0; k < 12; ++k) {
    const std::string name = std::string("t_") + kDtypeOrder[k];
    const TensorInfo* t = file.find(name);
    ASSERT_NE(t, nullptr) << name;
    EXPECT_EQ(dtype_name(t->dtype), kDtypeOrder[k]);
    EXPECT_EQ(t->shape, kShape);
    EXPECT_EQ(file.bytes(*t), pattern(k, kDtypeOrder[k], 105 * dtype_size(t->dtype))) << name;
  }
  const TensorInfo* scalar = file.find("scalar");
  ASSERT_NE(scalar, nullptr);
  EXPECT_TRUE(scalar->shape.empty());
  EXPECT_EQ(file.bytes(*scalar), pattern(1, "F32", 4));
  const TensorInfo* empty = file.find("empty");
  ASSERT_NE(empty, nullptr);
  EXPECT_EQ(empty->shape, (std::vector<int64_t>{0, 4}));
  EXPECT_TRUE(file.bytes(*empty).empty());
}

TEST_F(SafetensorsTest, ThePythonPackageReadsWhatLorapipeWrites) {
  std::vector<std::string> storage;
  storage.reserve(14);
  std::vector<TensorToWrite> tensors;
  for (int k = 0; k < 12; ++k) {
    const Dtype dtype = *parse_dtype(kDtypeOrder[k]);
    storage.push_back(pattern(k, kDtypeOrder[k], 105 * dtype_size(dtype)));
    tensors.push_back({std::string("t_") + kDtypeOrder[k], dtype, kShape, storage.back()});
  }
  storage.push_back(pattern(1, "F32", 4));
  tensors.push_back({"scalar", Dtype::kF32, {}, storage.back()});
  tensors.push_back({"empty", Dtype::kF16, {0, 4}, {}});
  const fs::path path = dir_ / "lorapipe.safetensors";
  write_safetensors(path, tensors, {{"ss_network_dim", "16"}, {"lorapipe", "caf\xc3\xa9"}});
  EXPECT_EQ(python("check " + path.string()), 0);
  // Written to a temporary name and renamed: nothing else is left in the folder.
  int files = 0;
  for (const auto& entry : fs::directory_iterator(dir_)) files += entry.is_regular_file();
  EXPECT_EQ(files, 1);
  // The writer refuses bytes that do not match the shape.
  std::vector<TensorToWrite> bad{{"x", Dtype::kF32, {2, 2}, storage[0].substr(0, 12)}};
  EXPECT_THROW(write_safetensors(dir_ / "bad.safetensors", bad), Error);
  EXPECT_FALSE(fs::exists(dir_ / "bad.safetensors"));
}

// release() hands a tensor's pages back to the kernel; the bytes must read the same afterwards
// (re-read from the file), for tensors spanning several pages and for ones inside a page, and
// releasing one tensor must leave its neighbours intact.
TEST_F(SafetensorsTest, ReleasedTensorsReadTheSameAgain) {
  std::vector<std::string> storage{pattern(1, "F32", 3 * 4096 + 12), pattern(2, "U8", 100),
                                   pattern(3, "F32", 2 * 4096)};
  const std::vector<TensorToWrite> tensors{
      {"big", Dtype::kF32, {(3 * 4096 + 12) / 4}, storage[0]},
      {"small", Dtype::kU8, {100}, storage[1]},
      {"next", Dtype::kF32, {2 * 4096 / 4}, storage[2]}};
  const fs::path path = dir_ / "release.safetensors";
  write_safetensors(path, tensors);
  const SafetensorsFile file = SafetensorsFile::open(path);
  for (int round = 0; round < 2; ++round) {
    for (size_t i = 0; i < tensors.size(); ++i) {
      const TensorInfo& info = *file.find(tensors[i].name);
      ASSERT_EQ(file.bytes(info), storage[i]) << tensors[i].name << ", round " << round;
      file.release(info);
    }
  }
}

TEST_F(SafetensorsTest, RefusesEveryMalformedHeader) {
  const std::string ok_entry = R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})";
  // Sanity: the well-formed version opens.
  EXPECT_NO_THROW(SafetensorsFile::open(raw_file("{" + ok_entry + "}", 8)));

  expect_refused(raw_file("{}", 0, /*declared=*/1000), "runs past the end");
  expect_refused(raw_file("{}", 0, /*declared=*/uint64_t{1} << 62), "over the");
  expect_refused(raw_file("{\"a\": nonsense", 8), "header is not JSON");
  expect_refused(raw_file("[1, 2, 3]", 0), "not a JSON object");
  expect_refused(raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,16]}})", 8),
                 "ends at byte 16 of a 8-byte data section");
  expect_refused(raw_file(R"({"a":{"dtype":"F32","shape":[0],"data_offsets":[8,0]}})", 8),
                 "reversed data_offsets");
  expect_refused(raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                          R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                          12),
                 "overlaps");
  expect_refused(raw_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", 8),
                 "gap of 4 bytes");
  expect_refused(raw_file(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8),
                 "different byte length");
  expect_refused(raw_file(R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", 8),
                 "negative or non-integer dimension");
  expect_refused(
      raw_file(R"({"a":{"dtype":"F32","shape":[4294967296,4294967296,16],"data_offsets":[0,8]}})",
               8),
      "different byte length");
  expect_refused(raw_file("{" + ok_entry + "," + ok_entry + "}", 8), "appears twice");
  expect_refused(raw_file(R"({"a":{"dtype":"F12","shape":[2],"data_offsets":[0,8]}})", 8),
                 "unknown dtype 'F12'");
  expect_refused(raw_file(R"({"__metadata__":{"k":1},)" + ok_entry + "}", 8),
                 "is not a string");
  expect_refused(raw_file("{" + ok_entry + "}", 12), "4 bytes after the last tensor");
  // torch.save's files, under any name (a .safetensors renamed, a --network_weights=x.pt):
  // named as pickles, not as a header length over the limit.
  std::ofstream(dir_ / "zip.safetensors") << "PK\x03\x04 a zip with a pickle inside";
  expect_refused(dir_ / "zip.safetensors", "a PyTorch pickle checkpoint (torch.save)");
  std::ofstream(dir_ / "legacy.pt") << std::string("\x80\x02\x8a\x0alegacy pickle", 16);
  expect_refused(dir_ / "legacy.pt", "lorapipe never loads pickles");
  // A 640-byte header's length starts with the bytes of a pickle's protocol 2: it opens.
  const std::string padded = "{" + ok_entry + "}";
  EXPECT_NO_THROW(
      SafetensorsFile::open(raw_file(padded + std::string(640 - padded.size(), ' '), 8)));
  std::ofstream(dir_ / "short.safetensors") << "abc";
  expect_refused(dir_ / "short.safetensors", "shorter than the 8-byte header length");
}

// Flux.1's files as users have them: the transformer (dev or schnell, told by guidance_in, with or
// without the original checkpoint's prefix) and kohya's --t5xxl file.
TEST_F(SafetensorsTest, InspectNamesFluxDevSchnellAndT5Files) {
  const std::string w(4 * 4, '\0');
  auto kind_of = [&](const std::vector<std::string>& names) {
    std::vector<TensorToWrite> tensors;
    for (const auto& n : names) tensors.push_back({n, Dtype::kF32, {2, 2}, w});
    const fs::path file = dir_ / "kind.safetensors";
    write_safetensors(file, tensors);
    const std::string text = inspect_checkpoint(file);
    const size_t at = text.find("kind: ");
    return at == std::string::npos ? text : text.substr(at + 6, text.find('\n', at) - at - 6);
  };
  EXPECT_EQ(kind_of({"double_blocks.0.img_attn.qkv.weight", "guidance_in.in_layer.weight"}),
            "Flux.1 [dev] transformer (original layout)");
  EXPECT_EQ(kind_of({"model.diffusion_model.double_blocks.0.img_attn.qkv.weight"}),
            "Flux.1 [schnell] transformer (original layout)");
  EXPECT_EQ(kind_of({"encoder.block.0.layer.0.SelfAttention.q.weight", "shared.weight"}),
            "T5 encoder (transformers layout)");
  // kohya's transformer file holds no other part: it says which flags give them.
  (void)kind_of({"double_blocks.0.img_attn.qkv.weight", "guidance_in.in_layer.weight"});
  const std::string text = inspect_checkpoint(dir_ / "kind.safetensors");
  EXPECT_NE(text.find("parts: give --clip_l --t5xxl --ae and --t5_tokenizer"), std::string::npos)
      << text;
}

TEST_F(SafetensorsTest, InspectDescribesALoraAndRefusesPickles) {
  // A kohya-named LoRA: rank 4, alpha 2 (F16), two modules.
  const std::string down(4 * 8 * 4, '\0');
  const std::string up(8 * 4 * 4, '\0');
  const std::string alpha("\x00\x40", 2);  // 2.0 in IEEE half
  std::vector<TensorToWrite> tensors{
      {"lora_unet_down_blocks_0_attentions_0_proj_in.lora_down.weight", Dtype::kF32, {4, 8}, down},
      {"lora_unet_down_blocks_0_attentions_0_proj_in.lora_up.weight", Dtype::kF32, {8, 4}, up},
      {"lora_unet_down_blocks_0_attentions_0_proj_in.alpha", Dtype::kF16, {}, alpha},
      {"lora_te_text_model_encoder_layers_0_mlp_fc1.lora_down.weight", Dtype::kF32, {4, 8}, down},
      {"lora_te_text_model_encoder_layers_0_mlp_fc1.lora_up.weight", Dtype::kF32, {8, 4}, up},
      {"lora_te_text_model_encoder_layers_0_mlp_fc1.alpha", Dtype::kF16, {}, alpha},
  };
  const fs::path lora = dir_ / "lora.safetensors";
  write_safetensors(lora, tensors, {{"ss_network_dim", "4"}});
  const std::string text = inspect_checkpoint(lora);
  EXPECT_NE(text.find("kind: LoRA (kohya names)"), std::string::npos) << text;
  EXPECT_NE(text.find("lora: 2 modules, rank 4, alpha 2"), std::string::npos) << text;
  EXPECT_NE(text.find("metadata: ss_network_dim = 4"), std::string::npos) << text;

  // The executable: exit 0 on a valid file, one line and non-zero on a bad one or a pickle.
  auto run_inspect = [&](const fs::path& target, std::string* err) {
    const fs::path err_path = dir_ / "stderr.txt";
    const std::string command = std::string(LORAPIPE_INSPECT_BIN) + " " + target.string() +
                                " >/dev/null 2>" + err_path.string();
    const int status = std::system(command.c_str());
    std::ifstream in(err_path);
    *err = {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
    return WEXITSTATUS(status);
  };
  std::string err;
  EXPECT_EQ(run_inspect(lora, &err), 0) << err;
  std::ofstream(dir_ / "model.ckpt") << "PK\x03\x04 pretend zip with a pickle inside";
  EXPECT_EQ(run_inspect(dir_ / "model.ckpt", &err), 1);
  EXPECT_NE(err.find("never loads pickles"), std::string::npos) << err;
  EXPECT_EQ(std::count(err.begin(), err.end(), '\n'), 1) << err;
  std::ofstream(dir_ / "broken.safetensors") << std::string("\xff\x00\x00\x00\x00\x00\x00\x00", 8);
  EXPECT_EQ(run_inspect(dir_ / "broken.safetensors", &err), 1);
  EXPECT_NE(err.find("not a valid safetensors file"), std::string::npos) << err;
  EXPECT_EQ(std::count(err.begin(), err.end(), '\n'), 1) << err;
}

}  // namespace
}  // namespace lorapipe::models

namespace lorapipe::models {
namespace {

// The fuzzer's kept corpus (models/fuzz/corpus) replayed through the ordinary build: every
// input opens or is refused with InputError, nothing else.
TEST(SafetensorsFuzzCorpus, EveryInputOpensOrIsRefusedCleanly) {
  const std::filesystem::path corpus = std::filesystem::path(LORAPIPE_SOURCE_DIR) / "models/fuzz/corpus";
  int inputs = 0;
  int accepted = 0;
  for (const auto& entry : std::filesystem::directory_iterator(corpus)) {
    ++inputs;
    try {
      const SafetensorsFile file = SafetensorsFile::open(entry.path());
      for (const TensorInfo& t : file.tensors()) {
        EXPECT_EQ(file.bytes(t).size(), t.numel() * dtype_size(t.dtype)) << entry.path();
      }
      ++accepted;
    } catch (const InputError&) {
    }
  }
  EXPECT_GE(inputs, 10);
  EXPECT_GE(accepted, 2);  // the seeds written by the Python package
}

}  // namespace
}  // namespace lorapipe::models
