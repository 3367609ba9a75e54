#pragma once
// The preprocess stage as a library: discover the dataset, hash and probe every image, choose
// its bucket, ask the cacher which samples it already holds, decode only the misses, and stream
// ImageSamples followed by one DatasetReport. main.cpp only parses flags into Options.

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "preprocess/bucket.h"
#include "preprocess/dataset.h"

namespace lorapipe::preprocess {

struct Options {
  std::string data_dir;        // a folder of images or of kohya repeat folders
  std::string dataset_config;  // or a kohya dataset TOML
  std::string reg_data_dir;    // with data_dir: kohya repeat folders of regularization images
  // kohya's --in_json: a fine-tuning dataset's metadata file (its images in data_dir, kohya's
  // --train_data_dir), each image dataset_repeats times.
  std::string in_json;
  int dataset_repeats = 1;
  std::string dataset_id;      // manifest name; empty: derived from the dataset path
  Defaults defaults;           // flag-level dataset and subset settings

  int threads = 0;  // decode workers; 0: one per core
  int min_image_side = 64;
  double max_aspect_ratio = 8.0;
  int64_t max_image_pixels = 100'000'000;
  std::string resize_filter = "lanczos3";
  bool jpeg_fast_path = true;  // false: every JPEG through libvips (see jpeg.h)
  uint64_t seed = 0;  // random_crop offsets derive from it and the image content

  // Called on the calling thread after each decoded (or failed) image: done of total to decode.
  std::function<void(size_t done, size_t total)> on_progress;

  bool report_only = false;  // no cacher: decode to validate, then report
  std::string report_json;   // also write the report here

  std::string push_endpoint;     // cacher's PULL (ImageSample, DatasetReport)
  std::string request_endpoint;  // cacher's REP (Hello, HasKeys)
  int timeout_ms = 30000;
  int has_keys_batch = 256;
};

// One image that is used, with everything the report and the cacher need.
struct ImageResult {
  std::string path;
  int width = 0;  // as displayed
  int height = 0;
  Reso bucket;
  Reso resized;
  CropLtrb crop_ltrb;
  CropOffset crop;
  double ar_error = 0;
  std::string caption;
  std::string caption_source;
  std::string caption_note;
  std::string caption_read;  // before prefix, suffix and separators (ss_tag_frequency)
  std::string subset_name;   // SubsetOptions::name()
  uint32_t subset_index = 0;
  uint32_t repeats = 1;
  bool is_reg = false;
  bool flip = false;
  bool alpha_mask = false;  // kohya's: the alpha channel travels as the loss mask
  std::string resize_filter;  // the subset's, else the run's --resize_filter
  bool augment_caption = false;
  bool shuffle_caption = false;  // the subset's caption augmentation, passed to the trainer
  int keep_tokens = 0;
  double caption_dropout_rate = 0;
  int caption_dropout_every_n_epochs = 0;
  double caption_tag_dropout_rate = 0;
  std::string caption_separator = ",";
  std::string keep_tokens_separator;
  std::string secondary_separator;
  bool enable_wildcard = false;
  int token_warmup_min = 1;
  double token_warmup_step = 0;
  int batch_size = 0;  // the dataset's batch_size (0: not set in a dataset TOML)
  uint32_t dataset_index = 0;  // which [[datasets]] of a dataset TOML
  std::optional<double> validation_split;  // the dataset's (kohya's dataset-level keys)
  std::optional<int64_t> validation_seed;
  Reso resolution;  // the dataset's resolution, for the square-crop comparison
  std::string image_key;  // content hash . transform hash
  bool cached = false;    // the cacher already holds it: sent key-only
};

struct Report {
  std::string dataset_id;
  bool dataset_id_given = false;  // --dataset_id named it (else derived from the dataset path)
  // This run's stream on the wire (random): a serving cacher fed by several runs at once, even over
  // one folder, tells their samples apart by it.
  std::string stream_id;
  std::vector<ImageResult> images;
  std::vector<Skipped> skipped;
  std::vector<Ignored> ignored;
  uint64_t images_found = 0;
  uint64_t captions_missing = 0;  // used images without a caption file
  uint64_t decoded = 0;
  // How the dataset was given, its datasets as discovered (kohya's precedence applied; bucket
  // sizes as kohya adjusts them to the steps), and the flag-level subset settings: what a LoRA's
  // metadata describes (DatasetSource in the manifest).
  enum class Source { kDataDir, kDatasetConfig, kInJson } source = Source::kDataDir;
  std::vector<DatasetOptions> datasets;
  SubsetOptions flags;
};

// Runs the stage. Throws InputError for bad options or an unreadable dataset, and
// wire::PeerTimeoutError naming the endpoint when the cacher does not answer. Bad images are
// never thrown: they are skipped and listed in the report.
Report run(const Options& options);

// The human-readable report: bucket table, totals, skipped files with reasons.
std::string format_report(const Report& report);

// The same as JSON (see README, "Report").
std::string report_to_json(const Report& report);

// "<content hash>.<transform hash>": the image half of a cache key (DESIGN.md, "Cache keys").
std::string make_image_key(const std::string& content_hash, const ImageResult& image,
                           const std::string& resize_filter);

}  // namespace lorapipe::preprocess
