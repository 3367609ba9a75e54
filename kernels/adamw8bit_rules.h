#pragma once
// The per-element arithmetic of kernels/adamw8bit.h, written once for the CPU reference and the
// CUDA kernel: both include this file, so they run the same fp32 operations in the same order.
// No fused multiply-add may be formed from these lines (see the build flags in
// kernels/CMakeLists.txt); every function is plain fp32.

#include <math.h>

#include <cmath>
#include <cstdint>

#include "kernels/adamw8bit.h"

#if defined(__CUDACC__)
#define LORAPIPE_HD __host__ __device__ __forceinline__
#else
#define LORAPIPE_HD inline
#endif

namespace lorapipe::kernels::adamw8bit_rules {

// True for finite x: NaN - NaN and Inf - Inf are NaN, which compares unequal to 0.
LORAPIPE_HD bool is_finite(float x) { return x - x == 0.f; }

// Step 2: the moments after gradient g.
LORAPIPE_HD void update_moments(const AdamW8bitStep& s, float g, float& m, float& v) {
  m = s.beta1 * m + s.one_minus_beta1 * g;
  v = s.beta2 * v + s.one_minus_beta2 * (g * g);
}

// Step 4: decoupled decay, then the Adam update from the fresh moments.
LORAPIPE_HD float update_param(const AdamW8bitStep& s, float p, float m, float v) {
  p = p * s.decay;
  const float denom = sqrtf(v) / s.correction2 + s.eps;
  return p - s.step_size * (m / denom);
}

// Step 5: the index of the code nearest to x, given mid[k] = (code[k] + code[k + 1]) / 2 for
// k < 255 (ascending): the number of midpoints below x, found by a branch-free binary search
// over 8 halvings. Ties (x on a midpoint) go to the lower code.
LORAPIPE_HD int nearest_code(const float* mid, float x) {
  int index = 0;
  for (int half = 128; half > 0; half >>= 1) {
    if (mid[index + half - 1] < x) index += half;
  }
  return index;
}

// What is rounded to a code: the value over its block's absmax (0 when the block is all zero).
LORAPIPE_HD float normalized(float value, float absmax) {
  return absmax > 0.f ? value / absmax : 0.f;
}

// The first-moment sign fix on the nearest code's index for m.
LORAPIPE_HD int sign_fixed(const float* code, int index, float m) {
  const float c = code[index];
  return index - static_cast<int>((m < 0.f) & (c >= 0.f)) + static_cast<int>((m > 0.f) & (c < 0.f));
}

}  // namespace lorapipe::kernels::adamw8bit_rules
