// Micro-batches from cached records (a fresh latent draw, kohya's flips and caption
// augmentation), their prefetch on a producer thread, and kohya's --debug_dataset listing.
#include "trainer/run.h"

#include <cstdio>
#include <random>

#include "common/error.h"
#include "common/log.h"
#include "common/random.h"

namespace lorapipe::trainer::detail {

namespace {
constexpr size_t kPrefetchDepth = 2;
}  // namespace

// A tensor from a record, as fp32 on the CPU.
torch::Tensor from_record(const wire::Tensor& t) {
  std::vector<int64_t> shape(t.shape().begin(), t.shape().end());
  const auto dtype = t.dtype() == wire::Tensor::F32   ? torch::kFloat
                     : t.dtype() == wire::Tensor::F16 ? torch::kHalf
                                                      : torch::kBFloat16;
  // A copy always: the record's bytes go when the record does (an F32 `.to` would alias them).
  return torch::from_blob(const_cast<char*>(t.data().data()), shape, dtype)
      .to(torch::kFloat, /*non_blocking=*/false, /*copy=*/true);
}

// kohya's SDXL size conditioning of a cached sample (BaseDataset.__getitem__): its original size,
// the crop's top-left (for a flipped sample the left is the target width minus crop_ltrb's right)
// and the target size, the cached latents' size in pixels (`downsample` pixels per latent);
// each truncated to an int as kohya's.
models::SampleGeometry sample_geometry(const wire::LatentRecord& record, bool flipped,
                                       const torch::Tensor& latent, int64_t downsample) {
  models::SampleGeometry g;
  g.target_height = latent.size(1) * downsample;
  g.target_width = latent.size(2) * downsample;
  g.original_height = record.has_original_size() ? record.original_size().height() : g.target_height;
  g.original_width = record.has_original_size() ? record.original_size().width() : g.target_width;
  if (record.crop_ltrb_size() == 4) {
    g.crop_top = static_cast<int64_t>(record.crop_ltrb(1));
    g.crop_left = flipped ? static_cast<int64_t>(static_cast<double>(g.target_width) - record.crop_ltrb(2))
                          : static_cast<int64_t>(record.crop_ltrb(0));
  }
  return g;
}

at::Generator generator_for(uint64_t seed, int64_t epoch, int64_t index, std::string_view purpose) {
  return at::make_generator<at::CPUGeneratorImpl>(stream(seed, epoch, index, purpose)());
}

PreparedBatch Run::prepare(int64_t epoch, int64_t index, const PlannedBatch& plan) {
  PreparedBatch out;
  out.epoch = epoch;
  out.index = index;
  out.step = plan.step;
  out.ends_step = plan.ends_step;
  out.share = plan.share;
  std::vector<std::string> latent_keys, text_keys;
  for (int i : plan.entries) {
    latent_keys.push_back(manifest_.entries(i).latent_key());
    if (cached_text_) text_keys.push_back(manifest_.entries(i).text_key());
  }
  const auto latents = records_->get(RecordKind::kLatent, latent_keys);
  std::vector<std::optional<std::string>> texts;
  if (cached_text_) texts = records_->get(RecordKind::kText, text_keys);
  at::Generator draw = generator_for(o_.seed, epoch, index, "latent");
  std::mt19937_64 rng = stream(o_.seed, epoch, index, "flip+caption");
  // The step this micro-batch belongs to (steps done before it), from where it sits in the run:
  // epochs count from 1 and end on steps.
  const auto steps_per_epoch = static_cast<int64_t>(scheduler_->steps_per_epoch());
  const CaptionClock clock{epoch, (epoch - 1) * steps_per_epoch + plan.step, max_steps_};
  std::vector<torch::Tensor> latent_list, hidden_list, pooled_list, text_mask_list, mask_list;
  std::vector<float> weights;
  bool any_mask = false;
  for (size_t k = 0; k < plan.entries.size(); ++k) {
    const wire::ManifestEntry& e = manifest_.entries(plan.entries[k]);
    wire::LatentRecord record;
    if (!latents[k] || !record.ParseFromString(*latents[k])) {
      throw Error("latent " + latent_keys[k] + " (" + e.path() + ") vanished from " +
                  records_->describe() + " after the pre-flight check");
    }
    // kohya flip_aug with cached latents: the flipped twin half of the time.
    const bool flipped = e.flip() && record.has_flipped_mean() &&
                         uniform_unit(rng) < 0.5;
    const torch::Tensor mean = from_record(flipped ? record.flipped_mean() : record.mean());
    const torch::Tensor std = from_record(flipped ? record.flipped_std() : record.std());
    // A fresh draw from the stored distribution every time (kohya freezes one at caching).
    latent_list.push_back(mean + std * at::randn(mean.sizes(), draw, torch::kFloat));
    out.flipped.push_back(flipped);
    out.geometry.push_back(
        sample_geometry(record, flipped, mean, model_->model_family().vae_downsample));
    // kohya's alpha mask, flipped with its image; an image without one weighs every cell fully.
    const bool has_mask = flipped ? record.has_flipped_mask() : record.has_mask();
    any_mask |= has_mask;
    mask_list.push_back(has_mask ? from_record(flipped ? record.flipped_mask() : record.mask())
                                 : torch::ones({mean.size(1), mean.size(2)}));
    weights.push_back(e.is_reg() ? static_cast<float>(o_.prior_loss_weight) : 1.0f);
    if (cached_text_) {
      wire::TextRecord text;
      if (!texts[k] || !text.ParseFromString(*texts[k])) {
        throw Error("text " + text_keys[k] + " vanished from " + records_->describe());
      }
      torch::Tensor hidden = from_record(text.hidden_states());
      if (text.has_mask()) {
        text_mask_list.push_back(from_record(text.mask()));
        // States kept only up to the mask's end (cacher/encode.cpp): zeros for the rest, which
        // the mask hides from the denoiser.
        const int64_t full = text_mask_list.back().size(0);
        if (hidden.size(0) < full) {
          hidden = torch::cat({hidden, torch::zeros({full - hidden.size(0), hidden.size(1)},
                                                    hidden.options())});
        }
      }
      hidden_list.push_back(hidden);
      if (text.has_pooled()) pooled_list.push_back(from_record(text.pooled()));
      // The trained encoders read the caption the cache encoded (captions are cached only where
      // nothing is drawn from them).
      if (partial_text_) out.captions.push_back(e.caption());
    } else {
      out.captions.push_back(process_caption(e.caption(), e.caption_settings(), clock, rng));
    }
  }
  out.latents = model_->model_latents(torch::stack(latent_list));
  if (cached_text_) out.hidden_states = torch::stack(hidden_list);
  if (cached_text_ && pooled_list.size() == hidden_list.size())
    out.pooled = torch::stack(pooled_list);
  if (cached_text_ && text_mask_list.size() == hidden_list.size() && !text_mask_list.empty())
    out.text_mask = torch::stack(text_mask_list);
  out.loss_weights = torch::tensor(weights);
  if (any_mask) out.masks = torch::stack(mask_list).unsqueeze(1);
  return out;
}

void Run::producer(int64_t epoch, int64_t index) {
  try {
    for (;; ++epoch, index = 0) {
      const std::vector<PlannedBatch> plan = scheduler_->epoch(epoch);
      for (; index < static_cast<int64_t>(plan.size()); ++index) {
        PreparedBatch batch = prepare(epoch, index, plan[index]);
        std::unique_lock<std::mutex> lock(mutex_);
        cv_.wait(lock, [&] { return stop_ || queue_.size() < kPrefetchDepth; });
        if (stop_) return;
        queue_.push_back(std::move(batch));
        cv_.notify_all();
      }
    }
  } catch (const std::exception& e) {
    std::lock_guard<std::mutex> lock(mutex_);
    PreparedBatch failed;
    failed.error = e.what();
    queue_.push_back(std::move(failed));
    cv_.notify_all();
  }
}

MicroBatch Run::to_micro_batch(const PreparedBatch& p) {
  MicroBatch batch;
  batch.latents = p.latents;
  batch.loss_weights = p.loss_weights;
  batch.masks = p.masks;
  batch.geometry = p.geometry;
  batch.share = p.share;
  batch.ends_step = p.ends_step;
  if (p.hidden_states.defined()) {
    batch.encoder_hidden_states = p.hidden_states;
    batch.pooled = p.pooled;
    batch.text_mask = p.text_mask;
    if (partial_text_) batch.tokens = model_->tokenize(p.captions, o_.max_token_length);
  } else {
    batch.tokens = model_->tokenize(p.captions, o_.max_token_length, o_.weighted_captions);
    text_encoded_online_ = true;
  }
  if (ranks_) {  // this rank's share of the global batch, the last rank's possibly shorter
    const int64_t n = batch.latents.size(0), world = ranks_->world_size();
    const int64_t per = (n + world - 1) / world;
    batch.rows_begin = std::min(n, per * ranks_->rank());
    batch.rows = std::min(per, n - batch.rows_begin);
  }
  return batch;
}

// kohya's --debug_dataset: every micro-batch of the run as training would take it (the same
// plan, flips and captions, drawn from the same streams), printed; nothing is trained or saved.
Summary Run::show_dataset() {
  cached_text_ = false;  // captions through process_caption, as online text is; fixed ones stay
  const auto steps_per_epoch = static_cast<int64_t>(scheduler_->steps_per_epoch());
  Summary summary;
  summary.dataset_only = true;
  for (int64_t epoch = epoch_;; ++epoch) {
    const std::vector<PlannedBatch> plan = scheduler_->epoch(epoch);
    for (int64_t index = 0; index < static_cast<int64_t>(plan.size()); ++index) {
      const int64_t step = (epoch - 1) * steps_per_epoch + plan[index].step + 1;
      if (step > max_steps_) return summary;
      const PreparedBatch batch = prepare(epoch, index, plan[index]);
      std::printf("step %lld/%lld  epoch %lld  batch %lld\n", static_cast<long long>(step),
                  static_cast<long long>(max_steps_), static_cast<long long>(epoch),
                  static_cast<long long>(index));
      for (size_t k = 0; k < plan[index].entries.size(); ++k) {
        const wire::ManifestEntry& e = manifest_.entries(plan[index].entries[k]);
        std::printf("  %s  %ux%u%s%s  '%s'\n", e.path().c_str(), e.bucket().width(),
                    e.bucket().height(), batch.flipped[k] ? "  flipped" : "",
                    e.is_reg() ? "  reg" : "", batch.captions[k].c_str());
      }
      summary.steps = step;
      summary.epochs = epoch;
    }
  }
}

}  // namespace lorapipe::trainer::detail
