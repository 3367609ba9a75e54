// python_float_repr against Python's own repr of the same doubles.
#include "common/numbers.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <random>
#include <string>
#include <vector>

namespace lorapipe {
namespace {

TEST(CommonNumbers, FloatReprIsPythons) {
  // The values a LoRA's metadata holds (learning rates, rates, noise settings), the edges of
  // Python's switch between positional and exponent notation, and random doubles of every size.
  std::vector<double> values = {0.0,    -0.0,   1.0,    1e-4,    5e-5,   0.1,     0.3,
                                1e-5,   2e-6,   16.0,   0.0357,  1e15,   1e16,    123456789.125,
                                1.5e16, 9.999999999999999e15,    1e-300, 5e-324,  1.7976931348623157e308,
                                -2.5,   0.00011, 1e22,  0.5,     100.0,  0.05};
  std::mt19937_64 rng(7);
  std::uniform_real_distribution<double> mantissa(1.0, 10.0);
  std::uniform_int_distribution<int> exponent(-30, 30);
  for (int i = 0; i < 2000; ++i) {
    values.push_back(mantissa(rng) * std::pow(10.0, exponent(rng)) * (i % 3 == 0 ? -1 : 1));
  }
  for (int i = 0; i < 500; ++i) {  // any bit pattern that is a finite double
    uint64_t bits = rng();
    double v;
    std::memcpy(&v, &bits, sizeof v);
    if (std::isfinite(v)) values.push_back(v);
  }
  char dir_template[] = "/tmp/lorapipe-repr-XXXXXX";
  ASSERT_NE(mkdtemp(dir_template), nullptr);
  const std::string dir = dir_template;
  {
    std::ofstream out(dir + "/in.txt");
    for (double v : values) {
      char hex[64];
      std::snprintf(hex, sizeof hex, "%a", v);  // exact
      out << hex << "\n";
    }
  }
  const char* python = std::getenv("LORAPIPE_PYTHON");
  ASSERT_NE(python, nullptr) << "LORAPIPE_PYTHON (the test venv's python) is unset";
  const std::string command =
      std::string(python) +
      " -c \"import sys; [print(repr(float.fromhex(l))) for l in sys.stdin.read().split()]\" < " +
      dir + "/in.txt > " + dir + "/out.txt";
  ASSERT_EQ(std::system(command.c_str()), 0) << command;
  std::ifstream in(dir + "/out.txt");
  std::string want;
  size_t checked = 0;
  for (double v : values) {
    ASSERT_TRUE(std::getline(in, want)) << "Python printed fewer lines than values";
    EXPECT_EQ(python_float_repr(v), want) << "for " << v;
    ++checked;
  }
  EXPECT_EQ(checked, values.size());
  std::system(("rm -rf " + dir).c_str());
}

}  // namespace
}  // namespace lorapipe
