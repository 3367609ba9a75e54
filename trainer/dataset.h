#pragma once
// The trainer's view of a cached dataset: kohya sd-scripts' bucket batch scheduler
// (library/train_util.py BaseDataset / BucketManager) over a Manifest, and kohya's online
// caption augmentation.
//
// Every choice is a pure function of (seed, epoch, batch index), so a resumed run draws exactly
// what the uninterrupted run drew without saving any generator state.

#include <cstdint>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "proto/lorapipe.pb.h"

namespace lorapipe::trainer {

struct PlannedBatch {
  std::vector<int> entries;  // indices into the manifest's entries, all of one bucket
  int64_t step = 0;          // the optimizer step it belongs to, counted within the epoch
  bool ends_step = false;    // the step's last micro-batch: the update follows it
  // Bucket batch sizes: its samples over its step's, the weight of its mean loss in the step's.
  // 0: kohya's fixed accumulation (every micro-batch 1 / gradient_accumulation_steps).
  double share = 0;
};

// A batch size per rank for each bucket (width, height): --bucket_batch_sizes.
using BucketBatchSizes = std::map<std::pair<uint32_t, uint32_t>, int>;
// "WxH:B,WxH:B": throws InputError naming the piece it cannot read.
BucketBatchSizes parse_bucket_batch_sizes(const std::string& text);
std::string format_bucket_batch_sizes(const BucketBatchSizes& sizes);

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
  //
  // Steps: kohya's, `accumulation` micro-batches each, in the order the batches are shuffled;
  // an epoch's last batch ends its step (accelerate's end of the dataloader).
  //
  // `bucket_batches` (--bucket_batch_sizes, lorapipe run --auto_batch) gives each bucket its own
  // micro-batch size per rank, and keeps the samples per optimizer step those of the dataset's
  // batch size times `accumulation` (S): a bucket's samples go in steps of S (its last step
  // holds what is left, as kohya's last batch), each step split into as few micro-batches as
  // its bucket's size allows, of sizes that differ by one at most, each weighing its share of
  // the step's samples -- the step's loss is the mean over its samples, as one batch of S would
  // give. A bucket whose size is S or more trains in single batches of S. Steps, not
  // micro-batches, are shuffled, so a step's micro-batches are of one bucket. With sizes of S
  // for every bucket the plan is kohya's at a batch size of S without accumulation.
  //
  // Throws InputError for a manifest without training images, a batch size < 1, or a bucket
  // `bucket_batches` does not size.
  BatchScheduler(const wire::Manifest& manifest, int batch_size, uint64_t seed,
                 bool fill_last_batch, int ranks = 1, int accumulation = 1,
                 const BucketBatchSizes& bucket_batches = {});

  size_t batches_per_epoch() const { return batches_per_epoch_; }
  size_t steps_per_epoch() const { return steps_per_epoch_; }
  // Samples an optimizer step takes (all ranks), the largest dataset's: batch_size() times the
  // accumulation.
  int samples_per_step() const { return batch_size_ * accumulation_; }
  bool bucket_batches() const { return !bucket_batches_.empty(); }
  uint64_t train_images() const { return train_images_; }  // training samples per epoch
  // Regularization images times their repeats, as the datasets declare them (kohya's
  // num_reg_images): before they are balanced against the training images.
  uint64_t reg_images() const { return reg_images_; }
  // Samples a step takes (all ranks): the dataset's; with several datasets of different batch
  // sizes, the largest.
  int batch_size() const { return batch_size_; }
  // --train_batch_size (per rank): a dataset's batch size when its TOML gives none.
  int default_batch_size() const { return default_batch_size_; }
  size_t datasets() const { return groups_.size(); }
  // The buckets and how many samples each holds per epoch, over all datasets: (width, height,
  // count).
  struct BucketInfo {
    uint32_t width = 0, height = 0;
    uint64_t count = 0;
  };
  const std::vector<BucketInfo>& buckets() const { return bucket_info_; }
  // Each dataset that trains, as kohya describes it in a LoRA's ss_datasets: its buckets in
  // kohya's order (by width, then height), counting samples per epoch.
  struct DatasetInfo {
    uint32_t index = 0;       // the manifest entries' dataset_index
    int batch_size = 1;       // per rank
    uint64_t train_images = 0;
    uint64_t reg_images = 0;  // as reg_images()
    std::vector<BucketInfo> buckets;
  };
  const std::vector<DatasetInfo>& dataset_info() const { return dataset_info_; }
  // What kohya warns of in the same dataset: regularization images the balance leaves out (more
  // of them than training images), or that no training image of their [[datasets]] balances.
  const std::vector<std::string>& warnings() const { return warnings_; }

  // The batches of `epoch` (1-based, as kohya counts): batches shuffled, and samples within each
  // bucket shuffled, every epoch (kohya's shuffle_buckets).
  std::vector<PlannedBatch> epoch(int64_t epoch) const;

 private:
  struct Group {  // one dataset
    int batch_size = 1;
    std::vector<std::vector<int>> buckets;  // per bucket: entry index per sample
    std::vector<int> bucket_batch;  // per bucket, all ranks (bucket batch sizes only)
  };
  std::vector<Group> groups_;  // by dataset_index
  std::vector<BucketInfo> bucket_info_;
  std::vector<DatasetInfo> dataset_info_;
  std::vector<std::string> warnings_;
  int batch_size_ = 1;
  int default_batch_size_ = 1;
  uint64_t seed_ = 0;
  bool fill_last_batch_ = false;
  size_t batches_per_epoch_ = 0;
  size_t steps_per_epoch_ = 0;
  int accumulation_ = 1;
  BucketBatchSizes bucket_batches_;
  uint64_t train_images_ = 0;
  uint64_t reg_images_ = 0;
};

// kohya's --validation_split (split_train_val): which manifest entries train and which validate.
// Each subset's images (a dataset's subset_index) are split on their own: of a `seed`ed shuffle,
// the first ceil(n * (1 - split)) train and the last round(n * split) (Python's round, half to
// even) validate, so one image may do both, as in kohya; regularization images always train and
// never validate. A dataset TOML's validation_split and validation_seed (in the entries) win over
// `split` and `seed` for its dataset's subsets, as kohya's dataset-level keys do. Throws
// InputError when that leaves no image to validate on or none to train on.
struct ValidationSplit {
  std::vector<bool> trains, validates;  // by manifest entry
};
ValidationSplit split_for_validation(const wire::Manifest& manifest, double split, uint64_t seed);
// Whether anything is held out: a training image whose dataset's split (its TOML's, else
// `split`, --validation_split) is above 0.
bool holds_out_for_validation(const wire::Manifest& manifest, double split);

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

// What kohya's train_network.py writes about the dataset into a LoRA's metadata, from the
// manifest's entries, its DatasetSource (how preprocess was given the dataset) and the batches
// `scheduler` plans of it. Text as kohya's str() and json.dumps write it.
// - With a dataset TOML: ss_datasets, each dataset with its settings, counts, buckets, tags and
//   subsets; ss_tag_frequency and ss_dataset_dirs merged over them (a folder name an earlier
//   dataset used keeps that dataset's tags; regularization subsets are not in the dirs).
// - Otherwise the one dataset's settings as keys of their own (ss_resolution, ss_enable_bucket,
//   ss_min/max_bucket_reso, ss_bucket_no_upscale, ss_bucket_info; the flags' ss_flip_aug,
//   ss_random_crop, ss_shuffle_caption, ss_keep_tokens), ss_tag_frequency, and training and
//   regularization subsets in ss_dataset_dirs and ss_reg_dataset_dirs.
// - Both: the flags' ss_caption_dropout_rate, ss_caption_dropout_every_n_epochs and
//   ss_caption_tag_dropout_rate.
// ss_tag_frequency: per subset folder name (a dataset's subsets of one name counted together),
// every tag of the captions as read (split at ",", stripped, lower-cased, empty tags left out)
// and how often it appears: once an occurrence in an image's caption, whatever the image's
// repeats. Web UIs and model sites show these as the LoRA's training tags. A dirs entry is
// {"n_repeats", "img_count"}, " (2)", " (3)" added to a name already taken. Names and tags appear
// in the order kohya meets them: datasets and subsets in order, images by path. A manifest
// cached before preprocess described its datasets gets the second layout, its resolution read
// from its largest bucket.
struct DatasetMetadata {
  std::map<std::string, std::string> keys;
  uint32_t width = 0, height = 0;  // the (first) dataset's resolution
  bool dataset_config = false;     // the first layout: kohya leaves out the batch size keys
};
DatasetMetadata kohya_dataset_metadata(const wire::Manifest& manifest,
                                       const BatchScheduler& scheduler);

}  // namespace lorapipe::trainer
