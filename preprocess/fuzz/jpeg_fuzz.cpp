// libFuzzer target for the clean-JPEG fast path and its Huffman decoder (jpeg_huffman.h): any
// bytes, at every shrink. Whatever comes in, decode_plain_jpeg must return (pixels or nullopt)
// without a sanitizer report, and when our Huffman decoder accepts a file, libjpeg-turbo's own
// decoder must accept it too (without a warning) and give the same pixels.
//
// Build: cmake -DLORAPIPE_FUZZ=ON -DLORAPIPE_TORCH=OFF -DCMAKE_CXX_COMPILER=clang++
// -DCMAKE_C_COMPILER=clang, then build/bin/jpeg_fuzz DIR_OF_SEED_JPEGS.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <string_view>

#include "preprocess/image.h"
#include "preprocess/jpeg.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using lorapipe::preprocess::decode_plain_jpeg;
  using lorapipe::preprocess::HuffmanDecoder;
  if (size < 1) return 0;
  const int shrink = 1 << (data[0] & 3);
  const std::string_view bytes(reinterpret_cast<const char*>(data + 1), size - 1);
  // The pipeline reads the header first and decodes nothing over --max_image_pixels (a
  // decompression bomb); the same check here, with a smaller bound to keep the fuzzer fast.
  try {
    const lorapipe::preprocess::ImageHeader header = lorapipe::preprocess::probe_image(bytes);
    if (static_cast<int64_t>(header.width) * header.height > 16'000'000) return 0;
  } catch (const std::exception&) {
    return 0;
  }
  const auto ours = decode_plain_jpeg(bytes, shrink, HuffmanDecoder::kOurs);
  if (ours && ours->huffman == HuffmanDecoder::kOurs) {
    // Ours may decline what libjpeg accepts, never the reverse, and never differ.
    const auto theirs = decode_plain_jpeg(bytes, shrink, HuffmanDecoder::kLibjpeg);
    if (!theirs || theirs->pixels != ours->pixels) std::abort();
  }
  return 0;
}
