#pragma once
// Test helpers for driving stages as real processes.

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <regex>
#include <string>
#include <vector>

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

// Each step's loss as the trainer's progress line prints it ("step 3/4  loss 0.1234 ..."), in order.
inline std::vector<double> trainer_losses(const std::string& log) {
  std::vector<double> out;
  const std::regex re(R"(step \d+/\d+  loss ([-0-9.naif]+))");
  for (auto it = std::sregex_iterator(log.begin(), log.end(), re); it != std::sregex_iterator();
       ++it) {
    out.push_back(std::stod((*it)[1]));
  }
  return out;
}

}  // namespace lorapipe::testing
