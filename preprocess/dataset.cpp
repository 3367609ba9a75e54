#include "preprocess/dataset.h"

#include <nlohmann/json.hpp>
#include <toml++/toml.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <set>
#include <sstream>

#include "common/error.h"
#include "common/log.h"
#include "common/text.h"
#include "preprocess/image.h"

namespace lorapipe::preprocess {
namespace fs = std::filesystem;

namespace {

constexpr std::string_view kLog = "preprocess";

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return s;
}

bool is_caption_extension(const fs::path& path) {
  const std::string ext = lower(path.extension().string());
  return ext == ".txt" || ext == ".caption";
}

// kohya extract_dreambooth_params: "<N>_<class tokens>" with N an integer; tokens may contain
// further underscores.
bool parse_repeat_folder(const std::string& name, int* repeats, std::string* class_tokens) {
  const size_t underscore = name.find('_');
  const std::string head = name.substr(0, underscore);
  int value = 0;
  auto [end, ec] = std::from_chars(head.data(), head.data() + head.size(), value);
  if (head.empty() || ec != std::errc() || end != head.data() + head.size() || value <= 0) {
    return false;
  }
  *repeats = value;
  *class_tokens = underscore == std::string::npos ? "" : name.substr(underscore + 1);
  return true;
}

bool valid_utf8(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    size_t n = 0;
    uint32_t cp = 0;
    if (c < 0x80) {
      ++i;
      continue;
    } else if ((c >> 5) == 0x6) {
      n = 1, cp = c & 0x1f;
    } else if ((c >> 4) == 0xe) {
      n = 2, cp = c & 0x0f;
    } else if ((c >> 3) == 0x1e) {
      n = 3, cp = c & 0x07;
    } else {
      return false;
    }
    if (i + n >= s.size()) return false;
    for (size_t k = 1; k <= n; ++k) {
      const auto cc = static_cast<unsigned char>(s[i + k]);
      if ((cc >> 6) != 0x2) return false;
      cp = (cp << 6) | (cc & 0x3f);
    }
    // Overlong forms, surrogates and values past U+10FFFF are not UTF-8.
    if ((n == 1 && cp < 0x80) || (n == 2 && cp < 0x800) || (n == 3 && cp < 0x10000) ||
        cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) {
      return false;
    }
    i += n + 1;
  }
  return true;
}

std::string latin1_to_utf8(std::string_view s) {
  std::string out;
  out.reserve(s.size() * 2);
  for (char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    if (c < 0x80) {
      out.push_back(static_cast<char>(c));
    } else {
      out.push_back(static_cast<char>(0xc0 | (c >> 6)));
      out.push_back(static_cast<char>(0x80 | (c & 0x3f)));
    }
  }
  return out;
}


// Sorted directory listing; errors while listing become one InputError naming the folder.
std::vector<fs::directory_entry> list_sorted(const fs::path& dir) {
  std::error_code ec;
  fs::directory_iterator it(dir, ec);
  if (ec) throw InputError("cannot list folder " + dir.string() + ": " + ec.message());
  std::vector<fs::directory_entry> entries;
  for (; it != fs::directory_iterator(); it.increment(ec)) {
    if (ec) throw InputError("cannot list folder " + dir.string() + ": " + ec.message());
    entries.push_back(*it);
  }
  std::sort(entries.begin(), entries.end(),
            [](const auto& a, const auto& b) { return a.path() < b.path(); });
  return entries;
}

// Finds and reads the image's caption. A caption file that is there but cannot be read (EIO, no
// permission) is an error, returned: the image is skipped by name rather than trained on a
// substitute caption (the class tokens, or none), as kohya would stop there.
std::optional<std::string> attach_caption(const SubsetOptions& subset, ImageEntry& entry,
                                          Discovery& out) {
  // kohya reads `.caption` unless told otherwise; lorapipe then also tries `.txt`, where most
  // taggers write, rather than fall back to the class tokens.
  std::vector<std::string> extensions{subset.caption_extension};
  if (!subset.caption_extension_set && subset.caption_extension != ".txt") {
    extensions.push_back(".txt");
  }
  // kohya's splitext(image)[0] + caption_extension, a dot put in front of an extension given
  // without one ("txt" is ".txt", "_tags.txt" is "._tags.txt"), as replace_extension does; then,
  // as kohya's read_caption, the name its face-crop tool gives a crop's caption: where the path
  // without its extension splits into 5 or more pieces at '_', all but the last 4 pieces.
  std::vector<fs::path> candidates;
  for (const std::string& ext : extensions) {
    fs::path caption_path = entry.path;
    caption_path.replace_extension(ext);
    candidates.push_back(caption_path);
    if (&ext != &extensions.front()) continue;  // lorapipe's .txt fallback: the plain name alone
    const std::string base = fs::path(entry.path).replace_extension().string();
    std::vector<size_t> cuts;
    for (size_t at = base.find('_'); at != std::string::npos; at = base.find('_', at + 1)) {
      cuts.push_back(at);
    }
    if (cuts.size() >= 4) {
      const std::string dotted = ext.empty() || ext[0] == '.' ? ext : "." + ext;
      candidates.push_back(base.substr(0, cuts[cuts.size() - 4]) + dotted);
    }
  }
  for (const fs::path& caption_path : candidates) {
    std::error_code ec;
    if (!fs::is_regular_file(caption_path, ec)) continue;
    try {
      Caption caption = read_caption_file(caption_path, subset.enable_wildcard);
      entry.caption = caption.text;
      entry.caption_source = "file";
      entry.caption_note = caption.note;
      if (!caption.note.empty()) {
        LP_LOG(kWarning, kLog) << caption_path.string() << ": " << caption.note;
      }
    } catch (const InputError& e) {
      return std::string(e.what());
    }
    break;
  }
  if (entry.caption_source.empty() || entry.caption_source == "none") {
    ++out.captions_missing;
    if (!subset.class_tokens.empty()) {
      entry.caption = subset.class_tokens;
      entry.caption_source = "class_tokens";
    } else {
      entry.caption.clear();
      entry.caption_source = "none";
    }
  }
  entry.caption_read = entry.caption;
  // kohya process_caption: prefix and suffix joined with a space.
  if (!subset.caption_prefix.empty()) entry.caption = subset.caption_prefix + " " + entry.caption;
  if (!subset.caption_suffix.empty()) entry.caption = entry.caption + " " + subset.caption_suffix;
  return std::nullopt;
}

// Whether an image's path is valid UTF-8; if not it is skipped, named with its odd bytes escaped.
// Its path travels in UTF-8 protobuf strings and JSON (which refuse other bytes), and its folder's
// name may be its caption: the user renames it rather than train on a guess at its encoding.
bool named_in_utf8(const fs::path& path, Discovery& out) {
  if (valid_utf8(path.string())) return true;
  out.skipped.push_back({escape_non_utf8(path.string()),
                         "its path is not valid UTF-8 (the bytes written \\xNN here): rename it "
                         "(convmv converts a folder's names from their encoding to UTF-8)"});
  return false;
}

// Collects the images of one subset folder (not recursive, as kohya).
void collect_subset(const fs::path& dir, size_t dataset, size_t subset_index,
                    const SubsetOptions& subset, bool top_level, Discovery& out) {
  for (const fs::directory_entry& entry : list_sorted(dir)) {
    const fs::path& path = entry.path();
    // Hidden files are not looked at, as kohya's glob("*") skips them: macOS's "._x.jpg"
    // AppleDouble companions are not images.
    if (path.filename().string().starts_with('.')) continue;
    std::error_code ec;
    const fs::file_status status = fs::status(path, ec);  // follows symlinks
    if (ec) {
      if (has_image_extension(path)) {
        out.skipped.push_back({path.string(), "cannot open: " + ec.message()});
      } else {
        out.ignored.push_back({path.string(), "cannot open: " + ec.message()});
      }
      continue;
    }
    if (fs::is_directory(status)) {
      if (top_level) continue;  // repeat folders are handled by the caller
      out.ignored.push_back(
          {path.string(), "subfolder of an image folder: kohya does not look into it"});
      continue;
    }
    if (!has_image_extension(path)) {
      if (!is_caption_extension(path)) {
        out.ignored.push_back({path.string(), "not an image (unknown extension)"});
      }
      continue;
    }
    if (!fs::is_regular_file(status)) {
      out.skipped.push_back({path.string(), "not a regular file"});
      continue;
    }
    if (!named_in_utf8(path, out)) continue;
    ImageEntry image;
    image.path = path;
    image.dataset = dataset;
    image.subset = subset_index;
    if (const std::optional<std::string> error = attach_caption(subset, image, out)) {
      out.skipped.push_back({path.string(), *error});
      continue;
    }
    out.images.push_back(std::move(image));
  }
}

// kohya's IMAGE_EXTENSIONS, in its order: glob_images(image_dir, key) tries key + each.
constexpr const char* kKohyaImageExtensions[] = {
    ".png", ".jpg", ".jpeg", ".webp", ".bmp", ".PNG", ".JPG", ".JPEG", ".WEBP", ".BMP",
    ".avif", ".AVIF", ".jxl", ".JXL"};

// A fine-tuning subset (kohya's FineTuningDataset): the images its metadata file lists, with
// their captions from it. An image that cannot be found is skipped and named, not the run.
void collect_metadata_subset(size_t dataset, size_t subset_index, const SubsetOptions& subset,
                             Discovery& out) {
  const fs::path& file = subset.metadata_file;
  std::ifstream in(file, std::ios::binary);
  if (!in) throw InputError("cannot read metadata_file " + file.string());
  nlohmann::ordered_json metadata;  // kohya walks it in the file's order
  try {
    metadata = nlohmann::ordered_json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    throw InputError(file.string() + ": not kohya's metadata JSON: " + e.what());
  }
  if (!metadata.is_object()) {
    throw InputError(file.string() + ": not kohya's metadata JSON: expected an object of "
                     "{\"image key\": {\"caption\": ..., \"tags\": ...}}");
  }
  if (metadata.empty()) {
    LP_LOG(kWarning, kLog) << file.string() << ": no image entries: subset not used";
    return;
  }
  bool bucket_info = false;
  for (const auto& [key, md] : metadata.items()) {
    // kohya: the key as a path if it exists, else image_dir/key with one of its extensions. A
    // key with its extension in image_dir is taken too.
    fs::path path;
    std::error_code ec;
    if (fs::is_regular_file(key, ec)) {
      path = key;
    } else if (!subset.image_dir.empty()) {
      // kohya's glob_images: every extension's match, sorted, the first taken (key.JPG before
      // key.jpg before key.png, where several are there).
      std::vector<fs::path> found;
      for (const char* ext : kKohyaImageExtensions) {
        const fs::path candidate = subset.image_dir / (key + ext);
        if (fs::is_regular_file(candidate, ec)) found.push_back(candidate);
      }
      if (!found.empty()) path = *std::min_element(found.begin(), found.end());
      const fs::path as_is = subset.image_dir / key;
      if (path.empty() && has_image_extension(as_is) && fs::is_regular_file(as_is, ec)) {
        path = as_is;
      }
    }
    const std::string where = file.string() + ": '" + key + "'";
    if (path.empty()) {
      const bool npz = fs::exists(fs::path(key).replace_extension(".npz"), ec) ||
                       (!subset.image_dir.empty() &&
                        fs::exists(subset.image_dir / (key + ".npz"), ec));
      out.skipped.push_back(
          {where, npz ? "only kohya's cached latents (.npz) found, not the image: lorapipe "
                        "caches from the images"
                      : "no such image (as a path, or in image_dir with an image extension)"});
      continue;
    }
    if (!md.is_object()) {
      out.skipped.push_back({where, "its metadata is not an object"});
      continue;
    }
    std::string not_text;  // a caption or tags that is not a string: skipped, named
    auto text = [&](const char* name) -> std::optional<std::string> {
      const auto it = md.find(name);
      if (it == md.end() || it->is_null()) return std::nullopt;
      if (!it->is_string()) {
        not_text = name;
        return std::nullopt;
      }
      return it->get<std::string>();
    };
    // kohya's FineTuningDataset: the caption, else the tags; both, joined by the separator (with
    // enable_wildcard, the tags after each of the caption's lines). ss_tag_frequency counts the
    // tags alone.
    std::optional<std::string> caption = text("caption"), tags = text("tags");
    if (!not_text.empty()) {
      out.skipped.push_back({where, "its '" + not_text + "' is not text"});
      continue;
    }
    if (!caption) {
      caption = tags;
      tags.reset();
    }
    ImageEntry image;
    if (subset.enable_wildcard) {
      if (tags) tags = replace_all(*tags, "\n", subset.caption_separator);
      if (caption && tags) {
        std::string joined;
        size_t begin = 0;
        while (begin <= caption->size()) {
          const size_t end = std::min(caption->find('\n', begin), caption->size());
          const std::string line = caption->substr(begin, end - begin);
          if (!python_strip(line).empty()) {
            joined += (joined.empty() ? "" : "\n") + line + subset.caption_separator + *tags;
          }
          begin = end + 1;
        }
        caption = joined;
      }
    } else if (tags && !tags->empty()) {
      *caption += subset.caption_separator + *tags;
      image.caption_read = *tags;
    }
    bucket_info = bucket_info || md.contains("train_resolution");
    if (!named_in_utf8(path, out)) continue;
    image.path = path;
    image.dataset = dataset;
    image.subset = subset_index;
    image.caption = caption.value_or("");
    image.caption_source = "metadata";
    // kohya process_caption: prefix and suffix joined with a space.
    if (!subset.caption_prefix.empty()) image.caption = subset.caption_prefix + " " + image.caption;
    if (!subset.caption_suffix.empty()) image.caption = image.caption + " " + subset.caption_suffix;
    if (!caption) ++out.captions_missing;
    out.images.push_back(std::move(image));
  }
  if (bucket_info) {
    LP_LOG(kInfo, kLog) << file.string() << ": its train_resolution values are not used: each "
                        << "image's bucket is chosen from its size, as for image folders";
  }
}

// ----- TOML -------------------------------------------------------------------------------

enum class KeyType { kInt, kFloat, kBool, kString, kResolution, kFloatPair, kTable };
enum Level : unsigned { kGeneral = 1, kDataset = 2, kSubset = 4 };

struct KeySpec {
  KeyType type;
  unsigned levels;
  bool used;  // false: accepted for compatibility with kohya configs, not used by lorapipe yet
};

// kohya config_util.py schemas: subset keys may also sit in [general] and [[datasets]]
// ("ascendable"); dataset keys may sit in [general].
const std::map<std::string, KeySpec, std::less<>>& key_specs() {
  constexpr unsigned kAll = kGeneral | kDataset | kSubset;
  constexpr unsigned kUpper = kGeneral | kDataset;
  static const std::map<std::string, KeySpec, std::less<>> specs{
      // subset, ascendable
      {"num_repeats", {KeyType::kInt, kAll, true}},
      {"caption_extension", {KeyType::kString, kAll, true}},
      {"class_tokens", {KeyType::kString, kAll, true}},
      {"flip_aug", {KeyType::kBool, kAll, true}},
      {"random_crop", {KeyType::kBool, kAll, true}},
      {"alpha_mask", {KeyType::kBool, kAll, true}},
      {"resize_interpolation", {KeyType::kString, kAll, true}},
      {"shuffle_caption", {KeyType::kBool, kAll, true}},
      {"keep_tokens", {KeyType::kInt, kAll, true}},
      {"caption_dropout_rate", {KeyType::kFloat, kAll, true}},
      {"caption_dropout_every_n_epochs", {KeyType::kInt, kAll, true}},
      {"caption_tag_dropout_rate", {KeyType::kFloat, kAll, true}},
      {"caption_prefix", {KeyType::kString, kAll, true}},
      {"caption_suffix", {KeyType::kString, kAll, true}},
      {"color_aug", {KeyType::kBool, kAll, false}},
      {"face_crop_aug_range", {KeyType::kFloatPair, kAll, false}},
      {"keep_tokens_separator", {KeyType::kString, kAll, true}},
      {"secondary_separator", {KeyType::kString, kAll, true}},
      {"enable_wildcard", {KeyType::kBool, kAll, true}},
      {"token_warmup_min", {KeyType::kInt, kAll, true}},
      {"token_warmup_step", {KeyType::kFloat, kAll, true}},
      {"cache_info", {KeyType::kBool, kAll, false}},
      {"caption_separator", {KeyType::kString, kAll, true}},
      {"custom_attributes", {KeyType::kTable, kAll, false}},
      // subset only
      {"image_dir", {KeyType::kString, kSubset, true}},
      {"metadata_file", {KeyType::kString, kSubset, true}},
      {"is_reg", {KeyType::kBool, kSubset, true}},
      // dataset, ascendable to general
      {"resolution", {KeyType::kResolution, kUpper, true}},
      {"batch_size", {KeyType::kInt, kUpper, true}},
      {"enable_bucket", {KeyType::kBool, kUpper, true}},
      {"min_bucket_reso", {KeyType::kInt, kUpper, true}},
      {"max_bucket_reso", {KeyType::kInt, kUpper, true}},
      {"bucket_reso_steps", {KeyType::kInt, kUpper, true}},
      {"bucket_no_upscale", {KeyType::kBool, kUpper, true}},
      {"network_multiplier", {KeyType::kFloat, kUpper, false}},
      {"validation_seed", {KeyType::kInt, kUpper, true}},
      {"validation_split", {KeyType::kFloat, kUpper, true}},
      {"skip_image_resolution", {KeyType::kResolution, kUpper, true}},
  };
  return specs;
}

const char* type_word(KeyType type) {
  switch (type) {
    case KeyType::kInt: return "an integer";
    case KeyType::kFloat: return "a number";
    case KeyType::kBool: return "true or false";
    case KeyType::kString: return "a string";
    case KeyType::kResolution: return "an integer or [width, height]";
    case KeyType::kFloatPair: return "[low, high]";
    case KeyType::kTable: return "a table";
  }
  return "?";
}

class TomlReader {
 public:
  explicit TomlReader(std::string name) : name_(std::move(name)) {}

  // "FILE:LINE" of a node; "FILE" alone for a node made from a JSON config, which has no line.
  static std::string where(const std::string& name, const toml::node& node) {
    const auto line = node.source().begin.line;
    return name + (line > 0 ? ":" + std::to_string(line) : std::string());
  }

  [[noreturn]] void fail(const toml::node& node, const std::string& what) const {
    throw InputError(where(name_, node) + ": " + what);
  }

  // Checks every key of `table` against the schema for `level`.
  void check_keys(const toml::table& table, Level level, const std::string& where) const {
    for (const auto& [key, node] : table) {
      const std::string_view k = key.str();
      if (level == kDataset && k == "subsets") continue;
      auto it = key_specs().find(k);
      if (it == key_specs().end()) {
        std::vector<std::string> here;  // the keys this table takes, for the hint
        for (const auto& [name, spec] : key_specs()) {
          if ((spec.levels & level) != 0) here.push_back(name);
        }
        fail(node, "unknown key '" + std::string(k) + "' in " + where + did_you_mean(k, here));
      }
      if ((it->second.levels & level) == 0) {
        fail(node, "key '" + std::string(k) + "' is not allowed in " + where);
      }
      check_type(k, node, it->second.type);
      if (!it->second.used) {
        // kohya's differential output preservation trains these images toward the base model's
        // own prediction: without it they would train toward the noise, as any other image.
        const toml::table* attributes = node.as_table();
        if (k == "custom_attributes" && attributes != nullptr &&
            attributes->get("diff_output_preservation") != nullptr &&
            attributes->get("diff_output_preservation")->value_or(true)) {
          fail(node, "custom_attributes.diff_output_preservation (kohya's differential output "
                     "preservation) is not supported by lorapipe yet: its images would train "
                     "as any other; leave it out");
        }
        // The pixel augmentations refuse as their flags do (common/kohya_flags.cpp): asked
        // for in the file, they would train without a word on images never augmented.
        if (k == "color_aug" && node.value_or(false)) {
          fail(node, "color_aug = true augments the pixels, which latents encoded once into the "
                     "cache cannot (kohya refuses it with cached latents too); leave it out");
        }
        // kohya scales the LoRA by it for the dataset's batches (a negative one trains away
        // from the dataset): trained at 1 here, it would train the other way without a word.
        if (k == "network_multiplier" && node.value_or(1.0) != 1.0) {
          fail(node, "network_multiplier (the LoRA's scale for this dataset's batches) is not "
                     "supported by lorapipe yet: its images would train at 1; leave it out or "
                     "make it 1.0");
        }
        if (k == "face_crop_aug_range") {
          fail(node, "face_crop_aug_range (face-centred crops) is not in lorapipe yet; leave it "
                     "out");
        }
        LP_LOG(kWarning, kLog) << TomlReader::where(name_, node) << ": '" << k
                               << "' is accepted but not used by lorapipe yet";
      }
    }
  }

  void check_type(std::string_view key, const toml::node& node, KeyType type) const {
    bool ok = false;
    switch (type) {
      case KeyType::kInt: ok = node.is_integer(); break;
      case KeyType::kFloat: ok = node.is_integer() || node.is_floating_point(); break;
      case KeyType::kBool: ok = node.is_boolean(); break;
      case KeyType::kString: ok = node.is_string(); break;
      case KeyType::kResolution:
        ok = node.is_integer() ||
             (node.is_array() && node.as_array()->size() == 2 &&
              node.as_array()->is_homogeneous(toml::node_type::integer));
        break;
      case KeyType::kFloatPair:
        ok = node.is_array() && node.as_array()->size() == 2;
        break;
      case KeyType::kTable: ok = node.is_table(); break;
    }
    if (!ok) {
      fail(node, "key '" + std::string(key) + "' must be " + type_word(type));
    }
  }

  static int64_t integer(const toml::node& node) { return node.value<int64_t>().value(); }
  static double number(const toml::node& node) { return node.value<double>().value(); }

  void apply_dataset(const toml::table& table, DatasetOptions& d) const {
    for (const auto& [key, node] : table) {
      const std::string_view k = key.str();
      BucketOptions& b = d.buckets;
      if (k == "resolution" || k == "skip_image_resolution") {
        Reso& reso = k == "resolution" ? b.resolution : d.skip_image_resolution;
        if (node.is_integer()) {
          reso = {static_cast<int>(integer(node)), static_cast<int>(integer(node))};
        } else {
          const auto& arr = *node.as_array();
          reso = {static_cast<int>(integer(*arr.get(0))), static_cast<int>(integer(*arr.get(1)))};
        }
      } else if (k == "batch_size") {
        // Checked here, where the line is known: the trainer would only see the number, long
        // after the latents are cached.
        if (integer(node) < 1 || integer(node) > 1 << 20) {
          fail(node, "batch_size must be a whole number from 1 to 1048576, got " +
                         std::to_string(integer(node)));
        }
        d.batch_size = static_cast<int>(integer(node));
      } else if (k == "validation_split") {
        const double split = number(node);
        if (!(split >= 0 && split < 1)) fail(node, "validation_split must be in [0, 1)");
        d.validation_split = split;
      } else if (k == "validation_seed") {
        if (integer(node) < 0) fail(node, "validation_seed must not be negative");
        d.validation_seed = integer(node);
      } else if (k == "enable_bucket") {
        b.enable_bucket = *node.value<bool>();
      } else if (k == "min_bucket_reso") {
        b.min_bucket_reso = static_cast<int>(integer(node));
      } else if (k == "max_bucket_reso") {
        b.max_bucket_reso = static_cast<int>(integer(node));
      } else if (k == "bucket_reso_steps") {
        b.bucket_reso_steps = static_cast<int>(integer(node));
      } else if (k == "bucket_no_upscale") {
        b.bucket_no_upscale = *node.value<bool>();
      } else if (k == "resize_interpolation") {
        d.resize_interpolation = *node.value<std::string>();  // checked with the subset's
      }
    }
  }

  void apply_subset(const toml::table& table, SubsetOptions& s) const {
    for (const auto& [key, node] : table) {
      const std::string_view k = key.str();
      if (k == "num_repeats") {
        s.num_repeats = static_cast<int>(integer(node));  // below 1: skipped (discover_toml)
      } else if (k == "caption_extension") {
        s.caption_extension = *node.value<std::string>();
        s.caption_extension_set = true;
      } else if (k == "class_tokens") {
        s.class_tokens = *node.value<std::string>();
      } else if (k == "flip_aug") {
        s.flip_aug = *node.value<bool>();
      } else if (k == "random_crop") {
        s.random_crop = *node.value<bool>();
      } else if (k == "alpha_mask") {
        s.alpha_mask = *node.value<bool>();
      } else if (k == "resize_interpolation") {
        try {
          s.resize_filter = resize_filter_from_kohya(*node.value<std::string>());
          s.resize_interpolation = *node.value<std::string>();
        } catch (const InputError& e) {
          fail(node, e.what());
        }
      } else if (k == "shuffle_caption") {
        s.shuffle_caption = *node.value<bool>();
      } else if (k == "keep_tokens") {
        s.keep_tokens = static_cast<int>(integer(node));
      } else if (k == "caption_dropout_rate") {
        s.caption_dropout_rate = number(node);
      } else if (k == "caption_dropout_every_n_epochs") {
        s.caption_dropout_every_n_epochs = static_cast<int>(integer(node));
      } else if (k == "caption_tag_dropout_rate") {
        s.caption_tag_dropout_rate = number(node);
      } else if (k == "caption_prefix") {
        s.caption_prefix = *node.value<std::string>();
      } else if (k == "caption_suffix") {
        s.caption_suffix = *node.value<std::string>();
      } else if (k == "caption_separator") {
        s.caption_separator = *node.value<std::string>();
        if (s.caption_separator.empty()) fail(node, "'caption_separator' must not be empty");
      } else if (k == "keep_tokens_separator") {
        s.keep_tokens_separator = *node.value<std::string>();
      } else if (k == "secondary_separator") {
        s.secondary_separator = *node.value<std::string>();
      } else if (k == "enable_wildcard") {
        s.enable_wildcard = *node.value<bool>();
      } else if (k == "token_warmup_min") {
        s.token_warmup_min = static_cast<int>(integer(node));
      } else if (k == "token_warmup_step") {
        s.token_warmup_step = number(node);
        if (s.token_warmup_step < 0) fail(node, "'token_warmup_step' must not be negative");
      } else if (k == "image_dir") {
        s.image_dir = *node.value<std::string>();
      } else if (k == "metadata_file") {
        s.metadata_file = *node.value<std::string>();
      } else if (k == "is_reg") {
        s.is_reg = *node.value<bool>();
      }
    }
  }

 private:
  std::string name_;
};

}  // namespace

std::string SubsetOptions::name() const {
  if (!metadata_file.empty()) return metadata_file.filename().string();
  return image_dir_name();
}

std::string SubsetOptions::image_dir_name() const {
  // kohya's os.path.basename(image_dir); of "dir/" that is "", where the folder's name is meant.
  fs::path dir = image_dir;
  if (!dir.has_filename()) dir = dir.parent_path();
  return dir.filename().string();
}

std::string SubsetOptions::fixed_caption(const std::string& caption) const {
  // Without wildcards kohya keeps the first line (a prefix or class tokens may hold a newline).
  const std::string text = enable_wildcard ? caption : caption.substr(0, caption.find('\n'));
  return secondary_separator.empty() ? text
                                     : replace_all(text, secondary_separator, caption_separator);
}

bool has_image_extension(const fs::path& path) {
  static const std::set<std::string> kExtensions{
      ".jpg", ".jpeg", ".jpe", ".png", ".webp", ".tif", ".tiff", ".gif",
      ".bmp", ".heic", ".heif", ".avif", ".jxl", ".jp2", ".ppm", ".pgm"};
  return kExtensions.count(lower(path.extension().string())) > 0;
}

std::string escape_non_utf8(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    // The valid sequence starting here (1 to 4 bytes; there is at most one), else this byte
    // alone, escaped.
    size_t taken = 0;
    for (size_t n = 1; n <= 4 && i + n <= s.size() && taken == 0; ++n) {
      if (valid_utf8(s.substr(i, n))) taken = n;
    }
    if (taken > 0) {
      out.append(s.substr(i, taken));
      i += taken;
    } else {
      char hex[5];
      std::snprintf(hex, sizeof hex, "\\x%02X", c);
      out += hex;
      ++i;
    }
  }
  return out;
}

Caption read_caption_file(const fs::path& path, bool all_lines) {
  // Every read checked (an istream reads an I/O error as the end of the file: a caption cut short).
  std::FILE* in = std::fopen(path.c_str(), "rb");
  if (in == nullptr) {
    throw InputError("cannot read caption file " + path.string() + ": " + std::strerror(errno));
  }
  std::string bytes;
  char buffer[1 << 14];
  for (size_t n; (n = std::fread(buffer, 1, sizeof buffer, in)) > 0;) bytes.append(buffer, n);
  const int error = std::ferror(in) ? (errno != 0 ? errno : EIO) : 0;
  std::fclose(in);
  if (error != 0) {
    throw InputError("cannot read caption file " + path.string() + ": " + std::strerror(error));
  }
  Caption caption;
  const bool empty_file = bytes.empty();
  if (bytes.rfind("\xef\xbb\xbf", 0) == 0) bytes.erase(0, 3);
  if (!valid_utf8(bytes)) {
    bytes = latin1_to_utf8(bytes);
    caption.note = "caption is not valid UTF-8: read as Latin-1";
  }
  std::vector<std::string> lines;
  for (size_t begin = 0; begin <= bytes.size();) {
    const size_t end = std::min(bytes.find_first_of("\r\n", begin), bytes.size());
    lines.push_back(python_strip(std::string_view(bytes).substr(begin, end - begin)));
    if (!all_lines || end == bytes.size()) break;
    begin = end + (bytes.compare(end, 2, "\r\n") == 0 ? 2 : 1);
  }
  for (const std::string& line : lines) {
    if (line.empty() && all_lines) continue;  // kohya drops blank lines
    caption.text += (caption.text.empty() ? "" : "\n") + line;
    if (!all_lines) break;
  }
  // kohya stops the run at an empty caption file; the image trains here, captioned with nothing
  // (what dropped captions train on), and the report says so, as for a file of blank lines.
  if (caption.text.empty() && caption.note.empty()) {
    caption.note = empty_file
                       ? "caption file is empty: trained with an empty caption (kohya stops at it)"
                       : "caption file holds no text: trained with an empty caption";
  }
  return caption;
}

Discovery discover_folder(const fs::path& data_dir, const Defaults& defaults,
                          const fs::path& reg_dir) {
  std::error_code ec;
  if (!fs::is_directory(data_dir, ec)) {
    throw InputError("--data_dir=" + data_dir.string() + " is not a folder");
  }
  if (!reg_dir.empty() && !fs::is_directory(reg_dir, ec)) {
    throw InputError("--reg_data_dir=" + reg_dir.string() + " is not a folder");
  }
  Discovery out;
  DatasetOptions dataset = defaults.dataset;
  dataset.subsets.clear();
  SubsetOptions top = defaults.subset;
  top.image_dir = data_dir;
  top.num_repeats = 1;
  dataset.subsets.push_back(top);

  // The kohya repeat folders `<N>_<class tokens>` of `dir` as subsets.
  auto add_repeat_folders = [&](const fs::path& dir, bool is_reg) {
    for (const fs::directory_entry& entry : list_sorted(dir)) {
      std::error_code status_ec;
      if (!fs::is_directory(entry.path(), status_ec)) {
        if (is_reg && has_image_extension(entry.path())) {
          out.ignored.push_back({entry.path().string(),
                                 "regularization images go in '<N>_<class tokens>' folders of "
                                 "--reg_data_dir, as in kohya: not used"});
        }
        continue;
      }
      const std::string name = entry.path().filename().string();
      if (!valid_utf8(name)) {
        // Its name would be its images' class tokens.
        out.ignored.push_back({escape_non_utf8(entry.path().string()),
                               "folder name is not valid UTF-8 (the bytes written \\xNN here): "
                               "rename it (convmv converts names to UTF-8): not used"});
        continue;
      }
      int repeats = 0;
      std::string tokens;
      if (!parse_repeat_folder(name, &repeats, &tokens)) {
        out.ignored.push_back({entry.path().string(),
                               "folder is neither images nor a kohya repeat folder "
                               "'<N>_<class tokens>' (N a positive number): not used"});
        continue;
      }
      SubsetOptions subset = defaults.subset;
      subset.image_dir = entry.path();
      subset.num_repeats = repeats;
      subset.class_tokens = tokens;
      subset.is_reg = is_reg;
      dataset.subsets.push_back(subset);
    }
  };
  add_repeat_folders(data_dir, /*is_reg=*/false);
  // kohya trains the repeat folders alone where there are any: images beside them are listed as
  // not used (a stray preview or an original left there), never trained unasked. A folder of
  // images and nothing else is lorapipe's plain layout, one repeat each.
  const bool repeat_folders = dataset.subsets.size() > 1;
  if (repeat_folders) {
    for (const fs::directory_entry& entry : list_sorted(data_dir)) {
      const fs::path& path = entry.path();
      std::error_code status_ec;
      if (path.filename().string().starts_with('.') || fs::is_directory(path, status_ec)) {
        continue;  // hidden, or a folder add_repeat_folders has looked at
      }
      if (has_image_extension(path)) {
        out.ignored.push_back({path.string(),
                               "an image beside kohya repeat folders: kohya trains only the "
                               "'<N>_<class tokens>' folders' images, and so does lorapipe "
                               "(move it into one to train it): not used"});
      } else if (!is_caption_extension(path)) {
        out.ignored.push_back({path.string(), "not an image (unknown extension)"});
      }
    }
    dataset.subsets.erase(dataset.subsets.begin());
  }
  if (!reg_dir.empty()) add_repeat_folders(reg_dir, /*is_reg=*/true);
  out.datasets.push_back(dataset);
  const DatasetOptions& d = out.datasets.back();
  for (size_t i = 0; i < d.subsets.size(); ++i) {
    collect_subset(d.subsets[i].image_dir, 0, i, d.subsets[i],
                   /*top_level=*/!repeat_folders && i == 0, out);
  }
  return out;
}

Discovery discover_metadata(const fs::path& metadata_file, const fs::path& image_dir, int repeats,
                            const Defaults& defaults) {
  std::error_code ec;
  if (!image_dir.empty() && !fs::is_directory(image_dir, ec)) {
    throw InputError("--train_data_dir=" + image_dir.string() + " is not a folder");
  }
  if (repeats < 1) {
    throw InputError("--dataset_repeats=" + std::to_string(repeats) + ": must be at least 1");
  }
  Discovery out;
  DatasetOptions dataset = defaults.dataset;
  dataset.subsets.clear();
  SubsetOptions subset = defaults.subset;
  subset.image_dir = image_dir;
  subset.metadata_file = metadata_file;
  subset.num_repeats = repeats;
  subset.class_tokens.clear();
  subset.is_reg = false;
  dataset.subsets.push_back(subset);
  out.datasets.push_back(dataset);
  collect_metadata_subset(0, 0, out.datasets[0].subsets[0], out);
  return out;
}

namespace {

toml::table json_table(const nlohmann::json& object, const std::string& name);
toml::array json_array(const nlohmann::json& array, const std::string& name);

// One JSON value as the TOML value it stands for, given to `insert`.
template <typename Insert>
void put_json(const nlohmann::json& value, const std::string& key, const std::string& name,
              Insert&& insert) {
  using Type = nlohmann::json::value_t;
  switch (value.type()) {
    case Type::object: insert(json_table(value, name)); break;
    case Type::array: insert(json_array(value, name)); break;
    case Type::boolean: insert(value.get<bool>()); break;
    case Type::number_integer:
    case Type::number_unsigned: insert(value.get<int64_t>()); break;
    case Type::number_float: insert(value.get<double>()); break;
    case Type::string: insert(value.get<std::string>()); break;
    default:
      throw InputError(name + ": key '" + key + "' is null: leave it out to take its default");
  }
}

toml::table json_table(const nlohmann::json& object, const std::string& name) {
  toml::table table;
  for (const auto& [key, value] : object.items()) {
    put_json(value, key, name,
             [&](auto&& node) { table.insert(key, std::forward<decltype(node)>(node)); });
  }
  return table;
}

toml::array json_array(const nlohmann::json& array, const std::string& name) {
  toml::array out;
  for (const nlohmann::json& value : array) {
    put_json(value, "[...]", name,
             [&](auto&& node) { out.push_back(std::forward<decltype(node)>(node)); });
  }
  return out;
}

}  // namespace

std::vector<DatasetOptions> parse_dataset_toml(const std::string& text, const std::string& name,
                                               const Defaults& defaults) {
  toml::table root;
  std::string ext = fs::path(name).extension().string();
  std::transform(ext.begin(), ext.end(), ext.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  if (ext == ".json") {
    // kohya's load_user_config reads a .json config as the same tables (errors then name the
    // key without a line).
    nlohmann::json json;
    try {
      json = nlohmann::json::parse(text);
    } catch (const nlohmann::json::exception& e) {
      throw InputError(name + ": not valid JSON: " + e.what());
    }
    if (!json.is_object()) {
      throw InputError(name + ": not a JSON object of [general] and [[datasets]]");
    }
    root = json_table(json, name);
  } else {
    try {
      root = toml::parse(text, name);
    } catch (const toml::parse_error& e) {
      throw InputError(name + ":" + std::to_string(e.source().begin.line) +
                       ": not valid TOML: " + std::string(e.description()));
    }
  }
  TomlReader reader(name);
  const toml::table* general = nullptr;
  const toml::array* datasets = nullptr;
  for (const auto& [key, node] : root) {
    if (key.str() == "general") {
      general = node.as_table();
      if (general == nullptr) reader.fail(node, "'general' must be a table: [general]");
    } else if (key.str() == "datasets") {
      datasets = node.as_array();
      if (datasets == nullptr || !datasets->is_homogeneous(toml::node_type::table)) {
        reader.fail(node, "'datasets' must be an array of tables: [[datasets]]");
      }
    } else {
      reader.fail(node, "unknown top-level key '" + std::string(key.str()) +
                            "' (expected [general] and [[datasets]])");
    }
  }
  if (datasets == nullptr || datasets->empty()) {
    throw InputError(name + ": no [[datasets]]: nothing to train on");
  }
  if (general != nullptr) reader.check_keys(*general, kGeneral, "[general]");

  std::vector<DatasetOptions> out;
  for (size_t i = 0; i < datasets->size(); ++i) {
    const toml::table& dataset_table = *datasets->get(i)->as_table();
    reader.check_keys(dataset_table, kDataset, "[[datasets]]");
    DatasetOptions dataset = defaults.dataset;
    dataset.subsets.clear();
    if (general != nullptr) reader.apply_dataset(*general, dataset);
    reader.apply_dataset(dataset_table, dataset);

    const toml::node* subsets_node = dataset_table.get("subsets");
    const toml::array* subsets = subsets_node ? subsets_node->as_array() : nullptr;
    if (subsets_node == nullptr || (subsets != nullptr && subsets->empty())) {
      // kohya's schema takes it, and it adds no image.
      LP_LOG(kWarning, kLog) << TomlReader::where(name, dataset_table)
                             << ": this [[datasets]] has no [[datasets.subsets]]: it adds no "
                                "image, as in kohya";
      continue;
    }
    if (subsets == nullptr || !subsets->is_homogeneous(toml::node_type::table)) {
      reader.fail(*subsets_node, "'subsets' must be an array of tables: [[datasets.subsets]]");
    }
    // kohya's config_util: a dataset is a fine-tuning one when a subset names a metadata_file.
    bool fine_tuning = false;
    for (size_t j = 0; j < subsets->size(); ++j) {
      fine_tuning = fine_tuning || subsets->get(j)->as_table()->contains("metadata_file");
    }
    for (const char* key : {"class_tokens", "is_reg", "caption_extension"}) {
      if (fine_tuning && dataset_table.contains(key)) {
        reader.fail(*dataset_table.get(key),
                    "'" + std::string(key) + "' is not a key of kohya's fine-tuning datasets "
                    "(their subsets name a metadata_file): its captions come from the metadata");
      }
    }
    for (size_t j = 0; j < subsets->size(); ++j) {
      const toml::table& subset_table = *subsets->get(j)->as_table();
      reader.check_keys(subset_table, kSubset, "[[datasets.subsets]]");
      if (fine_tuning) {
        if (!subset_table.contains("metadata_file")) {
          reader.fail(subset_table, "this [[datasets]] is a fine-tuning one (a subset names a "
                                    "metadata_file): every [[datasets.subsets]] of it needs "
                                    "'metadata_file', as in kohya");
        }
        for (const char* key : {"class_tokens", "is_reg", "caption_extension"}) {
          if (subset_table.contains(key)) {
            reader.fail(*subset_table.get(key),
                        "'" + std::string(key) + "' is not a key of kohya's fine-tuning "
                        "subsets (metadata_file): its captions come from the metadata");
          }
        }
      } else if (!subset_table.contains("image_dir")) {
        reader.fail(subset_table, "[[datasets.subsets]] needs 'image_dir' (or 'metadata_file')");
      }
      SubsetOptions subset = defaults.subset;
      if (general != nullptr) reader.apply_subset(*general, subset);
      reader.apply_subset(dataset_table, subset);
      reader.apply_subset(subset_table, subset);
      if (fine_tuning) {  // [general]'s DreamBooth keys do not reach it (kohya's FT params)
        subset.is_reg = false;
        subset.class_tokens.clear();
      }
      dataset.subsets.push_back(subset);
    }
    try {
      // kohya rounds the bucket sizes to the steps first and checks them after.
      dataset.buckets = adjusted_to_steps(dataset.buckets);
      validate(dataset.buckets);
    } catch (const InputError& e) {
      reader.fail(dataset_table, e.what());
    }
    out.push_back(std::move(dataset));
  }
  return out;
}

Discovery discover_toml(const fs::path& config, const Defaults& defaults) {
  std::ifstream in(config, std::ios::binary);
  if (!in) throw InputError("cannot read --dataset_config=" + config.string());
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  Discovery out;
  out.datasets = parse_dataset_toml(text, config.string(), defaults);
  for (size_t d = 0; d < out.datasets.size(); ++d) {
    // As kohya's datasets: a subset with num_repeats below 1, or with the image_dir (a
    // fine-tuning subset: the metadata_file) of an earlier subset of the dataset, is left out
    // with a warning (the first one wins).
    std::vector<SubsetOptions>& subsets = out.datasets[d].subsets;
    std::set<fs::path> sources;
    std::vector<SubsetOptions> kept;
    for (SubsetOptions& subset : subsets) {
      for (fs::path* path : {&subset.image_dir, &subset.metadata_file}) {
        if (path->empty() || path->is_relative() == false) continue;
        // Relative to the TOML's folder; where nothing is there but the path names something
        // from the working folder, that one, as kohya (Python's open) reads it.
        const fs::path beside_config = fs::absolute(config.parent_path() / *path);
        std::error_code ec;
        if (!fs::exists(beside_config, ec) && fs::exists(*path, ec)) {
          LP_LOG(kInfo, kLog) << config.string() << ": " << path->string()
                              << " is read from the working folder, as kohya reads it ("
                              << beside_config.string() << " does not exist)";
          *path = fs::absolute(*path);
        } else {
          *path = beside_config;
        }
      }
      const fs::path& source =
          subset.metadata_file.empty() ? subset.image_dir : subset.metadata_file;
      std::error_code ec;
      // (A fine-tuning subset may name no image_dir: its metadata holds whole paths.)
      if (!subset.image_dir.empty() && !fs::is_directory(subset.image_dir, ec)) {
        // kohya warns and trains the other subsets; listed with what was not used, so a
        // mistyped folder is seen (and a run with nothing else stops: no usable image).
        const std::string why =
            "image_dir is not a folder (a relative image_dir is read from the TOML's folder, or "
            "else from the working folder): this subset is not used, as kohya leaves it out";
        LP_LOG(kWarning, kLog) << config.string() << ": " << subset.image_dir.string() << ": "
                               << why;
        out.ignored.push_back({subset.image_dir.string(), why});
      } else if (subset.num_repeats < 1) {
        LP_LOG(kWarning, kLog) << config.string() << ": subset '" << source.string()
                               << "' has num_repeats " << subset.num_repeats << ": not used";
      } else if (!sources.insert(source.lexically_normal()).second) {
        LP_LOG(kWarning, kLog) << config.string() << ": subset '" << source.string()
                               << "' repeats an earlier subset's "
                               << (subset.metadata_file.empty() ? "image_dir" : "metadata_file")
                               << ": the first is used";
      } else {
        kept.push_back(std::move(subset));
      }
    }
    subsets = std::move(kept);
    for (size_t s = 0; s < subsets.size(); ++s) {
      SubsetOptions& subset = subsets[s];
      if (subset.metadata_file.empty()) {
        collect_subset(subset.image_dir, d, s, subset, /*top_level=*/false, out);
      } else {
        collect_metadata_subset(d, s, subset, out);
      }
    }
  }
  return out;
}

}  // namespace lorapipe::preprocess
