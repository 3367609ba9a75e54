#include "models/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <set>

#include "common/error.h"

namespace lorapipe::models {
namespace {

struct DtypeEntry {
  Dtype dtype;
  std::string_view name;
  size_t size;
};

constexpr DtypeEntry kDtypes[] = {
    {Dtype::kF64, "F64", 8},        {Dtype::kF32, "F32", 4},        {Dtype::kF16, "F16", 2},
    {Dtype::kBF16, "BF16", 2},      {Dtype::kF8E4M3, "F8_E4M3", 1}, {Dtype::kF8E5M2, "F8_E5M2", 1},
    {Dtype::kI64, "I64", 8},        {Dtype::kI32, "I32", 4},        {Dtype::kI16, "I16", 2},
    {Dtype::kI8, "I8", 1},          {Dtype::kU8, "U8", 1},          {Dtype::kBool, "BOOL", 1},
};

// Refuses duplicate keys among a header's top-level entries, which nlohmann's parser would
// otherwise merge silently (the last one winning).
class DuplicateKeyCheck {
 public:
  explicit DuplicateKeyCheck(std::string* duplicate) : duplicate_(duplicate) {}
  bool operator()(int depth, nlohmann::json::parse_event_t event, nlohmann::json& parsed) {
    if (event == nlohmann::json::parse_event_t::key && depth == 1) {
      const std::string key = parsed.get<std::string>();
      if (!seen_.insert(key).second && duplicate_->empty()) *duplicate_ = key;
    }
    return true;
  }

 private:
  std::set<std::string> seen_;
  std::string* duplicate_;
};

[[noreturn]] void fail(const std::string& source, const std::string& what) {
  throw InputError(source + ": not a valid safetensors file: " + what);
}

}  // namespace

size_t dtype_size(Dtype dtype) {
  for (const auto& e : kDtypes) {
    if (e.dtype == dtype) return e.size;
  }
  return 0;
}

std::string_view dtype_name(Dtype dtype) {
  for (const auto& e : kDtypes) {
    if (e.dtype == dtype) return e.name;
  }
  return "?";
}

std::optional<Dtype> parse_dtype(std::string_view name) {
  for (const auto& e : kDtypes) {
    if (e.name == name) return e.dtype;
  }
  return std::nullopt;
}

int64_t TensorInfo::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

SafetensorsHeader parse_safetensors_header(std::string_view json, uint64_t data_size,
                                           const std::string& source) {
  std::string duplicate;
  nlohmann::json root;
  try {
    root = nlohmann::json::parse(json.begin(), json.end(), DuplicateKeyCheck(&duplicate));
  } catch (const nlohmann::json::exception& e) {
    fail(source, std::string("header is not JSON (") + e.what() + ")");
  }
  if (!duplicate.empty()) fail(source, "tensor '" + duplicate + "' appears twice in the header");
  if (!root.is_object()) fail(source, "header is not a JSON object");

  SafetensorsHeader header;
  for (auto it = root.begin(); it != root.end(); ++it) {
    const std::string& name = it.key();
    const nlohmann::json& entry = it.value();
    if (name == "__metadata__") {
      if (!entry.is_object()) fail(source, "__metadata__ is not an object");
      for (auto m = entry.begin(); m != entry.end(); ++m) {
        if (!m.value().is_string()) {
          fail(source, "__metadata__ value of '" + m.key() + "' is not a string");
        }
        header.metadata[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    const std::string where = "tensor '" + name + "'";
    if (!entry.is_object()) fail(source, where + " is not an object");
    auto dtype_it = entry.find("dtype");
    auto shape_it = entry.find("shape");
    auto offsets_it = entry.find("data_offsets");
    if (dtype_it == entry.end() || !dtype_it->is_string()) fail(source, where + " has no dtype");
    if (shape_it == entry.end() || !shape_it->is_array()) fail(source, where + " has no shape");
    if (offsets_it == entry.end() || !offsets_it->is_array() || offsets_it->size() != 2) {
      fail(source, where + " has no data_offsets [begin, end]");
    }
    TensorInfo info;
    info.name = name;
    const auto dtype = parse_dtype(dtype_it->get<std::string>());
    if (!dtype) fail(source, where + " has unknown dtype '" + dtype_it->get<std::string>() + "'");
    info.dtype = *dtype;
    // Element count with overflow checks: every dimension non-negative, the byte size in 64 bits.
    unsigned __int128 bytes = dtype_size(info.dtype);
    for (const auto& dim : *shape_it) {
      if (!dim.is_number_integer() || dim.get<int64_t>() < 0 ||
          (dim.is_number_unsigned() && dim.get<uint64_t>() > uint64_t{INT64_MAX})) {
        fail(source, where + " has a negative or non-integer dimension " + dim.dump());
      }
      info.shape.push_back(dim.get<int64_t>());
      bytes *= static_cast<uint64_t>(info.shape.back());
      if (bytes > data_size + uint64_t{1}) {
        // Cannot fit, whatever the offsets say; also stops the product from overflowing.
        bytes = static_cast<unsigned __int128>(data_size) + 2;
      }
    }
    for (const auto& off : *offsets_it) {
      if (!off.is_number_unsigned()) fail(source, where + " has a negative or non-integer offset");
    }
    info.begin = (*offsets_it)[0].get<uint64_t>();
    info.end = (*offsets_it)[1].get<uint64_t>();
    if (info.begin > info.end) fail(source, where + " has reversed data_offsets");
    if (info.end > data_size) {
      fail(source, where + " ends at byte " + std::to_string(info.end) + " of a " +
                       std::to_string(data_size) + "-byte data section");
    }
    if (bytes != info.end - info.begin) {
      fail(source, where + ": shape x " + std::string(dtype_name(info.dtype)) + " needs a " +
                       "different byte length than data_offsets give (" +
                       std::to_string(info.end - info.begin) + " bytes)");
    }
    header.tensors.push_back(std::move(info));
  }
  std::sort(header.tensors.begin(), header.tensors.end(),
            [](const TensorInfo& a, const TensorInfo& b) {
              return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
            });
  // The tensors must tile the data section exactly: no overlap, no gap, nothing after.
  uint64_t expected = 0;
  for (const TensorInfo& t : header.tensors) {
    if (t.begin < expected) fail(source, "tensor '" + t.name + "' overlaps the one before it");
    if (t.begin > expected) {
      fail(source, "gap of " + std::to_string(t.begin - expected) + " bytes before tensor '" +
                       t.name + "'");
    }
    expected = t.end;
  }
  if (expected != data_size) {
    fail(source, std::to_string(data_size - expected) +
                     " bytes after the last tensor that no tensor claims");
  }
  return header;
}

SafetensorsFile SafetensorsFile::open(const std::filesystem::path& path) {
  const std::string source = path.string();
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw InputError(source + ": cannot open: " + std::strerror(errno));
  struct stat st {};
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    throw InputError(source + ": not a regular file");
  }
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size < 8) {
    ::close(fd);
    fail(source, "only " + std::to_string(size) + " bytes, shorter than the 8-byte header length");
  }
  void* mapping = mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  if (mapping == MAP_FAILED) throw InputError(source + ": cannot map: " + std::strerror(errno));
  SafetensorsFile file;
  file.path_ = path;
  file.mapping_ = mapping;
  file.mapping_size_ = size;
  const auto* base = static_cast<const unsigned char*>(mapping);
  uint64_t header_size = 0;
  for (int i = 7; i >= 0; --i) header_size = (header_size << 8) | base[i];
  // What torch.save writes (a zip, or before torch 1.6 a bare pickle: protocol 2 to 5) is named as
  // such wherever a checkpoint, VAE or LoRA is read, rather than by a header length it does not
  // have. Only where the start is no safetensors header: 0x80 0x02 is also the start of a valid
  // 640-byte one.
  const bool pickle_start = std::memcmp(base, "PK\x03\x04", 4) == 0 ||
                            (base[0] == 0x80 && base[1] >= 2 && base[1] <= 5);
  const auto refuse = [&](const std::string& what) {
    if (pickle_start) {
      throw InputError(source + ": a PyTorch pickle checkpoint (torch.save), not safetensors; "
                       "lorapipe never loads pickles, which can run code: convert it to "
                       ".safetensors first");
    }
    fail(source, what);
  };
  if (header_size > kMaxHeaderBytes) {
    refuse("header length " + std::to_string(header_size) + " is over the " +
           std::to_string(kMaxHeaderBytes) + "-byte limit");
  }
  if (header_size > size - 8) {
    refuse("header length " + std::to_string(header_size) + " runs past the end of the " +
           std::to_string(size) + "-byte file (truncated?)");
  }
  if (header_size > 0 && base[8] != '{') refuse("header is not a JSON object");
  const std::string_view json(reinterpret_cast<const char*>(base + 8), header_size);
  file.header_ = parse_safetensors_header(json, size - 8 - header_size, source);
  file.data_ = reinterpret_cast<const char*>(base + 8 + header_size);
  for (size_t i = 0; i < file.header_.tensors.size(); ++i) {
    file.index_[file.header_.tensors[i].name] = i;
  }
  return file;
}

SafetensorsFile::~SafetensorsFile() {
  if (mapping_ != nullptr) munmap(mapping_, mapping_size_);
}

SafetensorsFile::SafetensorsFile(SafetensorsFile&& other) noexcept { *this = std::move(other); }

SafetensorsFile& SafetensorsFile::operator=(SafetensorsFile&& other) noexcept {
  if (this != &other) {
    if (mapping_ != nullptr) munmap(mapping_, mapping_size_);
    path_ = std::move(other.path_);
    header_ = std::move(other.header_);
    index_ = std::move(other.index_);
    data_ = other.data_;
    mapping_ = other.mapping_;
    mapping_size_ = other.mapping_size_;
    other.mapping_ = nullptr;
    other.data_ = nullptr;
    other.mapping_size_ = 0;
  }
  return *this;
}

const TensorInfo* SafetensorsFile::find(std::string_view name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &header_.tensors[it->second];
}

std::string_view SafetensorsFile::bytes(const TensorInfo& tensor) const {
  return {data_ + tensor.begin, tensor.end - tensor.begin};
}

void SafetensorsFile::release(const TensorInfo& tensor) const {
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t begin = reinterpret_cast<uintptr_t>(data_ + tensor.begin);
  const uintptr_t end = reinterpret_cast<uintptr_t>(data_ + tensor.end);
  const uintptr_t first = (begin + page - 1) / page * page, last = end / page * page;
  // Advice only: a failure leaves the pages resident, which costs memory, never correctness.
  if (last > first) (void)madvise(reinterpret_cast<void*>(first), last - first, MADV_DONTNEED);
}

void write_safetensors(const std::filesystem::path& path, const std::vector<TensorToWrite>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  std::set<std::string> names;
  for (const TensorToWrite& t : tensors) {
    if (!names.insert(t.name).second) throw Error("write_safetensors: tensor '" + t.name + "' twice");
    uint64_t expected = dtype_size(t.dtype);
    for (int64_t d : t.shape) {
      if (d < 0) throw Error("write_safetensors: tensor '" + t.name + "' has a negative dimension");
      expected *= static_cast<uint64_t>(d);
    }
    if (expected != t.bytes.size()) {
      throw Error("write_safetensors: tensor '" + t.name + "' has " +
                  std::to_string(t.bytes.size()) + " bytes, its shape and dtype need " +
                  std::to_string(expected));
    }
    header[t.name] = {{"dtype", dtype_name(t.dtype)},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + t.bytes.size()}}};
    offset += t.bytes.size();
  }
  std::string json = header.dump();
  json.append((8 - json.size() % 8) % 8, ' ');  // data section 8-byte aligned, as the package does

  const std::filesystem::path temp =
      path.parent_path() / ("." + path.filename().string() + ".tmp-" + std::to_string(getpid()));
  std::FILE* out = std::fopen(temp.c_str(), "wb");
  if (out == nullptr) throw Error("cannot write " + temp.string() + ": " + std::strerror(errno));
  unsigned char length[8];
  for (int i = 0; i < 8; ++i) length[i] = static_cast<unsigned char>(json.size() >> (8 * i));
  bool ok = std::fwrite(length, 1, 8, out) == 8 &&
            std::fwrite(json.data(), 1, json.size(), out) == json.size();
  for (const TensorToWrite& t : tensors) {
    ok = ok && std::fwrite(t.bytes.data(), 1, t.bytes.size(), out) == t.bytes.size();
  }
  ok = ok && std::fflush(out) == 0 && fsync(fileno(out)) == 0;
  ok = (std::fclose(out) == 0) && ok;
  if (!ok) {
    std::filesystem::remove(temp);
    throw Error("cannot write " + path.string() + ": " + std::strerror(errno));
  }
  std::error_code ec;
  std::filesystem::rename(temp, path, ec);
  if (ec) {
    std::filesystem::remove(temp);
    throw Error("cannot rename " + temp.string() + " to " + path.string() + ": " + ec.message());
  }
  // The rename is on the disk once its folder is: without this, a power cut right after a save
  // may leave the folder without the file it said it saved.
  const std::filesystem::path folder = path.parent_path().empty() ? "." : path.parent_path();
  if (const int fd = ::open(folder.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC); fd >= 0) {
    const int rc = ::fsync(fd);
    const int error = errno;
    ::close(fd);
    if (rc != 0 && error == EIO) {  // some file systems cannot sync a folder (EINVAL): fine
      throw Error("cannot sync the folder " + folder.string() + " after writing " + path.string() +
                  ": " + std::strerror(error));
    }
  }
}

}  // namespace lorapipe::models
