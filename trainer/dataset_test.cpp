// trainer/dataset.h: kohya's bucket batch scheduler (train_util.BaseDataset, DreamBoothDataset's
// regularization balance, DatasetGroup over several [[datasets]]) and its caption augmentation
// (process_caption), on hand-built manifests. Counts are exact: each follows from kohya's rules.

#include "trainer/dataset.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <set>
#include <sstream>

#include "common/error.h"

namespace lorapipe::trainer {
namespace {

struct Entry {
  uint32_t width = 64, height = 64;
  uint32_t repeats = 1;
  bool is_reg = false;
  uint32_t dataset = 0;
  uint32_t batch_size = 0;
};

wire::Manifest manifest_of(const std::vector<Entry>& entries) {
  wire::Manifest m;
  m.set_dataset_id("test");
  for (size_t i = 0; i < entries.size(); ++i) {
    const Entry& e = entries[i];
    wire::ManifestEntry* out = m.add_entries();
    out->set_latent_key("latent-" + std::to_string(i));
    out->mutable_bucket()->set_width(e.width);
    out->mutable_bucket()->set_height(e.height);
    out->set_repeats(e.repeats);
    out->set_is_reg(e.is_reg);
    out->set_dataset_index(e.dataset);
    out->set_batch_size(e.batch_size);
  }
  return m;
}

std::vector<Entry> times(int n, Entry e) { return std::vector<Entry>(n, e); }

std::vector<Entry> join(std::initializer_list<std::vector<Entry>> parts) {
  std::vector<Entry> out;
  for (const auto& p : parts) out.insert(out.end(), p.begin(), p.end());
  return out;
}

// How often each entry is drawn in one epoch.
std::map<int, int> draws(const std::vector<PlannedBatch>& batches) {
  std::map<int, int> out;
  for (const PlannedBatch& b : batches) {
    for (int i : b.entries) ++out[i];
  }
  return out;
}

std::string order(const std::vector<PlannedBatch>& batches) {
  std::ostringstream out;
  for (const PlannedBatch& b : batches) {
    for (int i : b.entries) out << i << ' ';
    out << '|';
  }
  return out.str();
}

// Every batch from one bucket; each entry drawn its repeats times an epoch; the short last batch
// of a bucket kept short; a new order every epoch, the same order for the same epoch.
TEST(TrainBatches, EachBatchIsOneBucketAndEveryEpochIsReshuffled) {
  const wire::Manifest m = manifest_of(join({times(5, {64, 64}), times(3, {64, 96, 2})}));
  const BatchScheduler s(m, 2, /*seed=*/7, /*fill_last_batch=*/false);
  EXPECT_EQ(s.batches_per_epoch(), 3u + 3u) << "ceil(5 / 2) + ceil(3 * 2 / 2)";
  EXPECT_EQ(s.train_images(), 11u);
  ASSERT_EQ(s.buckets().size(), 2u);
  EXPECT_EQ(s.buckets()[0].count + s.buckets()[1].count, 11u);
  const auto epoch1 = s.epoch(1);
  ASSERT_EQ(epoch1.size(), 6u);
  int short_batches = 0;
  for (const PlannedBatch& b : epoch1) {
    std::set<std::pair<uint32_t, uint32_t>> sizes;
    for (int i : b.entries) sizes.insert({m.entries(i).bucket().width(), m.entries(i).bucket().height()});
    EXPECT_EQ(sizes.size(), 1u) << "a batch mixes buckets: " << order(epoch1);
    short_batches += b.entries.size() < 2;
  }
  EXPECT_EQ(short_batches, 1) << "5 images in batches of 2 leave one short batch";
  const auto counts = draws(epoch1);
  for (int i = 0; i < 8; ++i) EXPECT_EQ(counts.at(i), i < 5 ? 1 : 2) << "entry " << i;
  EXPECT_EQ(order(s.epoch(1)), order(epoch1)) << "an epoch is a function of (seed, epoch)";
  EXPECT_NE(order(s.epoch(2)), order(epoch1)) << "reshuffled every epoch";
  EXPECT_NE(order(BatchScheduler(m, 2, 8, false).epoch(1)), order(epoch1)) << "and by the seed";
}

TEST(TrainBatches, FillLastBatchTopsUpFromTheSameBucket) {
  const wire::Manifest m = manifest_of(join({times(5, {64, 64}), times(1, {64, 96})}));
  const BatchScheduler s(m, 4, 1, /*fill_last_batch=*/true);
  for (const PlannedBatch& b : s.epoch(1)) {
    ASSERT_EQ(b.entries.size(), 4u);
    const bool tall = m.entries(b.entries[0]).bucket().height() == 96;
    for (int i : b.entries) EXPECT_EQ(m.entries(i).bucket().height() == 96, tall);
  }
}

// kohya's DreamBoothDataset: reg images are registered with their repeats, then looped over one
// repeat at a time until they are as many as the training images (4 x 3 = 12 here): the five
// reg images get 3, 3, 2, 2, 2.
TEST(TrainBatches, RegularizationImagesAreBalancedAsKohya) {
  Entry reg;
  reg.is_reg = true;
  const wire::Manifest m = manifest_of(join({times(4, {64, 64, 3}), times(5, reg)}));
  const BatchScheduler s(m, 1, 3, false);
  EXPECT_EQ(s.train_images(), 12u);
  EXPECT_EQ(s.reg_images(), 12u);
  EXPECT_EQ(s.batches_per_epoch(), 24u);
  const auto counts = draws(s.epoch(1));
  const std::vector<int> expected = {3, 3, 3, 3, 3, 3, 2, 2, 2};
  for (int i = 0; i < 9; ++i) EXPECT_EQ(counts.at(i), expected[i]) << "entry " << i;

  const wire::Manifest only_reg = manifest_of(times(3, reg));
  EXPECT_THROW(BatchScheduler(only_reg, 1, 0, false), InputError);
}

// Several [[datasets]] of a dataset TOML are batched apart, as kohya's DatasetGroup holds them:
// a batch never mixes datasets (not even in a bucket of the same size), each takes its own
// batch_size (its TOML's, else --train_batch_size; per rank) and balances its own reg images;
// a dataset of reg images alone trains nothing. Their batches are shuffled together.
TEST(TrainBatches, DatasetsAreBatchedApartEachWithItsBatchSizeAndRegBalance) {
  Entry first{64, 64, 1, false, 0, 3};
  Entry second{64, 64, 1, false, 1, 0};
  Entry second_reg{64, 64, 1, true, 1, 0};
  Entry third_reg{64, 64, 1, true, 2, 0};
  const wire::Manifest m = manifest_of(
      join({times(6, first), times(4, second), times(1, second_reg), times(2, third_reg)}));
  const BatchScheduler s(m, /*batch_size=*/2, 5, false);
  EXPECT_EQ(s.datasets(), 2u);
  EXPECT_EQ(s.train_images(), 10u);
  EXPECT_EQ(s.reg_images(), 4u + 0u) << "the second dataset's one reg image, 4 times";
  EXPECT_EQ(s.batches_per_epoch(), 2u + 4u) << "6 / 3, and (4 + 4) / 2";
  EXPECT_EQ(s.batch_size(), 3);
  const auto epoch = s.epoch(1);
  std::vector<uint32_t> first_dataset_positions;
  for (size_t k = 0; k < epoch.size(); ++k) {
    std::set<uint32_t> datasets;
    for (int i : epoch[k].entries) datasets.insert(m.entries(i).dataset_index());
    ASSERT_EQ(datasets.size(), 1u) << "a batch mixes datasets: " << order(epoch);
    const uint32_t d = *datasets.begin();
    EXPECT_NE(d, 2u) << "a dataset of reg images alone trains nothing";
    EXPECT_EQ(epoch[k].entries.size(), d == 0 ? 3u : 2u);
    if (d == 0) first_dataset_positions.push_back(static_cast<uint32_t>(k));
  }
  EXPECT_EQ(draws(epoch).at(10), 4) << "the reg image balanced against its own dataset's four";
  // Shuffled together: over a few epochs the first dataset's batches are not always in front.
  bool interleaved = false;
  for (int e = 1; e <= 8 && !interleaved; ++e) {
    const auto batches = s.epoch(e);
    interleaved = m.entries(batches[0].entries[0]).dataset_index() == 1 ||
                  m.entries(batches[1].entries[0]).dataset_index() == 1;
  }
  EXPECT_TRUE(interleaved);

  const BatchScheduler two_ranks(m, 2, 5, false, /*ranks=*/2);
  EXPECT_EQ(two_ranks.batches_per_epoch(), 1u + 2u) << "6 / 6, and 8 / 4";
  for (const PlannedBatch& b : two_ranks.epoch(1)) {
    EXPECT_EQ(b.entries.size(), m.entries(b.entries[0]).dataset_index() == 0 ? 6u : 4u);
  }
}

wire::CaptionSettings caption_settings(bool shuffle, int keep, double dropout, int every,
                                       double tag_dropout) {
  wire::CaptionSettings s;
  s.set_shuffle_caption(shuffle);
  s.set_keep_tokens(keep);
  s.set_caption_dropout_rate(dropout);
  s.set_caption_dropout_every_n_epochs(every);
  s.set_caption_tag_dropout_rate(tag_dropout);
  return s;
}

std::multiset<std::string> tags_of(const std::string& caption) {
  std::multiset<std::string> out;
  std::stringstream in(caption);
  for (std::string tag; std::getline(in, tag, ',');) {
    out.insert(tag.substr(tag.find_first_not_of(' ')));
  }
  return out;
}

// kohya's process_caption: split at ",", the first keep_tokens kept in place, the rest shuffled
// and each dropped with caption_tag_dropout_rate; the whole caption dropped with
// caption_dropout_rate or on every caption_dropout_every_n_epochs-th epoch.
TEST(TrainCaptions, AugmentedAsKohya) {
  const std::string caption = "sks dog, red collar, grass, sunny day, park";
  std::mt19937_64 rng(1);
  EXPECT_EQ(augment_caption(caption, caption_settings(false, 0, 0, 0, 0), 1, rng), caption);
  std::set<std::string> orders;
  for (int i = 0; i < 50; ++i) {
    const std::string out = augment_caption(caption, caption_settings(true, 1, 0, 0, 0), 1, rng);
    EXPECT_EQ(out.rfind("sks dog, ", 0), 0u) << out;
    EXPECT_EQ(tags_of(out), tags_of(caption)) << out;
    orders.insert(out);
  }
  EXPECT_GT(orders.size(), 10u) << "shuffled";
  EXPECT_EQ(augment_caption(caption, caption_settings(true, 2, 0, 0, 1.0), 1, rng),
            "sks dog, red collar")
      << "every tag past keep_tokens dropped";
  EXPECT_EQ(augment_caption(caption, caption_settings(false, 0, 1.0, 0, 0), 1, rng), "");
  EXPECT_EQ(augment_caption(caption, caption_settings(false, 0, 0, 2, 0), 2, rng), "");
  EXPECT_EQ(augment_caption(caption, caption_settings(false, 0, 0, 2, 0), 3, rng), caption);
  int kept = 0;
  for (int i = 0; i < 400; ++i) {
    kept += !augment_caption(caption, caption_settings(false, 0, 0.25, 0, 0), 1, rng).empty();
  }
  // Binomial(400, 0.75): mean 300, sd 8.7; 5 sd either side.
  EXPECT_GT(kept, 256);
  EXPECT_LT(kept, 344);
}

}  // namespace
}  // namespace lorapipe::trainer
