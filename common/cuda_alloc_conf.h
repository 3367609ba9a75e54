#pragma once
// What the CUDA allocator settings in this process's environment (PYTORCH_ALLOC_CONF and
// PYTORCH_CUDA_ALLOC_CONF: LibTorch 2.11 reads expandable_segments from the first before the
// second and the backend the other way round, so a setting in either counts) rule out for
// sharing CUDA memory with another process. Expandable segments map memory through the driver's
// virtual-memory API (their handles travel as file descriptors, which sibling processes may not
// take from each other) and cudaMallocAsync has no IPC handles in LibTorch: with either, a
// trainer's weights cannot be opened by a sampler beside it (models/shared_weights.h). Read
// without LibTorch, so the launcher can decide before any stage starts.

#include <cctype>
#include <cstdlib>
#include <string>

namespace lorapipe {

// Empty when nothing in the settings rules it out; else the variable, its value and why.
inline std::string cuda_alloc_conf_blocks_ipc() {
  for (const char* name : {"PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"}) {
    const char* conf = std::getenv(name);
    if (conf == nullptr) continue;
    std::string folded;
    for (const char ch : std::string(conf)) {
      if (ch != ' ') folded += static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
    }
    for (const char* setting : {"expandable_segments:true", "backend:cudamallocasync"}) {
      if (folded.find(setting) != std::string::npos) {
        return std::string(name) + "=" + conf + " allocates memory CUDA IPC cannot share";
      }
    }
  }
  return "";
}

}  // namespace lorapipe
