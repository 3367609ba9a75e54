#pragma once
// Process-wide heap policy for the process that trains (and the bench that stands in for it).

namespace lorapipe {

// Keeps memory that tensors free in the heap for the next step instead of handing it back to the
// kernel. A training step frees and re-allocates the same activation buffers every time. With
// glibc's defaults a block of 128 KiB and up (the threshold then grows by itself, to 32 MiB at
// most) is its own mmap, unmapped on free, and free space at the top of the heap is trimmed, so
// every step faults each page of those buffers in again, zero-filled by the kernel: about 400k
// page faults per SD1.5 UNet step at 64x64, some 15% of its time. This serves every block from
// the heap and never trims it; the step after the first then takes almost no page faults.
//
// The cost is fragmentation: the process keeps its high-water mark, and blocks of changing sizes
// can leave holes. Measured at SD1.5 size: +0.3% peak RSS over a UNet forward+backward, +7% over
// a 512x512 VAE encode (bench/models_bench.py). It covers every allocation, LibTorch's and
// oneDNN's scratch buffers alike, which a caching allocator for tensors alone would not.
// malloc_trim(0) still hands free pages back where a process wants that. Call it first thing in
// main, before any thread starts; a no-op on C libraries other than glibc.
void keep_freed_memory_for_reuse();

}  // namespace lorapipe
