// resize_lanczos3 against Pillow's Image.resize(..., Image.LANCZOS), the real reference (test-only
// venv): the same pixels in, byte-identical pixels out.
#include "preprocess/resize.h"
#include "tests/paths.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

namespace lorapipe::preprocess {
namespace {
namespace fs = std::filesystem;

// Smooth gradients with seeded noise: every tap of every weight matters.
std::vector<unsigned char> photo_like(int width, int height, int bands, uint32_t seed) {
  std::vector<unsigned char> pixels(static_cast<size_t>(width) * height * bands);
  uint32_t state = seed;
  for (int y = 0; y < height; ++y) {
    for (int x = 0; x < width; ++x) {
      for (int c = 0; c < bands; ++c) {
        state = state * 1664525u + 1013904223u;
        const int ramp = (x * 255 / width + y * 127 / height + c * 60) % 256;
        const int noise = static_cast<int>(state >> 27) - 16;
        pixels[(static_cast<size_t>(y) * width + x) * bands + c] =
            static_cast<unsigned char>(std::clamp(ramp + noise, 0, 255));
      }
    }
  }
  return pixels;
}

std::string read_all(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// Pillow's result must match to the byte (tolerance zero): both take the same double-precision
// weights, the same 22-bit fixed point and rounding, and the same pass order.
TEST(PreprocessResize, MatchesPillowLanczosExactly) {
  struct Case {
    int width, height, bands, out_width, out_height;
  };
  const Case cases[] = {
      {1000, 750, 3, 683, 512},   // a 1/4-scale JPEG decode to its 512 cover size
      {1500, 1000, 3, 640, 427},  // 2.34x down
      {333, 777, 3, 329, 768},    // barely down; the height loses over twice the pixels: V first
      {400, 400, 3, 390, 380},    // 20 rows against 10 columns: horizontal first still
      {640, 480, 3, 640, 360},    // vertical pass only
      {640, 480, 3, 500, 480},    // horizontal pass only
      {97, 61, 3, 13, 7},         // 7x down: wide filters, clamped at both edges
      {120, 90, 3, 300, 200},     // up
      {100, 100, 3, 150, 99},     // wider and one row shorter: vertical first
      {1001, 675, 1, 517, 349},   // grey
      {400, 400, 1, 390, 379},    // grey, 21 rows against 10 columns: vertical first
  };
  const fs::path dir = fs::temp_directory_path() / ("lorapipe-resize-" + std::to_string(getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  std::vector<std::vector<unsigned char>> ours;
  for (size_t i = 0; i < std::size(cases); ++i) {
    const Case& c = cases[i];
    const std::vector<unsigned char> in = photo_like(c.width, c.height, c.bands, 17 + i);
    const std::string name = (dir / ("case" + std::to_string(i))).string();
    std::ofstream(name + ".raw", std::ios::binary)
        .write(reinterpret_cast<const char*>(in.data()), static_cast<std::streamsize>(in.size()));
    std::ofstream(name + ".case") << c.width << " " << c.height << " " << c.bands << " "
                                  << c.out_width << " " << c.out_height << "\n";
    ours.push_back(resize_lanczos3(in.data(), c.width, c.height, c.bands, c.out_width, c.out_height));
  }
  const char* python = std::getenv("LORAPIPE_PYTHON");
  ASSERT_NE(python, nullptr) << "LORAPIPE_PYTHON (the test venv's python) is not set";
  const std::string command = std::string(python) + " " + LORAPIPE_SOURCE_DIR +
                              "/tests/fixtures/pillow_resize.py " + dir.string();
  ASSERT_EQ(std::system(command.c_str()), 0) << command;
  for (size_t i = 0; i < std::size(cases); ++i) {
    const Case& c = cases[i];
    SCOPED_TRACE(std::to_string(c.width) + "x" + std::to_string(c.height) + "x" +
                 std::to_string(c.bands) + " to " + std::to_string(c.out_width) + "x" +
                 std::to_string(c.out_height));
    const std::string pillow = read_all(dir / ("case" + std::to_string(i) + ".pillow"));
    ASSERT_EQ(ours[i].size(), pillow.size());
    size_t differing = 0;
    for (size_t b = 0; b < pillow.size(); ++b) {
      differing += ours[i][b] != static_cast<unsigned char>(pillow[b]);
    }
    EXPECT_EQ(differing, 0u);
  }
  fs::remove_all(dir);
}

}  // namespace
}  // namespace lorapipe::preprocess
