// common/random.h: draws defined from the engine's raw outputs alone, so any standard library
// gives the same. Each expectation is recomputed here from a second engine with the same seed.

#include "common/random.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <vector>

namespace lorapipe {
namespace {

// The engine itself is the standard's: [rand.predef] fixes its 10000th output from the default
// seed, so the raw outputs below are the same everywhere.
TEST(CommonRandom, TheEngineIsTheStandardsOwn) {
  std::mt19937_64 rng;
  rng.discard(9999);
  EXPECT_EQ(rng(), 9981545732273789042ull);
}

TEST(CommonRandom, UniformBelowIsTheModuloOfTheFirstAcceptedOutput) {
  for (uint64_t n : {1ull, 2ull, 3ull, 7ull, 1000ull, (1ull << 63) + 1, ~0ull}) {
    std::mt19937_64 rng(42), raw(42);
    for (int k = 0; k < 200; ++k) {
      const uint64_t got = uniform_below(n, rng);
      uint64_t r = raw();
      // 2^64 mod n, written out the long way: (2^64 - n) mod n.
      const uint64_t reject_below = (~n + 1) % n;
      while (r < reject_below) r = raw();
      ASSERT_EQ(got, r % n) << "n " << n << " draw " << k;
      ASSERT_LT(got, n);
    }
  }
  // n = 2^63 + 1 rejects almost half the outputs: the draws must still cover both halves.
  std::mt19937_64 rng(7);
  bool low = false, high = false;
  for (int k = 0; k < 64; ++k) {
    const uint64_t x = uniform_below((1ull << 63) + 1, rng);
    (x < (1ull << 62) ? low : high) = true;
  }
  EXPECT_TRUE(low && high);
}

TEST(CommonRandom, UniformUnitIsTheTop53Bits) {
  std::mt19937_64 rng(3), raw(3);
  for (int k = 0; k < 1000; ++k) {
    const double x = uniform_unit(rng);
    EXPECT_EQ(x, static_cast<double>(raw() >> 11) / 9007199254740992.0);  // 2^53
    EXPECT_GE(x, 0.0);
    EXPECT_LT(x, 1.0);
  }
}

TEST(CommonRandom, ShuffleIsFisherYatesFromTheBack) {
  std::vector<int> values(50);
  std::iota(values.begin(), values.end(), 0);
  std::vector<int> expected = values;
  std::mt19937_64 rng(11), raw(11);
  shuffle(values.begin(), values.end(), rng);
  for (size_t i = expected.size(); i > 1; --i) {
    std::swap(expected[i - 1], expected[uniform_below(i, raw)]);
  }
  EXPECT_EQ(values, expected);
  std::vector<int> sorted = values;
  std::sort(sorted.begin(), sorted.end());
  for (int i = 0; i < 50; ++i) ASSERT_EQ(sorted[static_cast<size_t>(i)], i) << "not a permutation";
  EXPECT_NE(values, sorted) << "nothing moved";
  // Empty and single-element ranges draw nothing.
  std::vector<int> one{5};
  std::mt19937_64 a(1), b(1);
  shuffle(one.begin(), one.end(), a);
  shuffle(one.begin(), one.begin(), a);
  EXPECT_EQ(a(), b());
}

}  // namespace
}  // namespace lorapipe
