// lorapipe-make-tiny-model DIR [SEED]: writes the tiny SD1.5 checkpoint (see models/tiny.h).
#include <cstdio>
#include <cstdlib>
#include <exception>

#include "models/tiny.h"

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: lorapipe-make-tiny-model DIR [SEED]\n");
    return 2;
  }
  try {
    const auto out = lorapipe::models::write_tiny_checkpoint(
        argv[1], argc > 2 ? std::strtoull(argv[2], nullptr, 10) : 0);
    std::printf("diffusers folder: %s\nsingle file:      %s\ntokenizer:        %s\n"
                "(the single file carries no tokenizer, and its small text encoder does not fit "
                "CLIP's built-in one: give it with --tokenizer=%s)\n",
                out.diffusers.c_str(), out.single_file.c_str(), out.tokenizer.c_str(),
                out.tokenizer.c_str());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "lorapipe-make-tiny-model: %s\n", e.what());
    return 1;
  }
}
