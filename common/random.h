#pragma once
// Draws from std::mt19937_64 that come out the same with every standard library. The engine's
// output is fixed by the C++ standard; std::uniform_int_distribution, uniform_real_distribution
// and std::shuffle are not (libstdc++ and libc++ draw differently). A batch plan, a validation
// split or a caption's augmentation must be the same wherever the same seed runs: ranks on other
// hosts, a state resumed by another build. So those draw through these, whose results are
// defined here from the engine's raw outputs alone.

#include <cstdint>
#include <random>
#include <utility>

namespace lorapipe {

// Uniform in [0, n), n >= 1: the engine's output modulo n, rejecting the 2^64 mod n lowest
// outputs so that every residue has the same count of outputs behind it.
inline uint64_t uniform_below(uint64_t n, std::mt19937_64& rng) {
  const uint64_t reject_below = (uint64_t{0} - n) % n;  // 2^64 mod n
  for (;;) {
    const uint64_t r = rng();
    if (r >= reject_below) return r % n;
  }
}

// Uniform in [0, 1): the engine's top 53 bits, as the 53-bit mantissa of a double.
inline double uniform_unit(std::mt19937_64& rng) {
  return static_cast<double>(rng() >> 11) * 0x1.0p-53;
}

// Fisher-Yates from the back: for i = n .. 2, swap element i - 1 with uniform_below(i).
template <typename RandomIt>
void shuffle(RandomIt first, RandomIt last, std::mt19937_64& rng) {
  const auto n = static_cast<uint64_t>(last - first);
  for (uint64_t i = n; i > 1; --i) {
    const uint64_t j = uniform_below(i, rng);
    using std::swap;
    swap(first[static_cast<std::ptrdiff_t>(i - 1)], first[static_cast<std::ptrdiff_t>(j)]);
  }
}

}  // namespace lorapipe
