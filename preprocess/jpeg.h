#pragma once
// The fast path for the common case of preprocess: a clean JPEG decoded by libjpeg-turbo
// straight from memory, DCT-scaled on load.
//
// libvips feeds libjpeg through its own source a few KiB at a time, and libjpeg-turbo's Huffman
// decoder drops to its slow, byte-at-a-time path whenever less than a few KiB of input is
// buffered (jdhuff.c), so most of a libvips JPEG decode runs on the slow path. Here the whole
// file is one buffer (jpeg_mem_src) and the fast path runs throughout. The scaled output is
// what libvips' shrink-on-load gives (the same libjpeg call), so what follows is unchanged.

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace lorapipe::preprocess {

// Which Huffman decoder decodes the entropy-coded data: ours (jpeg_huffman.h) where it handles
// the file, libjpeg-turbo's otherwise. Both give the same coefficients; kLibjpeg is for tests and
// benchmarks that compare the two.
enum class HuffmanDecoder { kOurs, kLibjpeg };

struct DecodedJpeg {
  int width = 0;   // as stored: EXIF orientation not applied
  int height = 0;
  int bands = 0;   // 3 (RGB) or 1 (grey)
  std::vector<unsigned char> pixels;  // height * width * bands, row-major
  HuffmanDecoder huffman = HuffmanDecoder::kLibjpeg;  // the one that decoded this image
};

// Decodes `bytes`, scaled by 1/shrink (shrink 1, 2, 4 or 8), to 8-bit RGB or grey. Returns
// nullopt, never throws on bad data, when the file is anything but a clean JPEG whose pixels need
// no colour management: not a JPEG, CMYK or YCCK, an embedded ICC profile, or any libjpeg error or
// warning (corrupt data, truncation). The caller then takes the general libvips path, which
// converts such colour or reports such a file.
std::optional<DecodedJpeg> decode_plain_jpeg(std::string_view bytes, int shrink,
                                             HuffmanDecoder huffman = HuffmanDecoder::kOurs);

// The switch for the whole fast path (--jpeg_fast_path): with it off, or when the self-test
// below fails, decode_image sends every JPEG through libvips' own loader. On by default.
void set_jpeg_fast_path(bool enabled);
// Whether decode_image takes the fast path: the switch is on and the self-test passed. The
// self-test runs once per process, on first use: it encodes small JPEGs with the loaded libjpeg
// (4:2:0 and 4:4:4, with and without restart markers) and decodes each at every shrink with our
// Huffman decoder and with libjpeg-turbo's; any difference or error turns the fast path off with
// one warning, so a libjpeg-turbo whose internals moved costs speed, never pixels.
bool jpeg_fast_path_enabled();
// Runs the self-test now and returns its verdict (empty: passed; else why not).
std::string jpeg_fast_path_self_test();
// How many images decode_image has decoded through the fast path in this process.
uint64_t jpeg_fast_path_decodes();
// Counts one (decode_image calls it when the fast path decoded an image).
void count_jpeg_fast_path_decode();

}  // namespace lorapipe::preprocess
