// lorapipe-make-tiny-model DIR [SEED] [--sdxl] [--unet_width=N]: writes the tiny SD1.5
// checkpoint (its U-Net widened to N and 2N with --unet_width), or with --sdxl the tiny SDXL one
// (see models/tiny.h).
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <vector>

#include "models/tiny.h"
#include "runtime/exit_code.h"

int main(int argc, char** argv) {
  bool sdxl = false;
  int unet_width = 0;
  std::vector<const char*> args;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--sdxl") == 0) {
      sdxl = true;
    } else if (std::strncmp(argv[i], "--unet_width=", 13) == 0) {
      unet_width = std::atoi(argv[i] + 13);
    } else if (argv[i][0] == '-') {  // --help, a typo: never a folder to write into
      if (std::strcmp(argv[i], "--help") != 0 && std::strcmp(argv[i], "-h") != 0) {
        std::fprintf(stderr, "lorapipe-make-tiny-model: unknown option %s\n", argv[i]);
      }
      args.clear();
      break;
    } else {
      args.push_back(argv[i]);
    }
  }
  if (args.empty() || args.size() > 2) {
    std::fprintf(stderr, "usage: lorapipe-make-tiny-model DIR [SEED] [--sdxl] [--unet_width=N]\n");
    return 2;
  }
  try {
    const uint64_t seed = args.size() > 1 ? std::strtoull(args[1], nullptr, 10) : 0;
    const auto out = sdxl ? lorapipe::models::write_tiny_sdxl_checkpoint(args[0], seed)
                          : lorapipe::models::write_tiny_checkpoint(args[0], seed, unet_width);
    std::printf("diffusers folder: %s\nsingle file:      %s\ntokenizer:        %s\n"
                "(the single file carries no tokenizer, and its small text encoder does not fit "
                "CLIP's built-in one: give it with --tokenizer=%s)\n",
                out.diffusers.c_str(), out.single_file.c_str(), out.tokenizer.c_str(),
                out.tokenizer.c_str());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "lorapipe-make-tiny-model: %s\n", e.what());
    return lorapipe::runtime::kExitError;  // a failure, as every stage's
  }
}
