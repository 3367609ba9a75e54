#include "preprocess/resize.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

namespace lorapipe::preprocess {
namespace {

// x86-64's baseline (SSE2) has no 32-bit multiply across lanes; an AVX2 clone of each pass,
// chosen at load time, has one. Other targets compile the passes once.
#if defined(__x86_64__) && defined(__GNUC__)
#define LORAPIPE_VECTOR_CLONES [[gnu::target_clones("avx2", "default")]]
#else
#define LORAPIPE_VECTOR_CLONES
#endif

constexpr int kPrecisionBits = 22;  // 32 bits less 8 for the pixel and 2 for overshoot
constexpr int32_t kHalf = 1 << (kPrecisionBits - 1);
constexpr int kStripRows = 8;  // rows the horizontal pass filters together

double sinc(double x) {
  if (x == 0.0) return 1.0;
  x *= M_PI;
  return std::sin(x) / x;
}

double lanczos3(double x) { return -3.0 <= x && x < 3.0 ? sinc(x) * sinc(x / 3) : 0.0; }

// For each output position: the first input position it reads, how many, and their weights in
// fixed point. The arithmetic is Pillow's (precompute_coeffs, normalize_coeffs_8bpc), operation
// for operation, since a last-bit difference in a weight can move a pixel by one.
struct Weights {
  int taps = 0;  // weights stored per output position, the most any uses
  std::vector<int> first;
  std::vector<int> count;
  std::vector<int32_t> fixed;  // out_size * taps
};

Weights lanczos3_weights(int in_size, int out_size) {
  const double scale = static_cast<double>(in_size) / out_size;
  const double filter_scale = std::max(scale, 1.0);
  const double support = 3.0 * filter_scale;
  const double inverse = 1.0 / filter_scale;
  Weights w;
  w.taps = static_cast<int>(std::ceil(support)) * 2 + 1;
  w.first.resize(out_size);
  w.count.resize(out_size);
  w.fixed.assign(static_cast<size_t>(out_size) * w.taps, 0);
  std::vector<double> k(w.taps);
  for (int o = 0; o < out_size; ++o) {
    const double center = (o + 0.5) * scale;
    const int lo = std::max(static_cast<int>(center - support + 0.5), 0);
    const int hi = std::min(static_cast<int>(center + support + 0.5), in_size);
    const int n = hi - lo;
    double sum = 0.0;
    for (int i = 0; i < n; ++i) {
      k[i] = lanczos3((static_cast<double>(i + lo) - center + 0.5) * inverse);
      sum += k[i];
    }
    for (int i = 0; i < n; ++i) {
      const double normal = sum != 0.0 ? k[i] / sum : k[i];
      w.fixed[static_cast<size_t>(o) * w.taps + i] =
          static_cast<int32_t>(normal < 0 ? -0.5 + normal * (1 << kPrecisionBits)
                                          : 0.5 + normal * (1 << kPrecisionBits));
    }
    w.first[o] = lo;
    w.count[o] = n;
  }
  return w;
}

inline unsigned char clip(int32_t sum) {
  return static_cast<unsigned char>(std::clamp(sum >> kPrecisionBits, 0, 255));
}

// Horizontal pass over `rows` input rows from `in`, into `out` (rows of out_width * kBands).
// Strips of kStripRows rows are laid out column by column, so that each weight multiplies
// kStripRows * kBands bytes that sit together: the inner loop runs across all of them at once.
template <int kBands>
[[gnu::always_inline]] inline void horizontal(const unsigned char* in, int width, int rows,
                                              const Weights& w, int out_width,
                                              unsigned char* out) {
  constexpr int kLanes = kStripRows * kBands;
  std::vector<unsigned char> columns(static_cast<size_t>(width) * kLanes);
  const size_t in_stride = static_cast<size_t>(width) * kBands;
  const size_t out_stride = static_cast<size_t>(out_width) * kBands;
  for (int y0 = 0; y0 < rows; y0 += kStripRows) {
    const int strip = std::min(kStripRows, rows - y0);
    for (int r = 0; r < kStripRows; ++r) {
      // Rows past the end of the image repeat its last row; their results are not stored.
      const unsigned char* row = in + static_cast<size_t>(y0 + std::min(r, strip - 1)) * in_stride;
      for (int x = 0; x < width; ++x) {
        for (int c = 0; c < kBands; ++c) columns[x * kLanes + r * kBands + c] = row[x * kBands + c];
      }
    }
    for (int o = 0; o < out_width; ++o) {
      int32_t sum[kLanes];
      for (int l = 0; l < kLanes; ++l) sum[l] = kHalf;
      const int32_t* k = &w.fixed[static_cast<size_t>(o) * w.taps];
      const unsigned char* column = &columns[static_cast<size_t>(w.first[o]) * kLanes];
      for (int t = 0; t < w.count[o]; ++t, column += kLanes) {
        for (int l = 0; l < kLanes; ++l) sum[l] += column[l] * k[t];
      }
      for (int r = 0; r < strip; ++r) {
        for (int c = 0; c < kBands; ++c) {
          out[(y0 + r) * out_stride + o * kBands + c] = clip(sum[r * kBands + c]);
        }
      }
    }
  }
}

// Vertical pass: each output row is a weighted sum of input rows, along the whole row at once.
LORAPIPE_VECTOR_CLONES void vertical(const unsigned char* in, size_t row_bytes, const Weights& w,
                                     int out_height, unsigned char* out) {
  std::vector<int32_t> sum(row_bytes);
  for (int o = 0; o < out_height; ++o) {
    std::fill(sum.begin(), sum.end(), kHalf);
    const int32_t* k = &w.fixed[static_cast<size_t>(o) * w.taps];
    for (int t = 0; t < w.count[o]; ++t) {
      const unsigned char* row = in + static_cast<size_t>(w.first[o] + t) * row_bytes;
      const int32_t weight = k[t];
      for (size_t i = 0; i < row_bytes; ++i) sum[i] += row[i] * weight;
    }
    unsigned char* row = out + static_cast<size_t>(o) * row_bytes;
    for (size_t i = 0; i < row_bytes; ++i) row[i] = clip(sum[i]);
  }
}

// One function per band count, so that each can be cloned (clang clones no templates).
LORAPIPE_VECTOR_CLONES void horizontal_grey(const unsigned char* in, int width, int rows,
                                            const Weights& w, int out_width, unsigned char* out) {
  horizontal<1>(in, width, rows, w, out_width, out);
}
LORAPIPE_VECTOR_CLONES void horizontal_rgb(const unsigned char* in, int width, int rows,
                                           const Weights& w, int out_width, unsigned char* out) {
  horizontal<3>(in, width, rows, w, out_width, out);
}

void horizontal_pass(const unsigned char* in, int width, int rows, int bands, const Weights& w,
                     int out_width, unsigned char* out) {
  if (bands == 1) {
    horizontal_grey(in, width, rows, w, out_width, out);
  } else {
    horizontal_rgb(in, width, rows, w, out_width, out);
  }
}

}  // namespace

std::vector<unsigned char> resize_lanczos3(const unsigned char* pixels, int width, int height,
                                           int bands, int out_width, int out_height) {
  if ((bands != 1 && bands != 3) || width < 1 || height < 1 || out_width < 1 || out_height < 1) {
    throw std::invalid_argument("resize_lanczos3: bad size or bands: " + std::to_string(width) +
                                "x" + std::to_string(height) + "x" + std::to_string(bands) +
                                " to " + std::to_string(out_width) + "x" +
                                std::to_string(out_height));
  }
  const size_t in_row = static_cast<size_t>(width) * bands;
  const size_t out_row = static_cast<size_t>(out_width) * bands;
  if (out_width == width && out_height == height) {
    return std::vector<unsigned char>(pixels, pixels + in_row * height);
  }
  Weights rows = lanczos3_weights(height, out_height);
  std::vector<unsigned char> out(out_row * out_height);
  if (out_width == width) {  // one pass: Pillow skips the other
    vertical(pixels, in_row, rows, out_height, out.data());
    return out;
  }
  const Weights columns = lanczos3_weights(width, out_width);
  if (out_height == height) {
    horizontal_pass(pixels, width, height, bands, columns, out_width, out.data());
    return out;
  }
  // Pillow (13 on, python-pillow/Pillow#9549) runs the vertical pass first when the height shrinks
  // by more than twice as many pixels as the width does (found by probing Pillow 13.0.0, which
  // versions.env pins); the rounding between the passes makes the order show in the pixels.
  if (out_height < height && height - out_height > 2 * (width - out_width)) {
    std::vector<unsigned char> down(in_row * out_height);
    vertical(pixels, in_row, rows, out_height, down.data());
    horizontal_pass(down.data(), width, out_height, bands, columns, out_width, out.data());
    return out;
  }
  // Horizontal first, over only the input rows the vertical pass reads.
  const int first_row = rows.first.front();
  const int row_count = rows.first.back() + rows.count.back() - first_row;
  std::vector<unsigned char> across(out_row * row_count);
  horizontal_pass(pixels + first_row * in_row, width, row_count, bands, columns, out_width,
                  across.data());
  for (int& first : rows.first) first -= first_row;
  vertical(across.data(), out_row, rows, out_height, out.data());
  return out;
}

}  // namespace lorapipe::preprocess
