#include "trainer/dataset.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <sstream>

#include <nlohmann/json.hpp>

#include "common/error.h"
#include "common/hash.h"
#include "common/numbers.h"
#include "common/random.h"
#include "common/text.h"
#include "models/clip_tokenizer.h"

namespace lorapipe::trainer {
namespace {

double uniform(std::mt19937_64& rng) { return uniform_unit(rng); }

}  // namespace

ValidationSplit split_for_validation(const wire::Manifest& manifest, double split, uint64_t seed) {
  std::map<std::pair<uint32_t, uint32_t>, std::vector<int>> subsets;  // training images only
  const auto n_entries = static_cast<size_t>(manifest.entries_size());
  ValidationSplit out{std::vector<bool>(n_entries, true), std::vector<bool>(n_entries, false)};
  for (int i = 0; i < manifest.entries_size(); ++i) {
    const wire::ManifestEntry& e = manifest.entries(i);
    if (!e.is_reg()) subsets[{e.dataset_index(), e.subset_index()}].push_back(i);
  }
  size_t images = 0, training = 0, held_out = 0;
  bool from_toml = false;
  for (auto& [subset, entries] : subsets) {
    // A dataset TOML's own validation_split and validation_seed win over the flags, as kohya's
    // dataset-level keys do (every entry of a dataset carries the same).
    const wire::ManifestEntry& first = manifest.entries(entries.front());
    const double share = first.has_validation_split() ? first.validation_split() : split;
    from_toml = from_toml || first.has_validation_split();
    const uint64_t subset_seed = first.has_validation_seed() ? first.validation_seed() : seed;
    std::mt19937_64 rng = stream(subset_seed, subset.first, subset.second, "validation_split");
    lorapipe::shuffle(entries.begin(), entries.end(), rng);
    const double n = static_cast<double>(entries.size());
    // The same double arithmetic as kohya's Python: ceil, and round half to even (nearbyint).
    const auto trains = static_cast<size_t>(std::max(0.0, std::ceil(n * (1.0 - share))));
    const auto validates = static_cast<size_t>(std::max(0.0, std::nearbyint(n * share)));
    for (size_t k = 0; k < entries.size(); ++k) {
      const auto index = static_cast<size_t>(entries[k]);
      out.trains[index] = k < trains;
      out.validates[index] = k + std::min(validates, entries.size()) >= entries.size();
      training += out.trains[index] ? 1 : 0;
      held_out += out.validates[index] ? 1 : 0;
    }
    images += entries.size();
  }
  if (images > 0 && (held_out == 0 || training == 0)) {
    std::ostringstream what;
    what << "--validation_split=" << split << (from_toml ? " (and the dataset TOML's)" : "")
         << " of " << images << " training images, split in " << subsets.size()
         << " subset(s), leaves "
         << (held_out == 0 ? "no image to validate on" : "no image to train on");
    throw InputError(what.str());
  }
  return out;
}

bool holds_out_for_validation(const wire::Manifest& manifest, double split) {
  for (const wire::ManifestEntry& e : manifest.entries()) {
    if (e.is_reg()) continue;
    if ((e.has_validation_split() ? e.validation_split() : split) > 0) return true;
  }
  return false;
}

std::mt19937_64 stream(uint64_t seed, int64_t epoch, int64_t batch, std::string_view purpose) {
  Hasher h;
  h.field(static_cast<int64_t>(seed)).field(epoch).field(batch).field(purpose);
  return std::mt19937_64(h.digest().low);
}

BucketBatchSizes parse_bucket_batch_sizes(const std::string& text) {
  BucketBatchSizes out;
  std::stringstream pieces(text);
  for (std::string piece; std::getline(pieces, piece, ',');) {
    if (piece.empty()) continue;
    unsigned width = 0, height = 0;
    int batch = 0;
    char x = 0, colon = 0, extra = 0;
    std::istringstream in(piece);
    if (!(in >> width >> x >> height >> colon >> batch) || x != 'x' || colon != ':' ||
        (in >> extra) || width == 0 || height == 0 || batch < 1) {
      throw InputError("--bucket_batch_sizes: '" + piece +
                       "' is not WIDTHxHEIGHT:BATCH (a bucket in pixels and its batch size, "
                       "at least 1)");
    }
    out[{width, height}] = batch;
  }
  if (out.empty()) throw InputError("--bucket_batch_sizes='" + text + "' sizes no bucket");
  return out;
}

std::string format_bucket_batch_sizes(const BucketBatchSizes& sizes) {
  std::string out;
  for (const auto& [bucket, batch] : sizes) {
    if (!out.empty()) out += ",";
    out += std::to_string(bucket.first) + "x" + std::to_string(bucket.second) + ":" +
           std::to_string(batch);
  }
  return out;
}

BatchScheduler::BatchScheduler(const wire::Manifest& manifest, int batch_size, uint64_t seed,
                               bool fill_last_batch, int ranks, int accumulation,
                               const BucketBatchSizes& bucket_batches)
    : default_batch_size_(batch_size),
      seed_(seed),
      fill_last_batch_(fill_last_batch),
      accumulation_(accumulation),
      bucket_batches_(bucket_batches) {
  if (accumulation < 1) {
    throw InputError("--gradient_accumulation_steps=" + std::to_string(accumulation) +
                     ": must be at least 1");
  }
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
    std::map<std::pair<uint32_t, uint32_t>, uint64_t> dataset_buckets;
    auto add = [&](int index, uint64_t times) {
      if (times == 0) return;  // a reg image the balance never reached: in no bucket
      const auto& e = manifest.entries(index);
      const auto key = std::make_pair(e.bucket().width(), e.bucket().height());
      auto [it, fresh] = bucket_of.emplace(key, group.buckets.size());
      if (fresh) group.buckets.emplace_back();
      for (uint64_t r = 0; r < times; ++r) group.buckets[it->second].push_back(index);
      bucket_counts[key] += times;
      dataset_buckets[key] += times;
    };
    std::vector<int> reg;
    uint64_t train = 0, reg_declared = 0;
    for (int i : indices) {
      const auto& e = manifest.entries(i);
      const uint64_t repeats = std::max<uint32_t>(1, e.repeats());
      if (e.is_reg()) {
        reg.push_back(i);
        reg_declared += repeats;
        continue;
      }
      add(i, repeats);
      train += repeats;
    }
    // kohya: reg images are registered with their repeats and looped over again, one more
    // repeat each, until there are at least as many as the dataset's training images. It walks
    // them subset by subset in the TOML's order (then by path, the manifest's order within a
    // subset), so which reg images the balance reaches when there are more of them than
    // training images is kohya's.
    std::stable_sort(reg.begin(), reg.end(), [&](int a, int b) {
      return manifest.entries(a).subset_index() < manifest.entries(b).subset_index();
    });
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
      const auto unused = std::count(times.begin(), times.end(), uint64_t{0});
      if (unused > 0) {
        warnings_.push_back("dataset " + std::to_string(dataset) + ": " +
                            std::to_string(unused) + " of its " + std::to_string(reg.size()) +
                            " regularization images are not used: as kohya, as many reg "
                            "samples train as training samples (" + std::to_string(train) +
                            ", repeats included)");
      }
    }
    if (train == 0 && !reg.empty()) {
      warnings_.push_back("dataset " + std::to_string(dataset) + ": its " +
                          std::to_string(reg.size()) + " regularization images have no training "
                          "image in their [[datasets]] to balance, so none of them trains (kohya "
                          "balances reg images within their own dataset: put their subset in the "
                          "[[datasets]] of the images they regularize)");
    }
    if (train == 0) continue;  // only reg images: nothing of this dataset is trained
    train_images_ += train;
    reg_images_ += reg_declared;
    DatasetInfo info{dataset, per_rank, train, reg_declared, {}};
    for (const auto& [key, count] : dataset_buckets) {
      info.buckets.push_back({key.first, key.second, count});
    }
    dataset_info_.push_back(std::move(info));
    if (bucket_batches.empty()) {
      for (const std::vector<int>& bucket : group.buckets) {
        batches_per_epoch_ += (bucket.size() + group.batch_size - 1) / group.batch_size;
      }
    } else {
      const size_t step = static_cast<size_t>(group.batch_size) * accumulation;
      for (const auto& [key, at] : bucket_of) {
        const auto sized = bucket_batches.find(key);
        if (sized == bucket_batches.end()) {
          throw InputError("--bucket_batch_sizes=" + format_bucket_batch_sizes(bucket_batches) +
                           " gives no batch size for the bucket " + std::to_string(key.first) +
                           "x" + std::to_string(key.second) + " of dataset " +
                           std::to_string(dataset) + " (lorapipe run --auto_batch sizes every "
                           "bucket the dataset has)");
        }
        if (group.bucket_batch.size() <= at) group.bucket_batch.resize(at + 1);
        group.bucket_batch[at] = static_cast<int>(
            std::min<size_t>(step, static_cast<size_t>(sized->second) * std::max(1, ranks)));
      }
      for (size_t b = 0; b < group.buckets.size(); ++b) {
        const size_t n = group.buckets[b].size();
        const size_t size = static_cast<size_t>(group.bucket_batch[b]);
        for (size_t start = 0; start < n; start += step) {
          const size_t samples = fill_last_batch ? step : std::min(step, n - start);
          batches_per_epoch_ += (samples + size - 1) / size;
          ++steps_per_epoch_;
        }
      }
    }
    batch_size_ = std::max(batch_size_, group.batch_size);
    groups_.push_back(std::move(group));
  }
  if (train_images_ == 0) {
    throw InputError("manifest '" + manifest.dataset_id() +
                     "' holds only regularization images: nothing to train on");
  }
  for (const auto& [key, count] : bucket_counts) bucket_info_.push_back({key.first, key.second, count});
  if (bucket_batches.empty()) {
    steps_per_epoch_ = (batches_per_epoch_ + accumulation - 1) / accumulation;
  }
}

std::vector<PlannedBatch> BatchScheduler::epoch(int64_t epoch) const {
  std::mt19937_64 rng = stream(seed_, epoch, -1, "shuffle");
  const bool sized = !bucket_batches_.empty();
  // Shuffled as units: a batch each with kohya's accumulation, a step each with bucket sizes.
  std::vector<std::vector<PlannedBatch>> units;
  for (const Group& group : groups_) {
    const size_t size = static_cast<size_t>(group.batch_size) * (sized ? accumulation_ : 1);
    for (size_t b = 0; b < group.buckets.size(); ++b) {
      std::vector<int> samples = group.buckets[b];
      lorapipe::shuffle(samples.begin(), samples.end(), rng);
      for (size_t start = 0; start < samples.size(); start += size) {
        const size_t end = std::min(samples.size(), start + size);
        std::vector<int> entries(samples.begin() + start, samples.begin() + end);
        while (fill_last_batch_ && entries.size() < size) {
          entries.push_back(samples[uniform_below(samples.size(), rng)]);
        }
        std::vector<PlannedBatch> unit;
        if (!sized) {
          unit.push_back({std::move(entries)});
        } else {  // the step in as few micro-batches as the bucket's size allows, even in size
          const size_t n = entries.size();
          const size_t micro = (n + group.bucket_batch[b] - 1) / group.bucket_batch[b];
          for (size_t k = 0, at = 0; k < micro; ++k) {
            const size_t take = n / micro + (k < n % micro ? 1 : 0);
            PlannedBatch batch;
            batch.entries.assign(entries.begin() + at, entries.begin() + at + take);
            batch.share = static_cast<double>(take) / static_cast<double>(n);
            at += take;
            unit.push_back(std::move(batch));
          }
        }
        units.push_back(std::move(unit));
      }
    }
  }
  lorapipe::shuffle(units.begin(), units.end(), rng);
  std::vector<PlannedBatch> out;
  for (size_t u = 0; u < units.size(); ++u) {
    for (PlannedBatch& batch : units[u]) {
      const auto index = static_cast<int64_t>(out.size());
      batch.step = sized ? static_cast<int64_t>(u) : index / accumulation_;
      out.push_back(std::move(batch));
    }
    if (sized) out.back().ends_step = true;
  }
  if (!sized) {
    for (size_t i = 0; i < out.size(); ++i) {
      out[i].ends_step = (i + 1) % static_cast<size_t>(accumulation_) == 0 || i + 1 == out.size();
    }
  }
  return out;
}

namespace {

// Python's str.split(sep): every piece, empty ones included.
std::vector<std::string> split(const std::string& text, const std::string& sep) {
  std::vector<std::string> out;
  for (size_t begin = 0;;) {
    const size_t at = text.find(sep, begin);
    out.push_back(text.substr(begin, at == std::string::npos ? at : at - begin));
    if (at == std::string::npos) return out;
    begin = at + sep.size();
  }
}

size_t pick(size_t count, std::mt19937_64& rng) {
  return static_cast<size_t>(uniform_below(count, rng));
}

// kohya's wildcards: one line of a many-line caption, then each "{a|b|c}" (regex
// \{([^}]+)\}) replaced by one of its choices; "{{" and "}}" stand for braces.
std::string draw_wildcards(std::string caption, std::mt19937_64& rng) {
  if (caption.find('\n') != std::string::npos) {
    const std::vector<std::string> lines = split(caption, "\n");
    caption = lines[pick(lines.size(), rng)];
  }
  // Escaped braces hide behind marks the caption does not hold, as kohya's do.
  std::string open = "\u2985", close = "\u2986";
  while (caption.find(open) != std::string::npos || caption.find(close) != std::string::npos) {
    open += "\u2985";
    close += "\u2986";
  }
  caption = replace_all(replace_all(caption, "{{", open), "}}", close);
  std::string out;
  size_t next = 0;
  for (size_t from = 0;;) {
    const size_t left = caption.find('{', from);
    const size_t right = left == std::string::npos ? left : caption.find('}', left + 1);
    if (right == std::string::npos) break;
    if (right == left + 1) {  // "{}" is no wildcard: the search goes on after its "{"
      from = left + 1;
      continue;
    }
    const std::vector<std::string> choices = split(caption.substr(left + 1, right - left - 1), "|");
    out.append(caption, next, left - next);
    out += choices[pick(choices.size(), rng)];
    next = from = right + 1;
  }
  out.append(caption, next);
  return replace_all(replace_all(out, open, "{"), close, "}");
}

// The stripped, non-empty tags of `part`.
std::vector<std::string> tags_of(const std::string& part, const std::string& separator) {
  std::vector<std::string> out;
  for (const std::string& piece : split(part, separator)) {
    if (std::string tag = python_strip(piece); !tag.empty()) out.push_back(std::move(tag));
  }
  return out;
}

}  // namespace

std::string process_caption(std::string caption, const wire::CaptionSettings& s,
                            const CaptionClock& clock, std::mt19937_64& rng) {
  bool drop = s.caption_dropout_rate() > 0 && uniform(rng) < s.caption_dropout_rate();
  drop = drop || (s.caption_dropout_every_n_epochs() > 0 &&
                  clock.epoch % s.caption_dropout_every_n_epochs() == 0);
  if (drop) return "";
  if (s.enable_wildcard()) {
    caption = draw_wildcards(std::move(caption), rng);
  } else {
    caption = caption.substr(0, caption.find('\n'));
  }
  // Manifests written before caption_separator existed hold "": kohya's ",".
  const std::string separator = s.caption_separator().empty() ? "," : s.caption_separator();
  if (s.shuffle_caption() || s.token_warmup_step() > 0 || s.caption_tag_dropout_rate() > 0) {
    std::vector<std::string> fixed, flex, fixed_suffix;
    const std::string& mark = s.keep_tokens_separator();
    if (const size_t at = mark.empty() ? std::string::npos : caption.find(mark);
        at != std::string::npos) {
      // "fixed ||| flexible ||| fixed suffix": keep_tokens is not used.
      std::string flex_part = caption.substr(at + mark.size());
      if (const size_t second = flex_part.find(mark); second != std::string::npos) {
        fixed_suffix = tags_of(flex_part.substr(second + mark.size()), separator);
        flex_part.resize(second);
      }
      fixed = tags_of(caption.substr(0, at), separator);
      flex = tags_of(flex_part, separator);
    } else {
      for (const std::string& piece : split(python_strip(caption), separator)) {
        flex.push_back(python_strip(piece));
      }
      const size_t keep = std::min<size_t>(flex.size(), std::max(0, s.keep_tokens()));
      fixed.assign(flex.begin(), flex.begin() + static_cast<std::ptrdiff_t>(keep));
      flex.erase(flex.begin(), flex.begin() + static_cast<std::ptrdiff_t>(keep));
    }
    // Token warm-up: token_warmup_min tags at step 0, one more every so many steps, all from
    // token_warmup_step (below 1: that share of max_train_steps, rounded down).
    double warmup = s.token_warmup_step();
    if (warmup < 1) warmup = std::floor(warmup * static_cast<double>(clock.max_train_steps));
    if (warmup != 0 && static_cast<double>(clock.step) < warmup) {
      const double per_step = (static_cast<double>(flex.size()) - s.token_warmup_min()) / warmup;
      const auto length =
          static_cast<int64_t>(std::floor(static_cast<double>(clock.step) * per_step)) +
          s.token_warmup_min();
      const auto size = static_cast<int64_t>(flex.size());
      // Python's flex[:length]: a negative length counts from the end.
      flex.resize(static_cast<size_t>(length < 0 ? std::max<int64_t>(0, size + length)
                                                 : std::min(length, size)));
    }
    if (s.shuffle_caption()) lorapipe::shuffle(flex.begin(), flex.end(), rng);
    if (s.caption_tag_dropout_rate() > 0) {
      std::vector<std::string> kept;
      for (std::string& tag : flex) {
        if (uniform(rng) >= s.caption_tag_dropout_rate()) kept.push_back(std::move(tag));
      }
      flex = std::move(kept);
    }
    caption.clear();
    bool first = true;  // ", ".join(...): an empty tag still takes its place
    for (const auto* list : {&fixed, &flex, &fixed_suffix}) {
      for (const std::string& tag : *list) {
        caption += (first ? "" : ", ") + tag;
        first = false;
      }
    }
  }
  if (!s.secondary_separator().empty()) {
    caption = replace_all(caption, s.secondary_separator(), separator);
  }
  return caption;
}

namespace {

using nlohmann::ordered_json;  // Python's dicts keep the order keys arrive in

// json.dumps as kohya calls it: ", " and ": " between items, non-ASCII escaped (bytes that are
// not UTF-8 replaced), floats as Python's repr.
std::string python_json(const ordered_json& j) {
  auto plain = [](const ordered_json& v) {
    return v.dump(-1, ' ', /*ensure_ascii=*/true, ordered_json::error_handler_t::replace);
  };
  switch (j.type()) {
    case ordered_json::value_t::object: {
      std::string out = "{";
      for (auto it = j.begin(); it != j.end(); ++it) {
        if (it != j.begin()) out += ", ";
        out += plain(ordered_json(it.key())) + ": " + python_json(it.value());
      }
      return out + "}";
    }
    case ordered_json::value_t::array: {
      std::string out = "[";
      for (size_t i = 0; i < j.size(); ++i) out += (i ? ", " : "") + python_json(j[i]);
      return out + "]";
    }
    case ordered_json::value_t::number_float: {
      const double v = j.get<double>();
      if (std::isnan(v)) return "NaN";
      if (std::isinf(v)) return v > 0 ? "Infinity" : "-Infinity";
      return python_float_repr(v);
    }
    default:
      return plain(j);
  }
}

std::string python_bool(bool v) { return v ? "True" : "False"; }

// A count kohya keeps as None when it is not set.
std::string count_or_none(uint32_t v) { return v > 0 ? std::to_string(v) : "None"; }
ordered_json count_or_null(uint32_t v) { return v > 0 ? ordered_json(v) : ordered_json(nullptr); }
ordered_json text_or_null(const std::string& v) {
  return v.empty() ? ordered_json(nullptr) : ordered_json(v);
}

// The manifest entries of one subset (a dataset's subset_index).
struct SubsetEntries {
  std::string name;
  bool is_reg = false;
  uint32_t repeats = 1;
  std::vector<const wire::ManifestEntry*> entries;  // by path
};

std::map<std::pair<uint32_t, uint32_t>, SubsetEntries> subsets_of(const wire::Manifest& manifest) {
  std::map<std::pair<uint32_t, uint32_t>, SubsetEntries> subsets;  // by (dataset, subset) index
  for (const wire::ManifestEntry& e : manifest.entries()) {
    SubsetEntries& s = subsets[{e.dataset_index(), e.subset_index()}];
    s.name = e.subset_name();
    // A manifest cached before subsets were recorded: the image's folder, and its caption.
    if (s.name.empty()) s.name = std::filesystem::path(e.path()).parent_path().filename().string();
    s.is_reg = e.is_reg();
    s.repeats = e.repeats();
    s.entries.push_back(&e);
  }
  for (auto& [index, s] : subsets) {
    std::sort(s.entries.begin(), s.entries.end(),
              [](const auto* a, const auto* b) { return a->path() < b->path(); });
  }
  return subsets;
}

// kohya's set_tag_frequency: adds the tags of a subset's captions as read to `frequency`.
void count_tags(const SubsetEntries& s, ordered_json& frequency) {
  // kohya's str.lower(); a tag that is not UTF-8 (a class token from a folder name in another
  // encoding) is lower-cased in its ASCII letters alone rather than stop a save.
  auto lower = [](const std::string& tag) {
    try {
      return models::python_lower(tag);
    } catch (const InputError&) {
      std::string out = tag;
      for (char& c : out) {
        if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
      }
      return out;
    }
  };
  if (frequency.is_null()) frequency = ordered_json::object();
  for (const wire::ManifestEntry* e : s.entries) {
    const std::string& caption = e->subset_name().empty() ? e->caption() : e->caption_read();
    for (size_t begin = 0; begin <= caption.size();) {
      const size_t comma = std::min(caption.find(',', begin), caption.size());
      const std::string tag = python_strip(std::string_view(caption).substr(begin, comma - begin));
      if (!tag.empty()) {
        const std::string key = lower(tag);
        frequency[key] = frequency.value(key, 0) + 1;
      }
      begin = comma + 1;
    }
  }
}

// `name`, or with " (2)", " (3)", ... the first of those `dirs` does not hold yet.
std::string unique_name(const ordered_json& dirs, const std::string& name) {
  std::string out = name;
  for (int i = 2; dirs.contains(out); ++i) out = name + " (" + std::to_string(i) + ")";
  return out;
}

// kohya's bucket_info: the buckets of a dataset that buckets, numbered in kohya's order, with
// the mean aspect-ratio error of its images; None (null) for a dataset that does not bucket.
ordered_json bucket_info(const std::vector<BatchScheduler::BucketInfo>& buckets,
                         const wire::DatasetSettings* settings) {
  if (settings != nullptr && !settings->enable_bucket()) return nullptr;
  ordered_json numbered = ordered_json::object();
  for (size_t i = 0; i < buckets.size(); ++i) {
    numbered[std::to_string(i)] = {{"resolution", {buckets[i].width, buckets[i].height}},
                                   {"count", buckets[i].count}};
  }
  ordered_json info = {{"buckets", numbered}};
  if (settings != nullptr) info["mean_img_ar_error"] = settings->mean_img_ar_error();
  return info;
}

// kohya's (width, height) tuple, or None.
ordered_json skip_resolution_json(const wire::DatasetSettings& settings) {
  if (!settings.has_skip_image_resolution()) return nullptr;
  return {settings.skip_image_resolution().width(), settings.skip_image_resolution().height()};
}

// The subset keys kohya's ss_datasets holds for each subset.
ordered_json subset_json(const wire::SubsetSettings& subset, size_t img_count,
                         bool is_dreambooth) {
  const wire::CaptionSettings& c = subset.caption_settings();
  ordered_json j = {{"img_count", img_count},
                    {"num_repeats", subset.num_repeats()},
                    {"color_aug", false},
                    {"flip_aug", subset.flip_aug()},
                    {"random_crop", subset.random_crop()},
                    {"shuffle_caption", c.shuffle_caption()},
                    {"keep_tokens", c.keep_tokens()},
                    {"keep_tokens_separator", c.keep_tokens_separator()},
                    {"secondary_separator", text_or_null(c.secondary_separator())},
                    {"enable_wildcard", c.enable_wildcard()},
                    {"caption_prefix", text_or_null(subset.caption_prefix())},
                    {"caption_suffix", text_or_null(subset.caption_suffix())},
                    {"resize_interpolation", text_or_null(subset.resize_interpolation())}};
  if (!subset.image_dir().empty()) j["image_dir"] = subset.image_dir();
  if (is_dreambooth) {
    j["class_tokens"] = text_or_null(subset.class_tokens());
    j["is_reg"] = subset.is_reg();
  } else {
    j["metadata_file"] = subset.metadata_file();
  }
  return j;
}

}  // namespace

DatasetMetadata kohya_dataset_metadata(const wire::Manifest& manifest,
                                       const BatchScheduler& scheduler) {
  const auto subsets = subsets_of(manifest);
  const wire::DatasetSource& source = manifest.source();
  const bool described = manifest.has_source() && source.datasets_size() > 0;
  DatasetMetadata out;
  auto& m = out.keys;
  const wire::CaptionSettings& flags = source.flags().caption_settings();
  m["ss_caption_dropout_rate"] = python_float_repr(flags.caption_dropout_rate());
  m["ss_caption_dropout_every_n_epochs"] =
      count_or_none(static_cast<uint32_t>(std::max(0, flags.caption_dropout_every_n_epochs())));
  m["ss_caption_tag_dropout_rate"] = python_float_repr(flags.caption_tag_dropout_rate());
  m["ss_face_crop_aug_range"] = "None";
  // kohya's args.resize_interpolation (preprocess's flag), in both layouts.
  const std::string& interpolation = source.flags().resize_interpolation();
  m["ss_resize_interpolation"] = interpolation.empty() ? "None" : interpolation;

  if (described && source.kind() == wire::DatasetSource::DATASET_CONFIG) {
    // kohya with a dataset TOML: each dataset in ss_datasets, and the tags and training
    // subsets of all of them merged for the metadata editors (a folder name an earlier dataset
    // used keeps that dataset's tags; regularization subsets are left out of the dirs).
    out.dataset_config = true;
    ordered_json datasets = ordered_json::array(), tags = ordered_json::object(),
                 dirs = ordered_json::object();
    for (int d = 0; d < source.datasets_size(); ++d) {
      const wire::DatasetSettings& settings = source.datasets(d);
      const auto index = static_cast<uint32_t>(d);
      // A dataset that trains nothing (regularization images alone) has no plan: its batch size
      // and declared regularization images, as kohya counts them, from the settings and entries.
      BatchScheduler::DatasetInfo info;
      info.batch_size = settings.batch_size() > 0 ? static_cast<int>(settings.batch_size())
                                                  : scheduler.default_batch_size();
      for (const auto& [key, entries] : subsets) {
        if (key.first != index || !entries.is_reg) continue;
        info.reg_images += entries.entries.size() * std::max<uint32_t>(1, entries.repeats);
      }
      for (const auto& i : scheduler.dataset_info()) {
        if (i.index == index) info = i;
      }
      ordered_json dataset_tags = ordered_json::object(), subset_list = ordered_json::array();
      for (int k = 0; k < settings.subsets_size(); ++k) {
        const auto found = subsets.find({index, static_cast<uint32_t>(k)});
        if (found == subsets.end()) continue;  // kohya leaves out a subset without images
        const SubsetEntries& entries = found->second;
        const wire::SubsetSettings& subset = settings.subsets(k);
        count_tags(entries, dataset_tags[entries.name]);
        subset_list.push_back(subset_json(subset, entries.entries.size(),
                                          settings.is_dreambooth()));
        if (settings.is_dreambooth() && subset.is_reg()) continue;
        const std::string dir =
            settings.is_dreambooth() ? subset.image_dir() : subset.metadata_file();
        dirs[unique_name(dirs, dir)] = {{"n_repeats", subset.num_repeats()},
                                        {"img_count", entries.entries.size()}};
      }
      ordered_json dataset = {
          {"is_dreambooth", settings.is_dreambooth()},
          {"batch_size_per_device", info.batch_size},
          {"num_train_images", info.train_images},
          {"num_reg_images", info.reg_images},
          {"resolution", {settings.resolution().width(), settings.resolution().height()}},
          {"enable_bucket", settings.enable_bucket()},
          {"min_bucket_reso", count_or_null(settings.min_bucket_reso())},
          {"max_bucket_reso", count_or_null(settings.max_bucket_reso())},
          {"skip_image_resolution", skip_resolution_json(settings)},
          {"tag_frequency", dataset_tags},
          {"bucket_info", bucket_info(info.buckets, &settings)},
          {"resize_interpolation", text_or_null(settings.resize_interpolation())},
          {"subsets", subset_list}};
      datasets.push_back(std::move(dataset));
      for (auto it = dataset_tags.begin(); it != dataset_tags.end(); ++it) {
        if (!tags.contains(it.key())) tags[it.key()] = it.value();
      }
    }
    m["ss_datasets"] = python_json(datasets);
    m["ss_tag_frequency"] = python_json(tags);
    m["ss_dataset_dirs"] = python_json(dirs);
    out.width = source.datasets(0).resolution().width();
    out.height = source.datasets(0).resolution().height();
    return out;
  }

  // kohya without a dataset TOML: one dataset, its settings (the flags') as keys of their own.
  ordered_json tags = ordered_json::object(), dirs = ordered_json::object(),
               reg_dirs = ordered_json::object();
  ordered_json dataset_tags = ordered_json::object();  // the current dataset's
  auto end_dataset = [&] {
    for (auto it = dataset_tags.begin(); it != dataset_tags.end(); ++it) {
      if (!tags.contains(it.key())) tags[it.key()] = it.value();
    }
    dataset_tags = ordered_json::object();
  };
  uint32_t dataset = 0;
  for (const auto& [index, s] : subsets) {
    if (index.first != dataset) end_dataset();
    dataset = index.first;
    count_tags(s, dataset_tags[s.name]);
    ordered_json& target = s.is_reg ? reg_dirs : dirs;
    target[unique_name(target, s.name)] = {{"n_repeats", s.repeats},
                                           {"img_count", s.entries.size()}};
  }
  end_dataset();
  m["ss_tag_frequency"] = python_json(tags);
  m["ss_dataset_dirs"] = python_json(dirs);
  m["ss_reg_dataset_dirs"] = python_json(reg_dirs);
  const std::vector<BatchScheduler::BucketInfo>& buckets =
      scheduler.dataset_info().size() == 1 ? scheduler.dataset_info()[0].buckets
                                           : scheduler.buckets();
  if (described) {
    const wire::DatasetSettings& settings = source.datasets(0);
    const wire::SubsetSettings& subset = source.flags();
    out.width = settings.resolution().width();
    out.height = settings.resolution().height();
    m["ss_color_aug"] = "False";
    m["ss_flip_aug"] = python_bool(subset.flip_aug());
    m["ss_random_crop"] = python_bool(subset.random_crop());
    m["ss_shuffle_caption"] = python_bool(subset.caption_settings().shuffle_caption());
    m["ss_keep_tokens"] = std::to_string(subset.caption_settings().keep_tokens());
    m["ss_enable_bucket"] = python_bool(settings.enable_bucket());
    m["ss_bucket_no_upscale"] = python_bool(settings.bucket_no_upscale());
    m["ss_min_bucket_reso"] = count_or_none(settings.min_bucket_reso());
    m["ss_max_bucket_reso"] = count_or_none(settings.max_bucket_reso());
    m["ss_skip_image_resolution"] =
        settings.has_skip_image_resolution()
            ? "(" + std::to_string(settings.skip_image_resolution().width()) + ", " +
                  std::to_string(settings.skip_image_resolution().height()) + ")"
            : "None";
    m["ss_bucket_info"] = python_json(bucket_info(buckets, &settings));
  } else {
    // A manifest cached before preprocess described its dataset: the resolution it bucketed at
    // read from the buckets, whose largest area is that resolution squared (kohya's
    // make_bucket_resolutions keeps w * h <= reso^2).
    uint64_t max_area = 0;
    for (const auto& b : buckets) {
      max_area = std::max<uint64_t>(max_area, uint64_t{b.width} * b.height);
    }
    const auto side = static_cast<uint32_t>(
        std::lround(std::sqrt(static_cast<double>(max_area)) / 64.0) * 64);
    out.width = out.height = side;
    m["ss_enable_bucket"] = python_bool(buckets.size() > 1);
    m["ss_bucket_info"] = python_json(bucket_info(buckets, nullptr));
  }
  m["ss_resolution"] = "(" + std::to_string(out.width) + ", " + std::to_string(out.height) + ")";
  return out;
}

}  // namespace lorapipe::trainer
