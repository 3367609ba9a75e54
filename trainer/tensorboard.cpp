// TFRecord framing and the Event/Summary messages, as tensorflow/core/util/events_writer.cc and
// tensorflow/core/lib/io/record_writer.cc write them; see tensorboard.h.
#include "trainer/tensorboard.h"

#include <unistd.h>

#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <utility>

#include "common/error.h"
#include "common/log.h"
#include "proto/tensorboard.pb.h"

namespace lorapipe::trainer {
namespace {

namespace fs = std::filesystem;
namespace tb = lorapipe::tensorboard;

// The first record of every events file; TensorBoard reads the version after "brain.Event:".
constexpr char kFileVersion[] = "brain.Event:2";

// Byte-at-a-time table for the reflected Castagnoli polynomial. Scalars are a few dozen bytes
// per step, so the slicing-by-8 or SSE4.2 variants would buy nothing measurable here.
constexpr std::array<uint32_t, 256> make_crc32c_table() {
  std::array<uint32_t, 256> table{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t crc = i;
    for (int bit = 0; bit < 8; ++bit) crc = (crc >> 1) ^ ((crc & 1u) ? 0x82F63B78u : 0u);
    table[i] = crc;
  }
  return table;
}
constexpr std::array<uint32_t, 256> kCrc32cTable = make_crc32c_table();

void put_le(std::string& out, uint64_t value, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((value >> (8 * i)) & 0xFF));
}

std::string host_name() {
  char name[256] = {};
  if (gethostname(name, sizeof(name) - 1) != 0 || name[0] == '\0') return "localhost";
  return name;
}

// Counts the writers this process opens, the file name's last part (torch's _global_uid).
std::atomic<int> next_writer_index{0};

}  // namespace

uint32_t crc32c(std::string_view data) {
  uint32_t crc = 0xFFFFFFFFu;
  for (const char c : data) {
    crc = kCrc32cTable[(crc ^ static_cast<unsigned char>(c)) & 0xFFu] ^ (crc >> 8);
  }
  return crc ^ 0xFFFFFFFFu;
}

uint32_t masked_crc32c(std::string_view data) {
  const uint32_t crc = crc32c(data);
  return ((crc >> 15) | (crc << 17)) + 0xA282EAD8u;
}

double wall_time_now() {
  const auto since_epoch = std::chrono::system_clock::now().time_since_epoch();
  return std::chrono::duration<double>(since_epoch).count();
}

TensorBoardWriter TensorBoardWriter::open(const fs::path& dir) {
  std::error_code error;
  fs::create_directories(dir, error);
  if (error) {
    throw Error("tensorboard: cannot create the folder " + dir.string() + ": " + error.message());
  }
  const double now = wall_time_now();
  const std::string stem = "events.out.tfevents." + std::to_string(static_cast<int64_t>(now)) +
                           "." + host_name() + "." + std::to_string(getpid()) + ".";
  // "x": fail rather than overwrite, should another writer have taken the name.
  for (;;) {
    const fs::path path = dir / (stem + std::to_string(next_writer_index++));
    std::FILE* file = std::fopen(path.c_str(), "wbx");
    if (file == nullptr) {
      if (errno == EEXIST) continue;
      throw Error("tensorboard: cannot create " + path.string() + ": " + std::strerror(errno));
    }
    TensorBoardWriter writer(path, file);
    tb::Event event;
    event.set_wall_time(now);
    event.set_file_version(kFileVersion);
    writer.write_record(event.SerializeAsString());
    writer.flush();
    return writer;
  }
}

TensorBoardWriter::TensorBoardWriter(fs::path path, std::FILE* file)
    : path_(std::move(path)), file_(file) {}

TensorBoardWriter::TensorBoardWriter(TensorBoardWriter&& other) noexcept
    : path_(std::move(other.path_)), file_(std::exchange(other.file_, nullptr)) {}

TensorBoardWriter& TensorBoardWriter::operator=(TensorBoardWriter&& other) noexcept {
  if (this != &other) {
    close_logging_errors();
    path_ = std::move(other.path_);
    file_ = std::exchange(other.file_, nullptr);
  }
  return *this;
}

TensorBoardWriter::~TensorBoardWriter() { close_logging_errors(); }

void TensorBoardWriter::close_logging_errors() noexcept {
  if (file_ == nullptr) return;
  try {
    close();
  } catch (const std::exception& e) {
    LP_LOG(kError, "tensorboard") << e.what();
  }
}

void TensorBoardWriter::add_scalar(const std::string& tag, double value, int64_t step,
                                   double wall_time) {
  tb::Event event;
  event.set_wall_time(wall_time);
  event.set_step(step);
  tb::Summary::Value* entry = event.mutable_summary()->add_value();
  entry->set_tag(tag);
  entry->set_simple_value(static_cast<float>(value));
  write_record(event.SerializeAsString());
}

void TensorBoardWriter::flush() {
  if (file_ == nullptr) throw Error("tensorboard: " + path_.string() + " is closed");
  if (std::fflush(file_) != 0) {
    throw Error("tensorboard: cannot write " + path_.string() + ": " + std::strerror(errno));
  }
}

void TensorBoardWriter::close() {
  if (file_ == nullptr) return;
  std::FILE* file = std::exchange(file_, nullptr);
  // fclose flushes; it releases the stream even when that fails.
  if (std::fclose(file) != 0) {
    throw Error("tensorboard: cannot write " + path_.string() + ": " + std::strerror(errno));
  }
}

void TensorBoardWriter::write_record(std::string_view data) {
  if (file_ == nullptr) throw Error("tensorboard: " + path_.string() + " is closed");
  std::string header;
  put_le(header, data.size(), 8);
  put_le(header, masked_crc32c(header), 4);
  std::string footer;
  put_le(footer, masked_crc32c(data), 4);
  if (std::fwrite(header.data(), 1, header.size(), file_) != header.size() ||
      std::fwrite(data.data(), 1, data.size(), file_) != data.size() ||
      std::fwrite(footer.data(), 1, footer.size(), file_) != footer.size()) {
    throw Error("tensorboard: cannot write " + path_.string() + ": " + std::strerror(errno));
  }
}

}  // namespace lorapipe::trainer
