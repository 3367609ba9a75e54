#include "common/heap.h"

#include <cstdlib>  // defines __GLIBC__ on glibc, tested below

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace lorapipe {

void keep_freed_memory_for_reuse() {
#if defined(__GLIBC__)
  // mallopt caps M_MMAP_THRESHOLD at 32 MiB, and a UNet step has blocks well above that (the
  // GEGLU projection of a 64x64 latent alone is 42 MB), so instead no block is given its own
  // mmap at all (M_MMAP_MAX 0) and the heap is never trimmed (-1, as mallopt(3) documents).
  mallopt(M_MMAP_MAX, 0);
  mallopt(M_TRIM_THRESHOLD, -1);
#endif
}

}  // namespace lorapipe
