// kohya's validation loss: fixed latents, captions, timesteps and noise over the held-out
// images, weighted as the training loss is.
#include "trainer/run.h"

#include <random>

#include "common/log.h"
#include "common/random.h"

namespace lorapipe::trainer::detail {

void Run::prepare_validation() {
  if (validation_manifest_.entries_size() == 0) return;
  wire::Manifest saved = manifest_;
  manifest_ = validation_manifest_;
  for (int i = 0; i < validation_manifest_.entries_size(); ++i) {
    PlannedBatch plan;
    plan.entries = {i};
    PreparedBatch p = prepare(/*epoch=*/0, i, plan);
    // Validation uses the stored mean (no draw) and the caption as written, unshuffled, every
    // tag in: only its wildcards are drawn, once, so every validation sees the same text.
    const wire::ManifestEntry& entry = validation_manifest_.entries(i);
    wire::LatentRecord record;
    record.ParseFromString(*records_->get(RecordKind::kLatent, {entry.latent_key()})[0]);
    p.latents = model_->model_latents(from_record(record.mean()).unsqueeze(0));
    p.masks = record.has_mask() ? from_record(record.mask()).unsqueeze(0).unsqueeze(0)
                                : torch::Tensor();
    if (!cached_text_) {
      wire::CaptionSettings fixed;
      fixed.set_enable_wildcard(entry.caption_settings().enable_wildcard());
      fixed.set_caption_separator(entry.caption_settings().caption_separator());
      fixed.set_secondary_separator(entry.caption_settings().secondary_separator());
      std::mt19937_64 rng = stream(o_.seed, -1, i, "validation caption");
      p.captions = {process_caption(entry.caption(), fixed, CaptionClock{}, rng)};
      LP_LOG(kDebug, kLog) << "validation image " << i << " caption: '" << p.captions[0] << "'";
    }
    validation_.push_back(std::move(p));
  }
  manifest_ = std::move(saved);
}

double Run::validation_loss() {
  if (validation_.empty()) return -1;
  step_->optimizer().eval();  // the model a schedule-free optimizer averages, as kohya validates
  torch::NoGradGuard no_grad;
  network_->set_training(false);
  double sum = 0;
  int64_t n = 0;
  // kohya's --max_validation_steps counts batches of its validation loader; lorapipe validates
  // one image at a time, so N batches are N times the batch size in images.
  const int64_t batch = scheduler_->batch_size() / std::max(1, o_.ranks.world_size);
  const size_t items = o_.max_validation_steps > 0
                           ? std::min(validation_.size(),
                                      static_cast<size_t>(o_.max_validation_steps * batch))
                           : validation_.size();
  for (size_t i = 0; i < items; ++i) {
    const MicroBatch batch = to_micro_batch(validation_[i]);
    const models::Conditioning conditioning = step_->conditioning(batch);
    const torch::Tensor latents = batch.latents.to(device_, torch::kFloat);
    // kohya's fixed points (the objective's: 200, 400, 600, 800 of 1000 timesteps by default),
    // each with noise from a generator of its own, so validation losses compare.
    for (const models::ValidationPoint& point :
         step_->objective().validation_points(latents.size(0), device_)) {
      at::Generator g = generator_for(o_.validation_seed, static_cast<int64_t>(i), point.timestep,
                                      "val-noise");
      // kohya validates through its training's process_batch: the noise is drawn as in training
      // (--noise_offset, multires noise and --ip_noise_gamma act), from the fixed generator.
      const torch::Tensor noise = draw_noise(latents, o_.step.noise, g);
      const torch::Tensor input_noise = draw_input_noise(noise, o_.step.noise, g);
      // kohya's process_batch weighs the validation loss as the training loss: the samples'
      // loss weights, then the objective's weighting.
      torch::Tensor loss = step_->per_sample_loss(latents, noise, point.time, conditioning,
                                                  input_noise, batch.masks, batch.geometry);
      if (batch.loss_weights.defined()) loss = loss * batch.loss_weights.to(device_, torch::kFloat);
      sum += step_->weighted(loss, point.time).mean().item<double>();
      ++n;
    }
  }
  network_->set_training(true);
  const double mean = sum / static_cast<double>(n);
  if (pub_) {  // for the run's curves (the launcher's gallery plots them)
    wire::ValidationLoss v;
    v.set_run_id(run_id_);
    v.set_step(static_cast<uint64_t>(global_step_));
    v.set_loss(mean);
    (void)wire::send(*pub_, v);
  }
  return mean;
}

}  // namespace lorapipe::trainer::detail
