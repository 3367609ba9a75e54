// lorapipe-inspect FILE|DIR: what a checkpoint is. Exit 0 on a valid file; a one-line reason
// and exit 1 on anything malformed.
#include <cstdio>
#include <exception>

#include "models/inspect.h"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: lorapipe-inspect FILE.safetensors|DIFFUSERS_FOLDER\n");
    return 2;
  }
  try {
    std::fputs(lorapipe::models::inspect_checkpoint(argv[1]).c_str(), stdout);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "lorapipe-inspect: %s\n", e.what());
    return 1;
  }
}
