// CLIP's BPE vocabulary, built into the binary when CMake found it (models/CMakeLists.txt sets
// LORAPIPE_CLIP_VOCAB_FILE to the file's absolute path). The bytes are the file's own, gzip and
// all: the assembler includes them as they are, so they fingerprint like the file itself.
#include "models/clip_tokenizer.h"

#ifdef LORAPIPE_CLIP_VOCAB_FILE
__asm__(
    ".section .rodata\n"
    ".balign 16\n"
    ".local lorapipe_clip_vocab_begin\n"
    "lorapipe_clip_vocab_begin:\n"
    ".incbin \"" LORAPIPE_CLIP_VOCAB_FILE "\"\n"
    ".local lorapipe_clip_vocab_end\n"
    "lorapipe_clip_vocab_end:\n"
    ".previous\n");
extern "C" const char lorapipe_clip_vocab_begin[];
extern "C" const char lorapipe_clip_vocab_end[];
#endif

namespace lorapipe::models {

std::string_view ClipTokenizer::builtin_vocabulary() {
#ifdef LORAPIPE_CLIP_VOCAB_FILE
  return {lorapipe_clip_vocab_begin,
          static_cast<size_t>(lorapipe_clip_vocab_end - lorapipe_clip_vocab_begin)};
#else
  return {};
#endif
}

}  // namespace lorapipe::models
