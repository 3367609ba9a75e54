// decode_plain_jpeg against libvips' own JPEG loader (the path it replaces): JPEGs written by
// libvips' encoder, decoded both ways at every shrink, must agree pixel for pixel, and every file
// the fast path must leave to libvips is declined rather than decoded.
#include "preprocess/jpeg.h"

#include <gtest/gtest.h>
#include <jpeglib.h>
#include <vips/vips8>

#include <algorithm>
#include <cstdio>  // jpeglib.h needs FILE and size_t declared first
#include <cstdlib>
#include <random>
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

// A JPEG written by libjpeg with Huffman tables in which every code has `code_length` bits
// (canonical codes need no more: 162 AC symbols fit in 16 bits, 12 DC sizes in 4), so that every
// symbol is decoded through the same path of our decoder: 16 bits is past its one-lookup table.
std::string jpeg_with_code_length(const VImage& image, int code_length) {
  size_t size = 0;
  void* memory = image.write_to_memory(&size);
  const std::string pixels(static_cast<const char*>(memory), size);
  g_free(memory);
  jpeg_compress_struct info;
  jpeg_error_mgr errors;
  info.err = jpeg_std_error(&errors);
  jpeg_create_compress(&info);
  unsigned char* out = nullptr;
  unsigned long out_size = 0;
  jpeg_mem_dest(&info, &out, &out_size);
  info.image_width = static_cast<JDIMENSION>(image.width());
  info.image_height = static_cast<JDIMENSION>(image.height());
  info.input_components = image.bands();
  info.in_color_space = image.bands() == 3 ? JCS_RGB : JCS_GRAYSCALE;
  jpeg_set_defaults(&info);
  jpeg_set_quality(&info, 95, TRUE);
  for (int table = 0; table < 2; ++table) {
    for (const bool dc : {true, false}) {
      JHUFF_TBL* huffman = dc ? info.dc_huff_tbl_ptrs[table] : info.ac_huff_tbl_ptrs[table];
      std::vector<int> symbols;
      if (dc) {
        for (int category = 0; category <= 11; ++category) symbols.push_back(category);
      } else {
        symbols = {0x00, 0xF0};  // end of block, run of 16 zeros
        for (int run = 0; run < 16; ++run) {
          for (int size = 1; size <= 10; ++size) symbols.push_back(run << 4 | size);
        }
      }
      std::fill(std::begin(huffman->bits), std::end(huffman->bits), 0);
      huffman->bits[code_length] = static_cast<UINT8>(symbols.size());
      for (size_t i = 0; i < symbols.size(); ++i) huffman->huffval[i] = static_cast<UINT8>(symbols[i]);
    }
  }
  jpeg_start_compress(&info, TRUE);
  while (info.next_scanline < info.image_height) {
    JSAMPROW row = reinterpret_cast<JSAMPROW>(const_cast<char*>(
        &pixels[static_cast<size_t>(info.next_scanline) * image.width() * image.bands()]));
    jpeg_write_scanlines(&info, &row, 1);
  }
  jpeg_finish_compress(&info);
  jpeg_destroy_compress(&info);
  std::string bytes(reinterpret_cast<char*>(out), out_size);
  free(out);
  return bytes;
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

// Our Huffman decoder (jpeg_huffman.h) against libjpeg-turbo's, on the encodings that exercise
// its paths: 4:2:0 and 4:4:4 colour and grey (6, 3 and 1 blocks per MCU), quality 100 (values
// too long for the one-lookup path), optimized tables (codes longer than the lookup), and restart
// markers every MCU and every 7 (the segment and predictor resets). Both give the coefficients to
// the same libjpeg IDCT, so the tolerance is zero.
TEST_F(PreprocessJpeg, OurHuffmanDecoderMatchesLibjpegExactly) {
  struct Encoding {
    const char* name;
    int bands;
    vips::VOption* options;
  };
  const Encoding encodings[] = {
      {"4:2:0", 3, VImage::option()},
      {"4:4:4", 3, VImage::option()->set("subsample_mode", VIPS_FOREIGN_SUBSAMPLE_OFF)},
      {"grey", 1, VImage::option()},
      {"4:4:4 Q100", 3,
       VImage::option()->set("subsample_mode", VIPS_FOREIGN_SUBSAMPLE_OFF)->set("Q", 100)},
      {"optimized tables", 3, VImage::option()->set("optimize_coding", true)},
      {"restart every MCU", 3, VImage::option()->set("restart_interval", 1)},
      {"restart every 7 MCUs, grey", 1, VImage::option()->set("restart_interval", 7)},
  };
  std::vector<std::pair<std::string, std::string>> files;
  for (const Encoding& encoding : encodings) {
    files.emplace_back(encoding.name,
                       jpeg_of(photo_like(1001, 675, encoding.bands), encoding.options));
  }
  // Every code 16 bits long (past the lookup table: canonical decode); every code 8 bits long,
  // which with quality 95 values leaves many value bits past the table (a separate read).
  files.emplace_back("all codes 16 bits", jpeg_with_code_length(photo_like(333, 251, 3), 16));
  files.emplace_back("all codes 8 bits", jpeg_with_code_length(photo_like(333, 251, 3), 8));
  for (const auto& [name, bytes] : files) {
    for (const int shrink : {1, 2, 4, 8}) {
      SCOPED_TRACE(name + ", shrink " + std::to_string(shrink));
      const auto ours = decode_plain_jpeg(bytes, shrink, HuffmanDecoder::kOurs);
      const auto theirs = decode_plain_jpeg(bytes, shrink, HuffmanDecoder::kLibjpeg);
      ASSERT_TRUE(ours.has_value());
      ASSERT_TRUE(theirs.has_value());
      EXPECT_EQ(ours->huffman, HuffmanDecoder::kOurs);  // it did not quietly hand the file back
      EXPECT_EQ(theirs->huffman, HuffmanDecoder::kLibjpeg);
      EXPECT_EQ(ours->width, theirs->width);
      EXPECT_EQ(ours->height, theirs->height);
      EXPECT_TRUE(ours->pixels == theirs->pixels);
      if (shrink == 4) {
        EXPECT_EQ(std::string(ours->pixels.begin(), ours->pixels.end()), vips_decode(bytes, shrink));
      }
    }
  }
}

// Damaged entropy-coded data (bytes overwritten at seeded random places, restart markers among
// them): our decoder either declines the file, which then takes the libvips path, or gives exactly
// the pixels libvips gives for it, for a file libjpeg's own decoder accepts without a warning.
TEST_F(PreprocessJpeg, OurHuffmanDecoderDeclinesOrMatchesOnDamagedData) {
  for (const int restart_interval : {0, 2}) {
    const std::string good = jpeg_of(photo_like(96, 64, 3),
                                     VImage::option()->set("restart_interval", restart_interval));
    const size_t scan = good.find("\xff\xda");  // SOS: entropy-coded data follows its header
    ASSERT_NE(scan, std::string::npos);
    const size_t data = scan + 2 + ((static_cast<unsigned char>(good[scan + 2]) << 8) |
                                    static_cast<unsigned char>(good[scan + 3]));
    std::mt19937 random(restart_interval + 1);
    int decoded = 0, declined = 0;
    for (int trial = 0; trial < 300; ++trial) {
      std::string bad = good;
      const int changes = 1 + trial % 3;
      for (int c = 0; c < changes; ++c) {
        const size_t at = data + random() % (good.size() - 2 - data);  // keep the final EOI
        bad[at] = static_cast<char>(trial % 5 == 0 ? 0xFF : random() & 0xFF);
      }
      const auto ours = decode_plain_jpeg(bad, 1, HuffmanDecoder::kOurs);
      if (!ours.has_value()) {
        ++declined;
        continue;
      }
      ++decoded;
      ASSERT_EQ(ours->huffman, HuffmanDecoder::kOurs);
      // libjpeg's own decoder accepts it too, without a warning (a warning declines the file):
      // ours never lets through damage libjpeg would have reported.
      const auto theirs = decode_plain_jpeg(bad, 1, HuffmanDecoder::kLibjpeg);
      ASSERT_TRUE(theirs.has_value()) << "trial " << trial << ": libjpeg warns on this file";
      ASSERT_TRUE(theirs->pixels == ours->pixels) << "trial " << trial;
      std::string reference;
      try {
        reference = vips_decode(bad, 1);
      } catch (const vips::VError& e) {
        FAIL() << "trial " << trial << ": ours decoded a file libvips rejects: " << e.what();
      }
      ASSERT_EQ(std::string(ours->pixels.begin(), ours->pixels.end()), reference)
          << "trial " << trial << " (restart interval " << restart_interval << ")";
    }
    // Both outcomes occur, so neither branch of the check is vacuous.
    EXPECT_GT(decoded, 0);
    EXPECT_GT(declined, 0);
  }
}

TEST_F(PreprocessJpeg, ProgressiveJpegDecodes) {
  const std::string bytes =
      jpeg_of(photo_like(640, 480, 3), VImage::option()->set("interlace", true));
  const auto fast = decode_plain_jpeg(bytes, 2);
  ASSERT_TRUE(fast.has_value());
  EXPECT_EQ(fast->huffman, HuffmanDecoder::kLibjpeg);  // several scans: libjpeg's own decoder
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
  // Entropy-coded data one byte short before EOI: only the last MCU reads past its end.
  const std::string cut = good.substr(0, good.size() - 3) + good.substr(good.size() - 2);
  EXPECT_FALSE(decode_plain_jpeg(cut, 1).has_value());
  // A fill FF before a stuffed FF 00 in the entropy-coded data (invalid; found by jpeg_fuzz):
  // libjpeg-turbo's fast path stops there mid-MCU and leaves coefficients its retry keeps.
  const size_t scan = good.find("\xff\xda");
  const size_t stuffed = good.find(std::string("\xff\x00", 2), scan + 2);
  ASSERT_NE(stuffed, std::string::npos);
  std::string filled = good;
  filled.insert(stuffed, "\xff");
  EXPECT_FALSE(decode_plain_jpeg(filled, 1).has_value());
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

// The guard around the fast path: the start-up self-test passes with this machine's
// libjpeg-turbo (and really ran our decoder, which the build's version check allows here), and
// --jpeg_fast_path=false sends every JPEG through libvips while giving the same pixels.
TEST_F(PreprocessJpeg, FastPathSelfTestAndSwitch) {
  EXPECT_EQ(jpeg_fast_path_self_test(), "");
  EXPECT_TRUE(jpeg_fast_path_enabled());
  const std::string bytes = jpeg_of(photo_like(320, 240, 3));
  const auto ours = decode_plain_jpeg(bytes, 1);
  ASSERT_TRUE(ours.has_value());
  EXPECT_EQ(ours->huffman, HuffmanDecoder::kOurs) << "the build left our decoder out";
  // decode_image follows the switch: the fast path decodes the image when it is on, libvips
  // when it is off.
  const ImageHeader header = probe_image(bytes);
  DecodeRequest request;
  request.resized = {160, 120};
  request.bucket = {160, 120};
  const uint64_t before = jpeg_fast_path_decodes();
  const std::string fast = decode_image(bytes, header, request);
  EXPECT_EQ(jpeg_fast_path_decodes(), before + 1);
  set_jpeg_fast_path(false);
  EXPECT_FALSE(jpeg_fast_path_enabled());
  const std::string general = decode_image(bytes, header, request);
  EXPECT_EQ(jpeg_fast_path_decodes(), before + 1) << "the fast path ran with the switch off";
  set_jpeg_fast_path(true);
  EXPECT_TRUE(jpeg_fast_path_enabled());
  ASSERT_EQ(fast.size(), general.size());
  EXPECT_TRUE(fast == general) << "the switch changed the pixels";
}

}  // namespace
}  // namespace lorapipe::preprocess
