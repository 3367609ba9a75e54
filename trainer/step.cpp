#include "trainer/step.h"

#include <ATen/CPUGeneratorImpl.h>

#include <torch/torch.h>

#include <cmath>
#include <limits>
#include <map>

#include "common/error.h"
#include "common/log.h"
#include "models/diffusion_model.h"
#include "trainer/lora_network.h"

namespace lorapipe::trainer {

namespace {

// torch.cuda.amp.GradScaler's defaults, which accelerate (and so kohya) uses for fp16.
constexpr double kScaleGrowth = 2.0;
constexpr double kScaleBackoff = 0.5;
constexpr int64_t kScaleGrowthInterval = 2000;

}  // namespace

void TrainingStep::check(const StepOptions& options) {
  if (options.scale_weight_norms < 0) {
    throw InputError("--scale_weight_norms must not be negative (0 turns it off)");
  }
  if (options.gradient_accumulation_steps < 1) {
    throw InputError("--gradient_accumulation_steps must be at least 1");
  }
  if (options.max_grad_norm < 0) throw InputError("--max_grad_norm must not be negative");
  if (options.noise.ip_noise_gamma < 0) throw InputError("--ip_noise_gamma must not be negative");
  models::check_objective_options(options.objective);
  (void)elementwise_loss(torch::zeros({1}), torch::zeros({1}), options.loss_type,
                         torch::ones({1}));  // names an unknown --loss_type now, not mid-run
  validate(options.schedule);
}

void TrainingStep::check(const StepOptions& options, const models::ModelFamily& family) {
  check(options);
  const auto objective = models::make_training_objective(family, options.objective);
  // The Huber threshold's schedule is the objective's to refuse (flow matching has no SNR
  // schedule): asked now, not at the first step after the caching and the load.
  if (options.loss_type == "huber" || options.loss_type == "smooth_l1") {
    (void)objective->huber_threshold(
        objective->draw_times(1, at::make_generator<at::CPUGeneratorImpl>(0), torch::kCPU, 8, 8));
  }
  if (family.objective == models::ObjectiveKind::kFlowMatching) {
    // kohya's flow-matching trainers draw plain noise (flux_train_network's
    // get_noise_pred_and_target; only --ip_noise_gamma reaches it): a command carrying these
    // trains without them there, so they are refused rather than trained with here.
    const NoiseOptions& n = options.noise;
    const std::pair<bool, const char*> sd_only[] = {
        {n.noise_offset != 0, "--noise_offset"},
        {n.noise_offset_random_strength, "--noise_offset_random_strength"},
        {n.adaptive_noise_scale != 0, "--adaptive_noise_scale"},
        {n.multires_noise_iterations != 0, "--multires_noise_iterations"}};
    for (const auto& [set, flag] : sd_only) {
      if (set) {
        throw InputError(std::string(flag) + " is a Stable Diffusion (DDPM) option: kohya's " +
                         family.display_name +
                         " trainer draws plain noise and leaves it unused; leave it out "
                         "(--ip_noise_gamma is taken)");
      }
    }
  }
}

TrainingStep::TrainingStep(models::DiffusionModel& model, LoraNetwork& network,
                           const StepOptions& options)
    : model_(model),
      network_(network),
      options_(options) {
  check(options, model.model_family());
  objective_ = models::make_training_objective(model.model_family(), options.objective);

  std::vector<ParamGroup> groups;
  const auto& o = options.optimizer_groups;
  auto add_group = [&](std::vector<at::Tensor> params, double lr, const std::string& name,
                       double side_ratio) {
    if (params.empty()) return;
    if (lr < 0) throw InputError("learning rate for " + name + " is negative: " + std::to_string(lr));
    const double ratio = side_ratio > 0 ? side_ratio : o.loraplus_lr_ratio;
    // kohya's assemble_params leaves a group at rate 0 out of the optimizer ("NO LR skipping!"):
    // its weights stay as they start, whatever the optimizer (Adafactor's relative step would
    // otherwise move them at a step size of its own).
    auto push = [&](std::vector<at::Tensor> tensors, double rate, const std::string& group) {
      if (rate == 0) {
        LP_LOG(kInfo, "trainer") << group << ": learning rate 0, left out of the optimizer and "
                                            "not trained (as kohya leaves it)";
        // No gradient either: one no optimizer clears would pile up step after step in the
        // clipping norm (and, summed over ranks, overflow it).
        for (at::Tensor& t : tensors) t.requires_grad_(false);
        return;
      }
      groups.push_back(ParamGroup{std::move(tensors), rate, group});
    };
    if (ratio > 0) {
      // LoRA+ (kohya's loraplus ratios): the up matrices learn ratio times faster.
      std::vector<at::Tensor> downs, ups;
      for (size_t i = 0; i < params.size(); ++i) (i % 2 == 0 ? downs : ups).push_back(params[i]);
      push(std::move(downs), lr, name);
      push(std::move(ups), lr * ratio, name + "_plus");
    } else {
      push(std::move(params), lr, name);
    }
  };
  if (network.options().train_text_encoder) {
    // kohya's prepare_optimizer_params: with a second text encoder (SDXL), a group for each, at
    // --text_encoder_lr's first and second value (the first for both when it has one).
    const double te_lr = o.text_encoder_lr >= 0 ? o.text_encoder_lr : o.learning_rate;
    add_group(network.text_encoder_parameters(0), te_lr, "text_encoder",
              o.loraplus_text_encoder_lr_ratio);
    add_group(network.text_encoder_parameters(1),
              o.text_encoder_2_lr >= 0 ? o.text_encoder_2_lr : te_lr,
              "text_encoder_2", o.loraplus_text_encoder_lr_ratio);
  }
  const double unet_lr = o.unet_lr >= 0 ? o.unet_lr : o.learning_rate;
  const std::vector<double>& block_lr_weight = network.options().block_lr_weight;
  if (network.options().train_unet && block_lr_weight.empty()) {
    add_group(network.unet_parameters(), unet_lr, "unet", o.loraplus_unet_lr_ratio);
  } else if (network.options().train_unet) {
    // kohya's block learning rates (prepare_optimizer_params with block_lr): a group for each
    // block, in the order the blocks' first modules come, at the U-Net's rate times its weight.
    std::vector<int> order;
    std::map<int, std::vector<at::Tensor>> by_block;
    for (const LoraNetwork::Module& m : network.modules()) {
      if (m.target.text_encoder) continue;
      const int index = m.target.block;
      const int b = index < 0 ? static_cast<int>(block_lr_weight.size()) - 1 : index;  // [-1]
      if (!by_block.count(b)) order.push_back(b);
      by_block[b].push_back(m.adapter->down);
      by_block[b].push_back(m.adapter->up);
    }
    for (int b : order) {
      add_group(std::move(by_block[b]), unet_lr * block_lr_weight.at(b),
                "unet_block" + std::to_string(b), o.loraplus_unet_lr_ratio);
    }
  }
  if (groups.empty()) throw InputError("nothing to train: the LoRA has no trainable module");
  for (const ParamGroup& g : groups) initial_lrs_.push_back(g.lr);
  for (const ParamGroup& g : groups) group_names_.push_back(g.name);
  optimizer_ = make_optimizer(options.optimizer, std::move(groups));
  model_.set_gradient_checkpointing(options.gradient_checkpointing);
  model_.set_cpu_offload_checkpointing(options.cpu_offload_checkpointing);
}

TrainingStep::~TrainingStep() = default;

std::vector<at::Tensor> TrainingStep::trainable() const {
  std::vector<at::Tensor> out;
  for (const at::Tensor& t : network_.unet_parameters()) {
    if (t.requires_grad()) out.push_back(t);
  }
  for (const at::Tensor& t : network_.text_encoder_parameters()) {
    if (t.requires_grad()) out.push_back(t);
  }
  return out;
}

models::Conditioning TrainingStep::conditioning(const MicroBatch& batch) {
  if (batch.encoder_hidden_states.defined()) {
    const models::Conditioning cached =
        model_.cached_conditioning(batch.encoder_hidden_states, batch.pooled, batch.text_mask);
    // Partial caching: the trained encoders' part anew, through their LoRA.
    if (!batch.tokens.empty()) {
      return model_.encode_trained_text(batch.tokens, options_.clip_skip, cached);
    }
    return cached;
  }
  TORCH_CHECK(!batch.tokens.empty(), "a micro-batch needs token ids or hidden states");
  return model_.encode_text(batch.tokens, options_.clip_skip);
}

at::Tensor TrainingStep::per_sample_loss(const at::Tensor& latents, const at::Tensor& noise,
                                         const at::Tensor& times,
                                         const models::Conditioning& conditioning,
                                         const at::Tensor& input_noise, const at::Tensor& mask,
                                         const std::vector<models::SampleGeometry>& geometry) {
  models::DenoiseInput input;
  input.latents =
      objective_->noisy_latents(latents, input_noise.defined() ? input_noise : noise, times);
  input.time = times;
  input.conditioning = &conditioning;
  input.geometry = geometry;
  input.guidance = objective_->options().guidance_scale;  // read by guidance-embedded denoisers
  const at::Tensor prediction =
      objective_->prediction(model_.denoise(input).to(torch::kFloat32), input.latents, times);
  const at::Tensor target = objective_->target(latents, noise, times);
  at::Tensor huber_c = torch::ones({1}, latents.options());
  if (options_.loss_type == "huber" || options_.loss_type == "smooth_l1") {
    huber_c = objective_->huber_threshold(times);
  }
  at::Tensor loss =
      elementwise_loss(prediction, target.to(torch::kFloat32), options_.loss_type, huber_c);
  if (mask.defined()) loss = loss * mask.to(loss.device(), torch::kFloat32);
  return loss.mean({1, 2, 3});
}

double TrainingStep::accumulate(const MicroBatch& batch, at::Generator generator) {
  const double loss = accumulate_micro_batch(batch, generator);
  const bool step_goes_on = batch.share > 0
                               ? !batch.ends_step
                               : accumulated_ % options_.gradient_accumulation_steps != 0;
  if (options_.scale_weight_norms > 0 && step_goes_on) {
    network_.apply_max_norm(options_.scale_weight_norms);
  }
  return loss;
}

double TrainingStep::accumulate_micro_batch(const MicroBatch& batch, at::Generator generator) {
  const at::Device device = model_.denoiser_module().parameters().front().device();
  const at::Tensor latents = batch.latents.to(device, torch::kFloat32);
  at::Tensor noise;
  if (batch.noise.defined()) {
    noise = batch.noise.to(device, torch::kFloat32);
    if (options_.noise.noise_offset != 0) {
      noise = apply_noise_offset(noise, latents, batch.offset_noise.to(device, torch::kFloat32),
                                 options_.noise.noise_offset, options_.noise.adaptive_noise_scale);
    }
  } else {
    noise = draw_noise(latents, options_.noise, generator);
  }
  const at::Tensor times = batch.times.defined()
                               ? batch.times.to(device)
                               : objective_->draw_times(latents.size(0), generator, device,
                                                        latents.size(2), latents.size(3));

  // kohya's input perturbation (ip_noise_gamma): the latents are noised with extra noise that the
  // target does not carry; drawn after the noise points, as kohya draws it.
  at::Tensor input_noise;
  if (options_.noise.ip_noise_gamma > 0 && batch.ip_noise.defined()) {  // a given draw
    input_noise =
        noise + options_.noise.ip_noise_gamma * batch.ip_noise.to(device, torch::kFloat32);
  } else {
    input_noise = draw_input_noise(noise, options_.noise, generator);
  }

  if (batch.rows == 0) {  // a short last batch left this rank no rows: it adds nothing
    ++accumulated_;
    return 0.0;
  }
  if (batch.rows > 0) {  // this rank's rows of the global batch, drawn whole above
    const int64_t global = latents.size(0);
    auto rows = [&](const at::Tensor& t) {
      return t.defined() ? t.narrow(0, batch.rows_begin, batch.rows) : t;
    };
    MicroBatch mine;
    for (const at::Tensor& ids : batch.tokens.ids) mine.tokens.ids.push_back(rows(ids));
    for (const at::Tensor& w : batch.tokens.weights) mine.tokens.weights.push_back(rows(w));
    mine.encoder_hidden_states = rows(batch.encoder_hidden_states);
    mine.pooled = rows(batch.pooled);
    mine.text_mask = rows(batch.text_mask);
    const at::Tensor my_times = rows(times);
    std::vector<models::SampleGeometry> my_geometry;
    if (!batch.geometry.empty()) {
      my_geometry.assign(batch.geometry.begin() + batch.rows_begin,
                         batch.geometry.begin() + batch.rows_begin + batch.rows);
    }
    at::Tensor loss = per_sample_loss(rows(latents), rows(noise), my_times, conditioning(mine),
                                      rows(input_noise), rows(batch.masks), my_geometry);
    if (batch.loss_weights.defined()) {
      loss = loss * rows(batch.loss_weights).to(device, torch::kFloat32);
    }
    loss = weighted(loss, my_times);
    return backward(loss.sum() / static_cast<double>(global), batch.share);
  }
  at::Tensor loss =
      per_sample_loss(latents, noise, times, conditioning(batch), input_noise, batch.masks,
                      batch.geometry);
  if (batch.loss_weights.defined()) loss = loss * batch.loss_weights.to(device, torch::kFloat32);
  loss = weighted(loss, times);
  return backward(loss.mean(), batch.share);
}

double TrainingStep::backward(const at::Tensor& loss, double share) {
  const double value = loss.item<double>();
  if (!std::isfinite(value)) return value;
  at::Tensor scaled = share > 0 ? loss * share : loss / options_.gradient_accumulation_steps;
  if (options_.base_dtype == torch::kHalf) scaled = scaled * loss_scale_;
  scaled.backward();
  ++accumulated_;
  return value;
}

void TrainingStep::zero_grad() {
  optimizer_->zero_grad();
  accumulated_ = 0;
}

UpdateResult TrainingStep::update() {
  UpdateResult result = update_weights();
  if (options_.scale_weight_norms > 0) {
    result.max_norm = network_.apply_max_norm(options_.scale_weight_norms);
  }
  return result;
}

UpdateResult TrainingStep::update_weights() {
  UpdateResult result;
  const std::vector<at::Tensor> params = trainable();
  torch::NoGradGuard no_grad;
  if (reducer_) {
    // Every rank must hold every gradient to sum (one without rows this step has none). The last
    // tensor summed counts the ranks that reached each parameter: one that no rank reached (a
    // dropped module, a text-encoder layer past --clip_skip) is left without a gradient, as one
    // rank leaves it, so the optimizer skips it instead of decaying it (torch's AdamW and
    // AdamW8bit alike).
    std::vector<at::Tensor> grads;
    at::Tensor reached = torch::zeros({static_cast<int64_t>(params.size())}, torch::kFloat32);
    for (size_t i = 0; i < params.size(); ++i) {
      const at::Tensor& p = params[i];
      if (p.grad().defined()) {
        reached[static_cast<int64_t>(i)] = 1.0f;
      } else {
        at::Tensor(p).mutable_grad() = torch::zeros_like(p);
      }
      grads.push_back(p.grad());
    }
    grads.push_back(reached);
    reducer_(grads);
    for (size_t i = 0; i < params.size(); ++i) {
      if (reached[static_cast<int64_t>(i)].item<float>() == 0) {
        at::Tensor(params[i]).mutable_grad() = at::Tensor();
      }
    }
  }
  if (options_.base_dtype == torch::kHalf) {
    for (const at::Tensor& p : params) {
      if (p.grad().defined()) p.mutable_grad().div_(loss_scale_);
    }
  }
  // The total norm is finite exactly when every gradient is: one check (and one device sync)
  // instead of one per tensor. Clipping a non-finite set does no harm: it is thrown away.
  const double max_norm = options_.max_grad_norm > 0 ? options_.max_grad_norm
                                                      : std::numeric_limits<double>::infinity();
  result.grad_norm = torch::nn::utils::clip_grad_norm_(params, max_norm);
  if (!std::isfinite(result.grad_norm)) {
    if (options_.base_dtype == torch::kHalf) {
      loss_scale_ *= kScaleBackoff;
      growth_tracker_ = 0;
      result.scale_lowered = true;
      result.loss_scale = loss_scale_;
    }
    zero_grad();
    return result;
  }
  for (size_t g = 0; g < initial_lrs_.size(); ++g) {
    optimizer_->set_lr(g, initial_lrs_[g] * lr_multiplier(options_.schedule, updates_));
  }
  result.learning_rate = optimizer_->lr(0);
  optimizer_->step();
  ++updates_;
  result.applied = true;
  if (options_.base_dtype == torch::kHalf && ++growth_tracker_ == kScaleGrowthInterval) {
    loss_scale_ *= kScaleGrowth;
    growth_tracker_ = 0;
  }
  zero_grad();
  return result;
}

}  // namespace lorapipe::trainer
