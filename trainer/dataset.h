#pragma once
// The trainer's view of a cached dataset: kohya sd-scripts' bucket batch scheduler
// (library/train_util.py BaseDataset / BucketManager) over a Manifest, and kohya's online
// caption augmentation.
//
// Every choice is a pure function of (seed, epoch, batch index), so a resumed run draws exactly
// what the uninterrupted run drew without saving any generator state.

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "proto/lorapipe.pb.h"

namespace lorapipe::trainer {

struct PlannedBatch {
  std::vector<int> entries;  // indices into the manifest's entries, all of one bucket
};

class BatchScheduler {
 public:
  // kohya's datasets, each batched on its own (the manifest entries' dataset_index: a dataset
  // TOML's [[datasets]]), and their batches shuffled together every epoch, as kohya's
  // DatasetGroup behind one shuffling DataLoader. Within a dataset: each entry appears `repeats`
  // times in its bucket; regularization entries (is_reg) are repeated, as kohya does, until they
  // are as many as the dataset's training images (repeats included), or dropped when it has none
  // to balance. A dataset's batches hold `batch_size` samples per rank (its TOML batch_size,
  // carried by the manifest, wins over it, and is per rank too, as kohya's is per process), times
  // `ranks` in all: each step's batch is split over the ranks. The last batch of a bucket holds
  // fewer unless `fill_last_batch` tops it up with samples drawn again from the same bucket.
  // Throws InputError for a manifest without training images or a batch size < 1.
  BatchScheduler(const wire::Manifest& manifest, int batch_size, uint64_t seed,
                 bool fill_last_batch, int ranks = 1);

  size_t batches_per_epoch() const { return batches_per_epoch_; }
  uint64_t train_images() const { return train_images_; }  // training samples per epoch
  uint64_t reg_images() const { return reg_images_; }
  // Samples a step takes (all ranks): the dataset's; with several datasets of different batch
  // sizes, the largest.
  int batch_size() const { return batch_size_; }
  size_t datasets() const { return groups_.size(); }
  // The buckets and how many samples each holds per epoch, over all datasets: (width, height,
  // count).
  struct BucketInfo {
    uint32_t width = 0, height = 0;
    uint64_t count = 0;
  };
  const std::vector<BucketInfo>& buckets() const { return bucket_info_; }

  // The batches of `epoch` (1-based, as kohya counts): batches shuffled, and samples within each
  // bucket shuffled, every epoch (kohya's shuffle_buckets).
  std::vector<PlannedBatch> epoch(int64_t epoch) const;

 private:
  struct Group {  // one dataset
    int batch_size = 1;
    std::vector<std::vector<int>> buckets;  // per bucket: entry index per sample
  };
  std::vector<Group> groups_;  // by dataset_index
  std::vector<BucketInfo> bucket_info_;
  int batch_size_ = 1;
  uint64_t seed_ = 0;
  bool fill_last_batch_ = false;
  size_t batches_per_epoch_ = 0;
  uint64_t train_images_ = 0;
  uint64_t reg_images_ = 0;
};

// A generator for everything drawn for one (seed, epoch, batch, purpose).
std::mt19937_64 stream(uint64_t seed, int64_t epoch, int64_t batch, std::string_view purpose);

// Where in the run a caption is drawn: kohya's current_epoch, current_step and
// max_train_steps.
struct CaptionClock {
  int64_t epoch = 0;
  int64_t step = 0;  // the optimizer step the caption's micro-batch belongs to
  int64_t max_train_steps = 0;
};

// kohya's process_caption (train_util.py), after the prefix and suffix that preprocess adds:
// - the whole caption dropped with caption_dropout_rate, or on every
//   caption_dropout_every_n_epochs-th epoch;
// - enable_wildcard: one of the caption file's lines, each "{a|b}" one of its choices; without
//   it, the first line;
// - with shuffle_caption, token_warmup_step or caption_tag_dropout_rate: split at
//   caption_separator into the first keep_tokens tags, kept in front, and the rest (or, when the
//   caption holds keep_tokens_separator, "fixed ||| flexible ||| fixed suffix"); the flexible
//   tags cut to the token warm-up's count, shuffled, each dropped with caption_tag_dropout_rate;
//   joined with ", ";
// - secondary_separator replaced by caption_separator.
// Draws come from `rng` in kohya's order; a caption that draws nothing draws no number.
std::string process_caption(std::string caption, const wire::CaptionSettings& settings,
                            const CaptionClock& clock, std::mt19937_64& rng);

// What kohya's train_network.py writes about the dataset into a LoRA's metadata, as JSON text,
// from the manifest entries it trains on:
// - ss_tag_frequency: per subset folder name (a dataset's subsets of one name counted together,
//   and a name an earlier dataset used left to it), every tag of the captions as read (split at
//   ",", stripped, lower-cased, empty tags left out) and how often it appears there: once an
//   occurrence in an image's caption, whatever the image's repeats. Web UIs and model sites
//   show these as the LoRA's training tags.
// - ss_dataset_dirs / ss_reg_dataset_dirs: per training / regularization subset, its folder name
//   (" (2)", " (3)" added to a name already taken), {"n_repeats", "img_count"}.
// Names and tags appear in the order kohya meets them: datasets and subsets in order, images by
// path.
struct DatasetMetadata {
  std::string tag_frequency;
  std::string dataset_dirs;
  std::string reg_dataset_dirs;
};
DatasetMetadata kohya_dataset_metadata(const wire::Manifest& manifest);

}  // namespace lorapipe::trainer
