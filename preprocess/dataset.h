#pragma once
// Dataset discovery: plain folders, kohya repeat folders (`<N>_<class tokens>`), or a kohya
// dataset TOML, resolved into one list of image files with their captions and settings.

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "preprocess/bucket.h"

namespace lorapipe::preprocess {

// Per-subset settings (kohya [[datasets.subsets]]), after kohya's precedence
// subset > dataset > general.
struct SubsetOptions {
  std::filesystem::path image_dir;
  // kohya's fine-tuning subsets (a dataset TOML's metadata_file, or --in_json): the images and
  // their captions listed in a JSON file, {"image key": {"caption": ..., "tags": ...}}, as
  // kohya's merge_captions_to_metadata.py and merge_dd_tags_to_metadata.py write it. An image
  // key is a path, or a name that image_dir holds with one of kohya's image extensions.
  std::filesystem::path metadata_file;
  int num_repeats = 1;
  std::string caption_extension = ".caption";  // kohya's default
  bool caption_extension_set = false;  // false: ".txt" is tried after ".caption"
  std::string class_tokens;
  bool is_reg = false;
  bool flip_aug = false;
  bool random_crop = false;
  bool alpha_mask = false;  // kohya's: the image's alpha channel masks the loss
  std::string resize_filter;  // kohya's resize_interpolation as a filter name; empty: the run's
  std::string resize_interpolation;  // the same as kohya names it, for a LoRA's metadata
  bool shuffle_caption = false;
  int keep_tokens = 0;
  double caption_dropout_rate = 0.0;
  int caption_dropout_every_n_epochs = 0;
  double caption_tag_dropout_rate = 0.0;
  std::string caption_prefix;
  std::string caption_suffix;
  std::string caption_separator = ",";  // kohya's: splits a caption into tags
  std::string keep_tokens_separator;    // "fixed ||| flexible ||| fixed suffix"
  std::string secondary_separator;      // turned into caption_separator after the shuffle
  bool enable_wildcard = false;         // "{a|b}" drawn, every line of the caption file kept
  int token_warmup_min = 1;
  double token_warmup_step = 0;

  // kohya's name for the subset in a LoRA's ss_tag_frequency and ss_dataset_dirs: its
  // image_dir's folder name, or its metadata file's name.
  std::string name() const;
  std::string image_dir_name() const;  // image_dir's folder name ("" without one)

  // Caption augmentations make the text differ per step: the trainer encodes text online.
  bool augments_caption() const {
    return shuffle_caption || caption_dropout_rate > 0 || caption_dropout_every_n_epochs > 0 ||
           caption_tag_dropout_rate > 0 || token_warmup_step > 0;
  }
  // Does this caption draw anything in kohya's process_caption? The subset's augmentations, or a
  // wildcard: with enable_wildcard, a caption holding braces or several lines.
  bool draws_from(const std::string& caption) const {
    return augments_caption() ||
           (enable_wildcard && caption.find_first_of("{}\n") != std::string::npos);
  }
  // What kohya's process_caption makes of a caption that draws nothing: its first line unless
  // enable_wildcard, the secondary separator turned into the caption separator.
  std::string fixed_caption(const std::string& caption) const;
};

struct DatasetOptions {
  BucketOptions buckets;
  int batch_size = 0;  // from a dataset TOML; 0: not given (the trainer's --train_batch_size)
  // kohya's dataset-level validation_split and validation_seed; unset: the trainer's flags.
  std::optional<double> validation_split;
  std::optional<int64_t> validation_seed;
  // kohya's skip_image_resolution: an image whose area is at most width x height is left out
  // (a multi-resolution dataset's small copies). {0, 0}: off.
  Reso skip_image_resolution{0, 0};
  std::string resize_interpolation;  // the dataset's or general's (kohya's dataset-level value)
  std::vector<SubsetOptions> subsets;
};

// Something found and not taken: a folder that is neither images nor `<N>_<tokens>`, a file
// that is not an image, with why.
struct Ignored {
  std::string path;
  std::string reason;
};

struct Skipped {
  std::string path;
  std::string reason;
};

struct ImageEntry {
  std::filesystem::path path;
  size_t dataset = 0;  // index into Discovery::datasets
  size_t subset = 0;   // index into that dataset's subsets
  std::string caption;
  std::string caption_source;  // "file", "class_tokens", "none"
  std::string caption_note;    // e.g. "read as Latin-1: not valid UTF-8"
  // The caption before caption_prefix and caption_suffix: what kohya's ss_tag_frequency counts.
  std::string caption_read;
};

struct Discovery {
  std::vector<DatasetOptions> datasets;
  std::vector<ImageEntry> images;
  std::vector<Ignored> ignored;
  std::vector<Skipped> skipped;  // found as images but unusable before decoding (e.g. unreadable)
  uint64_t captions_missing = 0;
};

// The flag-level settings: the lowest layer of kohya's precedence.
struct Defaults {
  DatasetOptions dataset;  // its `subsets` is ignored
  SubsetOptions subset;
};

// kohya repeat folders `<N>_<class tokens>` of `data_dir` as one dataset, or where it has none,
// the images directly in it (one repeat; images beside repeat folders are listed in `ignored`,
// as kohya leaves them out); with `reg_dir` (kohya's --reg_data_dir), its repeat folders too, as
// regularization subsets (is_reg; images directly in it are not used, as in kohya). Throws
// InputError when `data_dir` or `reg_dir` is not a folder.
Discovery discover_folder(const std::filesystem::path& data_dir, const Defaults& defaults,
                          const std::filesystem::path& reg_dir = {});

// kohya's fine-tuning dataset from flags: --in_json's metadata over --train_data_dir's images,
// each --dataset_repeats times. Throws InputError when the file cannot be read as kohya's
// metadata or the folder is not one.
Discovery discover_metadata(const std::filesystem::path& metadata_file,
                            const std::filesystem::path& image_dir, int repeats,
                            const Defaults& defaults);

// A kohya dataset TOML. Throws InputError naming the key and its line for an unknown key or a
// value of the wrong type; relative image_dir and metadata_file paths resolve against the
// TOML's folder. A [[datasets]] whose subsets name a metadata_file is a fine-tuning dataset, as
// in kohya: every subset of it names one, and none takes class_tokens, is_reg or
// caption_extension.
Discovery discover_toml(const std::filesystem::path& config, const Defaults& defaults);

// Parses a kohya dataset TOML into datasets without touching the file system. `name` is the
// file name used in error messages.
std::vector<DatasetOptions> parse_dataset_toml(const std::string& text, const std::string& name,
                                               const Defaults& defaults);

// `s` with every byte that is not part of valid UTF-8 written as \xNN (valid text unchanged):
// how a file name the file system holds in another encoding (Latin-1, Shift-JIS from an archive
// made on Windows) is named in reports, whose strings and protobuf fields are UTF-8.
std::string escape_non_utf8(std::string_view s);

// Extensions libvips is asked to load (lower case, with the dot).
bool has_image_extension(const std::filesystem::path& path);

struct Caption {
  std::string text;
  std::string note;  // non-empty when the file needed repair, e.g. read as Latin-1
};

// kohya reads the first line of the caption file, stripped; with `all_lines` (enable_wildcard)
// every non-blank line, each stripped, joined with "\n" (the trainer draws one). Lines end at
// "\n", "\r\n" or "\r", as Python's text files. UTF-8 with a BOM removed; a file that is not
// valid UTF-8 is read as Latin-1 (and `note` says so). Throws InputError naming the file when it
// cannot be read.
Caption read_caption_file(const std::filesystem::path& path, bool all_lines = false);

}  // namespace lorapipe::preprocess
