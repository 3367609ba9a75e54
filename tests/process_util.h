#pragma once
// Test helpers for driving stages as real processes.

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

#include "runtime/process.h"

namespace lorapipe::testing {

// The runtime's own (the launcher starts its stages with them too): spawn throws, naming the
// program, when it cannot start; wait_exit gives the exit status or 128 + signal.
using runtime::spawn;
using runtime::wait_exit;

inline std::string read_text(const std::filesystem::path& path) {
  std::ifstream in(path);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

}  // namespace lorapipe::testing
