#pragma once
// Where a test finds the project's files: found at run time, never compiled in.
//
// An absolute path in a compile definition (-DLORAPIPE_SOURCE_DIR="/work/main") differs between
// two clones, and ccache's base_dir rewrites paths in arguments, not inside a definition's value:
// every test translation unit missed the cache in each fresh clone (CI's), about 1000 s of
// compiling on two cores. So: every executable is built into one folder (CMake's
// CMAKE_RUNTIME_OUTPUT_DIRECTORY, the test's own among them), and CMake writes the source
// folder's path into a file there (lorapipe-source-dir).
//
// The macros keep the names the definitions had; each is a std::string.

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>

namespace lorapipe::testing {

// The folder of the running executable, where CMake puts every executable it builds.
inline std::filesystem::path bin_dir() {
  std::error_code ec;
  const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (ec) throw std::runtime_error("tests/paths.h: cannot read /proc/self/exe: " + ec.message());
  return self.parent_path();
}

// An executable the build made, by its name.
inline std::string built(const std::string& name) { return (bin_dir() / name).string(); }

// The source tree, as CMake wrote it beside the executables at configure time.
inline std::string source_dir() {
  const std::filesystem::path file = bin_dir() / "lorapipe-source-dir";
  std::ifstream in(file);
  std::string dir;
  if (!std::getline(in, dir) || dir.empty()) {
    throw std::runtime_error(file.string() + ": no source folder (CMake writes it; reconfigure)");
  }
  return dir;
}

}  // namespace lorapipe::testing

#define LORAPIPE_SOURCE_DIR (::lorapipe::testing::source_dir())
#define LORAPIPE_BIN_DIR (::lorapipe::testing::bin_dir().string())
// The build folder's test-artifacts/ (bin/ is the build folder's own).
#define LORAPIPE_ARTIFACT_DIR ((::lorapipe::testing::bin_dir().parent_path() / "test-artifacts").string())
#define LORAPIPE_CACHER_BIN (::lorapipe::testing::built("lorapipe-cacher"))
#define LORAPIPE_INSPECT_BIN (::lorapipe::testing::built("lorapipe-inspect"))
#define LORAPIPE_PREPROCESS_BIN (::lorapipe::testing::built("lorapipe-preprocess"))
#define LORAPIPE_SAMPLER_BIN (::lorapipe::testing::built("lorapipe-sampler"))
#define LORAPIPE_TRAINER_BIN (::lorapipe::testing::built("lorapipe-trainer"))
#define LORAPIPE_STORE_TEST_HELPER (::lorapipe::testing::built("cache_store_test_helper"))
