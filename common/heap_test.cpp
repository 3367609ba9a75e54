#include "common/heap.h"

#include <sys/resource.h>

#include <cstdlib>
#include <cstring>

#include <gtest/gtest.h>

namespace {

long minor_faults() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return usage.ru_minflt;
}

// Page faults taken by the second of two malloc/touch/free rounds of three 40 MiB blocks, the
// shape of a training step that frees its activations and allocates them again.
long faults_when_allocating_again() {
  constexpr size_t kBlock = size_t{40} << 20;
  auto round = [&] {
    void* blocks[3];
    for (size_t i = 0; i < 3; ++i) {
      blocks[i] = std::malloc(kBlock + i * 4096);
      std::memset(blocks[i], 1, kBlock);
      EXPECT_EQ(static_cast<volatile char*>(blocks[i])[kBlock / 2], 1);  // keeps the memset
    }
    for (void* block : blocks) std::free(block);
  };
  round();
  const long before = minor_faults();
  round();
  return minor_faults() - before;
}

}  // namespace

// One test, in this order: the control needs the process as it was before the policy.
TEST(HeapPolicy, FreedLargeBlocksAreReusedWithoutPageFaults) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "lorapipe-skip: AddressSanitizer replaces malloc; the policy is glibc's";
#endif
  const long pages = 3 * (40l << 20) / 4096;
  // Control: glibc's default gives each block its own mmap and unmaps it on free, so every page
  // faults in again (at least half of them, whatever fault-around does).
  EXPECT_GT(faults_when_allocating_again(), pages / 2);
  lorapipe::keep_freed_memory_for_reuse();
  // With the policy the blocks come back from the heap already faulted in. The bound leaves
  // room for a few pages of heap bookkeeping.
  EXPECT_LT(faults_when_allocating_again(), pages / 100);
}
