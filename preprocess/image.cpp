#include "preprocess/image.h"

#include <vips/vips8>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <optional>

#include "common/error.h"
#include "common/log.h"
#include "preprocess/jpeg.h"
#include "preprocess/resize.h"

namespace lorapipe::preprocess {
namespace {

using vips::VImage;

// libvips keeps one global error buffer; the text of a VError is what we report.
std::string vips_reason(const vips::VError& e) {
  std::string what = e.what();
  vips_error_clear();
  while (!what.empty() && (what.back() == '\n' || what.back() == ' ')) what.pop_back();
  for (char& c : what) {
    if (c == '\n') c = ';';
  }
  return what;
}

VipsKernel kernel_from_name(const std::string& name) {
  if (name == "lanczos3") return VIPS_KERNEL_LANCZOS3;
  if (name == "lanczos2") return VIPS_KERNEL_LANCZOS2;
  if (name == "cubic") return VIPS_KERNEL_CUBIC;
  if (name == "mitchell") return VIPS_KERNEL_MITCHELL;
  if (name == "linear") return VIPS_KERNEL_LINEAR;
  if (name == "nearest") return VIPS_KERNEL_NEAREST;
  throw InputError("--resize_filter='" + name +
                   "' is not a filter: use lanczos3, lanczos2, cubic, mitchell, linear or nearest");
}

bool swaps_axes(int orientation) { return orientation >= 5 && orientation <= 8; }

// The largest JPEG DCT shrink (1, 2, 4, 8) that keeps the image at least `factor` times the
// target, so the final lanczos pass only ever downsamples (what vips_thumbnail does).
int jpeg_shrink_for(double factor) {
  for (int shrink : {8, 4, 2}) {
    if (factor >= shrink) return shrink;
  }
  return 1;
}

// libvips reports decoder warnings through GLib logging; they belong in our log (the reason a
// file is skipped is reported separately, from the error that follows them).
void log_vips_message(const gchar* domain, GLogLevelFlags, const gchar* message, gpointer) {
  LP_LOG(kDebug, "vips") << (domain != nullptr ? domain : "") << ": " << message;
}

}  // namespace

void init_vips() {
  static std::once_flag once;
  std::call_once(once, [] {
    g_log_set_handler("VIPS", static_cast<GLogLevelFlags>(G_LOG_LEVEL_WARNING | G_LOG_LEVEL_MESSAGE |
                                                          G_LOG_LEVEL_INFO | G_LOG_LEVEL_DEBUG),
                      log_vips_message, nullptr);
    if (VIPS_INIT("lorapipe") != 0) throw Error("cannot start libvips: " + std::string(vips_error_buffer()));
    vips_cache_set_max(0);   // every image is new: caching operations only costs memory
    vips_concurrency_set(1);  // parallelism comes from our decode workers, one image each
  });
}

void check_resize_filter(const std::string& name) { (void)kernel_from_name(name); }

std::string resize_filter_from_kohya(const std::string& interpolation) {
  if (interpolation == "lanczos") return "lanczos3";
  if (interpolation == "nearest") return "nearest";
  if (interpolation == "linear" || interpolation == "bilinear") return "linear";
  if (interpolation == "cubic" || interpolation == "bicubic") return "cubic";
  if (interpolation == "area" || interpolation == "box") {
    throw InputError("resize_interpolation '" + interpolation +
                     "': libvips has no area filter; use lanczos (lorapipe's default), cubic, "
                     "linear or nearest");
  }
  throw InputError("resize_interpolation '" + interpolation +
                   "' is not one of kohya's: lanczos, nearest, bilinear, linear, bicubic, cubic");
}

ImageHeader probe_image(std::string_view bytes) {
  init_vips();
  if (bytes.empty()) throw InputError("empty file (0 bytes)");
  const char* loader = vips_foreign_find_load_buffer(bytes.data(), bytes.size());
  if (loader == nullptr) {
    vips_error_clear();
    throw InputError("not an image libvips can read (unknown format)");
  }
  try {
    VImage image = VImage::new_from_buffer(bytes.data(), bytes.size(), "",
                                           VImage::option()->set("access", VIPS_ACCESS_SEQUENTIAL));
    ImageHeader header;
    header.stored_width = image.width();
    header.stored_height = image.height();
    header.loader = image.get_typeof("vips-loader") ? image.get_string("vips-loader") : loader;
    if (image.get_typeof(VIPS_META_ORIENTATION) != 0) {
      header.orientation = std::clamp(image.get_int(VIPS_META_ORIENTATION), 1, 8);
    }
    // A multi-page image (animated GIF, multi-page TIFF) reports the first page's height.
    if (image.get_typeof(VIPS_META_PAGE_HEIGHT) != 0) {
      const int page_height = image.get_int(VIPS_META_PAGE_HEIGHT);
      if (page_height > 0) header.stored_height = page_height;
    }
    header.width = swaps_axes(header.orientation) ? header.stored_height : header.stored_width;
    header.height = swaps_axes(header.orientation) ? header.stored_width : header.stored_height;
    return header;
  } catch (const vips::VError& e) {
    // libvips' loaders do not all say why a header fails (a PNG cut short inside its IHDR gives
    // an empty message): then the loader and what it means are named instead.
    std::string why = vips_reason(e);
    if (why.empty()) {
      why = std::string(loader) + " gave no reason; the file ends or is damaged inside its header";
    }
    throw InputError("cannot read the image header: " + why);
  }
}

std::string decode_image(std::string_view bytes, const ImageHeader& header,
                         const DecodeRequest& request, std::string* alpha) {
  if (request.alpha_mask && alpha == nullptr) {
    throw Error("internal: decode_image with alpha_mask needs somewhere to put the alpha");
  }
  init_vips();
  const VipsKernel kernel = kernel_from_name(request.resize_filter);
  try {
    const double factor = std::min(static_cast<double>(header.width) / request.resized.width,
                                   static_cast<double>(header.height) / request.resized.height);
    const bool is_jpeg = header.loader.rfind("jpegload", 0) == 0;
    const bool is_webp = header.loader.rfind("webpload", 0) == 0;
    // A clean JPEG goes through decode_plain_jpeg (the same pixels, with libjpeg-turbo's fast
    // Huffman path); everything else, and any JPEG it declines, through libvips' loader.
    // `plain` owns the pixels `image` points at until they are copied out below. It holds the
    // whole scaled image: under 4x the cover size in pixels when the shrink is 1, 2 or 4 (the
    // largest that keeps the image at least the cover size), else 1/64 of the file's pixels,
    // which --max_image_pixels caps (1.6 MP at the default 100 MP).
    std::optional<DecodedJpeg> plain;
    if (is_jpeg && jpeg_fast_path_enabled()) {
      plain = decode_plain_jpeg(bytes, jpeg_shrink_for(factor));
      if (plain) count_jpeg_fast_path_decode();
    }
    VImage image;
    if (plain) {
      // Lanczos-3 (the default filter) resizes here, with Pillow's exact arithmetic and 2-4x
      // faster than libvips' reduce; other filters resize below. It runs in the stored
      // orientation (autorot turns the smaller result), so for EXIF orientations 5-8 the pixels
      // are Pillow's resize of the stored image, turned.
      const bool swap = swaps_axes(header.orientation);
      const int width = swap ? request.resized.height : request.resized.width;
      const int height = swap ? request.resized.width : request.resized.height;
      if (kernel == VIPS_KERNEL_LANCZOS3 && (plain->width != width || plain->height != height)) {
        plain->pixels = resize_lanczos3(plain->pixels.data(), plain->width, plain->height,
                                        plain->bands, width, height);
        plain->width = width;
        plain->height = height;
      }
      image = VImage::new_from_memory(plain->pixels.data(), plain->pixels.size(), plain->width,
                                      plain->height, plain->bands, VIPS_FORMAT_UCHAR);
      image.set(VIPS_META_ORIENTATION, header.orientation);
    } else {
      vips::VOption* options = VImage::option()
                                   ->set("access", VIPS_ACCESS_SEQUENTIAL)
                                   ->set("fail_on", VIPS_FAIL_ON_ERROR);
      if (is_jpeg) {
        options->set("shrink", jpeg_shrink_for(factor));
      } else if (is_webp && factor >= 2) {
        options->set("scale", 1.0 / jpeg_shrink_for(factor));
      }
      image = VImage::new_from_buffer(bytes.data(), bytes.size(), "", options);
    }
    image = image.autorot();

    // To 8-bit sRGB. CMYK goes through its embedded profile (or libvips' fallback); an embedded
    // RGB profile (Display P3, Adobe RGB) is honoured; grey, 16-bit and palette images convert.
    const VipsInterpretation interpretation = image.interpretation();
    if (interpretation == VIPS_INTERPRETATION_CMYK) {
      image = image.icc_import(VImage::option()->set("embedded", true));
      image = image.colourspace(VIPS_INTERPRETATION_sRGB);
    } else if (image.get_typeof(VIPS_META_ICC_NAME) != 0 && image.format() == VIPS_FORMAT_UCHAR &&
               image.bands() >= 3) {
      try {
        image = image.icc_transform("srgb", VImage::option()->set("embedded", true));
      } catch (const vips::VError&) {
        vips_error_clear();  // a broken profile: keep the pixels as they are
      }
    }
    if (image.interpretation() != VIPS_INTERPRETATION_sRGB || image.format() != VIPS_FORMAT_UCHAR) {
      image = image.colourspace(VIPS_INTERPRETATION_sRGB);
    }
    if (request.alpha_mask) {
      // RGBA: the image's own alpha, or an opaque one.
      if (!image.has_alpha()) {
        image = image.extract_band(0, VImage::option()->set("n", 3)).bandjoin_const({255});
      } else if (image.bands() > 4) {
        image = image.extract_band(0, VImage::option()->set("n", 3))
                    .bandjoin(image.extract_band(image.bands() - 1));
      }
    } else {
      if (image.has_alpha()) {
        image =
            image.flatten(VImage::option()->set("background", std::vector<double>{255, 255, 255}));
      }
      if (image.bands() > 3) image = image.extract_band(0, VImage::option()->set("n", 3));
    }
    if (image.format() != VIPS_FORMAT_UCHAR) image = image.cast(VIPS_FORMAT_UCHAR);
    const int bands = request.alpha_mask ? 4 : 3;

    const double hscale = static_cast<double>(request.resized.width) / image.width();
    const double vscale = static_cast<double>(request.resized.height) / image.height();
    if (image.width() != request.resized.width || image.height() != request.resized.height) {
      image = image.resize(hscale, VImage::option()->set("vscale", vscale)->set("kernel", kernel));
    }
    // Rounding inside libvips may leave a pixel more or less than asked: centre the crop on what
    // there is, and pad by edge copy in the (one-pixel) case that the image came out short.
    if (image.width() < request.bucket.width || image.height() < request.bucket.height) {
      image = image.embed(0, 0, std::max(image.width(), request.bucket.width),
                          std::max(image.height(), request.bucket.height),
                          VImage::option()->set("extend", VIPS_EXTEND_COPY));
    }
    const int left = std::min(request.offset.left, image.width() - request.bucket.width);
    const int top = std::min(request.offset.top, image.height() - request.bucket.height);
    image = image.extract_area(left, top, request.bucket.width, request.bucket.height);

    size_t size = 0;
    void* memory = image.write_to_memory(&size);
    std::string pixels(static_cast<const char*>(memory), size);
    g_free(memory);
    const size_t count = static_cast<size_t>(request.bucket.width) * request.bucket.height;
    if (pixels.size() != count * bands) {
      throw Error("internal: decoded " + std::to_string(pixels.size()) + " bytes, expected " +
                  std::to_string(count * bands));
    }
    if (request.alpha_mask) {  // RGBA -> RGB and A
      std::string rgb(count * 3, '\0');
      alpha->assign(count, '\0');
      for (size_t i = 0; i < count; ++i) {
        std::memcpy(&rgb[i * 3], &pixels[i * 4], 3);
        (*alpha)[i] = pixels[i * 4 + 3];
      }
      return rgb;
    }
    return pixels;
  } catch (const vips::VError& e) {
    throw InputError("cannot decode: " + vips_reason(e));
  }
}

}  // namespace lorapipe::preprocess
