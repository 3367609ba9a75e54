#pragma once
// Test-only helpers for parity tests against the Python reference implementations: run a
// checked-in reference script, read what it wrote, compare with a stated tolerance.

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <stdexcept>
#include <string>

#include "models/safetensors.h"
#include "models/weights.h"

namespace lorapipe::models::testing {

// A fresh temporary folder, removed by the caller.
inline std::filesystem::path make_temp_dir(const std::string& name) {
  const auto dir = std::filesystem::temp_directory_path() /
                   ("lorapipe-" + name + "-" + std::to_string(getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

// Runs models/reference/<script> OUT_DIR with the test venv's python ($LORAPIPE_PYTHON).
inline ::testing::AssertionResult run_reference(const std::string& script,
                                                const std::filesystem::path& out_dir) {
  const char* python = std::getenv("LORAPIPE_PYTHON");
  if (python == nullptr) {
    return ::testing::AssertionFailure() << "LORAPIPE_PYTHON (the test venv's python) is unset";
  }
  const std::string command = std::string(python) + " " + LORAPIPE_SOURCE_DIR +
                              "/models/reference/" + script + " " + out_dir.string();
  if (std::system(command.c_str()) != 0) {
    return ::testing::AssertionFailure() << "reference script failed: " << command;
  }
  return ::testing::AssertionSuccess();
}

// Runs LORAPIPE_SOURCE_DIR/<script> OUT_DIR with $LORAPIPE_PYTHON once per test process and
// returns OUT_DIR, a temporary folder removed when the process exits. `name` labels the folder.
// Throws when the python is unset or the script fails (the test then fails, it never skips).
inline const std::filesystem::path& reference_output(const std::string& script,
                                                     const std::string& name) {
  struct Folders {
    std::map<std::string, std::filesystem::path> by_script;
    ~Folders() {
      std::error_code ignored;
      for (const auto& [script, folder] : by_script) std::filesystem::remove_all(folder, ignored);
    }
  };
  static Folders folders;
  if (auto it = folders.by_script.find(script); it != folders.by_script.end()) return it->second;
  const char* python = std::getenv("LORAPIPE_PYTHON");
  if (python == nullptr) {
    throw std::runtime_error("LORAPIPE_PYTHON (the test venv's python) is unset");
  }
  const std::filesystem::path folder = make_temp_dir(name);
  const std::string command =
      std::string(python) + " " + LORAPIPE_SOURCE_DIR + "/" + script + " " + folder.string();
  if (std::system(command.c_str()) != 0) {
    std::error_code ignored;
    std::filesystem::remove_all(folder, ignored);
    throw std::runtime_error("reference script failed: " + command);
  }
  return folders.by_script.emplace(script, folder).first->second;
}

inline std::map<std::string, torch::Tensor> read_all(const std::filesystem::path& path) {
  return read_tensors(SafetensorsFile::open(path));
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
