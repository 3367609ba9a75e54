#include "cacher/cacher.h"

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <deque>
#include <filesystem>
#include <mutex>
#include <fstream>
#include <iterator>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <thread>
#include <tuple>

#include "cacher/encode.h"
#include "cacher/keys.h"
#include "cacher/store.h"
#include "common/error.h"
#include "common/hash.h"
#include "common/log.h"
#include "models/device.h"
#include "models/fingerprint.h"
#include "models/placement.h"
#include "models/registry.h"
#include "proto/wire.h"
#include "runtime/stage.h"
#include "runtime/workers.h"

namespace lorapipe::cacher {
namespace fs = std::filesystem;

namespace {

constexpr std::string_view kLog = "cacher";
using Clock = std::chrono::steady_clock;

// Names a manifest by everything that decides its records, so runs over one folder with other
// settings keep their own: each entry's keys (image content . transform . VAE fingerprint, and
// caption . text-encoder fingerprint), its bucket, repeats, caption settings and flags, and the
// fingerprints. Entries arrive in the order preprocess finishes them, so they are hashed as a
// sorted set. 12 hex digits (48 bits): a collision needs ~16 million settings of one dataset.
std::string manifest_hash(const wire::Manifest& manifest) {
  std::vector<std::string> entries;
  for (const auto& entry : manifest.entries()) entries.push_back(entry.SerializeAsString());
  std::sort(entries.begin(), entries.end());
  Hasher hasher;
  hasher.field("manifest v1").field(manifest.vae_fingerprint());
  hasher.field(manifest.text_encoder_fingerprint()).field(manifest.text_cached() ? 1 : 0);
  for (const std::string& entry : entries) hasher.field(entry);
  hasher.field(manifest.source().SerializeAsString());
  return hasher.digest().hex().substr(0, 12);
}

// What a manifest named by default (no --dataset_id) caches, but for its contents: the dataset's
// default id (its folder, or its TOML's path), the folders its images are in (a TOML edited to
// name another subject's folders is another dataset), the model's fingerprints and every
// setting. A later manifest of the same series is the same dataset cached again after its images
// or captions changed (--gc --drop_superseded drops the earlier ones).
std::string manifest_series(const std::string& default_id, const wire::Manifest& manifest) {
  std::set<std::string> folders;
  for (const auto& e : manifest.entries()) {
    folders.insert(std::filesystem::path(e.path()).parent_path().string());
  }
  Hasher hasher;
  hasher.field("manifest series v2").field(default_id).field(manifest.model_family());
  for (const std::string& folder : folders) hasher.field(folder);
  hasher.field(manifest.vae_fingerprint()).field(manifest.text_encoder_fingerprint());
  // The source's settings without what the images made of them (mean_img_ar_error).
  wire::DatasetSource settings = manifest.source();
  for (wire::DatasetSettings& d : *settings.mutable_datasets()) d.clear_mean_img_ar_error();
  hasher.field(manifest.text_cached() ? 1 : 0).field(settings.SerializeAsString());
  return hasher.digest().hex();
}

// The stage's state for one stream.
class Cacher {
 public:
  explicit Cacher(const Options& options) : options_(options) {
    StoreOptions store_options;
    store_options.dir = options.cache_dir.empty() ? default_cache_dir() : options.cache_dir;
    store_options.max_map_bytes = options.max_map_bytes;
    store_options.wait_for_writer_s = options.wait_for_writer_s;
    store_.emplace(Store::open(store_options));

    // Built on the CPU in the compute dtype, then placed: the cacher needs the VAE and the text
    // encoders, both in --dtype (what their fingerprints are taken in).
    models::LoadOptions load;
    load.family = options.model_family;
    load.dtype = models::parse_precision(options.dtype, "--dtype");
    load.tokenizer = options.tokenizer;
    load.load_denoiser = false;
    load.vae = options.vae;
    load.parts = options.model_parts;
    // SDXL's VAE and FLUX.1's AE overflow in fp16: fp32 unless --vae gives another VAE (SDXL's
    // fixed fp16 one; kohya's --no_half_vae).
    load.vae_dtype = models::vae_compute_dtype(
        models::model_family(models::detect_family(options.model, options.model_family).family),
        load.dtype, !options.vae.empty(), options.no_half_vae);
    model_ = models::load_model(options.model, load);
    models::Placement placement;
    placement.device = models::resolve_device(options.device);
    placement.dtype = load.dtype;
    placement.vae_dtype = load.vae_dtype;
    placement.fp8_text_encoders = options.fp8_base && !options.fp8_base_unet;
    placement.fp8_scaled = options.fp8_scaled;
    models::place(*model_, placement);
    // Fingerprints of what is loaded, in the compute dtype, with the settings that shape the
    // output: another VAE, dtype, clip skip or tokenizer gives other keys. Everything below goes
    // through the family interface (models/diffusion_model.h).
    models::DiffusionModel& model = *model_;
    latents_.emplace(model, models::vae_encoder_fingerprint(model.vae_module()));
    latents_->out_of_memory_for_testing = options.test_oom_latent_batches;
    texts_.emplace(model,
                   models::weights_fingerprint(
                       model.text_encoder_module(),
                       model.text_encoder_settings(options.clip_skip, options.max_token_length)),
                   options.clip_skip, options.max_token_length);
    LP_LOG(kInfo, kLog) << "cache " << store_->dir().string() << ", model " << model_->source()
                        << " on " << models::describe_device(placement.device) << ", VAE "
                        << latents_->fingerprint().substr(0, 12) << ", text encoder "
                        << texts_->fingerprint().substr(0, 12);
  }

  Summary run();

 private:
  // Encoding runs on a worker (runtime::WorkerPool), so the main loop keeps answering HasKeys
  // and GetRecords (other runs' preprocess and trainers) while the VAE or the text encoder
  // works, also while a stream's last batches encode after its end. A job is one bucket's batch
  // or one batch of captions; the worker writes its records and leaves the counts for the main
  // loop, which alone touches the sockets and the summary. A job's failure is rethrown on the
  // main loop by collect(). Jobs are numbered as they are made; a stream's manifest is written
  // once every job made before its end has run.
  struct Caption {
    std::string stream;  // whose count it adds to
    std::string text;
  };
  struct Job {
    std::vector<wire::ImageSample> samples;  // a latent batch, or
    std::vector<Caption> captions;           // a text batch
  };
  struct Counts {
    uint64_t encoded = 0, rejected = 0, texts_encoded = 0, text_bytes = 0;
  };
  struct Done {  // what finished jobs left for the main loop
    std::map<std::string, Counts> streams;  // by stream_id
    std::vector<std::string> rejected_keys, rejected_text_keys;
    std::vector<uint64_t> jobs;  // their numbers
    std::vector<std::string> failures;  // serve: jobs that failed (a write the disk refused)
  };
  // One preprocess run's stream, from its first sample to its DatasetReport. A serving cacher
  // may be fed by several runs at once (other datasets, or one folder at other settings); each
  // gets its own entries, counts and manifest.
  struct Stream {
    std::string id;
    std::vector<wire::ManifestEntry> entries;
    std::vector<bool> hit;               // entries[i]'s latent was cached before (else encoded)
    std::set<std::string> texts_seen;    // text keys counted for this stream
    bool all_text_cached = true;
    Summary summary;
    Clock::time_point started = Clock::now();
    Clock::time_point last_sample = Clock::now();
    // Set by its DatasetReport: the stream has ended, and its manifest waits for the jobs
    // numbered below `jobs_before` (its last batches among them).
    std::optional<wire::DatasetReport> report;
    uint64_t jobs_before = 0;
    // Serve: why a job failed while the stream was open (its records may be missing): the
    // stream ends without a manifest, and the cacher goes on serving the others.
    std::string failed;
  };
  static constexpr size_t kMaxQueuedJobs = 2;  // then the stream waits (ZeroMQ's backpressure)
  void run_job(Job& job, Done& done);
  void submit(Job job);  // numbers the job and queues it; never waits
  void pump();           // hands queued jobs to the worker while it has room
  bool busy() const;     // jobs queued, waiting for the worker or running
  void collect();        // merges Done into the summary, writes ready manifests; rethrows a
                         // worker's failure

  // Reads the stream and answers requests until the stream's end (forever with serve).
  void serve_loop(runtime::SocketLoop& loop);
  void on_sample(const wire::ImageSample& sample);
  std::string check_sample(const wire::ImageSample& sample) const;
  void flush_bucket(std::vector<wire::ImageSample>& pending);
  void flush_texts();
  void finish(const wire::DatasetReport& report);  // the stream's end: its last batches go
  void write_manifest(Stream& stream);              // once they have run
  Stream& stream(const std::string& id, const std::string& dataset_id);
  void drop_abandoned_streams();  // serve: streams whose preprocess went silent
  std::unique_ptr<wire::HasKeysReply> has_keys(const wire::HasKeysRequest& request);
  std::unique_ptr<wire::GetRecordsReply> get_records(const wire::GetRecordsRequest& request);
  void publish_report(const Stream& stream, bool done);

  Options options_;
  std::optional<Store> store_;
  std::unique_ptr<models::DiffusionModel> model_;
  std::optional<LatentEncoder> latents_;
  std::optional<TextEncoder> texts_;
  std::optional<zmq::socket_t> pub_;

  std::map<std::pair<uint32_t, uint32_t>, std::vector<wire::ImageSample>> pending_;
  std::vector<Caption> pending_texts_;
  std::deque<std::pair<uint64_t, Job>> backlog_;  // numbered jobs the worker has no room for yet
  uint64_t next_job_ = 0;                         // the next job's number
  std::set<uint64_t> unfinished_jobs_;            // numbers in the backlog or with the worker
  std::set<std::string> queued_texts_;  // text keys found or queued while a stream is open
  std::map<std::string, Stream> streams_;  // open streams, by stream_id
  // Streams dropped as abandoned: what they send later is refused, never a new partial stream.
  std::set<std::string> dropped_streams_;
  // Content keys that did not encode (not finite, or out of memory alone): no record is written,
  // and no manifest names them while the store holds none (write_manifest looks again).
  std::set<std::string> rejected_keys_, rejected_text_keys_;
  Summary summary_;  // of the newest finished stream: what run() returns
  bool stream_done_ = false;

  std::mutex done_mutex_;
  Done done_;
  std::optional<runtime::StatusPublisher> status_;
  std::optional<runtime::WorkerPool> workers_;  // last: goes first, before what its jobs use
};

// Empty when `s` can be batched with its bucket: an image key that makes a storable latent key,
// a bucket of whole latent cells and, unless it is key-only, exactly bucket.width x bucket.height x 3 bytes of RGB; else the reason.
std::string Cacher::check_sample(const wire::ImageSample& s) const {
  if (s.image_key().empty()) return "no image key";
  if (latent_key(s.image_key(), latents_->fingerprint()).size() > kMaxKeyBytes) {
    return "an image key of " + std::to_string(s.image_key().size()) +
           " bytes (its latent key would pass LMDB's " + std::to_string(kMaxKeyBytes) +
           "-byte limit)";
  }
  const uint64_t w = s.bucket().width(), h = s.bucket().height();
  if (w == 0 || h == 0 || w % 8 != 0 || h % 8 != 0) {
    return "bucket " + std::to_string(w) + "x" + std::to_string(h) +
           " is not a positive multiple of 8 on each side";
  }
  if (s.key_only()) return "";
  if (s.channels() != 3) return std::to_string(s.channels()) + " channels (RGB, 3, expected)";
  if (s.pixels().size() != w * h * 3) {
    return std::to_string(s.pixels().size()) + " pixel bytes for a " + std::to_string(w) + "x" +
           std::to_string(h) + " bucket (" + std::to_string(w * h * 3) + " expected)";
  }
  if (!s.alpha_mask().empty() && s.alpha_mask().size() != w * h) {
    return std::to_string(s.alpha_mask().size()) + " alpha-mask bytes for a " +
           std::to_string(w) + "x" + std::to_string(h) + " bucket (" + std::to_string(w * h) +
           " expected)";
  }
  return "";
}

Cacher::Stream& Cacher::stream(const std::string& id, const std::string& dataset_id) {
  Stream& stream = streams_[id];
  stream.id = id;
  if (stream.summary.dataset_id.empty()) stream.summary.dataset_id = dataset_id;
  return stream;
}

void Cacher::drop_abandoned_streams() {
  const auto now = Clock::now();
  for (auto it = streams_.begin(); it != streams_.end();) {
    if (it->second.report ||  // ended: its manifest waits only for our own batches
        now - it->second.last_sample <= std::chrono::milliseconds(options_.idle_timeout_ms)) {
      ++it;
      continue;
    }
    // Its preprocess stopped before the end of its stream (killed, or its machine gone): no
    // manifest can be written. What it sent stays cached for the run that sends it again.
    LP_LOG(kWarning, kLog) << "dataset " << it->second.summary.dataset_id << ": nothing more for "
                           << options_.idle_timeout_ms / 1000 << " s and no end of its stream; "
                           << "dropped without a manifest (" << it->second.entries.size()
                           << " images so far)";
    dropped_streams_.insert(it->first);
    it = streams_.erase(it);
  }
  if (streams_.empty()) queued_texts_.clear();
}

void Cacher::on_sample(const wire::ImageSample& s) {
  if (dropped_streams_.count(s.stream_id())) {
    LP_LOG(kWarning, kLog) << "rejected " << s.path() << ": its stream (dataset " << s.dataset_id()
                           << ") was dropped after a silence; run its preprocess again";
    return;
  }
  Stream& stream = this->stream(s.stream_id(), s.dataset_id());
  stream.last_sample = Clock::now();
  std::string why = check_sample(s);
  if (why.empty() && stream.report) why = "it came after the end of its stream";
  if (!why.empty()) {
    // Rejected on arrival, alone: a sample that cannot join its bucket's batch must not poison
    // the batch it would have joined.
    ++stream.summary.rejected;
    LP_LOG(kWarning, kLog) << "rejected " << s.path() << ": " << why;
    publish_report(stream, false);
    return;
  }
  wire::ManifestEntry entry;
  entry.set_latent_key(latent_key(s.image_key(), latents_->fingerprint()));
  *entry.mutable_bucket() = s.bucket();
  entry.set_repeats(s.repeats());
  entry.set_caption(s.caption());
  entry.set_is_reg(s.is_reg());
  entry.set_flip(s.flip());
  entry.set_path(s.path());
  *entry.mutable_caption_settings() = s.caption_settings();
  entry.set_batch_size(s.batch_size());
  entry.set_dataset_index(s.dataset_index());
  entry.set_subset_name(s.subset_name());
  entry.set_subset_index(s.subset_index());
  entry.set_caption_read(s.caption_read());
  if (s.has_validation_split()) entry.set_validation_split(s.validation_split());
  if (s.has_validation_seed()) entry.set_validation_seed(s.validation_seed());
  if (s.augment_caption()) {
    stream.all_text_cached = false;  // the trainer encodes this caption online, augmented each step
  } else {
    const std::string key = text_key(s.caption(), texts_->fingerprint());
    entry.set_text_key(key);
    if (stream.texts_seen.insert(key).second) {
      if (queued_texts_.count(key)) {
        ++stream.summary.texts_cached;  // another stream's caption: cached or on its way
      } else {
        queued_texts_.insert(key);
        if (store_->contains_many(Table::kTexts, {key})[0]) {
          ++stream.summary.texts_cached;
        } else {
          pending_texts_.push_back({s.stream_id(), s.caption()});
          if (static_cast<int>(pending_texts_.size()) >= options_.text_batch_size) flush_texts();
        }
      }
    }
  }
  stream.entries.push_back(std::move(entry));
  stream.hit.push_back(false);

  if (s.key_only() ||
      store_->contains_many(Table::kLatents, {stream.entries.back().latent_key()})[0]) {
    stream.hit.back() = true;
    ++stream.summary.hits;
    return;
  }
  auto& bucket = pending_[{s.bucket().width(), s.bucket().height()}];
  bucket.push_back(s);
  if (static_cast<int>(bucket.size()) >= options_.vae_batch_size) flush_bucket(bucket);
}

void Cacher::flush_bucket(std::vector<wire::ImageSample>& pending) {
  if (pending.empty()) return;
  Job job;
  job.samples = std::move(pending);
  pending.clear();
  submit(std::move(job));
}

void Cacher::flush_texts() {
  if (pending_texts_.empty()) return;
  Job job;
  job.captions = std::move(pending_texts_);
  pending_texts_.clear();
  submit(std::move(job));
}

void Cacher::submit(Job job) {
  const uint64_t number = next_job_++;
  unfinished_jobs_.insert(number);
  backlog_.emplace_back(number, std::move(job));
  pump();
}

void Cacher::pump() {
  // The stream is read only while the worker has room and the backlog is empty, so the backlog
  // holds at most what one sample or one stream's end flushes.
  while (!backlog_.empty() && !workers_->full()) {
    const uint64_t number = backlog_.front().first;
    Job job = std::move(backlog_.front().second);
    backlog_.pop_front();
    workers_->submit([this, number, job = std::move(job)]() mutable {
      Done done;
      std::string failure;
      try {
        run_job(job, done);
      } catch (const c10::Error&) {
        throw;  // the model's or the device's: it would fail every stream after it too
      } catch (const std::exception& e) {
        // A serving cacher outlives one dataset's failure (a full disk, the map at its limit):
        // the trainers it serves keep reading what is stored. Alone, the failure ends the run.
        if (!options_.serve) throw;
        failure = e.what();
        done = Done{};
      }
      std::lock_guard<std::mutex> lock(done_mutex_);
      done_.jobs.push_back(number);
      if (!failure.empty()) done_.failures.push_back(failure);
      for (const auto& [id, counts] : done.streams) {
        Counts& into = done_.streams[id];
        into.encoded += counts.encoded;
        into.rejected += counts.rejected;
        into.texts_encoded += counts.texts_encoded;
        into.text_bytes += counts.text_bytes;
      }
      done_.rejected_keys.insert(done_.rejected_keys.end(), done.rejected_keys.begin(),
                                 done.rejected_keys.end());
      done_.rejected_text_keys.insert(done_.rejected_text_keys.end(),
                                      done.rejected_text_keys.begin(),
                                      done.rejected_text_keys.end());
    });
  }
}

bool Cacher::busy() const { return !backlog_.empty() || workers_->pending() > 0; }

void Cacher::run_job(Job& job, Done& done) {
  torch::NoGradGuard no_grad;  // thread-local: this thread's own
  std::vector<std::pair<std::string, std::string>> records;
  if (!job.samples.empty()) {
    std::vector<const wire::ImageSample*> batch;
    for (const auto& s : job.samples) batch.push_back(&s);
    std::vector<EncodedRecord> encoded = encode_fitting(*latents_, batch);
    if (options_.delay_per_batch_s > 0) {
      std::this_thread::sleep_for(std::chrono::duration<double>(options_.delay_per_batch_s));
    }
    for (size_t i = 0; i < encoded.size(); ++i) {
      EncodedRecord& r = encoded[i];
      Counts& counts = done.streams[batch[i]->stream_id()];
      if (!r.rejected.empty()) {
        // kohya stops the whole run here; one bad image costs only itself.
        ++counts.rejected;
        done.rejected_keys.push_back(r.key);
        LP_LOG(kWarning, kLog) << "rejected " << batch[i]->path() << ": " << r.rejected;
        continue;
      }
      ++counts.encoded;
      records.emplace_back(std::move(r.key), std::move(r.record));
    }
    store_->put(Table::kLatents, records);  // one transaction per batch
    return;
  }
  std::vector<std::string> captions;
  for (const Caption& c : job.captions) captions.push_back(c.text);
  std::vector<EncodedRecord> encoded = encode_fitting(*texts_, captions);
  for (size_t i = 0; i < encoded.size(); ++i) {
    EncodedRecord& r = encoded[i];
    if (!r.rejected.empty()) {
      // Its images leave the manifest (finish()); the caption is named, as a path would be.
      done.rejected_text_keys.push_back(r.key);
      LP_LOG(kWarning, kLog) << "rejected the caption \"" << captions[i] << "\": " << r.rejected;
      continue;
    }
    ++done.streams[job.captions[i].stream].texts_encoded;
    done.streams[job.captions[i].stream].text_bytes += r.record.size();
    records.emplace_back(std::move(r.key), std::move(r.record));
  }
  store_->put(Table::kTexts, records);
}

void Cacher::collect() {
  workers_->rethrow_failure();
  Done done;
  {
    std::lock_guard<std::mutex> lock(done_mutex_);
    std::swap(done, done_);
  }
  rejected_keys_.insert(done.rejected_keys.begin(), done.rejected_keys.end());
  rejected_text_keys_.insert(done.rejected_text_keys.begin(), done.rejected_text_keys.end());
  for (uint64_t number : done.jobs) unfinished_jobs_.erase(number);
  for (const std::string& failure : done.failures) {
    LP_LOG(kError, kLog) << "an encoding job failed: " << failure;
    // The store failed a write: every open stream writes there, and a caption one stream
    // encodes another may count as on its way, so none of them can be trusted whole.
    for (auto& [id, stream] : streams_) {
      if (stream.failed.empty()) stream.failed = failure;
    }
    queued_texts_.clear();  // texts it was to write may be missing: later streams look again
  }
  pump();
  if (!done.streams.empty()) {
    for (const auto& [id, counts] : done.streams) {
      const auto it = streams_.find(id);
      if (it == streams_.end()) continue;  // a stream dropped as abandoned
      Summary& summary = it->second.summary;
      summary.encoded += counts.encoded;
      summary.rejected += counts.rejected;
      summary.texts_encoded += counts.texts_encoded;
      summary.text_bytes += counts.text_bytes;
      publish_report(it->second, false);
    }
    // Images settled so far in the open streams; the total is known only at a stream's end.
    uint64_t settled = 0;
    for (const auto& [id, stream] : streams_) {
      settled += stream.summary.encoded + stream.summary.hits + stream.summary.rejected;
    }
    status_->progress(settled, 0, "images");
  }
  // Ended streams whose last batches have run, with their counts merged above.
  for (auto it = streams_.begin(); it != streams_.end();) {
    Stream& stream = (it++)->second;  // write_manifest erases it
    if (stream.report &&
        (unfinished_jobs_.empty() || *unfinished_jobs_.begin() >= stream.jobs_before)) {
      write_manifest(stream);
    }
  }
}

void Cacher::finish(const wire::DatasetReport& report) {
  if (dropped_streams_.count(report.stream_id())) {
    LP_LOG(kWarning, kLog) << "dataset " << report.dataset_id()
                           << ": its stream was dropped after a silence, so no manifest is "
                              "written; run its preprocess again (what was cached stays)";
    return;
  }
  // This stream's waiting samples go now, in batches of their own; other streams' keep waiting
  // for full batches.
  for (auto& [bucket, pending] : pending_) {
    std::vector<wire::ImageSample> mine, others;
    for (auto& s : pending) {
      (s.stream_id() == report.stream_id() ? mine : others).push_back(std::move(s));
    }
    pending = std::move(others);
    flush_bucket(mine);
  }
  flush_texts();
  // A report with no samples before it (an empty dataset) opens and ends its stream here.
  Stream& stream = this->stream(report.stream_id(), report.dataset_id());
  if (stream.report) {
    LP_LOG(kWarning, kLog) << "dataset " << report.dataset_id()
                           << ": a second end of its stream, ignored";
    return;
  }
  // Every record is written before the manifest that names them: the manifest waits for every
  // job made so far (this stream's last batches, and any caption of another stream that this
  // one counted as on its way). Meanwhile the loop answers requests and reads other streams.
  stream.report = report;
  stream.jobs_before = next_job_;
  collect();
}

void Cacher::write_manifest(Stream& stream) {
  const wire::DatasetReport& report = *stream.report;
  Summary& summary = stream.summary;
  auto end_without_manifest = [&](const std::string& why) {
    LP_LOG(kError, kLog) << "dataset " << summary.dataset_id << ": no manifest is written (" << why
                         << "); what was stored stays, and the cacher goes on serving: run its "
                            "preprocess again once the cause is gone";
    publish_report(stream, false);  // not done: a done report names a manifest that exists
    const std::string id = stream.id;
    streams_.erase(id);  // `stream` ends here
    if (streams_.empty()) queued_texts_.clear();
  };
  if (!stream.failed.empty()) return end_without_manifest(stream.failed);
  // A key rejected once whose record is in the store now (it ran out of memory in an earlier
  // stream, then encoded; or another cacher on a shared cache wrote it) is no longer rejected:
  // the sets only keep manifests from naming records that do not exist.
  for (auto [set, table, text] : {std::tuple{&rejected_keys_, Table::kLatents, false},
                                  std::tuple{&rejected_text_keys_, Table::kTexts, true}}) {
    std::vector<std::string> keys;
    for (const wire::ManifestEntry& entry : stream.entries) {
      const std::string& key = text ? entry.text_key() : entry.latent_key();
      if (!key.empty() && set->count(key)) keys.push_back(key);
    }
    if (keys.empty()) continue;
    const std::vector<bool> stored = store_->contains_many(table, keys);
    for (size_t i = 0; i < keys.size(); ++i) {
      if (stored[i]) set->erase(keys[i]);
    }
  }
  // Entries whose caption did not encode to finite values leave: each would name a text record
  // that does not exist, and the trainer's pre-flight would refuse the whole dataset. The image
  // counts once, as rejected (no longer as encoded or cached).
  std::vector<wire::ManifestEntry> entries;
  for (size_t i = 0; i < stream.entries.size(); ++i) {
    wire::ManifestEntry& entry = stream.entries[i];
    if (!rejected_keys_.count(entry.latent_key()) && !entry.text_key().empty() &&
        rejected_text_keys_.count(entry.text_key())) {
      ++summary.rejected;
      --(stream.hit[i] ? summary.hits : summary.encoded);
      LP_LOG(kWarning, kLog) << "rejected " << entry.path() << ": its caption \""
                             << entry.caption() << "\" did not encode to finite values";
      continue;
    }
    entries.push_back(std::move(entry));
  }
  wire::Manifest manifest;
  manifest.set_text_cached(stream.all_text_cached);
  manifest.set_model_family(model_->model_family().name);
  manifest.set_vae_fingerprint(latents_->fingerprint());
  manifest.set_text_encoder_fingerprint(texts_->fingerprint());
  *manifest.mutable_source() = report.source();
  // Entries arrive in the order preprocess's workers finish them, which changes from run to run.
  // Written in one fixed order instead (dataset, image path, then what tells apart the entries of
  // one image), so a dataset cached twice gives the same manifest, and the trainer the same
  // validation split and batches from the same seed.
  std::sort(entries.begin(), entries.end(),
            [](const wire::ManifestEntry& a, const wire::ManifestEntry& b) {
              return std::forward_as_tuple(a.dataset_index(), a.path(), a.is_reg(), a.flip(),
                                           a.caption(), a.latent_key(), a.text_key()) <
                     std::forward_as_tuple(b.dataset_index(), b.path(), b.is_reg(), b.flip(),
                                           b.caption(), b.latent_key(), b.text_key());
            });
  for (auto& entry : entries) {
    if (rejected_keys_.count(entry.latent_key())) continue;
    *manifest.add_entries() = std::move(entry);
  }
  const std::string default_id = summary.dataset_id;
  if (!report.dataset_id_given()) summary.dataset_id += "-" + manifest_hash(manifest);
  manifest.set_dataset_id(summary.dataset_id);
  summary.manifest_entries = static_cast<uint64_t>(manifest.entries_size());
  try {
    store_->put(Table::kManifests, {{summary.dataset_id, manifest.SerializeAsString()}});
  } catch (const std::exception& e) {
    if (!options_.serve) throw;
    return end_without_manifest(e.what());
  }
  if (!report.dataset_id_given()) {
    // When, and of which series: what --gc --drop_superseded reads. A manifest without it (a
    // failed write here, or a cache older than it) is never taken for superseded.
    const nlohmann::json written{
        {"series", manifest_series(default_id, manifest)},
        {"unix_ms", std::chrono::duration_cast<std::chrono::milliseconds>(
                        std::chrono::system_clock::now().time_since_epoch())
                        .count()}};
    try {
      store_->put(Table::kMeta,
                  {{std::string(kMetaManifestWritten) + summary.dataset_id, written.dump()}});
    } catch (const std::exception& e) {
      LP_LOG(kWarning, kLog) << "dataset " << summary.dataset_id << ": when it was cached is not "
                             << "recorded (" << e.what() << "): --gc --drop_superseded keeps it";
    }
  }
  const double seconds = std::chrono::duration<double>(Clock::now() - stream.started).count();
  summary.images_per_second = seconds > 0 ? summary.encoded / seconds : 0;
  LP_LOG(kInfo, kLog) << "dataset " << summary.dataset_id << ": " << summary.encoded
                      << " encoded, " << summary.hits << " cached, " << summary.rejected
                      << " rejected; texts " << summary.texts_encoded << " encoded"
                      << (summary.texts_encoded > 0
                              ? " (" + std::to_string(summary.text_bytes / summary.texts_encoded) +
                                    " bytes per caption)"
                              : std::string())
                      << ", " << summary.texts_cached << " cached; manifest of "
                      << summary.manifest_entries << " entries written";
  publish_report(stream, true);
  summary_ = summary;
  const std::string id = stream.id;
  streams_.erase(id);  // `stream` and `report` end here
  if (streams_.empty()) queued_texts_.clear();  // a later stream counts its own cached texts
  stream_done_ = true;
}

std::unique_ptr<wire::HasKeysReply> Cacher::has_keys(const wire::HasKeysRequest& request) {
  // Image keys (content . transform) from preprocess; the latent key adds our fingerprint.
  std::vector<std::string> keys;
  for (const std::string& image_key : request.keys()) {
    keys.push_back(latent_key(image_key, latents_->fingerprint()));
  }
  auto reply = std::make_unique<wire::HasKeysReply>();
  for (bool present : store_->contains_many(Table::kLatents, keys)) reply->add_present(present);
  return reply;
}

std::unique_ptr<wire::GetRecordsReply> Cacher::get_records(const wire::GetRecordsRequest& request) {
  Table table = Table::kLatents;
  if (request.kind() == wire::GetRecordsRequest::TEXT) table = Table::kTexts;
  if (request.kind() == wire::GetRecordsRequest::MANIFEST) table = Table::kManifests;
  const std::vector<std::string> keys(request.keys().begin(), request.keys().end());
  auto reply = std::make_unique<wire::GetRecordsReply>();
  const auto values = store_->get_many(table, keys);
  for (size_t i = 0; i < keys.size(); ++i) {
    auto* item = reply->add_items();
    item->set_key(keys[i]);
    item->set_found(values[i].has_value());
    if (values[i]) item->set_record(*values[i]);
  }
  return reply;
}

void Cacher::publish_report(const Stream& stream, bool done) {
  if (!pub_) return;
  const Summary& summary = stream.summary;
  wire::CacheReport report;
  report.set_dataset_id(summary.dataset_id);
  report.set_stream_id(stream.id);
  report.set_encoded(summary.encoded);
  report.set_hits(summary.hits);
  report.set_rejected(summary.rejected);
  const double seconds = std::chrono::duration<double>(Clock::now() - stream.started).count();
  report.set_images_per_second(seconds > 0 ? summary.encoded / seconds : 0);
  report.set_done(done);
  (void)wire::send(*pub_, report);  // PUB never blocks; nobody listening is fine
}

Summary Cacher::run() {
  zmq::context_t context;
  wire::SocketOptions socket_options;
  zmq::socket_t pull = wire::make_socket(context, zmq::socket_type::pull, socket_options);
  zmq::socket_t rep = wire::make_socket(context, zmq::socket_type::rep, socket_options);
  wire::Dispatcher stream("cacher");
  wire::Dispatcher requests("cacher");
  stream.watch(context, pull);
  pull.bind(options_.pull_endpoint);
  rep.bind(options_.rep_endpoint);
  // pub_ outlives this function; it must close before `context`, whose end waits for every
  // socket of it (else the cacher hangs at exit once the stream is done).
  struct ClosePub {
    std::optional<zmq::socket_t>& pub;
    ~ClosePub() { pub.reset(); }
  } close_pub{pub_};
  if (!options_.pub_endpoint.empty()) {
    pub_.emplace(wire::make_socket(context, zmq::socket_type::pub, socket_options));
    pub_->bind(options_.pub_endpoint);
  }
  status_.emplace(pub_ ? &*pub_ : nullptr, std::string(kLog));
  status_->ready();
  stream.on<wire::ImageSample>([this](const wire::ImageSample& s) { on_sample(s); });
  stream.on<wire::DatasetReport>([this, &stream](const wire::DatasetReport& r) {
    stream.peer_finished();  // its preprocess leaves now: no warning for that
    finish(r);
  });
  requests.on_request<wire::HasKeysRequest>(
      [this](const wire::HasKeysRequest& r) -> wire::Dispatcher::Reply { return has_keys(r); });
  requests.on_request<wire::GetRecordsRequest>(
      [this](const wire::GetRecordsRequest& r) -> wire::Dispatcher::Reply {
        return get_records(r);
      });
  requests.on_request<wire::ListManifestsRequest>(
      [this](const wire::ListManifestsRequest& r) -> wire::Dispatcher::Reply {
        auto reply = std::make_unique<wire::ListManifestsReply>();
        store_->for_each(Table::kManifests, [&](std::string_view key, std::string_view) {
          if (key.substr(0, r.prefix().size()) == r.prefix()) reply->add_names(std::string(key));
          return true;
        });
        return reply;
      });
  LP_LOG(kInfo, kLog) << "listening: samples on " << options_.pull_endpoint << ", requests on "
                      << options_.rep_endpoint;

  workers_.emplace(/*threads=*/1, kMaxQueuedJobs);
  struct StopWorkers {  // also on the way out of an error: drops what is queued, joins
    std::optional<runtime::WorkerPool>& workers;
    ~StopWorkers() { workers.reset(); }
  } stop_workers{workers_};
  runtime::SocketLoop loop;
  loop.add(rep, requests, /*reply=*/true);
  // The stream is read only while the worker has room; requests are answered always.
  loop.add(pull, stream, /*reply=*/false,
           [this] { return backlog_.empty() && !workers_->full(); });

  try {
    serve_loop(loop);
  } catch (const std::exception& e) {
    status_->error(e.what());
    throw;
  }
  status_->done("manifest " + summary_.dataset_id + " written");
  return summary_;
}

void Cacher::serve_loop(runtime::SocketLoop& loop) {
  auto last_message = Clock::now();
  while (options_.serve || !stream_done_) {
    // While jobs run, the loop wakes often to hand the worker the next one and to write a
    // manifest whose batches are done.
    // While the worker has no room the stream is not read: that is our silence, not the
    // streams'. Judged before the poll and after it, so a stream whose samples wait unread in
    // the socket is never dropped in the loop that frees the worker.
    const bool blocked_before = !backlog_.empty() || workers_->full();
    const int taken = loop.poll(std::chrono::milliseconds(busy() ? 20 : 200));
    collect();
    status_->tick();
    const bool encoding = blocked_before || !backlog_.empty() || workers_->full();
    const bool ending = std::any_of(streams_.begin(), streams_.end(),
                                    [](const auto& s) { return s.second.report.has_value(); });
    if (taken > 0 || encoding || ending) last_message = Clock::now();
    if (encoding) {
      for (auto& [id, stream] : streams_) stream.last_sample = Clock::now();
    }
    if (options_.serve && !encoding) drop_abandoned_streams();
    if (!options_.serve && !stream_done_ &&
        Clock::now() - last_message > std::chrono::milliseconds(options_.idle_timeout_ms)) {
      throw wire::PeerTimeoutError("cacher: nothing from preprocess on " + options_.pull_endpoint +
                                   " for " + std::to_string(options_.idle_timeout_ms / 1000) +
                                   " s");
    }
  }
}

}  // namespace

Summary run(const Options& options) {
  if (options.model.empty()) throw InputError("cacher: --model is required");
  if (options.vae_batch_size < 1) throw InputError("--vae_batch_size must be at least 1");
  if (options.max_token_length != 75 && options.max_token_length != 150 &&
      options.max_token_length != 225) {
    throw InputError("--max_token_length=" + std::to_string(options.max_token_length) +
                     ": expected 75, 150 or 225 (kohya's)");
  }
  Cacher cacher(options);
  return cacher.run();
}

}  // namespace lorapipe::cacher
