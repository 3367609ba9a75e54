// Dataset discovery: kohya repeat folders, captions, and the dataset TOML with kohya's
// precedence and errors that name the key and its line.
#include "preprocess/dataset.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <fstream>
#include <optional>
#include <set>

#include "common/error.h"

namespace lorapipe::preprocess {
namespace {
namespace fs = std::filesystem;

fs::path make_temp_dir(const std::string& name) {
  fs::path dir = fs::temp_directory_path() /
                 ("lorapipe-dataset-test-" + name + "-" + std::to_string(getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

void write_file(const fs::path& path, const std::string& bytes) {
  fs::create_directories(path.parent_path());
  std::ofstream(path, std::ios::binary) << bytes;
}

const ImageEntry* find_image(const Discovery& d, const std::string& name) {
  for (const ImageEntry& e : d.images) {
    if (e.path.filename() == name) return &e;
  }
  return nullptr;
}

TEST(DatasetFolder, KohyaRepeatFoldersCaptionsAndReportedFolders) {
  const fs::path dir = make_temp_dir("folder");
  write_file(dir / "top.png", "x");
  write_file(dir / "top.caption", "from a .caption file\n");
  write_file(dir / "10_sks dog" / "a.jpg", "x");
  write_file(dir / "10_sks dog" / "b.jpg", "x");
  write_file(dir / "10_sks dog" / "b.txt", "  a photo of sks dog on grass  \nignored second line");
  write_file(dir / "2_style_with_underscores" / "c.webp", "x");
  write_file(dir / "abc_tokens" / "d.png", "x");
  write_file(dir / "notes.md", "not an image");

  Defaults defaults;
  const Discovery d = discover_folder(dir, defaults);
  ASSERT_EQ(d.images.size(), 3u);
  // Beside repeat folders, kohya trains none of the loose images: listed, not trained.
  EXPECT_EQ(find_image(d, "top.png"), nullptr);
  bool top_reported = false;
  for (const Ignored& i : d.ignored) {
    top_reported |= i.path.find("top.png") != std::string::npos &&
                    i.reason.find("beside kohya repeat folders") != std::string::npos;
  }
  EXPECT_TRUE(top_reported);
  for (const auto& subset : d.datasets[0].subsets) {
    EXPECT_NE(subset.image_dir, dir) << "no subset of the loose images";
  }

  const ImageEntry* a = find_image(d, "a.jpg");
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->caption, "sks dog");
  EXPECT_EQ(a->caption_source, "class_tokens");
  EXPECT_EQ(d.datasets[0].subsets[a->subset].num_repeats, 10);

  const ImageEntry* b = find_image(d, "b.jpg");
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(b->caption, "a photo of sks dog on grass");  // first line, stripped (kohya)
  EXPECT_EQ(b->caption_source, "file");

  const ImageEntry* c = find_image(d, "c.webp");
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->caption, "style_with_underscores");
  EXPECT_EQ(d.datasets[0].subsets[c->subset].num_repeats, 2);

  bool abc_reported = false;
  bool notes_reported = false;
  for (const Ignored& i : d.ignored) {
    abc_reported |= i.path.find("abc_tokens") != std::string::npos &&
                    i.reason.find("<N>_<class tokens>") != std::string::npos;
    notes_reported |= i.path.find("notes.md") != std::string::npos;
  }
  EXPECT_TRUE(abc_reported) << "a folder that is not <N>_<tokens> must be reported by name";
  EXPECT_TRUE(notes_reported);
  EXPECT_EQ(find_image(d, "d.png"), nullptr);
  fs::remove_all(dir);
}

// A folder of images and no repeat folder: each image once, captioned from its file (lorapipe's
// plain layout; kohya would find no subset).
TEST(DatasetFolder, LooseImagesAloneTrainOnceEach) {
  const fs::path dir = make_temp_dir("loose");
  write_file(dir / "top.png", "x");
  write_file(dir / "top.caption", "from a .caption file\n");
  write_file(dir / "other.jpg", "x");
  const Discovery d = discover_folder(dir, Defaults{});
  ASSERT_EQ(d.images.size(), 2u);
  const ImageEntry* top = find_image(d, "top.png");
  ASSERT_NE(top, nullptr);
  EXPECT_EQ(top->caption, "from a .caption file");
  EXPECT_EQ(d.datasets[0].subsets[top->subset].num_repeats, 1);
  fs::remove_all(dir);
}

// A caption file that is there but cannot be read (here an I/O error: it links to /proc/self/mem,
// a regular file whose first page no process has mapped) skips its image by name, with the
// system's reason; the image is not trained on a substitute caption.
TEST(DatasetFolder, AnUnreadableCaptionSkipsItsImageByName) {
  const fs::path dir = make_temp_dir("unreadable-caption");
  write_file(dir / "a.png", "x");
  fs::create_symlink("/proc/self/mem", dir / "a.txt");
  write_file(dir / "b.png", "x");
  write_file(dir / "b.txt", "a caption\n");
  const Discovery d = discover_folder(dir, Defaults{});
  ASSERT_EQ(d.images.size(), 1u);
  EXPECT_EQ(d.images[0].caption, "a caption");
  ASSERT_EQ(d.skipped.size(), 1u);
  EXPECT_EQ(d.skipped[0].path, (dir / "a.png").string());
  EXPECT_EQ(d.skipped[0].reason,
            "cannot read caption file " + (dir / "a.txt").string() + ": Input/output error");
  fs::remove_all(dir);
}

// kohya's caption file is the image's name without its extension, then caption_extension with a
// dot put in front when it has none (DreamBoothSubset): "txt" reads a.txt, and "_tags.txt" reads
// a._tags.txt, not a_tags.txt. Then kohya's face-crop name.
TEST(DatasetFolder, CaptionExtensionWithoutADotGetsOneAsKohya) {
  const fs::path dir = make_temp_dir("suffix");
  write_file(dir / "1_cls" / "a.png", "x");
  write_file(dir / "1_cls" / "a.txt", "from a.txt\n");
  write_file(dir / "1_cls" / "b.png", "x");
  write_file(dir / "1_cls" / "b._tags.txt", "from b._tags.txt\n");
  write_file(dir / "1_cls" / "b_tags.txt", "not this one\n");
  Defaults defaults;
  defaults.subset.caption_extension_set = true;
  defaults.subset.caption_extension = "txt";
  const Discovery with_txt = discover_folder(dir, defaults);
  const ImageEntry* a = find_image(with_txt, "a.png");
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->caption, "from a.txt");
  defaults.subset.caption_extension = "_tags.txt";
  const Discovery d = discover_folder(dir, defaults);
  const ImageEntry* b = find_image(d, "b.png");
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(b->caption, "from b._tags.txt");
  // kohya's second candidate (its face-crop tool names a crop NAME_x_y_w_h and leaves the
  // caption as NAME's): all but the last 4 '_' pieces of the path, after the image's own name.
  write_file(dir / "1_cls" / "face_10_20_30_40.png", "x");
  write_file(dir / "1_cls" / "face.txt", "the original's caption\n");
  write_file(dir / "1_cls" / "own_1_2_3_4.png", "x");
  write_file(dir / "1_cls" / "own_1_2_3_4.txt", "its own caption\n");
  write_file(dir / "1_cls" / "own.txt", "not this one\n");
  defaults.subset.caption_extension = ".txt";
  const Discovery crops = discover_folder(dir, defaults);
  const ImageEntry* face = find_image(crops, "face_10_20_30_40.png");
  const ImageEntry* own = find_image(crops, "own_1_2_3_4.png");
  ASSERT_NE(face, nullptr);
  ASSERT_NE(own, nullptr);
  EXPECT_EQ(face->caption, "the original's caption");
  EXPECT_EQ(own->caption, "its own caption");
  fs::remove_all(dir);
}

// kohya's --reg_data_dir: its repeat folders are regularization subsets; images directly in it
// are not used (reported), nor are hidden files anywhere (macOS's "._x.jpg" are not images).
// A caption in kohya's default .caption wins over a .txt beside it.
TEST(DatasetFolder, RegDataDirRepeatFoldersAreRegularizationAndHiddenFilesSkipped) {
  const fs::path dir = make_temp_dir("reg");
  write_file(dir / "train" / "5_sks dog" / "a.jpg", "x");
  write_file(dir / "train" / "5_sks dog" / "._a.jpg", "AppleDouble");
  write_file(dir / "train" / "5_sks dog" / "both.jpg", "x");  // kohya's .caption before .txt
  write_file(dir / "train" / "5_sks dog" / "both.caption", "from the caption file");
  write_file(dir / "train" / "5_sks dog" / "both.txt", "from the tag file");
  write_file(dir / "reg" / "1_dog" / "r.jpg", "x");
  write_file(dir / "reg" / "loose.jpg", "x");
  const Discovery d = discover_folder(dir / "train", Defaults{}, dir / "reg");
  ASSERT_EQ(d.images.size(), 3u);
  ASSERT_NE(find_image(d, "both.jpg"), nullptr);
  EXPECT_EQ(find_image(d, "both.jpg")->caption, "from the caption file");
  const ImageEntry* a = find_image(d, "a.jpg");
  const ImageEntry* r = find_image(d, "r.jpg");
  ASSERT_NE(a, nullptr);
  ASSERT_NE(r, nullptr);
  EXPECT_FALSE(d.datasets[0].subsets[a->subset].is_reg);
  EXPECT_TRUE(d.datasets[0].subsets[r->subset].is_reg);
  EXPECT_EQ(r->caption, "dog");
  EXPECT_EQ(find_image(d, "._a.jpg"), nullptr);
  bool loose_reported = false;
  for (const Ignored& i : d.ignored) loose_reported |= i.path.find("loose.jpg") != std::string::npos;
  EXPECT_TRUE(loose_reported);
  EXPECT_THROW(discover_folder(dir / "train", Defaults{}, dir / "nope"), InputError);
  fs::remove_all(dir);
}

void expect_toml_error(const std::string& toml, const std::string& line_and_text,
                       const std::string& name = "config.toml") {
  try {
    parse_dataset_toml(toml, name, Defaults{});
    FAIL() << "accepted:\n" << toml;
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find(line_and_text), std::string::npos) << e.what();
  }
}

// As kohya's DreamBoothDataset: a subset with num_repeats below 1, or repeating an earlier
// subset's image_dir, is left out (the first one wins); kohya's caption_separator and
// custom_attributes are accepted.
TEST(DatasetToml, ZeroRepeatAndDuplicateSubsetsAreLeftOut) {
  const fs::path dir = make_temp_dir("toml-subsets");
  write_file(dir / "a" / "1.png", "x");
  write_file(dir / "b" / "2.png", "x");
  write_file(dir / "config.toml",
             "[[datasets]]\n"
             "[[datasets.subsets]]\nimage_dir = 'a'\nnum_repeats = 3\ncaption_separator = ';'\n"
             "custom_attributes = { style = 'x' }\n"
             "[[datasets.subsets]]\nimage_dir = 'a'\nnum_repeats = 7\n"
             "[[datasets.subsets]]\nimage_dir = 'b'\nnum_repeats = 0\n");
  const Discovery d = discover_toml(dir / "config.toml", Defaults{});
  ASSERT_EQ(d.datasets.size(), 1u);
  ASSERT_EQ(d.datasets[0].subsets.size(), 1u);
  EXPECT_EQ(d.datasets[0].subsets[0].num_repeats, 3) << "the first of the two 'a' subsets";
  ASSERT_EQ(d.images.size(), 1u);
  EXPECT_EQ(d.images[0].path.filename(), "1.png");
  // kohya's differential output preservation would train those images another way: refused
  // by name (set false, it asks for nothing and is taken).
  write_file(dir / "dop.toml",
             "[[datasets]]\n[[datasets.subsets]]\nimage_dir = 'a'\n"
             "custom_attributes = { diff_output_preservation = true }\n");
  try {
    discover_toml(dir / "dop.toml", Defaults{});
    ADD_FAILURE() << "diff_output_preservation was taken";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("dop.toml:4: custom_attributes.diff_output_preservation"),
              std::string::npos)
        << e.what();
  }
  write_file(dir / "dop.toml",
             "[[datasets]]\n[[datasets.subsets]]\nimage_dir = 'a'\n"
             "custom_attributes = { diff_output_preservation = false }\n");
  EXPECT_EQ(discover_toml(dir / "dop.toml", Defaults{}).images.size(), 1u);
  // The pixel augmentations are refused as their flags are; color_aug = false asks for nothing.
  for (const auto& [line, says] : std::vector<std::pair<std::string, std::string>>{
           {"color_aug = true", "aug.toml:4: color_aug = true augments the pixels"},
           {"face_crop_aug_range = [2.0, 4.0]", "aug.toml:4: face_crop_aug_range"}}) {
    write_file(dir / "aug.toml",
               "[[datasets]]\n[[datasets.subsets]]\nimage_dir = 'a'\n" + line + "\n");
    try {
      discover_toml(dir / "aug.toml", Defaults{});
      ADD_FAILURE() << line << " was taken";
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
    }
  }
  write_file(dir / "aug.toml", "[[datasets]]\n[[datasets.subsets]]\nimage_dir = 'a'\n"
                               "color_aug = false\n");
  EXPECT_EQ(discover_toml(dir / "aug.toml", Defaults{}).images.size(), 1u);
  // kohya scales the LoRA by a dataset's network_multiplier for its batches (-1: away from the
  // dataset): refused where it is not 1, which trains as without it.
  expect_toml_error("[[datasets]]\nnetwork_multiplier = -1.0\n[[datasets.subsets]]\nimage_dir = 'a'\n",
                    "config.toml:2: network_multiplier");
  write_file(dir / "multiplier.toml",
             "[[datasets]]\nnetwork_multiplier = 1.0\n[[datasets.subsets]]\nimage_dir = 'a'\n");
  EXPECT_EQ(discover_toml(dir / "multiplier.toml", Defaults{}).images.size(), 1u);
  fs::remove_all(dir);
}

// A relative image_dir is read from the TOML's folder; where nothing is there, from the working
// folder, as kohya reads it (a TOML in configs/ naming data/...). Neither: as kohya, the subset is
// left out and the others train; it is listed with what was not used, naming the path it looked
// for. A [[datasets]] without subsets adds nothing, as kohya's schema takes it.
TEST(DatasetToml, RelativeImageDirFromTheTomlsFolderElseTheWorkingFolder) {
  const fs::path dir = make_temp_dir("toml-relative");
  write_file(dir / "beside" / "configs" / "near" / "1.png", "x");
  write_file(dir / "work" / "far" / "2.png", "x");
  write_file(dir / "beside" / "configs" / "config.toml",
             "[[datasets]]\nresolution = 256\n"
             "[[datasets]]\n[[datasets.subsets]]\nimage_dir = 'near'\n"
             "[[datasets.subsets]]\nimage_dir = 'nowhere'\n"
             "[[datasets.subsets]]\nimage_dir = 'far'\n");
  const fs::path was = fs::current_path();
  fs::current_path(dir / "work");
  std::optional<Discovery> d;
  std::string error;
  try {
    d = discover_toml(dir / "beside" / "configs" / "config.toml", Defaults{});
  } catch (const InputError& e) {
    error = e.what();
  }
  fs::current_path(was);
  ASSERT_TRUE(d.has_value()) << error;
  ASSERT_EQ(d->datasets.size(), 1u) << "the dataset without subsets adds none";
  EXPECT_EQ(d->datasets[0].subsets.size(), 2u);
  std::set<std::string> found;
  for (const auto& image : d->images) found.insert(image.path.filename().string());
  EXPECT_EQ(found, (std::set<std::string>{"1.png", "2.png"}));
  ASSERT_EQ(d->ignored.size(), 1u);
  EXPECT_EQ(d->ignored[0].path, (dir / "beside" / "configs" / "nowhere").string());
  EXPECT_NE(d->ignored[0].reason.find("image_dir is not a folder"), std::string::npos)
      << d->ignored[0].reason;
  fs::remove_all(dir);
}

TEST(DatasetFolder, MissingFolderIsAClearError) {
  try {
    discover_folder("/nonexistent/lorapipe/photos", Defaults{});
    FAIL();
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent/lorapipe/photos"), std::string::npos);
  }
}

TEST(DatasetCaption, BomStrippedLatin1RepairedFirstLineOnly) {
  const fs::path dir = make_temp_dir("caption");
  write_file(dir / "bom.txt", "\xef\xbb\xbf" "a red ball\r\nsecond");
  write_file(dir / "latin1.txt", "caf\xe9 cr\xe8me");
  write_file(dir / "utf8.txt", "caf\xc3\xa9 \xf0\x9f\x90\xb6");
  Caption bom = read_caption_file(dir / "bom.txt");
  EXPECT_EQ(bom.text, "a red ball");
  EXPECT_TRUE(bom.note.empty());
  write_file(dir / "empty.txt", "");
  write_file(dir / "blank.txt", "  \n");
  write_file(dir / "bom-only.txt", "\xef\xbb\xbf");  // not empty to kohya: no stop there
  for (const char* name : {"empty.txt", "blank.txt", "bom-only.txt"}) {
    const Caption empty = read_caption_file(dir / name);
    EXPECT_EQ(empty.text, "") << name;
    EXPECT_NE(empty.note.find(name == std::string("empty.txt") ? "caption file is empty"
                                                                 : "caption file holds no text"),
              std::string::npos)
        << name;
  }
  Caption latin1 = read_caption_file(dir / "latin1.txt");
  EXPECT_EQ(latin1.text, "caf\xc3\xa9 cr\xc3\xa8me");
  EXPECT_NE(latin1.note.find("Latin-1"), std::string::npos);
  Caption utf8 = read_caption_file(dir / "utf8.txt");
  EXPECT_EQ(utf8.text, "caf\xc3\xa9 \xf0\x9f\x90\xb6");
  EXPECT_TRUE(utf8.note.empty());
  fs::remove_all(dir);
}

// kohya's read_caption: with enable_wildcard every non-blank line, stripped, joined with "\n";
// lines end as in Python's text files ("\n", "\r\n", "\r").
TEST(DatasetCaption, WildcardCaptionsKeepEveryLine) {
  const fs::path dir = make_temp_dir("caption-lines");
  write_file(dir / "lines.txt", "  first {a|b}  \r\n\n second\rthird\n\n");
  EXPECT_EQ(read_caption_file(dir / "lines.txt").text, "first {a|b}");
  EXPECT_EQ(read_caption_file(dir / "lines.txt", /*all_lines=*/true).text,
            "first {a|b}\nsecond\nthird");
  fs::remove_all(dir);
}

// kohya's caption separators, wildcards, token warm-up and resize_interpolation are read from a
// dataset TOML, at any level; a caption that draws nothing gets its secondary separator replaced
// here, so the cacher encodes what the trainer would see.
TEST(DatasetToml, CaptionSeparatorsWildcardsAndWarmupAreRead) {
  const fs::path dir = make_temp_dir("toml-separators");
  write_file(dir / "a" / "1.png", "x");
  write_file(dir / "a" / "1.txt", "red; blue ||| {x|y}\nsecond line");
  write_file(dir / "config.toml",
             "[general]\ncaption_separator = ';'\nenable_wildcard = true\n"
             "[[datasets]]\ntoken_warmup_step = 0.5\n"
             "[[datasets.subsets]]\nimage_dir = 'a'\nkeep_tokens_separator = '|||'\n"
             "secondary_separator = '+'\ntoken_warmup_min = 3\n");
  const Discovery d = discover_toml(dir / "config.toml", Defaults{});
  ASSERT_EQ(d.images.size(), 1u);
  const SubsetOptions& s = d.datasets[0].subsets[0];
  EXPECT_EQ(s.caption_separator, ";");
  EXPECT_EQ(s.keep_tokens_separator, "|||");
  EXPECT_EQ(s.secondary_separator, "+");
  EXPECT_TRUE(s.enable_wildcard);
  EXPECT_EQ(s.token_warmup_min, 3);
  EXPECT_DOUBLE_EQ(s.token_warmup_step, 0.5);
  EXPECT_TRUE(s.augments_caption()) << "the token warm-up changes the text each step";
  EXPECT_EQ(d.images[0].caption, "red; blue ||| {x|y}\nsecond line") << "every line kept";

  SubsetOptions plain;
  plain.secondary_separator = "+";
  plain.caption_separator = ";";
  EXPECT_FALSE(plain.draws_from("a+b, c"));
  EXPECT_EQ(plain.fixed_caption("a+b, c+"), "a;b, c;");
  plain.enable_wildcard = true;
  EXPECT_FALSE(plain.draws_from("a+b, c")) << "nothing to draw";
  EXPECT_TRUE(plain.draws_from("a {b|c}"));
  EXPECT_TRUE(plain.draws_from("a\nb"));

  write_file(dir / "filters.toml",
             "[general]\nresize_interpolation = 'bicubic'\n[[datasets]]\n[[datasets.subsets]]\n"
             "image_dir = 'a'\n[[datasets.subsets]]\nimage_dir = 'b'\n"
             "resize_interpolation = 'lanczos'\n");
  fs::create_directories(dir / "b");
  const Discovery filters = discover_toml(dir / "filters.toml", Defaults{});
  ASSERT_EQ(filters.datasets[0].subsets.size(), 2u);
  EXPECT_EQ(filters.datasets[0].subsets[0].resize_filter, "cubic") << "kohya's bicubic";
  EXPECT_EQ(filters.datasets[0].subsets[1].resize_filter, "lanczos3") << "Pillow's LANCZOS";
  // And as kohya names them, for the LoRA's metadata: the dataset's (from [general]) and each
  // subset's own or inherited.
  EXPECT_EQ(filters.datasets[0].resize_interpolation, "bicubic");
  EXPECT_EQ(filters.datasets[0].subsets[0].resize_interpolation, "bicubic");
  EXPECT_EQ(filters.datasets[0].subsets[1].resize_interpolation, "lanczos");
  write_file(dir / "area.toml", "[general]\nresize_interpolation = 'area'\n[[datasets]]\n"
                                "[[datasets.subsets]]\nimage_dir = 'a'\n");
  try {
    discover_toml(dir / "area.toml", Defaults{});
    FAIL() << "area was taken";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("area.toml:2: resize_interpolation 'area'"),
              std::string::npos)
        << e.what();
  }

  write_file(dir / "bad.toml",
             "[[datasets]]\n[[datasets.subsets]]\nimage_dir = 'a'\ncaption_separator = ''\n");
  try {
    discover_toml(dir / "bad.toml", Defaults{});
    FAIL() << "an empty caption_separator was taken";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("bad.toml:4: 'caption_separator' must not be empty"),
              std::string::npos)
        << e.what();
  }
  fs::remove_all(dir);
}

TEST(DatasetToml, KohyaPrecedenceSubsetOverDatasetOverGeneral) {
  const std::string toml = R"(
[general]
flip_aug = true
caption_extension = ".cap"
resolution = 768
shuffle_caption = false
validation_split = 0.1

[[datasets]]
resolution = [640, 512]
num_repeats = 2
batch_size = 4
validation_split = 0.25
validation_seed = 9
bucket_no_upscale = true
max_bucket_reso = 1024

  [[datasets.subsets]]
  image_dir = "a"
  num_repeats = 5
  class_tokens = "sks dog"

  [[datasets.subsets]]
  image_dir = "b"
  flip_aug = false
  is_reg = true
  shuffle_caption = true

[[datasets]]
  [[datasets.subsets]]
  image_dir = "c"
)";
  Defaults defaults;
  const auto datasets = parse_dataset_toml(toml, "config.toml", defaults);
  ASSERT_EQ(datasets.size(), 2u);
  EXPECT_EQ(datasets[0].buckets.resolution, (Reso{640, 512}));
  EXPECT_TRUE(datasets[0].buckets.bucket_no_upscale);
  EXPECT_EQ(datasets[0].batch_size, 4);
  EXPECT_EQ(datasets[0].validation_split, 0.25);
  EXPECT_EQ(datasets[0].validation_seed, 9);
  ASSERT_EQ(datasets[0].subsets.size(), 2u);
  const SubsetOptions& a = datasets[0].subsets[0];
  EXPECT_EQ(a.num_repeats, 5);
  EXPECT_TRUE(a.flip_aug);
  EXPECT_EQ(a.caption_extension, ".cap");
  EXPECT_EQ(a.class_tokens, "sks dog");
  EXPECT_FALSE(a.augments_caption());
  const SubsetOptions& b = datasets[0].subsets[1];
  EXPECT_EQ(b.num_repeats, 2);
  EXPECT_FALSE(b.flip_aug);
  EXPECT_TRUE(b.is_reg);
  EXPECT_TRUE(b.augments_caption());
  // The second dataset takes general's values only.
  EXPECT_EQ(datasets[1].buckets.resolution, (Reso{768, 768}));
  EXPECT_EQ(datasets[1].validation_split, 0.1);
  EXPECT_FALSE(datasets[1].validation_seed.has_value()) << "the trainer's --validation_seed";
  EXPECT_FALSE(datasets[1].buckets.bucket_no_upscale);
  EXPECT_EQ(datasets[1].subsets[0].num_repeats, 1);
  EXPECT_TRUE(datasets[1].subsets[0].flip_aug);
}

// kohya rounds min_bucket_reso down and max_bucket_reso up to the steps before it checks them
// against the resolution: 1000 becomes 1024, enough for a 1024 resolution.
TEST(DatasetToml, BucketSizesAreRoundedToTheStepsBeforeTheyAreChecked) {
  const auto datasets = parse_dataset_toml(R"(
[[datasets]]
resolution = 1024
min_bucket_reso = 300
max_bucket_reso = 1000
  [[datasets.subsets]]
  image_dir = "a"
)",
                                           "config.toml", Defaults{});
  ASSERT_EQ(datasets.size(), 1u);
  EXPECT_EQ(datasets[0].buckets.min_bucket_reso, 256);
  EXPECT_EQ(datasets[0].buckets.max_bucket_reso, 1024);
}

// The error names the file, the line and the key.
// kohya's load_user_config also reads a .json config (json.load): the same tables, read and
// checked as the TOML's; its errors name the key, without a line.
TEST(DatasetToml, AJsonConfigIsReadAsKohyaReadsIt) {
  const std::vector<DatasetOptions> datasets = parse_dataset_toml(
      R"({"general": {"shuffle_caption": true, "keep_tokens": 1},
          "datasets": [{"resolution": [512, 768], "batch_size": 2,
                        "subsets": [{"image_dir": "img", "num_repeats": 3,
                                     "caption_dropout_rate": 0.5}]}]})",
      "dataset.JSON", Defaults{});
  ASSERT_EQ(datasets.size(), 1u);
  EXPECT_EQ(datasets[0].buckets.resolution.width, 512);
  EXPECT_EQ(datasets[0].buckets.resolution.height, 768);
  EXPECT_EQ(datasets[0].batch_size, 2);
  ASSERT_EQ(datasets[0].subsets.size(), 1u);
  const SubsetOptions& subset = datasets[0].subsets[0];
  EXPECT_EQ(subset.image_dir, "img");
  EXPECT_EQ(subset.num_repeats, 3);
  EXPECT_TRUE(subset.shuffle_caption);
  EXPECT_EQ(subset.keep_tokens, 1);
  EXPECT_DOUBLE_EQ(subset.caption_dropout_rate, 0.5);
  expect_toml_error(R"({"datasets": [{"subsets": [{"image_dir": "a", "num_repeat": 3}]}]})",
                    "config.json: unknown key 'num_repeat' in [[datasets.subsets]] (did you mean "
                    "num_repeats?)",
                    "config.json");
  expect_toml_error(R"({"datasets": [{"subsets": [{"image_dir": "a", "flip_aug": null}]}]})",
                    "config.json: key 'flip_aug' is null", "config.json");
  expect_toml_error("{\"datasets\": [", "config.json: not valid JSON", "config.json");
}

TEST(DatasetToml, UnknownKeysAndWrongTypesNameKeyAndLine) {
  expect_toml_error("[general]\nflip_aug = true\nflipaug = true\n[[datasets]]\n"
                    "[[datasets.subsets]]\nimage_dir = 'a'\n",
                    "config.toml:3: unknown key 'flipaug' in [general] (did you mean flip_aug?)");
  expect_toml_error("[[datasets]]\n[[datasets.subsets]]\nimage_dir = 'a'\nnum_repeat = 3\n",
                    "config.toml:4: unknown key 'num_repeat' in [[datasets.subsets]] (did you mean "
                    "num_repeats?)");
  expect_toml_error("[[datasets]]\n[[datasets.subsets]]\nimage_dir = 'a'\nnum_repeats = \"3\"\n",
                    "config.toml:4: key 'num_repeats' must be an integer");
  expect_toml_error("[[datasets]]\nresolution = [512]\n[[datasets.subsets]]\nimage_dir = 'a'\n",
                    "config.toml:2: key 'resolution' must be an integer or [width, height]");
  expect_toml_error("[general]\nimage_dir = 'a'\n[[datasets]]\n[[datasets.subsets]]\n"
                    "image_dir = 'a'\n",
                    "config.toml:2: key 'image_dir' is not allowed in [general]");
  expect_toml_error("[[datasets]]\n[[datasets.subsets]]\nnum_repeats = 1\n",
                    "needs 'image_dir'");
  expect_toml_error("[[datasets]]\n[[datasets.subsets]]\nimage_dir = 'a'\nflip_aug = tru\n",
                    "config.toml:4: not valid TOML");
  expect_toml_error("[[datasets]]\nmin_bucket_reso = 2048\n[[datasets.subsets]]\nimage_dir = 'a'\n",
                    "min_bucket_reso");
  expect_toml_error("[[datasets]]\nvalidation_split = 1.5\n[[datasets.subsets]]\nimage_dir = 'a'\n",
                    "config.toml:2: validation_split must be in [0, 1)");
  // Refused at its line, not by the trainer after caching, naming a --train_batch_size the user
  // never gave.
  expect_toml_error("[general]\nbatch_size = 0\n[[datasets]]\n[[datasets.subsets]]\n"
                    "image_dir = 'a'\n",
                    "config.toml:2: batch_size must be a whole number from 1 to 1048576, got 0");
  expect_toml_error("[[datasets]]\nbatch_size = -2\n[[datasets.subsets]]\nimage_dir = 'a'\n",
                    "config.toml:2: batch_size must be a whole number from 1 to 1048576, got -2");
}

// kohya's fine-tuning datasets (FineTuningDataset): the images a metadata file lists, found as
// a path or as image_dir/<key><one of kohya's extensions> (the first of the matches sorted, as
// kohya's glob_images takes it), each with its caption and tags
// joined by the caption separator (the tags alone when there is no caption; with
// enable_wildcard, the tags after each of the caption's lines), then prefix and suffix. An image
// that cannot be found is skipped and named (kohya stops there), also when only kohya's .npz is
// there, and so is one whose caption is not text. ss_tag_frequency counts the tags alone
// (caption_read).
TEST(DatasetMetadata, ImagesAndCaptionsAsKohyasFineTuningDataset) {
  const fs::path dir = make_temp_dir("metadata");
  write_file(dir / "img" / "a.png", "x");
  write_file(dir / "img" / "a.jpg", "x");       // kohya's glob_images sorts: .jpg before .png
  write_file(dir / "img" / "b.JPG", "x");
  write_file(dir / "img" / "sub" / "c.webp", "x");
  write_file(dir / "elsewhere" / "d.png", "x");
  write_file(dir / "img" / "e.npz", "x");       // kohya's cached latents, no image
  const std::string d_path = (dir / "elsewhere" / "d.png").string();
  write_file(dir / "meta.json",
             R"({"a": {"caption": "a photo of a dog", "tags": "dog, brown",)"
             R"( "train_resolution": [512, 512]},)"
             R"( "b": {"tags": "cat, grey"},)"
             R"( "sub/c": {"caption": "line one\nline two"},)"
             R"( ")" + d_path + R"(": {"caption": "elsewhere", "tags": ""},)"
             R"( "e": {"caption": "latents only"},)"
             R"( "a.jpg": {"caption": 5},)"
             R"( "missing": {"caption": "gone"}})");
  Defaults defaults;
  defaults.subset.caption_prefix = "sks";
  const Discovery d = discover_metadata(dir / "meta.json", dir / "img", 4, defaults);
  ASSERT_EQ(d.datasets.size(), 1u);
  ASSERT_EQ(d.datasets[0].subsets.size(), 1u);
  EXPECT_EQ(d.datasets[0].subsets[0].name(), "meta.json");
  EXPECT_EQ(d.datasets[0].subsets[0].num_repeats, 4);
  ASSERT_EQ(d.images.size(), 4u);
  EXPECT_EQ(d.images[0].path, dir / "img" / "a.jpg");
  EXPECT_EQ(d.images[0].caption, "sks a photo of a dog,dog, brown");
  EXPECT_EQ(d.images[0].caption_read, "dog, brown");
  EXPECT_EQ(d.images[0].caption_source, "metadata");
  EXPECT_EQ(d.images[1].path, dir / "img" / "b.JPG");
  EXPECT_EQ(d.images[1].caption, "sks cat, grey") << "the tags stand in for a missing caption";
  EXPECT_EQ(d.images[1].caption_read, "") << "kohya counts tags only beside a caption";
  EXPECT_EQ(d.images[2].path, dir / "img" / "sub" / "c.webp");
  EXPECT_EQ(d.images[2].caption, "sks line one\nline two");
  EXPECT_EQ(d.images[3].path, d_path);
  EXPECT_EQ(d.images[3].caption, "sks elsewhere");
  ASSERT_EQ(d.skipped.size(), 3u);
  EXPECT_NE(d.skipped[0].path.find("'e'"), std::string::npos) << d.skipped[0].path;
  EXPECT_NE(d.skipped[0].reason.find(".npz"), std::string::npos) << d.skipped[0].reason;
  EXPECT_NE(d.skipped[1].path.find("meta.json: 'a.jpg'"), std::string::npos);
  EXPECT_EQ(d.skipped[1].reason, "its 'caption' is not text");
  EXPECT_NE(d.skipped[2].path.find("meta.json: 'missing'"), std::string::npos);

  // enable_wildcard: the tags, one line, after each non-blank line of the caption.
  write_file(dir / "wild.json",
             R"({"a": {"caption": "one\n\ntwo", "tags": "x\ny"}})");
  defaults.subset.caption_prefix.clear();
  defaults.subset.enable_wildcard = true;
  defaults.subset.caption_separator = ";";
  const Discovery w = discover_metadata(dir / "wild.json", dir / "img", 1, defaults);
  ASSERT_EQ(w.images.size(), 1u);
  EXPECT_EQ(w.images[0].caption, "one;x;y\ntwo;x;y");

  for (const auto& [text, error] : std::vector<std::pair<std::string, std::string>>{
           {"[1, 2]", "expected an object"}, {"{\"a\": ", "not kohya's metadata JSON"}}) {
    write_file(dir / "bad.json", text);
    try {
      discover_metadata(dir / "bad.json", dir / "img", 1, Defaults{});
      FAIL() << text;
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find("bad.json"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(error), std::string::npos) << e.what();
    }
  }
  fs::remove_all(dir);
}

// In a dataset TOML, a [[datasets]] whose subsets name metadata_file is a fine-tuning one, as in
// kohya's config_util: metadata_file resolves against the TOML's folder, image_dir may be left
// out, and DreamBooth's keys are refused in it by name and line.
TEST(DatasetToml, FineTuningDatasetsNameTheirMetadataFile) {
  const fs::path dir = make_temp_dir("toml-metadata");
  write_file(dir / "img" / "a.png", "x");
  write_file(dir / "img" / "b.png", "x");
  write_file(dir / "b.caption", "unused");
  write_file(dir / "meta" / "m.json", R"({"a": {"caption": "from the metadata"}})");
  write_file(dir / "config.toml",
             "[general]\nclass_tokens = 'sks'\n"
             "[[datasets]]\n[[datasets.subsets]]\nmetadata_file = 'meta/m.json'\n"
             "image_dir = 'img'\nnum_repeats = 2\n"
             "[[datasets]]\n[[datasets.subsets]]\nimage_dir = 'img'\n");
  const Discovery d = discover_toml(dir / "config.toml", Defaults{});
  ASSERT_EQ(d.datasets.size(), 2u);
  EXPECT_EQ(d.datasets[0].subsets[0].metadata_file, dir / "meta" / "m.json");
  EXPECT_EQ(d.datasets[0].subsets[0].class_tokens, "") << "[general]'s DreamBooth key stays out";
  ASSERT_EQ(d.images.size(), 3u);
  EXPECT_EQ(d.images[0].caption, "from the metadata");
  EXPECT_EQ(d.images[0].dataset, 0u);
  EXPECT_EQ(d.images[1].dataset, 1u);
  EXPECT_EQ(d.images[1].caption, "sks") << "the DreamBooth dataset's images take class_tokens";

  expect_toml_error("[[datasets]]\n[[datasets.subsets]]\nmetadata_file = 'm.json'\n"
                    "[[datasets.subsets]]\nimage_dir = 'a'\n",
                    "config.toml:4: this [[datasets]] is a fine-tuning one");
  expect_toml_error("[[datasets]]\n[[datasets.subsets]]\nmetadata_file = 'm.json'\nis_reg = true\n",
                    "config.toml:4: 'is_reg' is not a key of kohya's fine-tuning subsets");
  expect_toml_error("[[datasets]]\nclass_tokens = 'x'\n[[datasets.subsets]]\n"
                    "metadata_file = 'm.json'\n",
                    "config.toml:2: 'class_tokens' is not a key of kohya's fine-tuning datasets");
  fs::remove_all(dir);
}

}  // namespace
}  // namespace lorapipe::preprocess
