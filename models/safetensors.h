#pragma once
// safetensors reading and writing, with no LibTorch (lorapipe-inspect and the fuzzer use it as
// is; models/ wraps tensors around it).
//
// Format (huggingface/safetensors): 8-byte little-endian header length N, N bytes of JSON
// {"name": {"dtype": "F16", "shape": [..], "data_offsets": [begin, end]}, ...,
//  "__metadata__": {"key": "value"}}, then the data section; offsets are relative to it.
//
// The reader trusts nothing: it refuses, with a message naming the file and the tensor, a header
// length past the end of the file or over 100 MB, a header that is not JSON or not of that
// shape, duplicate names, unknown dtypes, negative or overflowing shapes, shape x dtype size that
// is not the byte length, and offsets out of range, reversed, overlapping or leaving gaps. It
// never allocates more than the header size to find that out.

#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace lorapipe::models {

enum class Dtype { kF64, kF32, kF16, kBF16, kF8E4M3, kF8E5M2, kI64, kI32, kI16, kI8, kU8, kBool };

size_t dtype_size(Dtype dtype);
std::string_view dtype_name(Dtype dtype);  // the format's spelling: "F32", "BF16", "F8_E4M3", ...
std::optional<Dtype> parse_dtype(std::string_view name);

struct TensorInfo {
  std::string name;
  Dtype dtype = Dtype::kF32;
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // byte offsets into the data section
  uint64_t end = 0;
  int64_t numel() const;
};

struct SafetensorsHeader {
  std::vector<TensorInfo> tensors;  // in file order (by offset)
  std::map<std::string, std::string> metadata;
};

// The largest header the reader accepts (the Python package's limit too).
inline constexpr uint64_t kMaxHeaderBytes = 100'000'000;

// Validates `json` as the header of a file whose data section has `data_size` bytes. `source`
// names the file in errors. Throws lorapipe::InputError.
SafetensorsHeader parse_safetensors_header(std::string_view json, uint64_t data_size,
                                           const std::string& source);

// A file mapped read-only. Tensor bytes are views into the mapping: valid while this object
// lives (copy them, e.g. to a device tensor, before it goes).
class SafetensorsFile {
 public:
  // Throws lorapipe::InputError naming the file and what is wrong with it.
  static SafetensorsFile open(const std::filesystem::path& path);
  ~SafetensorsFile();
  SafetensorsFile(SafetensorsFile&& other) noexcept;
  SafetensorsFile& operator=(SafetensorsFile&& other) noexcept;
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::filesystem::path& path() const { return path_; }
  const std::vector<TensorInfo>& tensors() const { return header_.tensors; }
  const std::map<std::string, std::string>& metadata() const { return header_.metadata; }
  const TensorInfo* find(std::string_view name) const;
  std::string_view bytes(const TensorInfo& tensor) const;
  // Hands the mapped pages that lie wholly inside `tensor`'s bytes back to the kernel (they are
  // read from the file again if touched): a loader that has copied a tensor out calls it so that
  // the mapping does not add the file's size to the process's resident memory.
  void release(const TensorInfo& tensor) const;

 private:
  SafetensorsFile() = default;
  std::filesystem::path path_;
  SafetensorsHeader header_;
  std::map<std::string, size_t, std::less<>> index_;
  const char* data_ = nullptr;  // start of the data section inside the mapping
  void* mapping_ = nullptr;
  size_t mapping_size_ = 0;
};

struct TensorToWrite {
  std::string name;
  Dtype dtype = Dtype::kF32;
  std::vector<int64_t> shape;
  std::string_view bytes;  // numel * dtype_size bytes, little-endian
};

// Writes a safetensors file: to a temporary name in the same folder, then renamed over `path`,
// so a crash never leaves a half-written file under the real name. Throws lorapipe::Error.
void write_safetensors(const std::filesystem::path& path, const std::vector<TensorToWrite>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

}  // namespace lorapipe::models
