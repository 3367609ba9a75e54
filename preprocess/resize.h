#pragma once
// Lanczos-3 resize of 8-bit interleaved pixels, giving exactly what Pillow's
// Image.resize(size, Image.LANCZOS) gives for the same pixels: the resize the Python trainers run.
// It takes the same coefficients, fixed-point precision (22 bits), rounding and pass order, so a
// test compares the two byte for byte. It is much faster than libvips' reduce on a downscale, because both passes run
// across many pixels at once: the vertical pass along each row, the horizontal pass on strips of
// rows laid out column by column.

#include <vector>

namespace lorapipe::preprocess {

// Resizes `pixels` (height rows of width * bands bytes; bands 1, grey, or 3, RGB) to
// out_width x out_height. (Pillow resizes LA and RGBA through premultiplied alpha.)
std::vector<unsigned char> resize_lanczos3(const unsigned char* pixels, int width, int height,
                                           int bands, int out_width, int out_height);

}  // namespace lorapipe::preprocess
