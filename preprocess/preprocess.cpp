#include "preprocess/preprocess.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <sstream>
#include <string_view>
#include <thread>

#include "common/error.h"
#include "common/hash.h"
#include "preprocess/jpeg.h"
#include "common/log.h"
#include "preprocess/image.h"
#include "proto/wire.h"
#include "runtime/workers.h"

namespace lorapipe::preprocess {
namespace fs = std::filesystem;

namespace {

constexpr std::string_view kLog = "preprocess";
// Bumped when the decode pipeline changes what pixels a transform produces, so caches filled by
// an older lorapipe are never served for it.
// 2: clean JPEGs resize with resize_lanczos3 (Pillow's arithmetic) instead of libvips' reduce.
constexpr int64_t kDecodeVersion = 2;

// A file's bytes, read whole in one read (an istreambuf_iterator copy runs at a fraction of disk
// speed). Not a std::string: that zero-fills every byte before the read overwrites it, which was
// 1.3% of a preprocess run on large JPEGs.
class FileBytes {
 public:
  std::string_view view() const { return {data_.get(), size_}; }
  // Grows to `capacity` bytes, keeping the first size() of them.
  void reserve(size_t capacity) {
    if (capacity <= capacity_) return;
    std::unique_ptr<char[]> grown(new char[capacity]);
    if (size_ > 0) std::memcpy(grown.get(), data_.get(), size_);
    data_ = std::move(grown);
    capacity_ = capacity;
  }
  // Reads to the end of `file`, past the size it was expected to have in case it grew meanwhile.
  void read_all(std::FILE* file) {
    for (;;) {
      if (size_ == capacity_) reserve(std::max<size_t>(capacity_ * 2, 65536));
      const size_t n = std::fread(data_.get() + size_, 1, capacity_ - size_, file);
      if (n == 0) return;
      size_ += n;
    }
  }

 private:
  std::unique_ptr<char[]> data_;
  size_t size_ = 0;
  size_t capacity_ = 0;
};

FileBytes read_file(const fs::path& path) {
  std::FILE* file = std::fopen(path.c_str(), "rb");
  if (file == nullptr) throw InputError(std::string("cannot open: ") + std::strerror(errno));
  std::error_code ec;
  const uintmax_t size = fs::file_size(path, ec);
  FileBytes bytes;
  bytes.reserve(ec ? 0 : size + 1);  // one byte over, so the read that finds the end needs no growth
  bytes.read_all(file);
  const bool failed = std::ferror(file) != 0;
  const int error = errno;
  std::fclose(file);
  if (failed) throw InputError(std::string("cannot read: ") + std::strerror(error));
  return bytes;
}

struct Probed {
  ImageResult result;
  ImageHeader header;
  std::string content_hash;
};

double fraction_from(const std::string& content_hash, uint64_t seed, std::string_view axis) {
  Hasher h;
  h.field(content_hash).field(static_cast<int64_t>(seed)).field(axis);
  return static_cast<double>(h.digest().low >> 11) / static_cast<double>(uint64_t{1} << 53);
}

std::string describe_megapixels(int64_t pixels) {
  char buffer[64];
  std::snprintf(buffer, sizeof(buffer), "%.1f MP", static_cast<double>(pixels) / 1e6);
  return buffer;
}

// Header-level checks and the bucket; no pixel is decoded. Throws InputError with the reason.
Probed probe_one(const ImageEntry& entry, const Discovery& discovery, const Options& options,
                 const std::vector<BucketSelector>& selectors) {
  const FileBytes file = read_file(entry.path);
  const std::string_view bytes = file.view();
  Probed p;
  p.content_hash = hash_bytes(bytes).hex();
  p.header = probe_image(bytes);
  const int w = p.header.width;
  const int h = p.header.height;
  const int64_t pixels = int64_t{w} * h;
  if (pixels > options.max_image_pixels) {
    throw InputError("header says " + std::to_string(w) + "x" + std::to_string(h) + " (" +
                     describe_megapixels(pixels) + "), over --max_image_pixels=" +
                     describe_megapixels(options.max_image_pixels) +
                     ": not decoded (possible decompression bomb)");
  }
  if (std::min(w, h) < options.min_image_side) {
    throw InputError(std::to_string(w) + "x" + std::to_string(h) + ": shorter side under " +
                     "--min_image_side=" + std::to_string(options.min_image_side));
  }
  const double aspect = static_cast<double>(std::max(w, h)) / std::min(w, h);
  if (aspect > options.max_aspect_ratio) {
    char buffer[160];
    std::snprintf(buffer, sizeof(buffer), "%dx%d: aspect ratio %.2f over --max_aspect_ratio=%g",
                  w, h, aspect, options.max_aspect_ratio);
    throw InputError(buffer);
  }
  const DatasetOptions& dataset = discovery.datasets[entry.dataset];
  const SubsetOptions& subset = dataset.subsets[entry.subset];
  const Reso skip = dataset.skip_image_resolution;
  if (skip.width > 0 && pixels <= int64_t{skip.width} * skip.height) {
    throw InputError(std::to_string(w) + "x" + std::to_string(h) + ": no larger than " +
                     "skip_image_resolution " + std::to_string(skip.width) + "x" +
                     std::to_string(skip.height) + " (by area, as kohya compares)");
  }
  std::string why;
  const std::optional<BucketChoice> choice = selectors[entry.dataset].select(w, h, &why);
  if (!choice) throw InputError(std::to_string(w) + "x" + std::to_string(h) + ": " + why);

  ImageResult& r = p.result;
  r.path = entry.path.string();
  r.width = w;
  r.height = h;
  r.bucket = choice->bucket;
  r.resized = choice->resized;
  r.ar_error = choice->ar_error;
  r.crop_ltrb = get_crop_ltrb(r.bucket, {w, h});
  if (subset.random_crop) {
    // kohya draws a new crop every epoch, which cached latents cannot follow; we draw one per
    // image, fixed by its content and --seed, so the cache key stays stable.
    r.crop = crop_offset(r.resized, r.bucket, fraction_from(p.content_hash, options.seed, "x"),
                         fraction_from(p.content_hash, options.seed, "y"));
  } else {
    r.crop = crop_offset(r.resized, r.bucket);
  }
  // A caption that draws nothing is final here, so the cacher encodes what the trainer sees.
  r.augment_caption = subset.draws_from(entry.caption);
  r.caption = r.augment_caption ? entry.caption : subset.fixed_caption(entry.caption);
  r.caption_source = entry.caption_source;
  r.caption_note = entry.caption_note;
  r.caption_read = entry.caption_read;
  r.subset_name = subset.name();
  r.subset_index = static_cast<uint32_t>(entry.subset);
  r.repeats = static_cast<uint32_t>(subset.num_repeats);
  r.is_reg = subset.is_reg;
  r.flip = subset.flip_aug;
  r.alpha_mask = subset.alpha_mask;
  r.resize_filter = subset.resize_filter.empty() ? options.resize_filter : subset.resize_filter;
  r.shuffle_caption = subset.shuffle_caption;
  r.keep_tokens = subset.keep_tokens;
  r.caption_dropout_rate = subset.caption_dropout_rate;
  r.caption_dropout_every_n_epochs = subset.caption_dropout_every_n_epochs;
  r.caption_tag_dropout_rate = subset.caption_tag_dropout_rate;
  r.caption_separator = subset.caption_separator;
  r.keep_tokens_separator = subset.keep_tokens_separator;
  r.secondary_separator = subset.secondary_separator;
  r.enable_wildcard = subset.enable_wildcard;
  r.token_warmup_min = subset.token_warmup_min;
  r.token_warmup_step = subset.token_warmup_step;
  r.batch_size = dataset.batch_size;
  r.dataset_index = static_cast<uint32_t>(entry.dataset);
  r.validation_split = dataset.validation_split;
  r.validation_seed = dataset.validation_seed;
  r.resolution = dataset.buckets.resolution;
  r.image_key = make_image_key(p.content_hash, r, r.resize_filter);
  return p;
}

// A counting gate on decoded images held in memory at once.
class Slots {
 public:
  explicit Slots(int count) : free_(count) {}
  void acquire() {
    std::unique_lock<std::mutex> lock(mutex_);
    cv_.wait(lock, [&] { return free_ > 0; });
    --free_;
  }
  void release() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      ++free_;
    }
    cv_.notify_one();
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  int free_;
};

struct Decoded {
  size_t index = 0;
  std::string pixels;
  std::string alpha;     // with alpha_mask
  std::string error;     // non-empty: skipped
  bool internal = false;  // the error is ours, not the file's: stop the run
};

std::string default_dataset_id(const Options& options) {
  const fs::path source = !options.dataset_config.empty() ? fs::path(options.dataset_config)
                          : !options.in_json.empty()      ? fs::path(options.in_json)
                                                          : fs::path(options.data_dir);
  std::error_code ec;
  fs::path absolute = fs::weakly_canonical(source, ec);
  if (ec) absolute = source;
  std::string name = absolute.filename().string();
  if (name.empty()) name = "dataset";
  std::string identity = absolute.string();
  if (!options.reg_data_dir.empty()) {  // other regularization images, another dataset
    fs::path reg = fs::weakly_canonical(options.reg_data_dir, ec);
    if (ec) reg = options.reg_data_dir;
    identity += "\nreg=" + reg.string();
  }
  if (!options.in_json.empty() && !options.data_dir.empty()) {  // the images the keys name
    fs::path images = fs::weakly_canonical(options.data_dir, ec);
    if (ec) images = options.data_dir;
    identity += "\nimages=" + images.string();
  }
  return name + "-" + hash_bytes(identity).hex().substr(0, 8);
}

// A subset's caption augmentation (SubsetOptions, or the ImageResult that carries its subset's).
template <typename Subset>
wire::CaptionSettings to_caption_settings(const Subset& subset) {
  wire::CaptionSettings c;
  c.set_shuffle_caption(subset.shuffle_caption);
  c.set_keep_tokens(subset.keep_tokens);
  c.set_caption_dropout_rate(subset.caption_dropout_rate);
  c.set_caption_dropout_every_n_epochs(subset.caption_dropout_every_n_epochs);
  c.set_caption_tag_dropout_rate(subset.caption_tag_dropout_rate);
  c.set_caption_separator(subset.caption_separator);
  c.set_keep_tokens_separator(subset.keep_tokens_separator);
  c.set_secondary_separator(subset.secondary_separator);
  c.set_enable_wildcard(subset.enable_wildcard);
  c.set_token_warmup_min(subset.token_warmup_min);
  c.set_token_warmup_step(subset.token_warmup_step);
  return c;
}

wire::ImageSample to_sample(const Report& report, const ImageResult& r) {
  wire::ImageSample s;
  s.set_dataset_id(report.dataset_id);
  s.set_stream_id(report.stream_id);
  s.set_path(r.path);
  s.set_image_key(r.image_key);
  s.mutable_original_size()->set_width(static_cast<uint32_t>(r.width));
  s.mutable_original_size()->set_height(static_cast<uint32_t>(r.height));
  s.mutable_bucket()->set_width(static_cast<uint32_t>(r.bucket.width));
  s.mutable_bucket()->set_height(static_cast<uint32_t>(r.bucket.height));
  s.mutable_resized()->set_width(static_cast<uint32_t>(r.resized.width));
  s.mutable_resized()->set_height(static_cast<uint32_t>(r.resized.height));
  for (double v : {r.crop_ltrb.left, r.crop_ltrb.top, r.crop_ltrb.right, r.crop_ltrb.bottom}) {
    s.add_crop_ltrb(v);
  }
  s.set_crop_left(r.crop.left);
  s.set_crop_top(r.crop.top);
  s.set_flip(r.flip);
  s.set_caption(r.caption);
  s.set_caption_source(r.caption_source);
  s.set_repeats(r.repeats);
  s.set_is_reg(r.is_reg);
  s.set_augment_caption(r.augment_caption);
  *s.mutable_caption_settings() = to_caption_settings(r);
  s.set_batch_size(static_cast<uint32_t>(r.batch_size));
  s.set_dataset_index(r.dataset_index);
  if (r.validation_split) s.set_validation_split(*r.validation_split);
  if (r.validation_seed) s.set_validation_seed(static_cast<uint64_t>(*r.validation_seed));
  s.set_subset_name(r.subset_name);
  s.set_subset_index(r.subset_index);
  s.set_caption_read(r.caption_read);
  s.set_channels(3);
  return s;
}

wire::SubsetSettings to_subset_settings(const SubsetOptions& subset) {
  wire::SubsetSettings s;
  // A folder's name in whatever encoding the file system holds it (its images, if not UTF-8, were
  // skipped by name).
  s.set_name(escape_non_utf8(subset.name()));
  s.set_image_dir(escape_non_utf8(subset.image_dir_name()));
  if (!subset.metadata_file.empty()) {
    s.set_metadata_file(escape_non_utf8(subset.metadata_file.filename().string()));
  }
  s.set_num_repeats(static_cast<uint32_t>(subset.num_repeats));
  s.set_flip_aug(subset.flip_aug);
  s.set_random_crop(subset.random_crop);
  s.set_class_tokens(subset.class_tokens);
  s.set_is_reg(subset.is_reg);
  s.set_caption_prefix(subset.caption_prefix);
  s.set_caption_suffix(subset.caption_suffix);
  s.set_resize_interpolation(subset.resize_interpolation);
  *s.mutable_caption_settings() = to_caption_settings(subset);
  return s;
}

wire::DatasetSource to_dataset_source(const Report& report) {
  wire::DatasetSource out;
  out.set_kind(report.source == Report::Source::kInJson ? wire::DatasetSource::IN_JSON
               : report.source == Report::Source::kDatasetConfig
                   ? wire::DatasetSource::DATASET_CONFIG
                   : wire::DatasetSource::DATA_DIR);
  // kohya's mean_img_ar_error: over a dataset's images (each once, regularization images too).
  std::vector<double> error_sum(report.datasets.size(), 0.0);
  std::vector<uint64_t> images(report.datasets.size(), 0);
  for (const ImageResult& r : report.images) {
    if (r.dataset_index >= report.datasets.size()) continue;
    error_sum[r.dataset_index] += std::abs(r.ar_error);
    ++images[r.dataset_index];
  }
  for (size_t d = 0; d < report.datasets.size(); ++d) {
    const DatasetOptions& dataset = report.datasets[d];
    wire::DatasetSettings* settings = out.add_datasets();
    const Reso& resolution = dataset.buckets.resolution;
    settings->mutable_resolution()->set_width(static_cast<uint32_t>(resolution.width));
    settings->mutable_resolution()->set_height(static_cast<uint32_t>(resolution.height));
    settings->set_enable_bucket(dataset.buckets.enable_bucket);
    // kohya keeps no bucket sizes for a dataset without buckets (None in its metadata).
    if (dataset.buckets.enable_bucket) {
      settings->set_min_bucket_reso(static_cast<uint32_t>(dataset.buckets.min_bucket_reso));
      settings->set_max_bucket_reso(static_cast<uint32_t>(dataset.buckets.max_bucket_reso));
      settings->set_bucket_no_upscale(dataset.buckets.bucket_no_upscale);
    }
    settings->set_batch_size(static_cast<uint32_t>(dataset.batch_size));
    if (dataset.skip_image_resolution.width > 0) {
      settings->mutable_skip_image_resolution()->set_width(
          static_cast<uint32_t>(dataset.skip_image_resolution.width));
      settings->mutable_skip_image_resolution()->set_height(
          static_cast<uint32_t>(dataset.skip_image_resolution.height));
    }
    settings->set_resize_interpolation(dataset.resize_interpolation);
    const bool fine_tuning = !dataset.subsets.empty() && !dataset.subsets[0].metadata_file.empty();
    settings->set_is_dreambooth(!fine_tuning);
    for (const SubsetOptions& subset : dataset.subsets) {
      *settings->add_subsets() = to_subset_settings(subset);
    }
    if (images[d] > 0) settings->set_mean_img_ar_error(error_sum[d] / images[d]);
  }
  *out.mutable_flags() = to_subset_settings(report.flags);
  return out;
}

wire::DatasetReport to_dataset_report(const Report& report) {
  wire::DatasetReport out;
  out.set_dataset_id(report.dataset_id);
  out.set_dataset_id_given(report.dataset_id_given);
  out.set_stream_id(report.stream_id);
  out.set_images_found(report.images_found);
  out.set_images_used(report.images.size());
  uint64_t cached = 0;
  std::map<Reso, uint64_t> buckets;
  for (const ImageResult& r : report.images) {
    cached += r.cached ? 1 : 0;
    buckets[r.bucket] += r.repeats;
  }
  out.set_images_cached(cached);
  out.set_images_sent(report.images.size() - cached);
  for (const Skipped& s : report.skipped) {
    auto* skipped = out.add_skipped();
    skipped->set_path(s.path);
    skipped->set_reason(s.reason);
  }
  for (const auto& [bucket, count] : buckets) {
    auto* b = out.add_buckets();
    b->mutable_bucket()->set_width(static_cast<uint32_t>(bucket.width));
    b->mutable_bucket()->set_height(static_cast<uint32_t>(bucket.height));
    b->set_count(count);
  }
  out.set_captions_missing(report.captions_missing);
  *out.mutable_source() = to_dataset_source(report);
  return out;
}

struct Totals {
  std::map<Reso, std::pair<uint64_t, uint64_t>> buckets;  // images, images x repeats
  double mean_abs_ar_error = 0;
  uint64_t pixels_bucketed = 0;  // training pixels per epoch with buckets
  uint64_t pixels_square = 0;    // ... with every image square-cropped to the resolution
  double kept_bucketed = 0;      // mean fraction of the image kept by the crop
  double kept_square = 0;
};

Totals compute_totals(const Report& report) {
  Totals t;
  double error_sum = 0;
  for (const ImageResult& r : report.images) {
    auto& b = t.buckets[r.bucket];
    b.first += 1;
    b.second += r.repeats;
    error_sum += std::abs(r.ar_error);
    t.pixels_bucketed += uint64_t(r.bucket.width) * r.bucket.height * r.repeats;
    t.pixels_square += uint64_t(r.resolution.width) * r.resolution.height * r.repeats;
    // Fraction of the (cover-resized) image inside the crop.
    t.kept_bucketed += double(r.bucket.width) * r.bucket.height /
                       (double(r.resized.width) * r.resized.height);
    const double square_ar = double(r.resolution.width) / r.resolution.height;
    const double image_ar = double(r.width) / r.height;
    t.kept_square += std::min(square_ar, image_ar) / std::max(square_ar, image_ar);
  }
  if (!report.images.empty()) {
    const double n = static_cast<double>(report.images.size());
    t.mean_abs_ar_error = error_sum / n;
    t.kept_bucketed /= n;
    t.kept_square /= n;
  }
  return t;
}

}  // namespace

std::string make_image_key(const std::string& content_hash, const ImageResult& image,
                           const std::string& resize_filter) {
  Hasher transform;
  transform.field("lorapipe-image-transform")
      .field(kDecodeVersion)
      .field(int64_t{image.bucket.width})
      .field(int64_t{image.bucket.height})
      .field(int64_t{image.resized.width})
      .field(int64_t{image.resized.height})
      .field(int64_t{image.crop.left})
      .field(int64_t{image.crop.top})
      .field(int64_t{image.flip})
      .field(resize_filter)
      .field(image.alpha_mask ? "alpha-mask" : "alpha-on-white");
  return content_hash + "." + transform.digest().hex();
}

Report run(const Options& options) {
  set_jpeg_fast_path(options.jpeg_fast_path);
  init_vips();
  check_resize_filter(options.resize_filter);
  if (!options.in_json.empty()) {
    if (!options.dataset_config.empty()) {
      throw InputError("give one of --in_json (with --train_data_dir) and --dataset_config: a "
                       "dataset TOML names its metadata files in its subsets' metadata_file");
    }
    if (!options.reg_data_dir.empty()) {
      throw InputError("--reg_data_dir does not go with --in_json: kohya's fine-tuning datasets "
                       "have no regularization images");
    }
  } else if (options.data_dir.empty() == options.dataset_config.empty()) {
    throw InputError("give exactly one of --data_dir (kohya's --train_data_dir) and --dataset_config");
  }
  if (!options.reg_data_dir.empty() && options.data_dir.empty()) {
    throw InputError("--reg_data_dir goes with --data_dir; in a --dataset_config, give "
                     "regularization subsets is_reg = true");
  }
  Discovery discovery =
      !options.in_json.empty()
          ? discover_metadata(options.in_json, options.data_dir, options.dataset_repeats,
                              options.defaults)
      : !options.data_dir.empty()
          ? discover_folder(options.data_dir, options.defaults, options.reg_data_dir)
          : discover_toml(options.dataset_config, options.defaults);
  std::vector<BucketSelector> selectors;
  for (const DatasetOptions& d : discovery.datasets) selectors.emplace_back(d.buckets);
  const int threads =
      options.threads > 0 ? options.threads : std::max(1u, std::thread::hardware_concurrency());

  Report report;
  report.dataset_id = options.dataset_id.empty() ? default_dataset_id(options) : options.dataset_id;
  report.dataset_id_given = !options.dataset_id.empty();
  std::random_device entropy;
  for (int i = 0; i < 4; ++i) {
    char word[9];
    std::snprintf(word, sizeof word, "%08x", static_cast<unsigned>(entropy()));
    report.stream_id += word;
  }
  // What was not used is named in UTF-8 whatever the file system's names are (the report is a
  // protobuf message and JSON, both UTF-8).
  report.ignored = discovery.ignored;
  for (Ignored& i : report.ignored) i = {escape_non_utf8(i.path), escape_non_utf8(i.reason)};
  report.skipped = discovery.skipped;
  for (Skipped& k : report.skipped) k = {escape_non_utf8(k.path), escape_non_utf8(k.reason)};
  report.images_found = discovery.images.size() + discovery.skipped.size();
  report.source = !options.in_json.empty()          ? Report::Source::kInJson
                  : !options.dataset_config.empty() ? Report::Source::kDatasetConfig
                                                    : Report::Source::kDataDir;
  report.datasets = discovery.datasets;
  for (size_t d = 0; d < report.datasets.size(); ++d) {
    BucketOptions& buckets = report.datasets[d].buckets;
    if (!buckets.enable_bucket) continue;
    buckets.min_bucket_reso = selectors[d].options().min_bucket_reso;
    buckets.max_bucket_reso = selectors[d].options().max_bucket_reso;
  }
  report.flags = options.defaults.subset;

  // Probe: read, hash, header, checks, bucket. Parallel; no pixel decoded.
  const size_t n = discovery.images.size();
  std::vector<std::optional<Probed>> probed(n);
  std::vector<std::string> reasons(n);
  // Bad input (InputError) skips that one file, named; anything else is our own bug or the
  // machine failing (bad_alloc, "internal: ..."), and stops the run loudly instead of passing
  // for a bad image.
  std::mutex internal_mutex;
  std::string internal_error;
  auto note_internal = [&](const fs::path& path, const std::exception& e) {
    std::lock_guard<std::mutex> lock(internal_mutex);
    if (internal_error.empty()) internal_error = path.string() + ": " + e.what();
  };
  runtime::parallel_for(n, threads, [&](size_t i) {
    try {
      probed[i] = probe_one(discovery.images[i], discovery, options, selectors);
    } catch (const InputError& e) {
      reasons[i] = e.what();
    } catch (const std::exception& e) {
      note_internal(discovery.images[i].path, e);
    }
  });
  if (!internal_error.empty()) throw Error("preprocess failed on " + internal_error);
  std::vector<size_t> usable;
  for (size_t i = 0; i < n; ++i) {
    if (probed[i]) {
      usable.push_back(i);
    } else {
      report.skipped.push_back({discovery.images[i].path.string(), reasons[i]});
      LP_LOG(kWarning, kLog) << "skipped " << discovery.images[i].path.string() << ": "
                             << reasons[i];
    }
  }
  if (usable.empty()) return report;

  // Ask the cacher which samples it already holds.
  std::optional<zmq::context_t> context;
  std::optional<zmq::socket_t> push;
  wire::SocketOptions socket_options;
  socket_options.send_timeout = std::chrono::milliseconds(options.timeout_ms);
  socket_options.receive_timeout = std::chrono::milliseconds(options.timeout_ms);
  if (!options.report_only) {
    context.emplace();
    wire::Client client(*context, options.request_endpoint, "preprocess", socket_options);
    client.hello();
    for (size_t begin = 0; begin < usable.size(); begin += options.has_keys_batch) {
      const size_t end = std::min(usable.size(), begin + options.has_keys_batch);
      wire::HasKeysRequest request;
      for (size_t k = begin; k < end; ++k) request.add_keys(probed[usable[k]]->result.image_key);
      const auto reply = client.request<wire::HasKeysReply>(request);
      if (static_cast<size_t>(reply.present_size()) != end - begin) {
        throw wire::PeerError("cacher at " + options.request_endpoint + " answered " +
                              std::to_string(reply.present_size()) + " flags for " +
                              std::to_string(end - begin) + " keys");
      }
      for (size_t k = begin; k < end; ++k) probed[usable[k]]->result.cached = reply.present(k - begin);
    }
    push.emplace(wire::make_socket(*context, zmq::socket_type::push, socket_options));
    push->connect(options.push_endpoint);
  }
  auto send_or_throw = [&](const google::protobuf::Message& message) {
    if (wire::send(*push, message) != wire::SendStatus::kSent) {
      throw wire::PeerTimeoutError("preprocess: the cacher at " + options.push_endpoint +
                                   " took no " + wire::type_name(message) + " within " +
                                   std::to_string(options.timeout_ms) + " ms");
    }
  };

  // Hits travel key-only; misses (all images in report-only mode, to find broken files) decode.
  std::vector<size_t> to_decode;
  std::vector<bool> failed(n, false);
  for (size_t i : usable) {
    if (probed[i]->result.cached && push) {
      wire::ImageSample sample = to_sample(report, probed[i]->result);
      sample.set_key_only(true);
      send_or_throw(sample);
    } else {
      to_decode.push_back(i);
    }
  }

  // Decode with bounded memory: at most `in_flight` decoded images exist at once.
  const int in_flight = 2 * threads;
  Slots slots(in_flight);
  std::mutex queue_mutex;
  std::condition_variable queue_cv;
  std::deque<Decoded> queue;
  std::atomic<bool> stop{false};
  std::thread producer([&] {
    runtime::parallel_for(to_decode.size(), threads, [&](size_t k) {
      const size_t i = to_decode[k];
      slots.acquire();
      if (stop) return;
      Decoded d;
      d.index = i;
      try {
        const Probed& p = *probed[i];
        const FileBytes file = read_file(discovery.images[i].path);
        const std::string_view bytes = file.view();
        if (hash_bytes(bytes).hex() != p.content_hash) {
          throw InputError("file changed while preprocessing: run again");
        }
        DecodeRequest request;
        request.resized = p.result.resized;
        request.bucket = p.result.bucket;
        request.offset = p.result.crop;
        request.resize_filter = p.result.resize_filter;
        request.alpha_mask = p.result.alpha_mask;
        d.pixels = decode_image(bytes, p.header, request, &d.alpha);
      } catch (const InputError& e) {
        d.error = e.what();
      } catch (const std::exception& e) {
        d.internal = true;
        d.error = e.what();
      }
      {
        std::lock_guard<std::mutex> lock(queue_mutex);
        queue.push_back(std::move(d));
      }
      queue_cv.notify_one();
    });
  });
  try {
    for (size_t done = 0; done < to_decode.size(); ++done) {
      Decoded d;
      {
        std::unique_lock<std::mutex> lock(queue_mutex);
        queue_cv.wait(lock, [&] { return !queue.empty(); });
        d = std::move(queue.front());
        queue.pop_front();
      }
      if (d.internal) {
        throw Error("preprocess failed on " + discovery.images[d.index].path.string() + ": " +
                    d.error);
      }
      if (!d.error.empty()) {
        failed[d.index] = true;
        report.skipped.push_back({discovery.images[d.index].path.string(), d.error});
        LP_LOG(kWarning, kLog) << "skipped " << discovery.images[d.index].path.string() << ": "
                               << d.error;
      } else {
        ++report.decoded;
        if (push) {
          wire::ImageSample sample = to_sample(report, probed[d.index]->result);
          sample.set_pixels(std::move(d.pixels));
          sample.set_alpha_mask(std::move(d.alpha));
          send_or_throw(sample);
        }
      }
      d.pixels.clear();
      d.alpha.clear();
      slots.release();
      if (options.on_progress) options.on_progress(done + 1, to_decode.size());
    }
  } catch (...) {
    // Stop the workers (each waiting one needs a slot to see the flag) before unwinding.
    stop = true;
    for (size_t k = 0; k < to_decode.size(); ++k) slots.release();
    producer.join();
    throw;
  }
  producer.join();

  for (size_t i : usable) {
    if (failed[i]) continue;
    report.images.push_back(probed[i]->result);
    if (probed[i]->result.caption_source != "file") ++report.captions_missing;
  }
  if (push) send_or_throw(to_dataset_report(report));
  return report;
}

std::string format_report(const Report& report) {
  const Totals t = compute_totals(report);
  std::ostringstream out;
  out << "dataset " << report.dataset_id << "\n";
  out << "  bucket        images   with repeats\n";
  for (const auto& [bucket, counts] : t.buckets) {
    char line[96];
    std::snprintf(line, sizeof(line), "  %4d x %-4d %9llu %14llu\n", bucket.width, bucket.height,
                  static_cast<unsigned long long>(counts.first),
                  static_cast<unsigned long long>(counts.second));
    out << line;
  }
  char line[256];
  std::snprintf(line, sizeof(line),
                "images used %zu of %llu found; %zu skipped; %zu ignored; %llu without a caption "
                "file\n",
                report.images.size(), static_cast<unsigned long long>(report.images_found),
                report.skipped.size(), report.ignored.size(),
                static_cast<unsigned long long>(report.captions_missing));
  out << line;
  std::snprintf(line, sizeof(line), "mean |aspect-ratio error| %.4f\n", t.mean_abs_ar_error);
  out << line;
  if (t.pixels_square > 0) {
    std::snprintf(line, sizeof(line),
                  "pixels per epoch %.2f MP bucketed vs %.2f MP square crops (%.3fx); image area "
                  "kept by the crop %.1f%% vs %.1f%%\n",
                  t.pixels_bucketed / 1e6, t.pixels_square / 1e6,
                  static_cast<double>(t.pixels_bucketed) / t.pixels_square,
                  100 * t.kept_bucketed, 100 * t.kept_square);
    out << line;
  }
  for (const Skipped& s : report.skipped) out << "skipped " << s.path << ": " << s.reason << "\n";
  for (const Ignored& s : report.ignored) out << "ignored " << s.path << ": " << s.reason << "\n";
  return out.str();
}

std::string report_to_json(const Report& report) {
  using nlohmann::json;
  const Totals t = compute_totals(report);
  json images = json::array();
  for (const ImageResult& r : report.images) {
    json image{{"path", r.path},
               {"width", r.width},
               {"height", r.height},
               {"bucket", {r.bucket.width, r.bucket.height}},
               {"resized", {r.resized.width, r.resized.height}},
               {"crop_ltrb", {r.crop_ltrb.left, r.crop_ltrb.top, r.crop_ltrb.right, r.crop_ltrb.bottom}},
               {"crop_offset", {r.crop.left, r.crop.top}},
               {"caption", r.caption},
               {"caption_source", r.caption_source},
               {"repeats", r.repeats},
               {"is_reg", r.is_reg},
               {"flip", r.flip},
               {"image_key", r.image_key},
               {"cached", r.cached}};
    if (!r.caption_note.empty()) image["caption_note"] = r.caption_note;
    images.push_back(std::move(image));
  }
  json skipped = json::array();
  for (const Skipped& s : report.skipped) skipped.push_back({{"path", s.path}, {"reason", s.reason}});
  json ignored = json::array();
  for (const Ignored& s : report.ignored) ignored.push_back({{"path", s.path}, {"reason", s.reason}});
  json buckets = json::array();
  for (const auto& [bucket, counts] : t.buckets) {
    buckets.push_back({{"bucket", {bucket.width, bucket.height}},
                       {"count", counts.first},
                       {"count_with_repeats", counts.second}});
  }
  json out{{"dataset_id", report.dataset_id},
           {"images", std::move(images)},
           {"skipped", std::move(skipped)},
           {"ignored", std::move(ignored)},
           {"buckets", std::move(buckets)},
           {"totals",
            {{"images_found", report.images_found},
             {"images_used", report.images.size()},
             {"images_skipped", report.skipped.size()},
             {"captions_missing", report.captions_missing},
             {"mean_abs_ar_error", t.mean_abs_ar_error},
             {"pixels_per_epoch_bucketed", t.pixels_bucketed},
             {"pixels_per_epoch_square", t.pixels_square},
             {"image_area_kept_bucketed", t.kept_bucketed},
             {"image_area_kept_square", t.kept_square}}}};
  return out.dump(2) + "\n";
}

}  // namespace lorapipe::preprocess
