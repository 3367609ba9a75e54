// decode_plain_jpeg against libvips' own JPEG loader (the path it replaces): JPEGs written by
// libvips' encoder, decoded both ways at every shrink, must agree pixel for pixel, and every file
// the fast path must leave to libvips is declined rather than decoded.
#include "preprocess/jpeg.h"

#include <gtest/gtest.h>
#include <vips/vips8>

#include <string>

#include "preprocess/image.h"

namespace lorapipe::preprocess {
namespace {

using vips::VImage;

// A smooth gradient under seeded noise, so every DCT block carries AC energy.
VImage photo_like(int width, int height, int bands) {
  VImage ramp = VImage::xyz(width, height)[0] * (255.0 / width);
  VImage noise = VImage::gaussnoise(width, height, VImage::option()->set("sigma", 20.0)
                                                     ->set("seed", 7));
  VImage one = (ramp + noise).cast(VIPS_FORMAT_UCHAR);
  if (bands == 1) return one;
  const std::vector<VImage> rgb = {one, (one * 0.5).cast(VIPS_FORMAT_UCHAR),
                                   (255 - one).cast(VIPS_FORMAT_UCHAR)};
  return VImage::bandjoin(rgb).copy(VImage::option()->set("interpretation", VIPS_INTERPRETATION_sRGB));
}

std::string jpeg_of(const VImage& image, vips::VOption* options = VImage::option()) {
  void* data = nullptr;
  size_t size = 0;
  image.write_to_buffer(".jpg", &data, &size, options->set("Q", 90));
  std::string bytes(static_cast<const char*>(data), size);
  g_free(data);
  return bytes;
}

std::string vips_decode(const std::string& bytes, int shrink) {
  VImage image = VImage::new_from_buffer(bytes.data(), bytes.size(), "",
                                         VImage::option()->set("shrink", shrink));
  size_t size = 0;
  void* memory = image.write_to_memory(&size);
  std::string pixels(static_cast<const char*>(memory), size);
  g_free(memory);
  return pixels;
}

class PreprocessJpeg : public ::testing::Test {
 protected:
  void SetUp() override { init_vips(); }
};

// Both decoders make the same libjpeg-turbo calls (DCT scaling 1/shrink, default IDCT and
// upsampling), so the tolerance is zero: any difference means the fast path changed the pixels.
TEST_F(PreprocessJpeg, MatchesLibvipsShrinkOnLoadExactly) {
  // 4:2:0 colour (odd sizes, so partial MCUs at the edges) and greyscale.
  for (const int bands : {3, 1}) {
    const std::string bytes = jpeg_of(photo_like(1001, 675, bands));
    for (const int shrink : {1, 2, 4, 8}) {
      SCOPED_TRACE("bands " + std::to_string(bands) + ", shrink " + std::to_string(shrink));
      const auto fast = decode_plain_jpeg(bytes, shrink);
      ASSERT_TRUE(fast.has_value());
      const VImage reference = VImage::new_from_buffer(bytes.data(), bytes.size(), "",
                                                       VImage::option()->set("shrink", shrink));
      EXPECT_EQ(fast->width, reference.width());
      EXPECT_EQ(fast->height, reference.height());
      EXPECT_EQ(fast->bands, bands);
      const std::string expected = vips_decode(bytes, shrink);
      ASSERT_EQ(fast->pixels.size(), expected.size());
      EXPECT_TRUE(std::equal(fast->pixels.begin(), fast->pixels.end(), expected.begin(),
                             [](unsigned char a, char b) { return a == static_cast<unsigned char>(b); }));
    }
  }
}

TEST_F(PreprocessJpeg, ProgressiveJpegDecodes) {
  const std::string bytes =
      jpeg_of(photo_like(640, 480, 3), VImage::option()->set("interlace", true));
  const auto fast = decode_plain_jpeg(bytes, 2);
  ASSERT_TRUE(fast.has_value());
  const std::string expected = vips_decode(bytes, 2);
  EXPECT_EQ(std::string(fast->pixels.begin(), fast->pixels.end()), expected);
}

TEST_F(PreprocessJpeg, LeavesEverythingElseToLibvips) {
  const std::string good = jpeg_of(photo_like(320, 240, 3));
  ASSERT_TRUE(decode_plain_jpeg(good, 1).has_value());
  EXPECT_FALSE(decode_plain_jpeg("", 1).has_value());
  EXPECT_FALSE(decode_plain_jpeg("this is a text file, not a JPEG", 1).has_value());
  // Truncated: libjpeg would pad the missing rows with grey and only warn.
  EXPECT_FALSE(decode_plain_jpeg(good.substr(0, good.size() / 2), 1).has_value());
  // Corrupt entropy-coded data in the middle.
  std::string corrupt = good;
  for (size_t i = corrupt.size() / 2; i < corrupt.size() / 2 + 64; ++i) corrupt[i] = '\xff';
  EXPECT_FALSE(decode_plain_jpeg(corrupt, 1).has_value());
  // CMYK needs colour management.
  const std::vector<VImage> four = {photo_like(64, 48, 3),
                                    VImage::black(64, 48).cast(VIPS_FORMAT_UCHAR)};
  const VImage cmyk = VImage::bandjoin(four).copy(VImage::option()->set("interpretation", VIPS_INTERPRETATION_CMYK));
  EXPECT_FALSE(decode_plain_jpeg(jpeg_of(cmyk), 1).has_value());
  // An embedded ICC profile (Display P3, Adobe RGB, ...) needs a transform to sRGB.
  VImage tagged = photo_like(64, 48, 3);
  VipsBlob* profile = nullptr;  // libvips' built-in sRGB profile: a real ICC profile to embed
  ASSERT_EQ(vips_profile_load("srgb", &profile, nullptr), 0);
  size_t profile_size = 0;
  const void* profile_data = vips_blob_get(profile, &profile_size);
  tagged.set(VIPS_META_ICC_NAME, nullptr, const_cast<void*>(profile_data), profile_size);
  ASSERT_NE(jpeg_of(tagged).find("ICC_PROFILE"), std::string::npos);  // the encoder kept it
  EXPECT_FALSE(decode_plain_jpeg(jpeg_of(tagged), 1).has_value());
  vips_area_unref(VIPS_AREA(profile));
}

}  // namespace
}  // namespace lorapipe::preprocess
