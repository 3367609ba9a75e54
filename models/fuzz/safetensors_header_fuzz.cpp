// libFuzzer target: a whole safetensors file from the fuzzer's bytes, opened through the real
// reader. Any outcome but InputError (a crash, a sanitizer report, another exception, a huge
// allocation) is a bug.
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <string>

#include "common/error.h"
#include "models/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string path = "/tmp/lorapipe-fuzz-" + std::to_string(getpid()) + ".safetensors";
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) return 0;
  std::fwrite(data, 1, size, f);
  std::fclose(f);
  try {
    const auto file = lorapipe::models::SafetensorsFile::open(path);
    for (const auto& t : file.tensors()) {
      const std::string_view bytes = file.bytes(t);
      volatile char sink = bytes.empty() ? 0 : bytes[bytes.size() - 1];
      (void)sink;
    }
  } catch (const lorapipe::InputError&) {
  }
  return 0;
}
