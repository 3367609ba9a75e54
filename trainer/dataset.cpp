#include "trainer/dataset.h"

#include <algorithm>
#include <map>

#include "common/error.h"
#include "common/hash.h"

namespace lorapipe::trainer {
namespace {

std::string trim(const std::string& s) {
  const size_t begin = s.find_first_not_of(" \t\r\n");
  if (begin == std::string::npos) return "";
  const size_t end = s.find_last_not_of(" \t\r\n");
  return s.substr(begin, end - begin + 1);
}

double uniform(std::mt19937_64& rng) {
  return std::uniform_real_distribution<double>(0.0, 1.0)(rng);
}

}  // namespace

std::mt19937_64 stream(uint64_t seed, int64_t epoch, int64_t batch, std::string_view purpose) {
  Hasher h;
  h.field(static_cast<int64_t>(seed)).field(epoch).field(batch).field(purpose);
  return std::mt19937_64(h.digest().low);
}

BatchScheduler::BatchScheduler(const wire::Manifest& manifest, int batch_size, uint64_t seed,
                               bool fill_last_batch, int ranks)
    : seed_(seed), fill_last_batch_(fill_last_batch) {
  if (manifest.entries_size() == 0) {
    throw InputError("manifest '" + manifest.dataset_id() + "' has no entries: nothing to train on");
  }
  std::map<uint32_t, std::vector<int>> by_dataset;
  for (int i = 0; i < manifest.entries_size(); ++i) {
    by_dataset[manifest.entries(i).dataset_index()].push_back(i);
  }
  std::map<std::pair<uint32_t, uint32_t>, uint64_t> bucket_counts;
  batch_size_ = 0;
  for (const auto& [dataset, indices] : by_dataset) {
    int per_rank = batch_size;
    for (int i : indices) {
      const uint32_t b = manifest.entries(i).batch_size();
      if (b > 0) per_rank = static_cast<int>(b);  // the TOML wins
    }
    if (per_rank < 1) {
      throw InputError("--train_batch_size=" + std::to_string(per_rank) + ": must be at least 1");
    }
    Group group;
    group.batch_size = per_rank * std::max(1, ranks);
    std::map<std::pair<uint32_t, uint32_t>, size_t> bucket_of;
    auto add = [&](int index, uint64_t times) {
      const auto& e = manifest.entries(index);
      const auto key = std::make_pair(e.bucket().width(), e.bucket().height());
      auto [it, fresh] = bucket_of.emplace(key, group.buckets.size());
      if (fresh) group.buckets.emplace_back();
      for (uint64_t r = 0; r < times; ++r) group.buckets[it->second].push_back(index);
      bucket_counts[key] += times;
    };
    std::vector<int> reg;
    uint64_t train = 0;
    for (int i : indices) {
      const auto& e = manifest.entries(i);
      const uint64_t repeats = std::max<uint32_t>(1, e.repeats());
      if (e.is_reg()) {
        reg.push_back(i);
        continue;
      }
      add(i, repeats);
      train += repeats;
    }
    // kohya: reg images are registered with their repeats and looped over again, one more
    // repeat each, until there are at least as many as the dataset's training images.
    if (!reg.empty() && train > 0) {
      std::vector<uint64_t> times(reg.size(), 0);
      uint64_t n = 0;
      bool first = true;
      while (n < train) {
        for (size_t k = 0; k < reg.size() && n < train; ++k) {
          const uint64_t repeats = std::max<uint32_t>(1, manifest.entries(reg[k]).repeats());
          times[k] += first ? repeats : 1;
          n += first ? repeats : 1;
        }
        first = false;
      }
      for (size_t k = 0; k < reg.size(); ++k) add(reg[k], times[k]);
      reg_images_ += n;
    }
    if (train == 0) continue;  // only reg images: nothing of this dataset is trained
    train_images_ += train;
    for (const std::vector<int>& bucket : group.buckets) {
      batches_per_epoch_ += (bucket.size() + group.batch_size - 1) / group.batch_size;
    }
    batch_size_ = std::max(batch_size_, group.batch_size);
    groups_.push_back(std::move(group));
  }
  if (train_images_ == 0) {
    throw InputError("manifest '" + manifest.dataset_id() +
                     "' holds only regularization images: nothing to train on");
  }
  for (const auto& [key, count] : bucket_counts) bucket_info_.push_back({key.first, key.second, count});
}

std::vector<PlannedBatch> BatchScheduler::epoch(int64_t epoch) const {
  std::mt19937_64 rng = stream(seed_, epoch, -1, "shuffle");
  std::vector<PlannedBatch> out;
  for (const Group& group : groups_) {
    const size_t size = static_cast<size_t>(group.batch_size);
    for (const std::vector<int>& bucket : group.buckets) {
      std::vector<int> samples = bucket;
      std::shuffle(samples.begin(), samples.end(), rng);
      for (size_t start = 0; start < samples.size(); start += size) {
        PlannedBatch batch;
        const size_t end = std::min(samples.size(), start + size);
        batch.entries.assign(samples.begin() + start, samples.begin() + end);
        while (fill_last_batch_ && batch.entries.size() < size) {
          batch.entries.push_back(samples[std::uniform_int_distribution<size_t>(
              0, samples.size() - 1)(rng)]);
        }
        out.push_back(std::move(batch));
      }
    }
  }
  std::shuffle(out.begin(), out.end(), rng);
  return out;
}

std::string augment_caption(const std::string& caption, const wire::CaptionSettings& s,
                            int64_t epoch, std::mt19937_64& rng) {
  bool drop = s.caption_dropout_rate() > 0 && uniform(rng) < s.caption_dropout_rate();
  drop = drop || (s.caption_dropout_every_n_epochs() > 0 &&
                  epoch % s.caption_dropout_every_n_epochs() == 0);
  if (drop) return "";
  if (!s.shuffle_caption() && s.caption_tag_dropout_rate() <= 0) return caption;
  std::vector<std::string> tags;
  const std::string text = trim(caption);
  for (size_t begin = 0;;) {
    const size_t comma = text.find(',', begin);
    tags.push_back(trim(text.substr(begin, comma == std::string::npos ? comma : comma - begin)));
    if (comma == std::string::npos) break;
    begin = comma + 1;
  }
  const size_t keep = std::min<size_t>(tags.size(), std::max(0, s.keep_tokens()));
  std::vector<std::string> fixed(tags.begin(), tags.begin() + keep);
  std::vector<std::string> flex(tags.begin() + keep, tags.end());
  if (s.shuffle_caption()) std::shuffle(flex.begin(), flex.end(), rng);
  if (s.caption_tag_dropout_rate() > 0) {
    std::vector<std::string> kept;
    for (std::string& tag : flex) {
      if (uniform(rng) >= s.caption_tag_dropout_rate()) kept.push_back(std::move(tag));
    }
    flex = std::move(kept);
  }
  std::string out;
  for (const auto* list : {&fixed, &flex}) {
    for (const std::string& tag : *list) out += (out.empty() ? "" : ", ") + tag;
  }
  return out;
}

}  // namespace lorapipe::trainer
