#include "preprocess/jpeg.h"

#include <algorithm>
#include <csetjmp>
#include <cstdio>  // jpeglib.h needs FILE and size_t declared first
#include <cstring>

#include <jpeglib.h>

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

}  // namespace lorapipe::preprocess
