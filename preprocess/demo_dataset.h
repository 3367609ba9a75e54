#pragma once
// The bundled demo dataset: a few dozen drawn shapes of varied sizes and aspect ratios, with
// captions that describe them, in a kohya repeat folder. Generated on first use (nothing binary
// is committed); the same every time.

#include <array>
#include <filesystem>
#include <string>
#include <vector>

namespace lorapipe::preprocess {

struct DemoImage {
  std::filesystem::path path;
  std::string caption;
  std::array<int, 3> shape_rgb;       // colour at the image centre
  std::array<int, 3> background_rgb;  // colour at the corners
  int width = 0;
  int height = 0;
};

inline constexpr int kDemoRepeats = 10;
inline constexpr const char* kDemoFolder = "10_shapes";

// Writes the dataset under `dir` (dir/10_shapes/NN_<shape>.{jpg,png} with .txt captions) and
// returns what it drew. Overwrites files of the same names.
std::vector<DemoImage> write_demo_dataset(const std::filesystem::path& dir);

}  // namespace lorapipe::preprocess
