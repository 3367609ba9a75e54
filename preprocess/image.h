#pragma once
// libvips decoding for preprocess: header probing (no pixels decoded) and the decode, resize and
// crop of one image to its bucket. Inputs are encoded bytes in memory (already read and hashed
// by the caller); outputs are 8-bit sRGB RGB pixels, row-major.

#include <cstdint>
#include <string>
#include <string_view>

#include "preprocess/bucket.h"

namespace lorapipe::preprocess {

// Starts libvips once per process (safe to call from any thread, any number of times).
void init_vips();

struct ImageHeader {
  int width = 0;   // as displayed: EXIF orientation applied
  int height = 0;
  int stored_width = 0;  // as stored in the file
  int stored_height = 0;
  int orientation = 1;   // EXIF orientation, 1..8
  std::string loader;    // libvips loader, e.g. "jpegload_buffer"
};

// Reads only the header. Throws lorapipe::InputError with the reason when the bytes are empty
// or not an image libvips can load.
ImageHeader probe_image(std::string_view bytes);

// The resampling kernels of libvips by their kohya-ish names: "lanczos3" (default), "lanczos2",
// "cubic", "mitchell", "linear", "nearest". Throws InputError naming an unknown one.
void check_resize_filter(const std::string& name);

// kohya's --resize_interpolation (and the dataset TOML key) as one of those names: "lanczos" is
// lanczos3 (kohya resizes it with Pillow's LANCZOS, a = 3), "nearest", "linear"/"bilinear",
// "cubic"/"bicubic". kohya's "area" and "box" (OpenCV's INTER_AREA, Pillow's BOX) have no
// libvips kernel: InputError, naming the value.
std::string resize_filter_from_kohya(const std::string& interpolation);

struct DecodeRequest {
  Reso resized;       // cover size, as displayed
  Reso bucket;        // final size
  CropOffset offset;  // where the bucket sits in the resized image
  std::string resize_filter = "lanczos3";
  // kohya's alpha_mask: keep the alpha channel (resized and cropped with the colour, its bands
  // apart, as kohya's resize does) instead of compositing on white; the colour is then the
  // image's own, as kohya encodes it.
  bool alpha_mask = false;
};

// Decodes `bytes` with shrink-on-load, applies the EXIF orientation, converts CMYK, grey,
// 16-bit and palette images to 8-bit sRGB, composites alpha on white, resizes to
// `request.resized` and crops `request.bucket` at `request.offset`. Returns
// bucket.height * bucket.width * 3 bytes. With request.alpha_mask, `alpha` (required then) gets
// bucket.height * bucket.width bytes of alpha, 255 for an image without one. Throws InputError
// with libvips' reason on a corrupt or truncated file.
std::string decode_image(std::string_view bytes, const ImageHeader& header,
                         const DecodeRequest& request, std::string* alpha = nullptr);

}  // namespace lorapipe::preprocess
