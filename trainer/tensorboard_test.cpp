// TensorBoardWriter against the Python tensorboard package (test venv, LORAPIPE_PYTHON): its
// crc32c gives our checksums, and trainer/reference/read_tensorboard.py reads our files with
// the record reader and EventFileLoader TensorBoard itself uses.
//
// Tolerance: none. Checksums are equal integers; every scalar read back has exactly the bits of
// float(value) (TensorBoard stores float32), the step and the wall time we wrote.
#include "tests/paths.h"
#include "trainer/tensorboard.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <bit>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <nlohmann/json.hpp>
#include <regex>
#include <string>
#include <vector>

#include "common/error.h"

namespace lorapipe::trainer {
namespace {
namespace fs = std::filesystem;
using nlohmann::json;

// Runs read_tensorboard.py with `args`, returns its JSON; a failure to run fails the test.
json run_reader(const std::string& args) {
  const char* python = std::getenv("LORAPIPE_PYTHON");
  if (python == nullptr || *python == '\0') {
    ADD_FAILURE() << "LORAPIPE_PYTHON (the test venv's python) is not set";
    return json();
  }
  const std::string command = std::string(python) + " " + LORAPIPE_SOURCE_DIR +
                              "/trainer/reference/read_tensorboard.py " + args;
  std::FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) {
    ADD_FAILURE() << "cannot run " << command;
    return json();
  }
  std::string out;
  char buffer[4096];
  for (size_t n; (n = std::fread(buffer, 1, sizeof(buffer), pipe)) > 0;) out.append(buffer, n);
  const int status = pclose(pipe);
  if (status != 0) {
    ADD_FAILURE() << command << " failed (status " << status << ")";
    return json();
  }
  return json::parse(out);
}

std::string hex(std::string_view bytes) {
  static const char kDigits[] = "0123456789abcdef";
  std::string out;
  for (const char c : bytes) {
    out.push_back(kDigits[static_cast<unsigned char>(c) >> 4]);
    out.push_back(kDigits[static_cast<unsigned char>(c) & 15]);
  }
  return out;
}

std::string read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_file(const fs::path& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

// Offsets of each TFRecord in `bytes` (8-byte length, 4-byte CRC, data, 4-byte CRC).
std::vector<size_t> record_offsets(const std::string& bytes) {
  std::vector<size_t> offsets;
  for (size_t at = 0; at + 12 <= bytes.size();) {
    offsets.push_back(at);
    uint64_t length = 0;
    for (int i = 7; i >= 0; --i) length = (length << 8) | static_cast<unsigned char>(bytes[at + i]);
    at += 12 + length + 4;
  }
  return offsets;
}

class TrainTensorBoard : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("lorapipe-tensorboard-" + std::to_string(getpid()) + "-" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  fs::path dir_;
};

// The standard check value, the iSCSI vectors of RFC 3720 B.4, and tensorboard's own crc32c and
// masked_crc32c on inputs that include a record length header.
TEST_F(TrainTensorBoard, Crc32cMatchesCheckValuesAndTensorBoard) {
  EXPECT_EQ(crc32c("123456789"), 0xE3069283u);
  EXPECT_EQ(crc32c(""), 0u);
  EXPECT_EQ(crc32c(std::string(32, '\0')), 0x8A9136AAu);
  EXPECT_EQ(crc32c(std::string(32, '\xff')), 0x62A8AB43u);

  std::string all_bytes;
  for (int i = 0; i < 256; ++i) all_bytes.push_back(static_cast<char>(i));
  const std::vector<std::string> inputs = {
      "123456789",
      "",
      std::string(32, '\0'),
      all_bytes,
      std::string("\x18\x00\x00\x00\x00\x00\x00\x00", 8),  // a record header of length 24
      "brain.Event:2"};
  std::string args = "crc32c";
  for (const std::string& input : inputs) args += " '" + hex(input) + "'";
  const json reference = run_reader(args);
  ASSERT_TRUE(reference.is_object()) << "the reader gave no result";
  ASSERT_EQ(reference["checksums"].size(), inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    EXPECT_EQ(crc32c(inputs[i]), reference["checksums"][i]["crc32c"].get<uint32_t>())
        << "input " << i;
    EXPECT_EQ(masked_crc32c(inputs[i]), reference["checksums"][i]["masked"].get<uint32_t>())
        << "input " << i;
  }
}

TEST_F(TrainTensorBoard, ScalarsReadBackByTensorBoard) {
  struct Scalar {
    std::string tag;
    int64_t step;
    double value;
    double wall_time;
  };
  const double t0 = 1.7e9 + 0.125;
  std::vector<Scalar> written;
  for (int64_t step = 0; step < 5; ++step) {
    // Doubles that a float cannot hold exactly, so the float32 rounding is what is compared.
    written.push_back({"loss/train", step, 0.1 + 1.0 / (3.0 + step), t0 + 0.37 * step});
    written.push_back({"lr/unet", step, 1e-4 * (1.0 - 0.1 * step), t0 + 0.37 * step + 1e-6});
  }
  written.push_back({"loss/train", int64_t{1} << 40, -2.5e30, t0 + 100});  // int64 step, big value
  written.push_back({"loss/diverged", 7, std::numeric_limits<double>::infinity(), t0 + 101});
  written.push_back({"loss/diverged", 8, std::numeric_limits<double>::quiet_NaN(), t0 + 102});
  written.push_back({"grad/norm", 9, 1e-45, t0 + 103});  // rounds to the smallest float denormal

  const double before = wall_time_now();
  fs::path path;
  {
    TensorBoardWriter writer = TensorBoardWriter::open(dir_ / "logs" / "run1");
    path = writer.path();
    EXPECT_EQ(path.parent_path(), dir_ / "logs" / "run1");
    char host[256] = {};
    gethostname(host, sizeof(host) - 1);
    const std::regex name("events\\.out\\.tfevents\\.[0-9]{10}\\." +
                          std::regex_replace(std::string(host), std::regex("[.]"), "\\.") + "\\." +
                          std::to_string(getpid()) + "\\.[0-9]+");
    EXPECT_TRUE(std::regex_match(path.filename().string(), name)) << path;

    for (size_t i = 0; i < 4; ++i) {
      writer.add_scalar(written[i].tag, written[i].value, written[i].step, written[i].wall_time);
    }
    // A running TensorBoard sees what was flushed, while the writer stays open.
    writer.flush();
    const json partial = run_reader("read '" + path.string() + "'");
    ASSERT_TRUE(partial.is_object()) << "the reader gave no result";
    EXPECT_EQ(partial["records"], 5);
    EXPECT_EQ(partial["data_loss"], nullptr);
    EXPECT_EQ(partial["scalars"].size(), 4u);

    for (size_t i = 4; i < written.size(); ++i) {
      writer.add_scalar(written[i].tag, written[i].value, written[i].step, written[i].wall_time);
    }
    writer.add_scalar("time/default", 1.0, 99);  // wall time defaults to now
  }                                              // the destructor flushes and closes
  const double after = wall_time_now();

  const json read = run_reader("read '" + path.string() + "'");
  ASSERT_TRUE(read.is_object()) << "the reader gave no result";
  EXPECT_EQ(read["records"], 1 + written.size() + 1);
  EXPECT_EQ(read["data_loss"], nullptr);
  EXPECT_EQ(read["file_version"], "brain.Event:2");
  for (const char* tag : {"loss/train", "lr/unet", "loss/diverged", "grad/norm", "time/default"}) {
    EXPECT_EQ(read["plugins"][tag], "scalars") << tag;
  }
  const json& scalars = read["scalars"];
  ASSERT_EQ(scalars.size(), written.size() + 1);
  for (size_t i = 0; i < written.size(); ++i) {
    const Scalar& w = written[i];
    const json& r = scalars[i];
    SCOPED_TRACE(w.tag + " step " + std::to_string(w.step));
    EXPECT_EQ(r["tag"], w.tag);
    EXPECT_EQ(r["step"].get<int64_t>(), w.step);
    EXPECT_EQ(r["wall_time"].get<double>(), w.wall_time);  // a double on disk: exact
    EXPECT_EQ(r["dtype"], "float32");
    EXPECT_EQ(r["shape"], json::array());
    const auto bits = r["bits"].get<uint32_t>();
    if (std::isnan(w.value)) {
      EXPECT_TRUE(std::isnan(std::bit_cast<float>(bits))) << std::hex << bits;
    } else {
      EXPECT_EQ(bits, std::bit_cast<uint32_t>(static_cast<float>(w.value)))
          << "read back " << std::bit_cast<float>(bits) << ", wrote " << w.value;
    }
  }
  const json& last = scalars.back();
  EXPECT_EQ(last["tag"], "time/default");
  EXPECT_EQ(last["value"].get<double>(), 1.0);
  EXPECT_GE(last["wall_time"].get<double>(), before);
  EXPECT_LE(last["wall_time"].get<double>(), after);
}

// One flipped byte must not pass as data. TensorBoard's record reader raises DataLossError
// ("failed ... crc32 check"); EventFileLoader, what the TensorBoard server reads with, swallows
// that error silently (it cannot tell a corrupt record from one still being written) and stops:
// the scalars before the damage are shown, none of the damaged record or after it.
TEST_F(TrainTensorBoard, FlippedByteIsDataLossForTensorBoard) {
  fs::path path;
  {
    TensorBoardWriter writer = TensorBoardWriter::open(dir_);
    path = writer.path();
    for (int64_t step = 0; step < 4; ++step) writer.add_scalar("loss", 0.5 * step, step, 1e9);
    writer.close();
  }
  const std::string good = read_file(path);
  const std::vector<size_t> offsets = record_offsets(good);
  ASSERT_EQ(offsets.size(), 5u);  // file_version, 4 scalars

  const json intact = run_reader("read '" + path.string() + "'");
  ASSERT_TRUE(intact.is_object()) << "the reader gave no result";
  EXPECT_EQ(intact["records"], 5);
  EXPECT_EQ(intact["data_loss"], nullptr);
  EXPECT_EQ(intact["scalars"].size(), 4u);

  struct Damage {
    const char* what;
    size_t offset;  // of the flipped byte
    const char* message;
  };
  const Damage damages[] = {
      // Record 3 (the scalar at step 2): a byte of its data, then a byte of its length.
      {"data", offsets[3] + 12 + 5, "failed event crc32 check"},
      {"length", offsets[3] + 1, "failed header crc32 check"},
  };
  for (const Damage& damage : damages) {
    SCOPED_TRACE(damage.what);
    std::string bad = good;
    bad[damage.offset] = static_cast<char>(bad[damage.offset] ^ 0x40);
    write_file(path, bad);
    const json read = run_reader("read '" + path.string() + "'");
    ASSERT_TRUE(read.is_object()) << "the reader gave no result";
    EXPECT_EQ(read["records"], 3);
    ASSERT_TRUE(read["data_loss"].is_string());
    EXPECT_NE(read["data_loss"].get<std::string>().find(damage.message), std::string::npos)
        << read["data_loss"];
    ASSERT_EQ(read["scalars"].size(), 2u);  // steps 0 and 1 only, and no error raised
    EXPECT_EQ(read["scalars"][1]["step"], 1);
  }
}

TEST_F(TrainTensorBoard, WritersGetTheirOwnFilesAndMove) {
  TensorBoardWriter first = TensorBoardWriter::open(dir_);
  TensorBoardWriter second = TensorBoardWriter::open(dir_);  // same second, same process
  EXPECT_NE(first.path(), second.path());

  TensorBoardWriter moved = std::move(first);
  moved.add_scalar("loss", 1.0, 0, 1e9);
  EXPECT_THROW(first.add_scalar("loss", 1.0, 1, 1e9), Error);  // NOLINT(bugprone-use-after-move)
  second = std::move(moved);  // closes second's file, takes over moved's
  second.add_scalar("loss", 2.0, 1, 1e9);
  second.close();
  EXPECT_THROW(second.add_scalar("loss", 3.0, 2, 1e9), Error);

  const std::vector<size_t> offsets = record_offsets(read_file(second.path()));
  EXPECT_EQ(offsets.size(), 3u);  // file_version and two scalars
  size_t files = 0;
  for ([[maybe_unused]] const auto& entry : fs::directory_iterator(dir_)) ++files;
  EXPECT_EQ(files, 2u);
}

TEST_F(TrainTensorBoard, UnwritableFolderThrowsNamingIt) {
  fs::create_directories(dir_);
  write_file(dir_ / "file", "not a folder");
  try {
    TensorBoardWriter::open(dir_ / "file" / "logs");
    FAIL() << "expected lorapipe::Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find((dir_ / "file" / "logs").string()), std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace lorapipe::trainer
