#include "common/file.h"

#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>
#include <system_error>

#include "common/error.h"

namespace lorapipe {

void write_file(const std::filesystem::path& path, std::string_view bytes, bool sync) {
  std::FILE* out = std::fopen(path.c_str(), "wb");
  if (out == nullptr) throw Error("cannot write " + path.string() + ": " + std::strerror(errno));
  int error = 0;
  if (std::fwrite(bytes.data(), 1, bytes.size(), out) != bytes.size() || std::fflush(out) != 0 ||
      (sync && fsync(fileno(out)) != 0)) {
    error = errno;
  }
  if (std::fclose(out) != 0 && error == 0) error = errno;
  if (error != 0) {
    std::error_code ignored;  // the write's error is the one to report
    std::filesystem::remove(path, ignored);
    throw Error("cannot write " + path.string() + ": " + std::strerror(error));
  }
}

}  // namespace lorapipe
