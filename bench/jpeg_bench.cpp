// JPEG decode of a folder with lorapipe's Huffman decoder against libjpeg-turbo's own, on the
// same files in the same run: same DCT scaling, same IDCT, upsampling and colour conversion, so
// the difference is the entropy decoding. Checks the pixels are identical, then prints CPU time
// per side (median of rounds that alternate which side goes first) and the ratio.
//
//     build/bin/jpeg_bench DIR [shrink=4] [rounds=5]
#include <sys/resource.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "preprocess/jpeg.h"

namespace {

using lorapipe::preprocess::decode_plain_jpeg;
using lorapipe::preprocess::HuffmanDecoder;

double cpu_seconds() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<double>(usage.ru_utime.tv_sec) + usage.ru_utime.tv_usec * 1e-6;
}

double decode_all(const std::vector<std::string>& files, int shrink, HuffmanDecoder huffman) {
  const double start = cpu_seconds();
  for (const std::string& bytes : files) {
    const auto decoded = decode_plain_jpeg(bytes, shrink, huffman);
    if (!decoded || decoded->huffman != huffman) {
      std::fprintf(stderr, "jpeg_bench: a file was declined or decoded by the other decoder\n");
      std::exit(1);
    }
  }
  return cpu_seconds() - start;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: jpeg_bench DIR [shrink=4] [rounds=5]\n");
    return 2;
  }
  const int shrink = argc > 2 ? std::atoi(argv[2]) : 4;
  const int rounds = argc > 3 ? std::atoi(argv[3]) : 5;
  std::vector<std::string> files;
  for (const auto& entry : std::filesystem::recursive_directory_iterator(argv[1])) {
    if (entry.path().extension() != ".jpg") continue;
    std::ifstream in(entry.path(), std::ios::binary);
    files.emplace_back(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  size_t bytes = 0;
  for (const std::string& f : files) {
    bytes += f.size();
    const auto ours = decode_plain_jpeg(f, shrink, HuffmanDecoder::kOurs);
    const auto theirs = decode_plain_jpeg(f, shrink, HuffmanDecoder::kLibjpeg);
    if (!ours || !theirs || ours->pixels != theirs->pixels) {
      std::fprintf(stderr, "jpeg_bench: the two decoders disagree\n");
      return 1;
    }
  }
  std::vector<double> ours, theirs, ratios;
  for (int r = 0; r < rounds; ++r) {
    const bool ours_first = r % 2 == 0;
    const double a = decode_all(files, shrink, ours_first ? HuffmanDecoder::kOurs : HuffmanDecoder::kLibjpeg);
    const double b = decode_all(files, shrink, ours_first ? HuffmanDecoder::kLibjpeg : HuffmanDecoder::kOurs);
    ours.push_back(ours_first ? a : b);
    theirs.push_back(ours_first ? b : a);
    ratios.push_back(theirs.back() / ours.back());
  }
  std::printf("jpeg_bench: %zu JPEGs (%.0f MB) at 1/%d, pixels identical; CPU s per pass: "
              "lorapipe %.3f, libjpeg-turbo %.3f; libjpeg/lorapipe %.2fx [%.2f-%.2f]\n",
              files.size(), bytes / 1e6, shrink, median(ours), median(theirs), median(ratios),
              *std::min_element(ratios.begin(), ratios.end()),
              *std::max_element(ratios.begin(), ratios.end()));
  return 0;
}
