#pragma once
// One training step of a LoRA, as kohya sd-scripts' train_network.py runs it: the noise and the
// noise points, the noisy latents, the denoiser's prediction against the target (the family's
// training objective, models/objective.h), kohya's loss options, backward (divided over
// gradient accumulation), then gradient clipping, the optimizer and the learning-rate schedule.
//
// The step is the unit the parity tests compare with diffusers + peft (trainer/reference/
// train_reference.py), so everything random can also be given explicitly.

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "models/diffusion_model.h"
#include "models/objective.h"
#include "trainer/lora_network.h"
#include "trainer/lr_schedule.h"
#include "trainer/noise.h"
#include "trainer/optimizer.h"


namespace lorapipe::trainer {

struct StepOptions {
  // The family's objective under kohya's knobs (--v_parameterization, --min_snr_gamma, the
  // timestep range, the Huber schedule, ...): models/objective.h.
  models::ObjectiveOptions objective;
  // --scale_weight_norms (0: off): kohya's max-norm regularization after every micro-batch
  // (LoraNetwork::apply_max_norm).
  double scale_weight_norms = 0;
  NoiseOptions noise;
  std::string loss_type = "l2";   // --loss_type l2 | l1 | huber | smooth_l1
  int clip_skip = 1;
  int gradient_accumulation_steps = 1;
  double max_grad_norm = 1.0;     // 0: no clipping
  c10::ScalarType base_dtype = c10::kFloat;  // --mixed_precision: the frozen base's dtype
  bool gradient_checkpointing = false;
  // kohya's --cpu_offload_checkpointing (with gradient_checkpointing): the checkpointed blocks'
  // inputs in pinned host memory until backward (models/checkpoint.h). FLUX.1 only.
  bool cpu_offload_checkpointing = false;
  OptimizerOptions optimizer;
  struct LearningRates {
    double learning_rate = 1e-4;  // --learning_rate
    double unet_lr = -1;          // --unet_lr (negative: learning_rate)
    double text_encoder_lr = -1;  // --text_encoder_lr (negative: learning_rate)
    // --text_encoder_lr's second value, the second text encoder's (SDXL's bigG); negative: the
    // first's. kohya's list: one value for both, or one per encoder.
    double text_encoder_2_lr = -1;
    double loraplus_lr_ratio = 0; // network_args loraplus_lr_ratio (0: off)
    // network_args loraplus_unet_lr_ratio / loraplus_text_encoder_lr_ratio: that side's ratio,
    // over loraplus_lr_ratio (0: unset), as kohya's prepare_optimizer_params picks it.
    double loraplus_unet_lr_ratio = 0;
    double loraplus_text_encoder_lr_ratio = 0;
  } optimizer_groups;
  LrScheduleOptions schedule;
};

// One micro-batch. `latents` are already drawn from the cached distribution and scaled by the
// family's latent factors (DiffusionModel::model_latents). Text comes as token ids for each text
// encoder (encoded online, through the LoRA when the text encoder trains) or as cached encoder
// hidden states. `noise`, `offset_noise` and `times` are drawn from the step's generator unless
// given.
struct MicroBatch {
  at::Tensor latents;                // [B, 4, h, w] fp32
  // ids per text encoder (weights: --weighted_captions), or the states cached below; both where
  // the cache holds the untrained encoders' part (partial caching, DiffusionModel::
  // encode_trained_text).
  models::TokenBatch tokens;
  at::Tensor encoder_hidden_states;  // [B, tokens, C] cached
  at::Tensor pooled;                 // [B, C'] cached with the hidden states (families that use it)
  at::Tensor text_mask;              // [B, tokens] cached with them (families whose text has one)
  at::Tensor loss_weights;           // [B] fp32: prior_loss_weight for reg images, else 1
  at::Tensor noise;                  // optional [B, 4, h, w]
  at::Tensor offset_noise;           // optional [B, 4, 1, 1] (with noise_offset)
  at::Tensor times;                  // optional [B] model times (DDPM: int64 timesteps)
  at::Tensor ip_noise;               // optional [B, 4, h, w] (with ip_noise_gamma; fixed strength)
  at::Tensor masks;                  // optional [B, 1, h, w] fp32: kohya's alpha masks
  // Each sample's original size, crop and target size (kohya's, from the cache), for the
  // families that condition on them (SDXL); empty: every sample at its latents' size, no crop.
  std::vector<models::SampleGeometry> geometry;
  // Data-parallel ranks (trainer/ranks.h): every rank gets the whole global batch and draws its
  // noise and timesteps, then computes rows [rows_begin, rows_begin + rows) alone, with a loss
  // that is their sum over B, so the ranks' summed gradients are the global batch's mean.
  // rows < 0: every row, the loss their mean.
  int64_t rows_begin = 0;
  int64_t rows = -1;
  // Bucket batch sizes (BatchScheduler): the micro-batch's share of its step's samples, which
  // scales its backward in place of 1 / gradient_accumulation_steps, and whether it ends its
  // step. share 0: kohya's fixed accumulation.
  double share = 0;
  bool ends_step = false;
};

struct UpdateResult {
  bool applied = false;    // false: an fp16 overflow or a non-finite gradient skipped it
  double grad_norm = 0;    // total norm before clipping
  double learning_rate = 0;  // the (first group's) rate this update used
  // With scale_weight_norms: what the max-norm pass after this update did.
  std::optional<MaxNormResult> max_norm;
  // fp16: the gradients overflowed at the loss scale and it was halved to `loss_scale`, as
  // torch's GradScaler does while it finds its scale (not a sign of a diverging run while the
  // scale stays at 1 or more).
  bool scale_lowered = false;
  double loss_scale = 0;
  bool finding_the_scale() const { return scale_lowered && loss_scale >= 1; }
};

class TrainingStep {
 public:
  // Throws InputError for options that cannot work (unknown loss or schedule, accumulation < 1).
  TrainingStep(models::DiffusionModel& model, LoraNetwork& network, const StepOptions& options);
  // The constructor's checks of `options` alone, without a model or network.
  static void check(const StepOptions& options);
  // And against a family's training objective (the other objective's flags, and noise its
  // kohya trainer does not draw, refused by name), from the family alone: before any caching.
  static void check(const StepOptions& options, const models::ModelFamily& family);
  ~TrainingStep();

  // Forward and backward of one micro-batch; returns its loss (before the division by the
  // accumulation steps). A non-finite loss is returned without backward. With
  // scale_weight_norms, a micro-batch that does not complete gradient_accumulation_steps ends
  // with the max-norm pass, as kohya runs it after every micro-batch (an epoch's short last step
  // also gets one before its update: the weights have not moved since the last pass, so it
  // changes them by rounding at most).
  double accumulate(const MicroBatch& batch, at::Generator generator);
  // Clips, updates and advances the schedule once gradient_accumulation_steps micro-batches
  // have been accumulated; then zeroes the gradients (and runs the max-norm pass).
  UpdateResult update();
  // Data-parallel ranks: called by update() on the trainable tensors' gradients before anything
  // reads them, to sum them over the ranks.
  void set_gradient_reducer(std::function<void(const std::vector<at::Tensor>&)> reducer) {
    reducer_ = std::move(reducer);
  }
  // Drops accumulated gradients (after a bad step).
  void zero_grad();

  int64_t updates() const { return updates_; }
  void set_updates(int64_t updates) { updates_ = updates; }
  Optimizer& optimizer() { return *optimizer_; }
  // The optimizer's parameter groups by name, in its order ("text_encoder", "unet", and with
  // LoRA+ "text_encoder_plus", "unet_plus").
  const std::vector<std::string>& group_names() const { return group_names_; }
  // Each group's rate before the schedule (kohya's per-group --unet_lr / --text_encoder_lr).
  const std::vector<double>& initial_lrs() const { return initial_lrs_; }
  const StepOptions& options() const { return options_; }
  // fp16 only: the gradient scaler's state, saved with the training state.
  double loss_scale() const { return loss_scale_; }
  int64_t scale_growth_tracker() const { return growth_tracker_; }
  void set_scaler(double scale, int64_t tracker) { loss_scale_ = scale, growth_tracker_ = tracker; }

  // The denoiser's loss for a batch whose text conditioning is already computed (validation
  // uses it with fixed noise and points). Per-sample, before weighting, [B]. The latents are
  // noised with `input_noise` when given (kohya's ip_noise_gamma perturbation), the target
  // stays `noise`. `mask` [B, 1, h, w] (kohya's alpha mask at latent size) weighs each element
  // of the loss before the mean, as kohya's apply_masked_loss. `geometry`: each sample's, for
  // the families that condition on it (SDXL's time ids); empty: the latents' own size.
  at::Tensor per_sample_loss(const at::Tensor& latents, const at::Tensor& noise,
                             const at::Tensor& times,
                             const models::Conditioning& conditioning,
                             const at::Tensor& input_noise = {}, const at::Tensor& mask = {},
                             const std::vector<models::SampleGeometry>& geometry = {});
  models::Conditioning conditioning(const MicroBatch& batch);
  // Per-sample losses times the objective's weighting (kohya's min-SNR and the rest), [B].
  at::Tensor weighted(at::Tensor loss, const at::Tensor& times) const {
    return objective_->weighted(std::move(loss), times);
  }
  const models::TrainingObjective& objective() const { return *objective_; }

 private:
  std::vector<at::Tensor> trainable() const;
  // The loss's value; unless it is non-finite, its backward (scaled for accumulation and fp16).
  // `share`: MicroBatch::share.
  double backward(const at::Tensor& loss, double share);
  double accumulate_micro_batch(const MicroBatch& batch, at::Generator generator);
  UpdateResult update_weights();

  models::DiffusionModel& model_;
  LoraNetwork& network_;
  StepOptions options_;
  std::unique_ptr<models::TrainingObjective> objective_;
  std::unique_ptr<Optimizer> optimizer_;
  std::vector<std::string> group_names_;
  std::vector<double> initial_lrs_;
  int64_t updates_ = 0;
  int accumulated_ = 0;
  double loss_scale_ = 65536.0;
  int64_t growth_tracker_ = 0;
  std::function<void(const std::vector<at::Tensor>&)> reducer_;
};

}  // namespace lorapipe::trainer
