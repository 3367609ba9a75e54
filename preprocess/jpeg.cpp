#include "preprocess/jpeg.h"

#include <algorithm>
#include <atomic>
#include <csetjmp>
#include <cstdio>  // jpeglib.h needs FILE and size_t declared first
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>

#include <jpeglib.h>

#include "common/log.h"
#include "preprocess/jpeg_huffman.h"

namespace lorapipe::preprocess {
namespace {

// libjpeg reports a fatal error by calling error_exit, which must not return: it jumps back to
// decode_into. A warning (corrupt or missing data that libjpeg papers over) is only recorded.
struct ErrorManager {
  jpeg_error_mgr base;
  std::jmp_buf jump;
  bool warned;
};

[[noreturn]] void on_error(j_common_ptr info) {
  std::longjmp(reinterpret_cast<ErrorManager*>(info->err)->jump, 1);
}

void on_message(j_common_ptr info, int level) {
  if (level < 0) reinterpret_cast<ErrorManager*>(info->err)->warned = true;
}

bool has_icc_profile(const jpeg_decompress_struct& info) {
  static constexpr char kIcc[] = "ICC_PROFILE";  // APP2 tag, ICC.1 annex B.4
  for (jpeg_saved_marker_ptr m = info.marker_list; m != nullptr; m = m->next) {
    if (m->marker == JPEG_APP0 + 2 && m->data_length >= sizeof(kIcc) &&
        std::memcmp(m->data, kIcc, sizeof(kIcc)) == 0) {
      return true;
    }
  }
  return false;
}

// Only C objects live in this frame between setjmp and a possible longjmp, so the jump skips no
// destructor; `out` belongs to the caller.
bool decode_into(std::string_view bytes, int shrink, HuffmanDecoder huffman, DecodedJpeg* out) {
  jpeg_decompress_struct info;
  ErrorManager errors;
  info.err = jpeg_std_error(&errors.base);
  errors.base.error_exit = on_error;
  errors.base.emit_message = on_message;
  errors.warned = false;
  if (setjmp(errors.jump) != 0) {
    jpeg_destroy_decompress(&info);
    return false;
  }
  jpeg_create_decompress(&info);
  jpeg_mem_src(&info, reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size());
  jpeg_save_markers(&info, JPEG_APP0 + 2, 0xFFFF);
  const bool plain = jpeg_read_header(&info, TRUE) == JPEG_HEADER_OK && !has_icc_profile(info) &&
                     (info.jpeg_color_space == JCS_YCbCr || info.jpeg_color_space == JCS_RGB ||
                      info.jpeg_color_space == JCS_GRAYSCALE);
  if (!plain || errors.warned) {
    jpeg_destroy_decompress(&info);
    return false;
  }
  const bool grey = info.jpeg_color_space == JCS_GRAYSCALE;
  info.out_color_space = grey ? JCS_GRAYSCALE : JCS_RGB;
  info.scale_num = 1;
  info.scale_denom = static_cast<unsigned>(shrink);
  jpeg_start_decompress(&info);
  if (huffman == HuffmanDecoder::kOurs && install_fast_huffman(&info)) {
    out->huffman = HuffmanDecoder::kOurs;
  }
  out->width = static_cast<int>(info.output_width);
  out->height = static_cast<int>(info.output_height);
  out->bands = grey ? 1 : 3;
  const size_t stride = static_cast<size_t>(out->width) * out->bands;
  out->pixels.resize(stride * out->height);
  while (info.output_scanline < info.output_height) {
    JSAMPROW rows[16];
    const JDIMENSION first = info.output_scanline;
    const JDIMENSION count = std::min<JDIMENSION>(16, info.output_height - first);
    for (JDIMENSION i = 0; i < count; ++i) rows[i] = out->pixels.data() + (first + i) * stride;
    jpeg_read_scanlines(&info, rows, count);
  }
  jpeg_finish_decompress(&info);
  jpeg_destroy_decompress(&info);
  // libjpeg rounds a scaled size up; libvips' shrink-on-load rounds down, dropping the partial
  // last column and row. Match it, so the fast path hands on exactly libvips' pixels.
  const int width = static_cast<int>(info.image_width) / shrink;
  const int height = static_cast<int>(info.image_height) / shrink;
  if (width < out->width) {
    const size_t new_stride = static_cast<size_t>(width) * out->bands;
    for (int y = 1; y < height; ++y) {
      std::memmove(out->pixels.data() + y * new_stride, out->pixels.data() + y * stride, new_stride);
    }
  }
  out->width = std::min(out->width, width);
  out->height = std::min(out->height, height);
  out->pixels.resize(static_cast<size_t>(out->width) * out->height * out->bands);
  return !errors.warned;
}

}  // namespace

std::optional<DecodedJpeg> decode_plain_jpeg(std::string_view bytes, int shrink,
                                             HuffmanDecoder huffman) {
  DecodedJpeg decoded;
  if (!decode_into(bytes, shrink, huffman, &decoded)) return std::nullopt;
  return decoded;
}

namespace {

std::atomic<bool> fast_path_switch{true};
std::atomic<uint64_t> fast_path_decodes{0};

// A small JPEG written by the loaded libjpeg: a gradient with a seeded pattern, odd sizes so the
// edge MCUs are partial; empty when the encoder fails.
std::string encode_test_jpeg(bool subsampled, int restart_interval) {
  constexpr int kWidth = 67, kHeight = 45;
  std::vector<unsigned char> rgb(kWidth * kHeight * 3);
  uint32_t state = 12345;
  for (size_t i = 0; i < rgb.size(); ++i) {
    state = state * 1664525u + 1013904223u;
    rgb[i] = static_cast<unsigned char>((i * 7 / 3) % 200 + (state >> 27));
  }
  jpeg_compress_struct info{};
  ErrorManager errors{};
  info.err = jpeg_std_error(&errors.base);
  errors.base.error_exit = on_error;
  unsigned char* buffer = nullptr;
  unsigned long size = 0;
  if (setjmp(errors.jump)) {
    jpeg_destroy_compress(&info);
    std::free(buffer);
    return "";
  }
  jpeg_create_compress(&info);
  jpeg_mem_dest(&info, &buffer, &size);
  info.image_width = kWidth;
  info.image_height = kHeight;
  info.input_components = 3;
  info.in_color_space = JCS_RGB;
  jpeg_set_defaults(&info);
  jpeg_set_quality(&info, 90, TRUE);
  if (!subsampled) info.comp_info[0].h_samp_factor = info.comp_info[0].v_samp_factor = 1;
  info.restart_interval = static_cast<unsigned int>(restart_interval);
  jpeg_start_compress(&info, TRUE);
  while (info.next_scanline < info.image_height) {
    JSAMPROW row = rgb.data() + static_cast<size_t>(info.next_scanline) * kWidth * 3;
    jpeg_write_scanlines(&info, &row, 1);
  }
  jpeg_finish_compress(&info);
  jpeg_destroy_compress(&info);
  std::string out(reinterpret_cast<const char*>(buffer), size);
  std::free(buffer);
  return out;
}

}  // namespace

void set_jpeg_fast_path(bool enabled) { fast_path_switch = enabled; }

uint64_t jpeg_fast_path_decodes() { return fast_path_decodes; }

void count_jpeg_fast_path_decode() { ++fast_path_decodes; }

std::string jpeg_fast_path_self_test() {
  for (bool subsampled : {true, false}) {
    for (int restart : {0, 3}) {
      const std::string jpeg = encode_test_jpeg(subsampled, restart);
      if (jpeg.empty()) return "libjpeg could not encode the test image";
      for (int shrink : {1, 2, 4, 8}) {
        const auto ours = decode_plain_jpeg(jpeg, shrink, HuffmanDecoder::kOurs);
        const auto theirs = decode_plain_jpeg(jpeg, shrink, HuffmanDecoder::kLibjpeg);
        const std::string where = std::string(subsampled ? "4:2:0" : "4:4:4") + ", restart " +
                                  std::to_string(restart) + ", shrink " + std::to_string(shrink);
        if (!ours || !theirs) return "a clean test JPEG was declined (" + where + ")";
        if (ours->width != theirs->width || ours->height != theirs->height ||
            ours->pixels != theirs->pixels) {
          return "our Huffman decoder and libjpeg-turbo's disagree (" + where + ")";
        }
      }
    }
  }
  return "";
}

bool jpeg_fast_path_enabled() {
  static std::once_flag once;
  static bool passed = false;
  if (!fast_path_switch) return false;
  std::call_once(once, [] {
    const std::string why = jpeg_fast_path_self_test();
    passed = why.empty();
    if (!passed) {
      LP_LOG(kWarning, "preprocess") << "JPEG fast path off: " << why
                                     << "; every JPEG goes through libvips";
    }
  });
  return passed;
}

}  // namespace lorapipe::preprocess
