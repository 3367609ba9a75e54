#pragma once
// A TensorBoard event file writer for the trainer's scalars (loss, learning rates, ...), with
// no TensorFlow and no LibTorch.
//
// The file is what torch.utils.tensorboard.SummaryWriter writes: a sequence of TFRecords
// (tensorflow/core/lib/io/record_writer.cc), each
//   uint64 length (little endian) | uint32 masked_crc32c(length) | data | uint32
//   masked_crc32c(data)
// where data is a serialized tensorflow.Event (proto/tensorboard.proto). The first record carries
// file_version "brain.Event:2"; each scalar is one Event with a Summary.Value.simple_value.

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <string>
#include <string_view>

namespace lorapipe::trainer {

// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78, init and final xor 0xFFFFFFFF);
// crc32c("123456789") == 0xE3069283.
uint32_t crc32c(std::string_view data);

// TFRecord's checksum: CRC-32C rotated right by 15 bits plus 0xa282ead8
// (tensorflow/core/lib/hash/crc32c.h Mask), so a CRC of data that holds CRCs stays useful.
uint32_t masked_crc32c(std::string_view data);

// Seconds since the Unix epoch, with sub-second precision: an Event's wall_time.
double wall_time_now();

// Writes one events file. Not thread-safe: one writer per thread, or a lock around it.
class TensorBoardWriter {
 public:
  // Creates `dir` (and its parents) if missing and a new file in it named
  // events.out.tfevents.<unix seconds>.<hostname>.<pid>.<n>, n counting the writers this process
  // has opened (0 for the first), as torch's SummaryWriter names them; an existing file is never
  // overwritten. Writes the file_version event. Throws lorapipe::Error naming the path when
  // the folder or the file cannot be made.
  static TensorBoardWriter open(const std::filesystem::path& dir);

  TensorBoardWriter(TensorBoardWriter&& other) noexcept;
  TensorBoardWriter& operator=(TensorBoardWriter&& other) noexcept;
  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;
  // Flushes and closes; an error then is logged, not thrown (call close() to see it).
  ~TensorBoardWriter();

  // Appends one scalar under `tag` (TensorBoard groups tags by their prefix before '/':
  // "loss/train", "lr/unet"). The value is stored as a float32, as every TensorBoard scalar
  // is; NaN and infinities are stored as they are. Buffered: readers see it after flush().
  // Throws lorapipe::Error naming the file when the write fails, or when the writer is closed.
  void add_scalar(const std::string& tag, double value, int64_t step,
                  double wall_time = wall_time_now());

  // Hands everything written so far to the operating system, where a running TensorBoard reads
  // it. Throws lorapipe::Error naming the file on failure.
  void flush();

  // Flushes and closes the file; later writes throw. Throws lorapipe::Error on failure.
  void close();

  const std::filesystem::path& path() const { return path_; }

 private:
  TensorBoardWriter(std::filesystem::path path, std::FILE* file);
  void write_record(std::string_view data);
  void close_logging_errors() noexcept;  // the destructor's close

  std::filesystem::path path_;
  std::FILE* file_ = nullptr;  // null once closed or moved from
};

}  // namespace lorapipe::trainer
