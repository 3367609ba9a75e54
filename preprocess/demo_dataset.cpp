#include "preprocess/demo_dataset.h"

#include <vips/vips8>

#include <cstdio>
#include <fstream>

#include "common/error.h"
#include "preprocess/image.h"

namespace lorapipe::preprocess {
namespace {

using vips::VImage;

struct Colour {
  const char* name;
  std::array<int, 3> rgb;
};

constexpr Colour kColours[] = {
    {"red", {220, 30, 30}},    {"green", {30, 170, 60}},   {"blue", {30, 60, 210}},
    {"yellow", {240, 210, 40}}, {"purple", {140, 50, 170}}, {"orange", {245, 140, 30}},
    {"white", {245, 245, 245}}, {"black", {20, 20, 20}},
};

// Width x height pairs covering square, landscape, portrait and extreme-ish ratios.
constexpr std::array<std::array<int, 2>, 12> kSizes{{{512, 512},
                                                      {768, 512},
                                                      {512, 768},
                                                      {1024, 576},
                                                      {576, 1024},
                                                      {640, 480},
                                                      {480, 640},
                                                      {900, 400},
                                                      {400, 900},
                                                      {1200, 800},
                                                      {300, 300},
                                                      {1000, 1000}}};

constexpr const char* kShapes[] = {"circle", "square", "ring"};

std::vector<double> ink(const std::array<int, 3>& rgb) { return {double(rgb[0]), double(rgb[1]), double(rgb[2])}; }

}  // namespace

std::vector<DemoImage> write_demo_dataset(const std::filesystem::path& dir) {
  init_vips();
  const std::filesystem::path folder = dir / kDemoFolder;
  std::filesystem::create_directories(folder);
  constexpr int kCount = 36;
  constexpr size_t kColourCount = sizeof(kColours) / sizeof(kColours[0]);
  std::vector<DemoImage> images;
  for (int i = 0; i < kCount; ++i) {
    const auto [w, h] = kSizes[i % kSizes.size()];
    const Colour& shape_colour = kColours[i % kColourCount];
    // Offset 1..7 from the shape colour, changing every 8 images: never the shape's colour, and
    // no two images alike (a repeated image would be one cache entry).
    const Colour& background = kColours[(i + 1 + (i / kColourCount) % (kColourCount - 1)) %
                                        kColourCount];
    const char* shape = kShapes[(i / 2) % 3];
    const int side = std::min(w, h);
    const int cx = w / 2;
    const int cy = h / 2;
    const int r = side * 3 / 10;

    VImage image = (VImage::black(w, h, VImage::option()->set("bands", 3)) + ink(background.rgb))
                       .cast(VIPS_FORMAT_UCHAR);
    if (std::string(shape) == "circle") {
      image.draw_circle(ink(shape_colour.rgb), cx, cy, r, VImage::option()->set("fill", true));
    } else if (std::string(shape) == "square") {
      image.draw_rect(ink(shape_colour.rgb), cx - r, cy - r, 2 * r, 2 * r,
                      VImage::option()->set("fill", true));
    } else {
      // A thick ring with a filled centre dot, so the centre pixel is the shape colour.
      image.draw_circle(ink(shape_colour.rgb), cx, cy, r, VImage::option()->set("fill", true));
      image.draw_circle(ink(background.rgb), cx, cy, r * 2 / 3, VImage::option()->set("fill", true));
      image.draw_circle(ink(shape_colour.rgb), cx, cy, r / 4, VImage::option()->set("fill", true));
    }

    char stem[64];
    std::snprintf(stem, sizeof(stem), "%02d_%s_%s", i, shape_colour.name, shape);
    const bool jpeg = i % 2 == 0;
    DemoImage demo;
    demo.path = folder / (std::string(stem) + (jpeg ? ".jpg" : ".png"));
    const char first = shape_colour.name[0];
    const bool vowel = first == 'a' || first == 'e' || first == 'i' || first == 'o' || first == 'u';
    demo.caption = std::string(vowel ? "an " : "a ") + shape_colour.name + " " + shape + " on a " +
                   background.name + " background";
    demo.shape_rgb = shape_colour.rgb;
    demo.background_rgb = background.rgb;
    demo.width = w;
    demo.height = h;
    try {
      if (jpeg) {
        image.jpegsave(demo.path.c_str(), VImage::option()->set("Q", 92));
      } else {
        image.pngsave(demo.path.c_str());
      }
    } catch (const vips::VError& e) {
      throw Error("cannot write demo image " + demo.path.string() + ": " + e.what());
    }
    std::ofstream caption(folder / (std::string(stem) + ".txt"));
    caption << demo.caption << "\n";
    if (!caption) throw Error("cannot write demo caption in " + folder.string());
    images.push_back(std::move(demo));
  }
  return images;
}

}  // namespace lorapipe::preprocess
