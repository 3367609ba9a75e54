// Bad input and unusual encodings, through the real libvips decoder. Fixtures come from
// tests/fixtures/make_bad_images.py (Pillow, an independent encoder), generated per run.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>

#include "common/error.h"
#include "preprocess/image.h"
#include "preprocess/preprocess.h"
#include "runtime/process.h"
#include "tests/paths.h"

namespace lorapipe::preprocess {
namespace {
namespace fs = std::filesystem;

class PreprocessBadInput : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = fs::temp_directory_path() / ("lorapipe-bad-input-" + std::to_string(getpid()));
    fs::remove_all(dir_);
    const char* python = std::getenv("LORAPIPE_PYTHON");
    ASSERT_NE(python, nullptr) << "LORAPIPE_PYTHON (the test venv's python) is not set";
    const std::string command = std::string(python) + " " + LORAPIPE_SOURCE_DIR +
                                "/tests/fixtures/make_bad_images.py " + dir_.string();
    ASSERT_EQ(std::system(command.c_str()), 0) << command;
    fs::permissions(dir_, fs::perms::all, fs::perm_options::add);
  }
  static void TearDownTestSuite() { fs::remove_all(dir_); }

  static Options report_options() {
    Options options;
    options.data_dir = dir_.string();
    options.report_only = true;
    options.threads = 2;
    return options;
  }

  static std::string bytes_of(const std::string& name) {
    std::ifstream in(dir_ / "3_widget" / name, std::ios::binary);
    return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  }

  // Decodes a fixture to its displayed size (no resize, no crop).
  static std::string decode_native(const std::string& name, ImageHeader* header_out) {
    const std::string bytes = bytes_of(name);
    const ImageHeader header = probe_image(bytes);
    DecodeRequest request;
    request.resized = {header.width, header.height};
    request.bucket = request.resized;
    *header_out = header;
    return decode_image(bytes, header, request);
  }

  static std::array<int, 3> pixel(const std::string& rgb, const ImageHeader& h, int x, int y) {
    const size_t i = (static_cast<size_t>(y) * h.width + x) * 3;
    return {static_cast<unsigned char>(rgb[i]), static_cast<unsigned char>(rgb[i + 1]),
            static_cast<unsigned char>(rgb[i + 2])};
  }

  static fs::path dir_;
};
fs::path PreprocessBadInput::dir_;

std::map<std::string, std::string> skipped_by_name(const Report& report) {
  std::map<std::string, std::string> out;
  for (const Skipped& s : report.skipped) out[fs::path(s.path).filename().string()] = s.reason;
  return out;
}

// A header libvips cannot read is skipped with a reason that says something: what libvips said,
// or, where its loader says nothing, which loader failed and how. Never the bare prefix.
TEST_F(PreprocessBadInput, AnUnreadableHeaderIsNamedWithLibvipsReason) {
  const std::string signature("\x89PNG\r\n\x1a\n", 8);
  for (const std::string& bytes :
       {signature + std::string("\0\0\0\x0dIHDR\0\0", 10),  // cut inside IHDR
        signature + std::string(64, 'x')}) {                     // garbage after the signature
    try {
      (void)probe_image(bytes);
      ADD_FAILURE() << "a broken PNG header was read";
    } catch (const InputError& e) {
      const std::string what = e.what(), prefix = "cannot read the image header: ";
      ASSERT_EQ(what.rfind(prefix, 0), 0u) << what;
      EXPECT_GT(what.size(), prefix.size() + 10) << "no reason: '" << what << "'";
    }
  }
}

TEST_F(PreprocessBadInput, EveryBadFileIsNamedWithItsReasonAndGoodOnesAreUsed) {
  const Report report = run(report_options());
  const auto skipped = skipped_by_name(report);
  const std::map<std::string, std::string> expected{
      {"zero.jpg", "empty file"},
      {"text.jpg", "not an image libvips can read"},
      {"truncated.jpg", "cannot decode"},
      {"corrupt.png", "cannot decode"},
      {"one_pixel.png", "1x1: shorter side under --min_image_side=64"},
      {"strip.png", "20000x20"},
      {"bomb.png", "header says 60000x60000"},
      {"loop.jpg", "Too many levels of symbolic links"},
  };
  for (const auto& [name, reason] : expected) {
    auto it = skipped.find(name);
    ASSERT_NE(it, skipped.end()) << name << " was not reported as skipped";
    EXPECT_NE(it->second.find(reason), std::string::npos) << name << ": " << it->second;
  }
  std::map<std::string, const ImageResult*> used;
  for (const ImageResult& r : report.images) used[fs::path(r.path).filename().string()] = &r;
  for (const char* name : {"good.jpg", "good_green.png", "good.webp", "good.tiff", "cmyk.jpg", "deep16.png",
                           "grey_alpha.png", "palette.gif", "animated.gif", "rotated.jpg",
                           "latin1.png", "bom.png"}) {
    EXPECT_EQ(used.count(name), 1u) << name << " is good and must be used";
  }
  // EXIF orientation 6: stored 400x200, displayed 200x400, so a portrait bucket.
  ASSERT_EQ(used.count("rotated.jpg"), 1u);
  EXPECT_EQ(used["rotated.jpg"]->width, 200);
  EXPECT_EQ(used["rotated.jpg"]->height, 400);
  EXPECT_LT(used["rotated.jpg"]->bucket.width, used["rotated.jpg"]->bucket.height);
  // Captions: Latin-1 read and reported, BOM stripped, class tokens for the rest.
  EXPECT_EQ(used["latin1.png"]->caption, "caf\xc3\xa9 au lait, cr\xc3\xa8me");
  EXPECT_NE(used["latin1.png"]->caption_note.find("Latin-1"), std::string::npos);
  EXPECT_EQ(used["bom.png"]->caption, "a cyan square");
  EXPECT_EQ(used["good.jpg"]->caption, "widget");
  EXPECT_EQ(used["good.jpg"]->caption_source, "class_tokens");
  EXPECT_EQ(used["good.jpg"]->repeats, 3u);
  // The abc_tokens folder is reported, not used.
  bool abc_reported = false;
  for (const Ignored& i : report.ignored) abc_reported |= i.path.find("abc_tokens") != std::string::npos;
  EXPECT_TRUE(abc_reported);
  EXPECT_EQ(report.decoded, report.images.size());
}

TEST_F(PreprocessBadInput, UnreadableFileIsSkippedWithItsReason) {
  // root reads any file, so the stage runs as its own process (the tests' spawn helper), as
  // nobody when this test runs as root.
  const fs::path json = dir_ / "unreadable-report.json";
  runtime::SpawnOptions options;
  options.argv = {LORAPIPE_PREPROCESS_BIN, "--data_dir=" + dir_.string(), "--report_only",
                  "--report_json=" + json.string(), "--threads=2"};
  options.stderr_path = dir_ / "unreadable.err";
  if (geteuid() == 0) options.run_as = std::make_pair(uid_t{65534}, gid_t{65534});
  ASSERT_EQ(runtime::wait_exit(runtime::spawn(options)), 0)
      << std::ifstream(dir_ / "unreadable.err").rdbuf();
  std::ifstream in(json);
  const std::string text{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  const size_t at = text.find("unreadable.png");
  ASSERT_NE(at, std::string::npos) << "unreadable.png is not in the report";
  const size_t reason = text.find("\"reason\"", at);
  ASSERT_NE(reason, std::string::npos);
  EXPECT_NE(text.substr(reason, 80).find("cannot open: Permission denied"), std::string::npos)
      << text.substr(at, 200);
}

TEST_F(PreprocessBadInput, CmykBecomesSrgb) {
  ImageHeader h;
  const std::string rgb = decode_native("cmyk.jpg", &h);
  // C=0 M=100% Y=100% K=0 is a saturated red in any CMYK profile.
  const auto p = pixel(rgb, h, h.width / 2, h.height / 2);
  EXPECT_GT(p[0], 180);
  EXPECT_LT(p[1], 90);
  EXPECT_LT(p[2], 90);
}

TEST_F(PreprocessBadInput, SixteenBitBecomesEightBit) {
  ImageHeader h;
  const std::string rgb = decode_native("deep16.png", &h);
  ASSERT_EQ(h.width, 256);
  // Red ramps 0..65535 over 256 columns: column x holds 257*x, which is x in 8 bits (±1 for
  // rounding); green 0x8000 is 128.
  for (int x : {0, 64, 128, 255}) {
    const auto p = pixel(rgb, h, x, 10);
    EXPECT_NEAR(p[0], x, 1) << "column " << x;
    EXPECT_NEAR(p[1], 128, 1);
    EXPECT_EQ(p[2], 0);
  }
}

TEST_F(PreprocessBadInput, AlphaIsCompositedOnWhite) {
  ImageHeader h;
  const std::string rgb = decode_native("grey_alpha.png", &h);
  EXPECT_EQ(pixel(rgb, h, 10, 10), (std::array<int, 3>{0, 0, 0}));          // opaque black
  EXPECT_EQ(pixel(rgb, h, 190, 10), (std::array<int, 3>{255, 255, 255}));   // transparent
}

// kohya's alpha_mask: the alpha channel travels apart and the colour is the image's own, not
// put on white, as Pillow reads them (an independent decoder, the one kohya uses): an RGBA PNG
// of random values and a grey+alpha one, bit for bit. An image without alpha gets 255.
TEST(PreprocessAlphaMask, AlphaTravelsApartAndColourIsKeptAsPillowReadsIt) {
  const fs::path dir = fs::temp_directory_path() / ("lorapipe-alpha-" + std::to_string(getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  const char* python = std::getenv("LORAPIPE_PYTHON");
  ASSERT_NE(python, nullptr) << "LORAPIPE_PYTHON (the test venv's python) is not set";
  const std::string script =
      "import sys, numpy as np\n"
      "from PIL import Image\n"
      "d = sys.argv[1]\n"
      "rgba = np.random.default_rng(3).integers(0, 256, (40, 48, 4), dtype=np.uint8)\n"
      "Image.fromarray(rgba, 'RGBA').save(d + '/rgba.png')\n"
      "la = np.random.default_rng(4).integers(0, 256, (24, 32, 2), dtype=np.uint8)\n"
      "Image.fromarray(la, 'LA').save(d + '/la.png')\n"
      "Image.fromarray(rgba[:, :, :3], 'RGB').save(d + '/rgb.png')\n"
      "for name in ('rgba', 'la'):\n"
      "    open(d + '/' + name + '.raw', 'wb').write(\n"
      "        np.asarray(Image.open(d + '/' + name + '.png').convert('RGBA')).tobytes())\n";
  std::ofstream(dir / "make.py") << script;
  const std::string command =
      std::string(python) + " " + (dir / "make.py").string() + " " + dir.string();
  ASSERT_EQ(std::system(command.c_str()), 0) << command;
  auto read = [&](const std::string& name) {
    std::ifstream in(dir / name, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  };
  for (const std::string name : {"rgba", "la"}) {
    const std::string bytes = read(name + ".png");
    const ImageHeader header = probe_image(bytes);
    DecodeRequest request;
    request.resized = {header.width, header.height};
    request.bucket = request.resized;
    request.alpha_mask = true;
    std::string alpha;
    const std::string rgb = decode_image(bytes, header, request, &alpha);
    const std::string pillow = read(name + ".raw");
    const size_t count = static_cast<size_t>(header.width) * header.height;
    ASSERT_EQ(pillow.size(), count * 4) << name;
    ASSERT_EQ(rgb.size(), count * 3) << name;
    ASSERT_EQ(alpha.size(), count) << name;
    size_t colour_differs = 0, alpha_differs = 0;
    for (size_t i = 0; i < count; ++i) {
      colour_differs += rgb.compare(i * 3, 3, pillow, i * 4, 3) != 0;
      alpha_differs += alpha[i] != pillow[i * 4 + 3];
    }
    EXPECT_EQ(colour_differs, 0u) << name;
    EXPECT_EQ(alpha_differs, 0u) << name;
    request.alpha_mask = false;
    EXPECT_NE(decode_image(bytes, header, request), rgb) << name << ": without it, put on white";
  }
  // No alpha channel: fully opaque, also resized and cropped to a bucket.
  const std::string bytes = read("rgb.png");
  const ImageHeader header = probe_image(bytes);
  DecodeRequest request;
  request.resized = {36, 30};
  request.bucket = {32, 24};
  request.offset = {2, 3};
  request.alpha_mask = true;
  std::string alpha;
  EXPECT_EQ(decode_image(bytes, header, request, &alpha).size(), 32u * 24 * 3);
  EXPECT_EQ(alpha, std::string(32 * 24, '\xff'));
  fs::remove_all(dir);
}

TEST_F(PreprocessBadInput, PaletteAndAnimatedGifUseTheFirstFrame) {
  ImageHeader h;
  const std::string blue = decode_native("palette.gif", &h);
  EXPECT_EQ(pixel(blue, h, 5, 5), (std::array<int, 3>{0, 0, 255}));
  const std::string first = decode_native("animated.gif", &h);
  EXPECT_EQ(h.height, 120) << "the frame height, not all frames stacked";
  EXPECT_EQ(pixel(first, h, 5, 5), (std::array<int, 3>{255, 0, 0}));
}

TEST_F(PreprocessBadInput, ExifOrientationIsApplied) {
  ImageHeader h;
  const std::string rgb = decode_native("rotated.jpg", &h);
  ASSERT_EQ(h.width, 200);
  ASSERT_EQ(h.height, 400);
  // Stored left half red, right half blue; rotated 90 degrees clockwise, red is on top.
  const auto top = pixel(rgb, h, 100, 50);
  const auto bottom = pixel(rgb, h, 100, 350);
  EXPECT_GT(top[0], 200);
  EXPECT_LT(top[2], 60);
  EXPECT_GT(bottom[2], 200);
  EXPECT_LT(bottom[0], 60);
}

TEST_F(PreprocessBadInput, ResizeAndCropGiveExactlyTheBucket) {
  const std::string bytes = bytes_of("good.jpg");  // 640x480
  const ImageHeader header = probe_image(bytes);
  BucketSelector selector(BucketOptions{});
  std::string why;
  const auto choice = selector.select(header.width, header.height, &why);
  ASSERT_TRUE(choice.has_value());
  DecodeRequest request;
  request.resized = choice->resized;
  request.bucket = choice->bucket;
  request.offset = crop_offset(choice->resized, choice->bucket);
  for (const char* filter : {"lanczos3", "linear", "nearest"}) {
    request.resize_filter = filter;
    const std::string rgb = decode_image(bytes, header, request);
    EXPECT_EQ(rgb.size(), static_cast<size_t>(choice->bucket.width) * choice->bucket.height * 3)
        << filter;
  }
  request.resize_filter = "bicubic-ish";
  EXPECT_THROW(decode_image(bytes, header, request), InputError);
}

}  // namespace
}  // namespace lorapipe::preprocess
