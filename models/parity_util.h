#pragma once
// Test-only helpers for parity tests against the Python reference implementations: run a
// checked-in reference script, read what it wrote, compare with a stated tolerance.

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/sha256.h"
#include "models/safetensors.h"
#include "models/weights.h"
#include "tests/paths.h"

namespace lorapipe::models::testing {

// A fresh temporary folder, removed by the caller.
inline std::filesystem::path make_temp_dir(const std::string& name) {
  const auto dir = std::filesystem::temp_directory_path() /
                   ("lorapipe-" + name + "-" + std::to_string(getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

// Reference outputs are computed once per build tree, not once per test process: ctest runs
// every test in its own process, and a suite of N tests over one reference script would run it
// N times (two at once on two cores, where each run slows the other several-fold). An output is
// a pure function of what the script reads, so it is kept under a key that hashes all of it: the
// python path (its venv names the torch version), scripts/versions.env (the reference packages'
// pins), the OpenMP thread count, every .py file beside the script, and each input file or
// folder's names and bytes.
// Cached outputs live in $LORAPIPE_REFERENCE_CACHE, else in reference-cache/ beside the test
// executable (build/bin/); the first process to need one computes it under an flock while the
// others wait, then all read the same folder. A failed script caches nothing.
inline std::filesystem::path reference_cache_root() {
  if (const char* dir = std::getenv("LORAPIPE_REFERENCE_CACHE"); dir != nullptr && *dir != 0) {
    return dir;
  }
  return std::filesystem::read_symlink("/proc/self/exe").parent_path() / "reference-cache";
}

inline std::string read_bytes(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read " + path.string());
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// Hashes a file, or a folder's regular files in name order, each with its relative name.
inline void hash_tree(Sha256& sha, const std::filesystem::path& path) {
  std::vector<std::filesystem::path> files;
  if (std::filesystem::is_directory(path)) {
    for (const auto& entry : std::filesystem::recursive_directory_iterator(path)) {
      if (entry.is_regular_file()) files.push_back(entry.path());
    }
    std::sort(files.begin(), files.end());
  } else {
    files.push_back(path);
  }
  for (const auto& file : files) {
    const std::string name = std::filesystem::relative(file, path).generic_string();
    sha.update(name).update(std::string(1, '\0'));
    sha.update(sha256_file(file)).update(std::string(1, '\0'));
  }
}

// Runs `$LORAPIPE_PYTHON LORAPIPE_SOURCE_DIR/<script> [inputs...] OUT_DIR` unless the cache
// already holds its output, and returns the cached OUT_DIR (read it, never write into it).
// Throws when the python is unset or the script fails (the test then fails, it never skips).
inline std::filesystem::path cached_reference(const std::string& script,
                                              const std::vector<std::filesystem::path>& inputs = {}) {
  namespace fs = std::filesystem;
  const char* python = std::getenv("LORAPIPE_PYTHON");
  if (python == nullptr) {
    throw std::runtime_error("LORAPIPE_PYTHON (the test venv's python) is unset");
  }
  const fs::path source = LORAPIPE_SOURCE_DIR;
  const fs::path script_path = source / script;
  Sha256 sha;
  sha.update(python).update(std::string(1, '\0')).update(script).update(std::string(1, '\0'));
  sha.update(read_bytes(source / "scripts" / "versions.env"));
  // The threads it computes with: LibTorch's CPU kernels sum in another order with another count,
  // and a test compares its own run (in the same environment) with the output bit for bit.
  const char* threads = std::getenv("OMP_NUM_THREADS");
  sha.update(std::string("OMP_NUM_THREADS=") + (threads != nullptr ? threads : ""))
      .update(std::string(1, '\0'));
  std::vector<fs::path> siblings;
  for (const auto& entry : fs::directory_iterator(script_path.parent_path())) {
    if (entry.path().extension() == ".py") siblings.push_back(entry.path());
  }
  std::sort(siblings.begin(), siblings.end());
  for (const auto& file : siblings) hash_tree(sha, file);
  for (const auto& input : inputs) hash_tree(sha, input);
  const std::string key = script_path.stem().string() + "-" + sha.hex().substr(0, 24);

  const fs::path root = reference_cache_root();
  fs::create_directories(root);
  const fs::path folder = root / key;
  const int lock = ::open((root / (key + ".lock")).c_str(), O_CREAT | O_RDWR | O_CLOEXEC, 0644);
  if (lock < 0) throw std::runtime_error("cannot open the lock of " + folder.string());
  ::flock(lock, LOCK_EX);  // released with the descriptor, also when this process dies
  struct Unlock {
    int fd;
    ~Unlock() { ::close(fd); }
  } unlock{lock};
  if (fs::is_directory(folder)) {
    std::printf("[reference] %s: reusing %s\n", script.c_str(), folder.c_str());
    return folder;
  }
  const fs::path partial = root / (key + ".partial-" + std::to_string(getpid()));
  fs::remove_all(partial);
  fs::create_directories(partial);
  std::string command = std::string(python) + " " + script_path.string();
  for (const auto& input : inputs) command += " " + input.string();
  command += " " + partial.string();
  if (std::system(command.c_str()) != 0) {
    std::error_code ignored;
    fs::remove_all(partial, ignored);
    throw std::runtime_error("reference script failed: " + command);
  }
  fs::rename(partial, folder);  // atomic: a folder under `key` is always complete
  return folder;
}

// Fills OUT_DIR with models/reference/<script>'s output (computed once per build tree).
inline ::testing::AssertionResult run_reference(const std::string& script,
                                                const std::filesystem::path& out_dir) {
  try {
    const auto folder = cached_reference("models/reference/" + script);
    std::filesystem::copy(folder, out_dir,
                          std::filesystem::copy_options::recursive |
                              std::filesystem::copy_options::overwrite_existing);
  } catch (const std::exception& e) {
    return ::testing::AssertionFailure() << e.what();
  }
  return ::testing::AssertionSuccess();
}

// LORAPIPE_SOURCE_DIR/<script>'s output folder (computed once per build tree); read only.
inline std::filesystem::path reference_output(const std::string& script) {
  return cached_reference(script);
}

inline std::map<std::string, torch::Tensor> read_all(const std::filesystem::path& path) {
  return read_tensors(SafetensorsFile::open(path));
}

// Writes `tensors` (each in its own dtype) and `metadata` as a safetensors file: read_all's
// inverse, for tests that hand the loaders a changed copy of a file.
inline void write_all(const std::filesystem::path& path,
                      const std::map<std::string, torch::Tensor>& tensors,
                      const std::map<std::string, std::string>& metadata = {}) {
  std::vector<torch::Tensor> keep;
  keep.reserve(tensors.size());
  std::vector<TensorToWrite> out;
  for (const auto& [name, tensor] : tensors) {
    keep.push_back(tensor.detach().cpu().contiguous());
    const torch::Tensor& t = keep.back();
    out.push_back({name, to_safetensors_dtype(t.scalar_type()), t.sizes().vec(),
                   std::string_view(static_cast<const char*>(t.data_ptr()), t.nbytes())});
  }
  write_safetensors(path, out, metadata);
}

// max|actual - expected| / max|expected|: the error relative to the output's scale.
inline double relative_error(const torch::Tensor& actual, const torch::Tensor& expected) {
  const auto a = actual.detach().to(torch::kFloat64).cpu();
  const auto e = expected.detach().to(torch::kFloat64).cpu();
  return (a - e).abs().max().item<double>() / std::max(e.abs().max().item<double>(), 1e-30);
}

// Compares shapes and values; prints the measured error so the log carries it.
inline void expect_close(const std::string& what, const torch::Tensor& actual,
                         const torch::Tensor& expected, double tolerance) {
  ASSERT_EQ(actual.sizes(), expected.sizes()) << what;
  const double error = relative_error(actual, expected);
  std::printf("[parity] %-40s max relative error %.3g (tolerance %.0e)\n", what.c_str(), error,
              tolerance);
  ::testing::Test::RecordProperty(what, std::to_string(error));
  EXPECT_LE(error, tolerance) << what;
}

}  // namespace lorapipe::models::testing
