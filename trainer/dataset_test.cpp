// trainer/dataset.h: kohya's bucket batch scheduler (train_util.BaseDataset, DreamBoothDataset's
// regularization balance, DatasetGroup over several [[datasets]]) and its caption augmentation
// (process_caption), on hand-built manifests. Counts are exact: each follows from kohya's rules.

#include "trainer/dataset.h"
#include "trainer/loss_recorder.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <map>
#include <set>
#include <sstream>
#include <tuple>

#include <nlohmann/json.hpp>

#include "common/error.h"

namespace lorapipe::trainer {
namespace {

struct Entry {
  uint32_t width = 64, height = 64;
  uint32_t repeats = 1;
  bool is_reg = false;
  uint32_t dataset = 0;
  uint32_t batch_size = 0;
  uint32_t subset = 0;
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
    out->set_subset_index(e.subset);
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
  // ...and not only the batches' order: each bucket's images are shuffled before they are cut
  // into batches (kohya shuffles both), so the batches themselves are new.
  auto compositions = [](const std::vector<PlannedBatch>& batches) {
    std::set<std::vector<int>> out;
    for (const PlannedBatch& b : batches) {
      std::vector<int> entries(b.entries.begin(), b.entries.end());
      std::sort(entries.begin(), entries.end());
      out.insert(entries);
    }
    return out;
  };
  EXPECT_NE(compositions(s.epoch(2)), compositions(epoch1)) << "only the batches' order changed";
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
  EXPECT_EQ(s.reg_images(), 5u) << "kohya's num_reg_images counts them as declared";
  EXPECT_EQ(s.batches_per_epoch(), 24u);
  const auto counts = draws(s.epoch(1));
  const std::vector<int> expected = {3, 3, 3, 3, 3, 3, 2, 2, 2};
  for (int i = 0; i < 9; ++i) EXPECT_EQ(counts.at(i), expected[i]) << "entry " << i;

  const wire::Manifest only_reg = manifest_of(times(3, reg));
  EXPECT_THROW(BatchScheduler(only_reg, 1, 0, false), InputError);

  // More reg images than training ones: kohya takes them subset by subset in the TOML's order.
  // The manifest lists entries by path, so the second subset's ("men", subset 2) come first
  // there; the first subset's ("women", subset 1) are the ones the balance reaches.
  Entry men = reg, women = reg;
  men.subset = 2;
  women.subset = 1;
  const wire::Manifest mixed =
      manifest_of(join({times(3, {64, 64, 1}), times(3, men), times(3, women)}));
  const auto reached = draws(BatchScheduler(mixed, 1, 3, false).epoch(1));
  for (int i = 0; i < 3; ++i) EXPECT_EQ(reached.count(3 + i), 0u) << "men's reg image " << i;
  for (int i = 0; i < 3; ++i) EXPECT_EQ(reached.at(6 + i), 1) << "women's reg image " << i;

  // What kohya warns of is said: reg images the balance leaves out, and reg images alone in a
  // [[datasets]] of their own (kohya balances within a dataset, so none of them trains).
  EXPECT_TRUE(s.warnings().empty());
  const BatchScheduler more_reg(mixed, 1, 3, false);
  ASSERT_EQ(more_reg.warnings().size(), 1u);
  EXPECT_NE(more_reg.warnings()[0].find("3 of its 6 regularization images are not used"),
            std::string::npos)
      << more_reg.warnings()[0];
  Entry apart = reg;
  apart.dataset = 1;
  const BatchScheduler alone(manifest_of(join({times(3, {64, 64, 1}), times(2, apart)})), 1, 3,
                             false);
  ASSERT_EQ(alone.warnings().size(), 1u);
  EXPECT_NE(alone.warnings()[0].find("dataset 1: its 2 regularization images have no training "
                                     "image in their [[datasets]]"),
            std::string::npos)
      << alone.warnings()[0];
  EXPECT_EQ(alone.train_images(), 3u);
}

// kohya's accumulation as the scheduler now states it: every `accumulation` batches end a step,
// and an epoch's last batch ends its step early; the plan is the one without accumulation.
TEST(TrainBatches, AccumulationEndsAStepEveryNBatchesAndAtTheEpochsEnd) {
  const wire::Manifest m = manifest_of(join({times(5, {64, 64}), times(3, {64, 96})}));
  const BatchScheduler plain(m, 2, 7, false), accumulated(m, 2, 7, false, 1, 3);
  EXPECT_EQ(accumulated.batches_per_epoch(), 5u);
  EXPECT_EQ(accumulated.steps_per_epoch(), 2u) << "ceil(5 batches / 3)";
  EXPECT_EQ(plain.steps_per_epoch(), 5u);
  EXPECT_EQ(accumulated.samples_per_step(), 6);
  const auto epoch = accumulated.epoch(1);
  EXPECT_EQ(order(epoch), order(plain.epoch(1))) << "accumulation changes no batch";
  ASSERT_EQ(epoch.size(), 5u);
  const std::vector<int64_t> steps = {0, 0, 0, 1, 1};
  const std::vector<bool> ends = {false, false, true, false, true};
  for (size_t i = 0; i < epoch.size(); ++i) {
    EXPECT_EQ(epoch[i].step, steps[i]) << "batch " << i;
    EXPECT_EQ(epoch[i].ends_step, ends[i]) << "batch " << i;
    EXPECT_EQ(epoch[i].share, 0.0) << "kohya's 1 / accumulation, applied by the step";
  }
}

// Bucket batch sizes: a step holds the dataset's batch x accumulation samples (S = 6 here) of one
// bucket, in as few micro-batches as the bucket's size allows, of sizes within one of each
// other, weighing their shares of the step; every sample still comes its repeats times an epoch.
TEST(TrainBatches, BucketBatchSizesKeepTheSamplesPerStepAndSplitEachStepByItsBucketsSize) {
  // 13 square samples (batch 4 fits), 7 tall ones (batch 2 fits), 4 wide ones (batch 8 fits).
  const wire::Manifest m =
      manifest_of(join({times(13, {64, 64}), times(7, {64, 128}), times(4, {128, 64})}));
  const BucketBatchSizes sizes = parse_bucket_batch_sizes("64x64:4,64x128:2,128x64:8");
  const BatchScheduler s(m, /*batch_size=*/2, 5, false, /*ranks=*/1, /*accumulation=*/3, sizes);
  EXPECT_TRUE(s.bucket_batches());
  EXPECT_EQ(s.samples_per_step(), 6);
  // Steps: squares 6 + 6 + 1, tall 6 + 1, wide 4: 6 steps. Micro-batches: squares 2 + 2 + 1
  // (6 in 4s: 3 + 3), tall 3 + 1 (6 in 2s), wide 1.
  EXPECT_EQ(s.steps_per_epoch(), 6u);
  EXPECT_EQ(s.batches_per_epoch(), 10u);
  for (int64_t epoch : {1, 2}) {
    const auto plan = s.epoch(epoch);
    ASSERT_EQ(plan.size(), 10u);
    EXPECT_EQ(draws(plan).size(), 24u) << "every sample, once";
    for (const auto& [entry, n] : draws(plan)) EXPECT_EQ(n, 1) << "entry " << entry;
    std::map<int64_t, std::vector<const PlannedBatch*>> steps;
    for (const PlannedBatch& b : plan) steps[b.step].push_back(&b);
    ASSERT_EQ(steps.size(), 6u);
    std::multiset<std::string> shapes;
    for (const auto& [step, batches] : steps) {
      std::set<std::pair<uint32_t, uint32_t>> buckets;
      size_t samples = 0, smallest = 1000, largest = 0;
      double shares = 0;
      for (const PlannedBatch* b : batches) {
        for (int i : b->entries) {
          buckets.insert({m.entries(i).bucket().width(), m.entries(i).bucket().height()});
        }
        samples += b->entries.size();
        smallest = std::min(smallest, b->entries.size());
        largest = std::max(largest, b->entries.size());
        shares += b->share;
        EXPECT_EQ(b->ends_step, b == batches.back()) << "step " << step;
      }
      ASSERT_EQ(buckets.size(), 1u) << "a step mixes buckets";
      const auto [width, height] = *buckets.begin();
      EXPECT_LE(largest, static_cast<size_t>(sizes.at({width, height}))) << width << "x" << height;
      EXPECT_LE(largest - smallest, 1u) << "even micro-batches";
      EXPECT_NEAR(shares, 1.0, 1e-12) << "shares of one step sum to one";
      for (const PlannedBatch* b : batches) {
        EXPECT_DOUBLE_EQ(b->share, static_cast<double>(b->entries.size()) / samples);
      }
      shapes.insert(std::to_string(width) + "x" + std::to_string(height) + ":" +
                    std::to_string(samples) + "/" + std::to_string(batches.size()));
    }
    EXPECT_EQ(shapes, (std::multiset<std::string>{"64x64:6/2", "64x64:6/2", "64x64:1/1",
                                                   "64x128:6/3", "64x128:1/1", "128x64:4/1"}))
        << "epoch " << epoch;
  }
  EXPECT_NE(order(s.epoch(2)), order(s.epoch(1))) << "reshuffled every epoch";
}

// Where every bucket's size is S the plan is kohya's at a batch of S without accumulation, draw
// for draw: --auto_batch on a card that fits the whole step changes nothing but the speed.
TEST(TrainBatches, BucketBatchSizesOfTheWholeStepPlanKohyasBatchOfThatSize) {
  const wire::Manifest m = manifest_of(join({times(9, {64, 64}), times(5, {64, 96, 2})}));
  const BatchScheduler kohya(m, 4, 11, /*fill_last_batch=*/true);
  const BatchScheduler sized(m, 2, 11, true, 1, 2, parse_bucket_batch_sizes("64x64:9,64x96:4"));
  EXPECT_EQ(sized.steps_per_epoch(), kohya.steps_per_epoch());
  EXPECT_EQ(sized.batches_per_epoch(), kohya.batches_per_epoch());
  for (int64_t epoch : {1, 3}) {
    const auto a = kohya.epoch(epoch), b = sized.epoch(epoch);
    EXPECT_EQ(order(b), order(a)) << "epoch " << epoch;
    for (const PlannedBatch& batch : b) {
      EXPECT_TRUE(batch.ends_step);
      EXPECT_EQ(batch.share, 1.0);
    }
  }
}

// Ranks: a bucket's size is per rank, as --train_batch_size is; a missing bucket or a bad
// piece is named.
TEST(TrainBatches, BucketBatchSizesArePerRankAndNameWhatTheyLack) {
  const wire::Manifest m = manifest_of(join({times(8, {64, 64}), times(3, {64, 96})}));
  const BatchScheduler s(m, 2, 3, false, /*ranks=*/2, /*accumulation=*/2,
                         parse_bucket_batch_sizes("64x64:1,64x96:2"));
  EXPECT_EQ(s.samples_per_step(), 8) << "2 per rank x 2 ranks x 2 micro-batches";
  for (const PlannedBatch& b : s.epoch(1)) {
    const bool square = m.entries(b.entries[0]).bucket().height() == 64;
    EXPECT_LE(b.entries.size(), square ? 2u : 4u) << "1 and 2 per rank, over 2 ranks";
  }
  EXPECT_EQ(s.steps_per_epoch(), 2u);
  EXPECT_EQ(s.batches_per_epoch(), 4u + 1u) << "8 squares in 4 batches of 2; 3 tall in one";

  try {
    BatchScheduler(m, 2, 3, false, 1, 1, parse_bucket_batch_sizes("64x64:2"));
    ADD_FAILURE() << "a bucket without a size trained";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("64x96"), std::string::npos) << e.what();
  }
  for (const char* bad : {"64x64", "64x64:0", "64:2", "64x64:2x", "axb:1", ""}) {
    try {
      parse_bucket_batch_sizes(bad);
      ADD_FAILURE() << "'" << bad << "' parsed";
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find("--bucket_batch_sizes"), std::string::npos) << e.what();
    }
  }
  EXPECT_EQ(format_bucket_batch_sizes(parse_bucket_batch_sizes("64x96:2,64x64:3")),
            "64x64:3,64x96:2");
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
  EXPECT_EQ(s.reg_images(), 1u) << "the second dataset's one reg image (drawn 4 times); the "
                                   "third dataset trains nothing";
  EXPECT_EQ(s.batches_per_epoch(), 2u + 4u) << "6 / 3, and (4 + 4) / 2";
  EXPECT_EQ(s.batch_size(), 3);
  // What a LoRA's ss_datasets says of each: the reg image counted once as declared, and in its
  // bucket as often as it is drawn.
  ASSERT_EQ(s.dataset_info().size(), 2u);
  const auto& first_info = s.dataset_info()[0];
  const auto& second_info = s.dataset_info()[1];
  EXPECT_EQ(std::tie(first_info.index, first_info.batch_size, first_info.train_images,
                     first_info.reg_images),
            std::make_tuple(0u, 3, uint64_t{6}, uint64_t{0}));
  EXPECT_EQ(std::tie(second_info.index, second_info.batch_size, second_info.train_images,
                     second_info.reg_images),
            std::make_tuple(1u, 2, uint64_t{4}, uint64_t{1}));
  ASSERT_EQ(first_info.buckets.size(), 1u);
  EXPECT_EQ(first_info.buckets[0].count, 6u);
  ASSERT_EQ(second_info.buckets.size(), 1u);
  EXPECT_EQ(second_info.buckets[0].count, 8u);
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
TEST(TrainCaptions, ShuffledAndDroppedAsKohya) {
  const std::string caption = "sks dog, red collar, grass, sunny day, park";
  std::mt19937_64 rng(1);
  auto draw = [&](const wire::CaptionSettings& settings, int64_t epoch = 1) {
    return process_caption(caption, settings, CaptionClock{epoch}, rng);
  };
  EXPECT_EQ(draw(caption_settings(false, 0, 0, 0, 0)), caption);
  std::set<std::string> orders;
  for (int i = 0; i < 50; ++i) {
    const std::string out = draw(caption_settings(true, 1, 0, 0, 0));
    EXPECT_EQ(out.rfind("sks dog, ", 0), 0u) << out;
    EXPECT_EQ(tags_of(out), tags_of(caption)) << out;
    orders.insert(out);
  }
  EXPECT_GT(orders.size(), 10u) << "shuffled";
  EXPECT_EQ(draw(caption_settings(true, 2, 0, 0, 1.0)), "sks dog, red collar")
      << "every tag past keep_tokens dropped";
  EXPECT_EQ(draw(caption_settings(false, 0, 1.0, 0, 0)), "");
  EXPECT_EQ(draw(caption_settings(false, 0, 0, 2, 0), 2), "");
  EXPECT_EQ(draw(caption_settings(false, 0, 0, 2, 0), 3), caption);
  int kept = 0;
  for (int i = 0; i < 400; ++i) {
    kept += !draw(caption_settings(false, 0, 0.25, 0, 0)).empty();
  }
  // Binomial(400, 0.75): mean 300, sd 8.7; 5 sd either side.
  EXPECT_GT(kept, 256);
  EXPECT_LT(kept, 344);
}

// Every output of `draw` over `tries` draws, by count.
std::map<std::string, int> outcomes(int tries, const std::function<std::string()>& draw) {
  std::map<std::string, int> out;
  for (int i = 0; i < tries; ++i) ++out[draw()];
  return out;
}

std::set<std::string> keys_of(const std::map<std::string, int>& counts) {
  std::set<std::string> out;
  for (const auto& [key, count] : counts) out.insert(key);
  return out;
}

// kohya's caption_separator, keep_tokens_separator and secondary_separator, as train_util.py's
// process_caption applies them.
TEST(TrainCaptions, SeparatorsAsKohya) {
  std::mt19937_64 rng(7);
  const CaptionClock clock{1, 0, 100};
  // keep_tokens_separator: "fixed ||| flexible ||| fixed suffix"; empty tags dropped, keep_tokens
  // not used; joined with ", ".
  wire::CaptionSettings s = caption_settings(true, 5, 0, 0, 0);
  s.set_keep_tokens_separator("|||");
  const std::string marked = "sks dog, 1girl ||| red, blue,, green, white ||| masterpiece";
  const auto shuffled =
      outcomes(200, [&] { return process_caption(marked, s, clock, rng); });
  EXPECT_GT(shuffled.size(), 12u) << "the 4 flexible tags shuffled (24 orders)";
  for (const auto& [out, count] : shuffled) {
    EXPECT_EQ(out.rfind("sks dog, 1girl, ", 0), 0u) << out;
    EXPECT_TRUE(out.ends_with(", masterpiece")) << out;
    EXPECT_EQ(tags_of(out), tags_of("sks dog, 1girl, red, blue, green, white, masterpiece")) << out;
  }
  // One mark: the rest is flexible.
  s.set_caption_tag_dropout_rate(1.0);
  EXPECT_EQ(process_caption("a, b ||| c, d", s, clock, rng), "a, b");
  EXPECT_EQ(process_caption("a, b ||| c ||| d", s, clock, rng), "a, b, d");
  // Without shuffle, warm-up or tag dropout kohya leaves the caption, marks and all, as it is.
  wire::CaptionSettings plain;
  plain.set_keep_tokens_separator("|||");
  EXPECT_EQ(process_caption("a ||| b, c", plain, clock, rng), "a ||| b, c");

  // caption_separator splits, ", " joins; without the mark, keep_tokens counts tags.
  wire::CaptionSettings semi = caption_settings(false, 1, 0, 0, 1.0);
  semi.set_caption_separator(";");
  EXPECT_EQ(process_caption(" x ;y; z ", semi, clock, rng), "x");
  semi.set_caption_tag_dropout_rate(0);
  semi.set_shuffle_caption(true);
  for (const auto& [out, count] :
       outcomes(50, [&] { return process_caption("x; y; z, w", semi, clock, rng); })) {
    EXPECT_TRUE(out == "x, y, z, w" || out == "x, z, w, y") << out;
  }
  // An empty tag keeps its place in the join, as Python's ", ".join does.
  semi.set_shuffle_caption(false);
  semi.set_caption_tag_dropout_rate(1e-300);
  EXPECT_EQ(process_caption(";a;;b", semi, clock, rng), ", a, , b");

  // secondary_separator: what it joins is one tag for the shuffle and the drops, and becomes
  // caption_separator afterwards (also when nothing else is done).
  wire::CaptionSettings second = caption_settings(true, 0, 0, 0, 0);
  second.set_secondary_separator(";;;");
  const std::string dress = "black;;;white dress, hat, shoe";
  const auto joined =
      outcomes(100, [&] { return process_caption(dress, second, clock, rng); });
  EXPECT_EQ(joined.size(), 6u) << "3 tags, 6 orders";
  for (const auto& [out, count] : joined) {
    EXPECT_NE(out.find("black,white dress"), std::string::npos) << out;
  }
  wire::CaptionSettings only_second;
  only_second.set_secondary_separator(";;;");
  only_second.set_caption_separator(" / ");
  EXPECT_EQ(process_caption("a;;;b, c", only_second, clock, rng), "a / b, c");
}

// kohya's token warm-up: token_warmup_min flexible tags at step 0, all of them from
// token_warmup_step (a share of max_train_steps below 1): floor(step * (tags - min) / warm-up
// steps) + min.
TEST(TrainCaptions, TokenWarmupAsKohya) {
  std::mt19937_64 rng(3);
  wire::CaptionSettings s = caption_settings(false, 1, 0, 0, 0);
  s.set_token_warmup_min(1);
  s.set_token_warmup_step(10);
  const std::string caption = "sks, t1, t2, t3, t4, t5, t6";  // 1 kept, 6 flexible
  auto at = [&](int64_t step, int64_t max_steps) {
    return process_caption(caption, s, CaptionClock{1, step, max_steps}, rng);
  };
  // floor(step * 5 / 10) + 1 flexible tags.
  EXPECT_EQ(at(0, 100), "sks, t1");
  EXPECT_EQ(at(1, 100), "sks, t1");
  EXPECT_EQ(at(2, 100), "sks, t1, t2");
  EXPECT_EQ(at(5, 100), "sks, t1, t2, t3");
  EXPECT_EQ(at(9, 100), "sks, t1, t2, t3, t4, t5");
  EXPECT_EQ(at(10, 100), caption);
  // 0.25 of 40 steps: the same 10.
  s.set_token_warmup_step(0.25);
  EXPECT_EQ(at(5, 40), "sks, t1, t2, t3");
  EXPECT_EQ(at(10, 40), caption);
  // A share that rounds down to 0 steps is no warm-up.
  s.set_token_warmup_step(0.05);
  EXPECT_EQ(at(0, 10), caption);
  // More tags asked for at the start than there are: all of them.
  s.set_token_warmup_step(4);
  s.set_token_warmup_min(9);
  EXPECT_EQ(at(0, 10), caption);
  // With the separator mark, the warm-up counts the flexible part only.
  s.set_token_warmup_min(0);
  s.set_keep_tokens_separator("|||");
  EXPECT_EQ(process_caption("a, b ||| c, d, e, f ||| z", s, CaptionClock{1, 2, 10}, rng),
            "a, b, c, d, z");
}

// kohya's enable_wildcard: one of a caption file's lines, then each {a|b|c} one of its choices;
// {{ and }} are braces. Without it, the first line.
TEST(TrainCaptions, WildcardsAsKohya) {
  std::mt19937_64 rng(11);
  const CaptionClock clock{1, 0, 100};
  wire::CaptionSettings s;
  s.set_enable_wildcard(true);
  auto draws = [&](const std::string& caption) {
    return keys_of(outcomes(300, [&] { return process_caption(caption, s, clock, rng); }));
  };
  EXPECT_EQ(draws("a {red|blue|green} ball, {{literal}}"),
            (std::set<std::string>{"a red ball, {literal}", "a blue ball, {literal}",
                                   "a green ball, {literal}"}));
  EXPECT_EQ(draws("photo of {cat|dog}\nsketch, {pencil|ink}"),
            (std::set<std::string>{"photo of cat", "photo of dog", "sketch, pencil",
                                   "sketch, ink"}));
  // The regex \{([^}]+)\}: "{}" is no wildcard, a "{" inside one is a character of a choice.
  EXPECT_EQ(draws("x {} {a{b|c}"), (std::set<std::string>{"x {} a{b", "x {} c"}));
  // Python's replace takes "{{" and "}}" left to right: in "}}}" the first two are an escaped
  // brace and the last closes the wildcard, so its second choice is "b}".
  EXPECT_EQ(draws("{{{a|b}}}"), (std::set<std::string>{"{a", "{b}"}));
  // The marks that stand in for escaped braces never meet the caption's own.
  EXPECT_EQ(draws("\u2985 {{x}} \u2986"), (std::set<std::string>{"\u2985 {x} \u2986"}));
  // Drawn, then shuffled as kohya: wildcards first.
  s.set_shuffle_caption(true);
  s.set_keep_tokens(1);
  for (const std::string& out : draws("sks, {a|b}, c")) {
    EXPECT_TRUE(out == "sks, a, c" || out == "sks, c, a" || out == "sks, b, c" ||
                out == "sks, c, b")
        << out;
  }
  // Off: braces are text, the first line is the caption, and no number is drawn.
  wire::CaptionSettings off;
  std::mt19937_64 before = rng;
  EXPECT_EQ(process_caption("a {b|c}\nsecond", off, clock, rng), "a {b|c}");
  EXPECT_EQ(rng, before) << "a caption that draws nothing draws no number";
}

// kohya's dataset metadata (train_network.py, and BaseDataset.set_tag_frequency): tags split at
// ",", stripped, lower-cased (Unicode, as str.lower), empty ones left out, every occurrence in
// an image's caption as read counted once; a folder name counted by an earlier dataset keeps
// that dataset's counts; subset folders listed with their repeats and image counts, a taken name
// getting " (2)", regularization subsets apart; json.dumps' escapes. A manifest cached before
// subsets were recorded is named by the images' folders and counted on their captions.
TEST(TrainMetadata, TagFrequencyAndDatasetDirsAsKohyaWritesThem) {
  wire::Manifest m;
  auto add = [&](const std::string& path, const std::string& subset, uint32_t dataset,
                 uint32_t index, uint32_t repeats, bool is_reg, const std::string& read,
                 const std::string& caption) {
    wire::ManifestEntry* e = m.add_entries();
    e->set_path(path);
    e->set_subset_name(subset);
    e->set_dataset_index(dataset);
    e->set_subset_index(index);
    e->set_repeats(repeats);
    e->set_is_reg(is_reg);
    e->set_caption_read(read);
    e->set_caption(caption);
  };
  // Out of path order, and with the caption prefix the trainer sees: neither may show.
  add("d/1_dog/b.png", "1_dog", 0, 0, 3, false, "a dog\nsit, \xc3\x84PFEL", "sks a dog\nsit, x");
  add("d/1_dog/a.png", "1_dog", 0, 0, 3, false, "Dog, Brown ,dog,, ", "sks Dog, Brown ,dog,, ");
  add("r/1_reg/p.png", "1_reg", 0, 1, 1, true, "person", "person");
  add("e/1_dog/c.png", "1_dog", 1, 0, 2, false, "cat", "cat");
  add("x/old_dir/i.png", "", 2, 0, 1, false, "", "Old, Tag");
  const DatasetMetadata got = kohya_dataset_metadata(m, BatchScheduler(m, 1, 0, false));
  EXPECT_EQ(got.keys.at("ss_tag_frequency"),
            R"({"1_dog": {"dog": 2, "brown": 1, "a dog\nsit": 1, "\u00e4pfel": 1}, )"
            R"("1_reg": {"person": 1}, "old_dir": {"old": 1, "tag": 1}})");
  EXPECT_EQ(got.keys.at("ss_dataset_dirs"),
            R"j({"1_dog": {"n_repeats": 3, "img_count": 2}, "1_dog (2)": {"n_repeats": 2, )j"
            R"j("img_count": 1}, "old_dir": {"n_repeats": 1, "img_count": 1}})j");
  EXPECT_EQ(got.keys.at("ss_reg_dataset_dirs"), R"({"1_reg": {"n_repeats": 1, "img_count": 1}})");
}

wire::ManifestEntry* add_entry(wire::Manifest& m, const std::string& path, uint32_t dataset,
                               uint32_t subset, const std::string& subset_name, uint32_t repeats,
                               bool is_reg, uint32_t width, uint32_t height,
                               const std::string& caption) {
  wire::ManifestEntry* e = m.add_entries();
  e->set_path(path);
  e->set_dataset_index(dataset);
  e->set_subset_index(subset);
  e->set_subset_name(subset_name);
  e->set_repeats(repeats);
  e->set_is_reg(is_reg);
  e->mutable_bucket()->set_width(width);
  e->mutable_bucket()->set_height(height);
  e->set_caption_read(caption);
  e->set_caption(caption);
  return e;
}

wire::DatasetSettings* add_dataset(wire::DatasetSource& source, uint32_t width, uint32_t height,
                                   bool buckets, uint32_t batch_size, bool dreambooth) {
  wire::DatasetSettings* d = source.add_datasets();
  d->mutable_resolution()->set_width(width);
  d->mutable_resolution()->set_height(height);
  d->set_enable_bucket(buckets);
  if (buckets) {
    d->set_min_bucket_reso(256);
    d->set_max_bucket_reso(1024);
  }
  d->set_batch_size(batch_size);
  d->set_is_dreambooth(dreambooth);
  return d;
}

// kohya's LossRecorder: the first epoch's mean of every loss so far, then a window of one
// epoch's worth in which each batch position's new loss replaces its old one.
TEST(TrainLossAverage, MovesAsKohyasLossRecorder) {
  LossRecorder r;
  r.add(1, 0, 1.0);
  EXPECT_DOUBLE_EQ(r.moving_average(), 1.0);
  r.add(1, 1, 2.0);
  r.add(1, 2, 3.0);
  EXPECT_DOUBLE_EQ(r.moving_average(), 2.0) << "(1 + 2 + 3) / 3";
  r.add(2, 0, 4.0);
  EXPECT_DOUBLE_EQ(r.moving_average(), 3.0) << "(4 + 2 + 3) / 3: not reset at the epoch's start";
  r.add(2, 1, 5.0);
  EXPECT_DOUBLE_EQ(r.moving_average(), 4.0) << "(4 + 5 + 3) / 3";
  r.add(2, 3, 8.0);  // a longer epoch (fill_last_batch off, another bucket split)
  EXPECT_DOUBLE_EQ(r.moving_average(), 5.0) << "(4 + 5 + 3 + 8) / 4";
}

// kohya's --validation_split: each subset is split on its own, of a seeded shuffle the first
// ceil(n * (1 - split)) training and the last round(n * split) validating (Python's round:
// 2.5 -> 2, 3.5 -> 4), so with 14 images and 0.25 one image does both (11 + 4), as in kohya;
// regularization images always train; the split depends on the seed alone.
TEST(TrainValidation, EachSubsetIsSplitAsKohyaAndRegImagesNeverValidate) {
  wire::Manifest m;
  for (int i = 0; i < 10; ++i) {
    add_entry(m, "a/" + std::to_string(i), 0, 0, "a", 1, false, 64, 64, "a");
  }
  for (int i = 0; i < 14; ++i) {
    add_entry(m, "b/" + std::to_string(i), 0, 1, "b", 1, false, 64, 64, "b");
  }
  for (int i = 0; i < 6; ++i) add_entry(m, "r/" + std::to_string(i), 0, 2, "r", 1, true, 64, 64, "r");
  const ValidationSplit split = split_for_validation(m, 0.25, 7);
  ASSERT_EQ(split.validates.size(), 30u);
  std::map<std::string, int> trains, validates, both;
  for (int i = 0; i < m.entries_size(); ++i) {
    const std::string& subset = m.entries(i).subset_name();
    trains[subset] += split.trains[i];
    validates[subset] += split.validates[i];
    both[subset] += split.trains[i] && split.validates[i];
  }
  EXPECT_EQ(validates["a"], 2) << "round(10 * 0.25) = round(2.5) = 2";
  EXPECT_EQ(trains["a"], 8) << "ceil(10 * 0.75)";
  EXPECT_EQ(both["a"], 0);
  EXPECT_EQ(validates["b"], 4) << "round(14 * 0.25) = round(3.5) = 4";
  EXPECT_EQ(trains["b"], 11) << "ceil(14 * 0.75) = ceil(10.5)";
  EXPECT_EQ(both["b"], 1) << "kohya's two counts overlap by one image";
  EXPECT_EQ(validates["r"], 0) << "regularization images never validate";
  EXPECT_EQ(trains["r"], 6);
  EXPECT_EQ(split_for_validation(m, 0.25, 7).validates, split.validates) << "a function of the seed";
  EXPECT_NE(split_for_validation(m, 0.25, 8).validates, split.validates)
      << "and another seed draws others";
  EXPECT_THROW(split_for_validation(m, 0.01, 7), InputError) << "nothing to validate on";
  EXPECT_THROW(split_for_validation(m, 1.0, 7), InputError) << "nothing to train on";
}

// kohya's dataset-level validation_split and validation_seed from a dataset TOML (carried in the
// manifest's entries): they win over the flags for their dataset; the other dataset keeps the
// flags'. A TOML split alone is enough to hold images out.
TEST(TrainValidation, ADatasetTomlsSplitAndSeedWinForItsDataset) {
  auto build = [](std::optional<uint64_t> seed) {
    wire::Manifest m;
    for (int i = 0; i < 10; ++i) {
      add_entry(m, "a/" + std::to_string(i), 0, 0, "a", 1, false, 64, 64, "a");
    }
    for (int i = 0; i < 10; ++i) {
      wire::ManifestEntry* e = add_entry(m, "b/" + std::to_string(i), 1, 0, "b", 1, false, 64, 64, "b");
      e->set_validation_split(0.5);
      if (seed) e->set_validation_seed(*seed);
    }
    return m;
  };
  const wire::Manifest m = build(std::nullopt);
  EXPECT_TRUE(holds_out_for_validation(m, 0.0)) << "the TOML's split alone";
  wire::Manifest plain;
  add_entry(plain, "a/0", 0, 0, "a", 1, false, 64, 64, "a");
  EXPECT_FALSE(holds_out_for_validation(plain, 0.0));
  EXPECT_TRUE(holds_out_for_validation(plain, 0.1));
  plain.mutable_entries(0)->set_validation_split(0.0);
  EXPECT_FALSE(holds_out_for_validation(plain, 0.1)) << "the TOML's 0 wins over the flag";
  auto count = [](const wire::Manifest& manifest, const ValidationSplit& split) {
    std::map<std::string, int> validates;
    for (int i = 0; i < manifest.entries_size(); ++i) {
      validates[manifest.entries(i).subset_name()] += split.validates[i];
    }
    return validates;
  };
  auto none = count(m, split_for_validation(m, 0.0, 7));
  EXPECT_EQ(none["a"], 0) << "no --validation_split: dataset a keeps every image";
  EXPECT_EQ(none["b"], 5) << "round(10 * 0.5) from the TOML";
  auto both = count(m, split_for_validation(m, 0.2, 7));
  EXPECT_EQ(both["a"], 2) << "round(10 * 0.2) from the flag";
  EXPECT_EQ(both["b"], 5) << "the TOML's 0.5 wins for dataset b";
  // The TOML's seed wins for its dataset: the same held-out images whatever --validation_seed.
  const wire::Manifest seeded = build(uint64_t{11});
  const ValidationSplit s7 = split_for_validation(seeded, 0.2, 7);
  const ValidationSplit s8 = split_for_validation(seeded, 0.2, 8);
  bool a_differs = false;
  for (int i = 0; i < seeded.entries_size(); ++i) {
    if (seeded.entries(i).subset_name() == "b") {
      EXPECT_EQ(s7.validates[i], s8.validates[i]) << "entry " << i;
    } else {
      a_differs = a_differs || s7.validates[i] != s8.validates[i];
    }
  }
  EXPECT_TRUE(a_differs) << "dataset a follows --validation_seed";
  const ValidationSplit s11 = split_for_validation(build(std::nullopt), 0.2, 11);
  for (int i = 10; i < 20; ++i) EXPECT_EQ(s11.validates[i], s7.validates[i]) << "entry " << i;
}

// kohya's train_network.py with a dataset TOML: every dataset in ss_datasets (its counts, its
// buckets numbered by size, its tags, the subsets that hold images), and the training subsets of
// all of them in ss_dataset_dirs (regularization subsets left out, fine-tuning subsets by their
// metadata file); no keys of the flags' layout.
TEST(TrainMetadata, DatasetConfigWritesSsDatasetsAsKohya) {
  wire::Manifest m;
  wire::DatasetSource& source = *m.mutable_source();
  source.set_kind(wire::DatasetSource::DATASET_CONFIG);
  wire::DatasetSettings* dreambooth = add_dataset(source, 512, 512, true, 2, true);
  dreambooth->set_mean_img_ar_error(0.05);
  dreambooth->mutable_skip_image_resolution()->set_width(256);
  dreambooth->mutable_skip_image_resolution()->set_height(256);
  dreambooth->set_resize_interpolation("bicubic");
  wire::SubsetSettings* dogs = dreambooth->add_subsets();
  dogs->set_name("10_dog");
  dogs->set_image_dir("10_dog");
  dogs->set_num_repeats(2);
  dogs->set_flip_aug(true);
  dogs->set_caption_prefix("sks");
  dogs->set_resize_interpolation("lanczos");
  dogs->mutable_caption_settings()->set_shuffle_caption(true);
  wire::SubsetSettings* reg = dreambooth->add_subsets();
  reg->set_name("1_dog");
  reg->set_image_dir("1_dog");
  reg->set_num_repeats(1);
  reg->set_is_reg(true);
  reg->set_class_tokens("dog");
  dreambooth->add_subsets()->set_name("empty");  // no images: kohya leaves it out
  wire::DatasetSettings* fine_tuning = add_dataset(source, 768, 512, false, 0, false);
  wire::SubsetSettings* meta = fine_tuning->add_subsets();
  meta->set_name("meta.json");
  meta->set_image_dir("imgs");
  meta->set_metadata_file("meta.json");
  meta->set_num_repeats(1);
  add_entry(m, "d/10_dog/b.png", 0, 0, "10_dog", 2, false, 512, 512, "b");
  add_entry(m, "d/10_dog/a.png", 0, 0, "10_dog", 2, false, 512, 512, "A, b");
  add_entry(m, "r/1_dog/r.png", 0, 1, "1_dog", 1, true, 448, 576, "dog");
  add_entry(m, "imgs/c.png", 1, 0, "meta.json", 1, false, 768, 512, "c");
  // A dataset of regularization images alone trains nothing, and is described all the same.
  wire::DatasetSettings* reg_only = add_dataset(source, 512, 512, true, 0, true);
  wire::SubsetSettings* lone = reg_only->add_subsets();
  lone->set_name("3_reg");
  lone->set_image_dir("3_reg");
  lone->set_num_repeats(3);
  lone->set_is_reg(true);
  add_entry(m, "q/3_reg/x.png", 2, 0, "3_reg", 3, true, 512, 512, "x");
  add_entry(m, "q/3_reg/y.png", 2, 0, "3_reg", 3, true, 512, 512, "y");
  for (auto& e : *m.mutable_entries()) {
    if (e.dataset_index() == 0) e.set_batch_size(2);  // as the cacher copies it from the TOML
  }

  const DatasetMetadata got = kohya_dataset_metadata(m, BatchScheduler(m, 1, 0, false));
  EXPECT_TRUE(got.dataset_config);
  EXPECT_EQ(got.width, 512u);
  EXPECT_EQ(got.height, 512u);
  for (const char* key : {"ss_resolution", "ss_reg_dataset_dirs", "ss_bucket_info",
                          "ss_enable_bucket", "ss_flip_aug", "ss_shuffle_caption"}) {
    EXPECT_FALSE(got.keys.count(key)) << key << " belongs to kohya's layout without a TOML";
  }
  EXPECT_EQ(got.keys.at("ss_dataset_dirs"),
            R"({"10_dog": {"n_repeats": 2, "img_count": 2}, )"
            R"("meta.json": {"n_repeats": 1, "img_count": 1}})");
  EXPECT_EQ(got.keys.at("ss_tag_frequency"),
            R"({"10_dog": {"a": 1, "b": 2}, "1_dog": {"dog": 1}, "meta.json": {"c": 1}, )"
            R"("3_reg": {"x": 1, "y": 1}})");
  const nlohmann::json datasets = nlohmann::json::parse(got.keys.at("ss_datasets"));
  ASSERT_EQ(datasets.size(), 3u);
  EXPECT_EQ(datasets[2]["batch_size_per_device"], 1) << "--train_batch_size";
  EXPECT_EQ(datasets[2]["num_train_images"], 0);
  EXPECT_EQ(datasets[2]["num_reg_images"], 6) << "2 images x 3 repeats, as declared";
  const nlohmann::json& first = datasets[0];
  EXPECT_EQ(first["is_dreambooth"], true);
  EXPECT_EQ(first["batch_size_per_device"], 2) << "the TOML's batch_size";
  EXPECT_EQ(first["num_train_images"], 4) << "2 images x 2 repeats";
  EXPECT_EQ(first["num_reg_images"], 1) << "as declared, before the balance draws it 4 times";
  EXPECT_EQ(first["resolution"], nlohmann::json({512, 512}));
  EXPECT_EQ(first["min_bucket_reso"], 256);
  EXPECT_EQ(first["max_bucket_reso"], 1024);
  EXPECT_EQ(first["skip_image_resolution"], nlohmann::json({256, 256}));
  EXPECT_EQ(first["resize_interpolation"], "bicubic");
  EXPECT_EQ(got.keys.at("ss_resize_interpolation"), "None") << "no --resize_interpolation";
  // kohya's key order: the dataset's settings, then its tags, buckets and subsets.
  const nlohmann::ordered_json in_order =
      nlohmann::ordered_json::parse(got.keys.at("ss_datasets"))[0];
  std::vector<std::string> order;
  for (auto it = in_order.begin(); it != in_order.end(); ++it) order.push_back(it.key());
  EXPECT_EQ(order, (std::vector<std::string>{
                       "is_dreambooth", "batch_size_per_device", "num_train_images",
                       "num_reg_images", "resolution", "enable_bucket", "min_bucket_reso",
                       "max_bucket_reso", "skip_image_resolution", "tag_frequency", "bucket_info",
                       "resize_interpolation", "subsets"}));
  EXPECT_EQ(first["bucket_info"],
            nlohmann::json::parse(R"({"buckets": {"0": {"resolution": [448, 576], "count": 4},)"
                                  R"( "1": {"resolution": [512, 512], "count": 4}},)"
                                  R"( "mean_img_ar_error": 0.05})"));
  EXPECT_EQ(first["tag_frequency"],
            nlohmann::json::parse(R"({"10_dog": {"a": 1, "b": 2}, "1_dog": {"dog": 1}})"));
  ASSERT_EQ(first["subsets"].size(), 2u);
  const nlohmann::json& dog_subset = first["subsets"][0];
  EXPECT_EQ(dog_subset["img_count"], 2);
  EXPECT_EQ(dog_subset["num_repeats"], 2);
  EXPECT_EQ(dog_subset["flip_aug"], true);
  EXPECT_EQ(dog_subset["color_aug"], false);
  EXPECT_EQ(dog_subset["shuffle_caption"], true);
  EXPECT_EQ(dog_subset["caption_prefix"], "sks");
  EXPECT_TRUE(dog_subset["caption_suffix"].is_null()) << "kohya's None";
  EXPECT_EQ(dog_subset["resize_interpolation"], "lanczos");
  EXPECT_EQ(dog_subset["image_dir"], "10_dog");
  EXPECT_TRUE(dog_subset["class_tokens"].is_null());
  EXPECT_EQ(dog_subset["is_reg"], false);
  EXPECT_FALSE(dog_subset.contains("metadata_file"));
  EXPECT_EQ(first["subsets"][1]["is_reg"], true);
  EXPECT_EQ(first["subsets"][1]["class_tokens"], "dog");
  const nlohmann::json& second = datasets[1];
  EXPECT_EQ(second["is_dreambooth"], false);
  EXPECT_EQ(second["batch_size_per_device"], 1) << "--train_batch_size, no TOML batch_size";
  EXPECT_EQ(second["resolution"], nlohmann::json({768, 512}));
  EXPECT_EQ(second["enable_bucket"], false);
  EXPECT_TRUE(second["min_bucket_reso"].is_null());
  EXPECT_TRUE(second["bucket_info"].is_null()) << "kohya keeps none without buckets";
  EXPECT_TRUE(second["skip_image_resolution"].is_null());
  EXPECT_TRUE(second["resize_interpolation"].is_null());
  EXPECT_TRUE(second["subsets"][0]["resize_interpolation"].is_null());
  ASSERT_EQ(second["subsets"].size(), 1u);
  EXPECT_EQ(second["subsets"][0]["metadata_file"], "meta.json");
  EXPECT_EQ(second["subsets"][0]["image_dir"], "imgs");
  EXPECT_FALSE(second["subsets"][0].contains("is_reg"));
}

// kohya without a TOML: the dataset's settings and the flags' subset settings as keys of their
// own, as its str() writes them; a regularization image the balance never reaches is in no
// bucket.
TEST(TrainMetadata, FlagsLayoutWritesTheDatasetsSettingsAsKeys) {
  wire::Manifest m;
  wire::DatasetSource& source = *m.mutable_source();
  source.set_kind(wire::DatasetSource::DATA_DIR);
  wire::DatasetSettings* dataset = add_dataset(source, 768, 640, true, 0, true);
  dataset->set_min_bucket_reso(320);
  dataset->set_bucket_no_upscale(true);
  dataset->set_mean_img_ar_error(0.125);
  wire::SubsetSettings* flags = source.mutable_flags();
  flags->set_flip_aug(true);
  wire::CaptionSettings* c = flags->mutable_caption_settings();
  c->set_shuffle_caption(true);
  c->set_keep_tokens(2);
  c->set_caption_dropout_rate(0.1);
  c->set_caption_dropout_every_n_epochs(3);
  c->set_caption_tag_dropout_rate(0.05);
  add_entry(m, "d/3_x/a.png", 0, 0, "3_x", 3, false, 768, 640, "x");
  add_entry(m, "r/5_p/a.png", 0, 1, "5_p", 5, true, 768, 640, "p");  // 5 draws: 3 reached
  add_entry(m, "r/5_p/b.png", 0, 1, "5_p", 5, true, 512, 512, "p");  // never drawn

  const BatchScheduler scheduler(m, 1, 0, false);
  EXPECT_EQ(scheduler.reg_images(), 10u) << "kohya's num_reg_images: as declared";
  const DatasetMetadata got = kohya_dataset_metadata(m, scheduler);
  EXPECT_FALSE(got.dataset_config);
  const std::map<std::string, std::string> want = {
      {"ss_resolution", "(768, 640)"},
      {"ss_enable_bucket", "True"},
      {"ss_bucket_no_upscale", "True"},
      {"ss_min_bucket_reso", "320"},
      {"ss_max_bucket_reso", "1024"},
      {"ss_skip_image_resolution", "None"},
      {"ss_resize_interpolation", "None"},
      {"ss_color_aug", "False"},
      {"ss_flip_aug", "True"},
      {"ss_random_crop", "False"},
      {"ss_shuffle_caption", "True"},
      {"ss_keep_tokens", "2"},
      {"ss_caption_dropout_rate", "0.1"},
      {"ss_caption_dropout_every_n_epochs", "3"},
      {"ss_caption_tag_dropout_rate", "0.05"},
      {"ss_face_crop_aug_range", "None"},
      {"ss_bucket_info", R"({"buckets": {"0": {"resolution": [768, 640], "count": 8}}, )"
                         R"("mean_img_ar_error": 0.125})"},
      {"ss_dataset_dirs", R"({"3_x": {"n_repeats": 3, "img_count": 1}})"},
      {"ss_reg_dataset_dirs", R"({"5_p": {"n_repeats": 5, "img_count": 2}})"},
      {"ss_tag_frequency", R"({"3_x": {"x": 1}, "5_p": {"p": 2}})"}};
  for (const auto& [key, value] : want) {
    ASSERT_TRUE(got.keys.count(key)) << key;
    EXPECT_EQ(got.keys.at(key), value) << key;
  }
  EXPECT_EQ(got.keys.size(), want.size()) << "no key of kohya's TOML layout";
}

}  // namespace
}  // namespace lorapipe::trainer
