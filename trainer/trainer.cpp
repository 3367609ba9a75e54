#include "trainer/trainer.h"

#include <malloc.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <random>
#include <string>

#include "common/error.h"
#include "common/log.h"
#include "common/random.h"
#include "models/block_swap.h"
#include "models/device.h"
#include "trainer/run.h"

// The loop of a training run (Run::train_steps): steps, accumulation, bad steps, saves on
// kohya's schedule, validation, the stop on Ctrl-C. Its parts live one concept to a file
// (trainer/run.h lists them).
namespace lorapipe::trainer {
namespace detail {

volatile std::sig_atomic_t g_stop_requested = 0;

namespace {

// 'a', 'b': each caption in single quotes, as a log line shows them.
std::string join_quoted(const std::vector<std::string>& texts) {
  std::string out;
  for (const std::string& text : texts) out += (out.empty() ? "'" : ", '") + text + "'";
  return out;
}

// Whether every element of `t` is finite, in any floating dtype (float8 too, which has no
// isfinite of its own on every device), widened a slice at a time so that a 12 B-parameter
// model's largest tensor never exists in fp32 at once. Integer tensors are finite.
bool all_finite(const at::Tensor& t) {
  if (!t.defined() || !t.is_floating_point()) return true;
  torch::NoGradGuard no_grad;
  const at::Tensor flat = t.detach().reshape({-1});
  constexpr int64_t kSlice = int64_t{1} << 24;
  for (int64_t begin = 0; begin < flat.numel(); begin += kSlice) {
    const at::Tensor part = flat.slice(0, begin, std::min(flat.numel(), begin + kSlice));
    if (!at::isfinite(part.to(torch::kFloat32)).all().item<bool>()) return false;
  }
  return true;
}

// The name of `module`'s first parameter or buffer that is not finite; empty where none. A weight
// `swap` took is looked at in its host copy, the only one of its values.
std::string first_non_finite(const torch::nn::Module& module,
                             const models::BlockSwap* swap = nullptr) {
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    const at::Tensor host = swap != nullptr ? swap->host_copy(item.value()) : at::Tensor();
    if (!all_finite(host.defined() ? host : item.value())) return item.key();
  }
  for (const auto& item : module.named_buffers(/*recurse=*/true)) {
    if (!all_finite(item.value())) return item.key();
  }
  return "";
}

// A save killed mid-write leaves its whole size as ".NAME.safetensors.tmp-PID"
// (models::write_safetensors): those of writers no longer alive are removed from `dir`.
void remove_stale_saves(const fs::path& dir) {
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const fs::directory_entry& entry = *it;
    const std::string name = entry.path().filename().string();
    const size_t tmp = name.rfind(".tmp-");
    if (!name.starts_with(".") || tmp == std::string::npos) continue;
    const std::string digits = name.substr(tmp + 5);
    const auto digit = [](unsigned char c) { return std::isdigit(c) != 0; };
    if (digits.empty() || digits.size() > 9 || !std::all_of(digits.begin(), digits.end(), digit)) {
      continue;
    }
    const pid_t pid = static_cast<pid_t>(std::stol(digits));
    // Its writer may still be writing; this process has written nothing yet (a container
    // restarted gives the same PID again). Another host writing the folder is not seen here.
    if (pid != ::getpid() && (::kill(pid, 0) == 0 || errno == EPERM)) continue;
    std::error_code ignored;
    if (fs::remove(entry.path(), ignored)) {
      LP_LOG(kInfo, kLog) << "removed " << entry.path().string()
                          << ", left by a save killed mid-write";
    }
  }
}

}  // namespace

// How non_finite_weight() begins when the LoRA itself overflowed (not the model's weights).
constexpr std::string_view kLoraNotFinite = "The LoRA's weight '";

std::string Run::non_finite_weight() const {
  const auto damaged = [&](const std::string& key, const std::string& part) {
    return "The model's own weight '" + key + "' (its " + part + ", from " + model_->source() +
           ") holds NaN or infinity: the model file is damaged or was saved broken" +
           (o_.base_weights.empty() ? "" : ", or a --base_weights LoRA merged into it broke it") +
           ", and no learning rate trains over it. Get the file again, or use another";
  };
  if (const std::string key = first_non_finite(model_->denoiser_module(), model_->block_swap());
      !key.empty()) {
    return damaged(key, "denoiser");
  }
  if (network_->text_encoder_module_count() > 0 || text_encoded_online_) {  // it ran in the steps
    if (const std::string key = first_non_finite(model_->text_encoder_module()); !key.empty()) {
      return damaged(key, "text encoder");
    }
  }
  for (const auto& [name, value] : network_->named_parameters()) {
    if (!all_finite(value)) {
      return std::string(kLoraNotFinite) + name + "' is no longer finite: an update overflowed it. "
             "Lower the learning rate and train again, from the start or from a state saved "
             "before";
    }
  }
  return "";
}

// The run, with its lifecycle published once the PUB socket is bound (StageStatus).
Summary Run::train() {
  try {
    Summary summary = train_steps();
    status_.done(summary.interrupted ? "interrupted; state saved in " + summary.state.string()
                                     : "");
    return summary;
  } catch (const std::exception& e) {
    status_.error(e.what());
    throw;
  }
}

Summary Run::train_steps() {
  // kohya's session id: random.randint(0, 2**32), written as ss_session_id (a resumed run keeps
  // its own).
  std::random_device entropy;
  run_id_ = std::to_string(std::uniform_int_distribution<uint64_t>(0, uint64_t{1} << 32)(entropy));
  training_started_at_ = unix_time_now();
  load_data();
  load_model();
  preflight();
  if (o_.ranks.world_size > 1) {
    // After every check of this rank's input, so a bad flag fails here and not as a lost rank.
    ranks_ = RankGroup::join(
        o_.ranks, std::chrono::milliseconds(static_cast<int64_t>(o_.timeout_s * 1000)), device_);
    main_ = ranks_->rank() == 0;
  }

  torch::manual_seed(o_.seed);
  network_ = std::make_unique<LoraNetwork>(*model_, o_.network,
                                           at::make_generator<at::CPUGeneratorImpl>(o_.seed));
  if (!o_.network_weights.empty()) network_->load(o_.network_weights);
  const int64_t batches = static_cast<int64_t>(scheduler_->batches_per_epoch());
  const int64_t steps_per_epoch = static_cast<int64_t>(scheduler_->steps_per_epoch());
  max_steps_ = o_.max_train_epochs > 0 ? o_.max_train_epochs * steps_per_epoch : o_.max_train_steps;
  if (o_.save_n_epoch_ratio > 0) {  // kohya: floor(num_train_epochs / ratio) or 1
    const int64_t epochs = (max_steps_ + steps_per_epoch - 1) / steps_per_epoch;
    o_.save_every_n_epochs = std::max<int64_t>(1, epochs / o_.save_n_epoch_ratio);
    LP_LOG(kInfo, kLog) << "--save_n_epoch_ratio=" << o_.save_n_epoch_ratio << ": a LoRA every "
                        << o_.save_every_n_epochs << " epochs of " << epochs;
  }
  StepOptions step_options = o_.step;
  // kohya's schedule counts its steps once per process (LrScheduleOptions::processes).
  const int64_t processes = std::max(1, o_.ranks.world_size);
  step_options.schedule.processes = processes;
  step_options.schedule.training_steps = max_steps_ * processes;
  step_options.schedule.warmup_steps = warmup_steps_from(o_.lr_warmup_steps, max_steps_ * processes);
  step_options.schedule.initial_lr = o_.step.optimizer_groups.learning_rate;
  step_ = std::make_unique<TrainingStep>(*model_, *network_, step_options);
  if (ranks_) {
    step_->set_gradient_reducer([this](const std::vector<at::Tensor>& grads) { ranks_->sum(grads); });
  }
  network_->set_training(true);
  if (!o_.resume.empty()) load_state(o_.resume);
  prepare_validation();

  LP_LOG(kInfo, kLog) << "LoRA: " << network_->unet_module_count() << " UNet + "
                      << network_->text_encoder_module_count() << " text-encoder modules, "
                      << (o_.dim_from_weights
                              ? "ranks and alphas of " + o_.network_weights.string()
                              : "dim " + std::to_string(o_.network.dim) + ", alpha " +
                                    number(o_.network.alpha))
                      << "; "
                      << scheduler_->train_images() << " training images (repeats included) of "
                      << o_.dataset_id << ", "
                      << scheduler_->reg_images() << " reg; batch " << scheduler_->batch_size()
                      << (scheduler_->datasets() > 1
                              ? " (the largest of " + std::to_string(scheduler_->datasets()) +
                                    " datasets, each batched on its own)"
                              : std::string())
                      << ", " << batches << " batches and " << steps_per_epoch
                      << " steps per epoch"
                      << (scheduler_->bucket_batches()
                              ? " (batch per bucket: " +
                                    format_bucket_batch_sizes(o_.bucket_batch_sizes) + ", " +
                                    std::to_string(scheduler_->samples_per_step()) +
                                    " samples per step)"
                              : std::string())
                      << "; " << max_steps_ << " steps in all on "
                      << models::describe_device(device_)
                      << (partial_text_ ? "; text from the cache, the trained encoders' part "
                                          "encoded at every step"
                          : cached_text_  ? "; text from the cache"
                                          : "; text encoded online")
                      << "; optimizer " << step_->optimizer().describe()
                      << (ranks_ ? "; rank " + std::to_string(ranks_->rank()) + " of " +
                                       std::to_string(ranks_->world_size()) + " over " +
                                       ranks_->backend() + " (the batch is per rank)"
                                 : std::string());
  for (const std::string& warning : scheduler_->warnings()) LP_LOG(kWarning, kLog) << warning;
  if (o_.debug_dataset) return show_dataset();

  if (main_) {
    fs::create_directories(o_.output_dir / "lora");
    remove_stale_saves(o_.output_dir / "lora");
    remove_stale_saves(o_.output_dir / "lora" / "sample_only");
    tensorboard_.emplace(TensorBoardWriter::open(
        o_.tensorboard_dir.empty() ? o_.output_dir / "tensorboard" : o_.tensorboard_dir));
  }
  if (main_ && !o_.pub_endpoint.empty()) {
    pub_.emplace(wire::make_socket(context_, zmq::socket_type::pub));
    pub_->bind(o_.pub_endpoint);
    bound_at_ = std::chrono::steady_clock::now();
    status_ = runtime::StatusPublisher(&*pub_, std::string(kLog));
  }
  status_.ready();

  // kohya's validation tags: the loss over the held-out points as loss/validation/step_average
  // (at a step) or epoch_average (at an epoch's end), and its divergence from the training's
  // average loss (loss/average) at that moment, where there is one yet.
  auto record_validation = [this](const std::string& at, double loss, int64_t when) {
    if (!tensorboard_) return;
    tensorboard_->add_scalar("loss/validation/" + at + "_average", loss, when);
    if (!losses_.empty()) {
      tensorboard_->add_scalar("loss/validation/" + at + "_divergence",
                               loss - losses_.moving_average(), when);
    }
  };
  Summary summary;
  summary.first_validation_loss = validation_loss();
  if (summary.first_validation_loss >= 0) {
    LP_LOG(kInfo, kLog) << "validation loss at step " << global_step_ << ": "
                        << summary.first_validation_loss;
    record_validation("step", summary.first_validation_loss, global_step_);  // lorapipe's own
  }
  int64_t epoch_average_logged = 0;  // the epoch whose loss/epoch_average is written

  if (o_.sample_at_first) save_for_samples(global_step_);  // kohya's, before the first step
  if (main_ && o_.sample_every_n_steps > 0 && o_.sample_every_n_epochs > 0) {
    LP_LOG(kWarning, kLog) << "--sample_every_n_steps is ignored with --sample_every_n_epochs, "
                              "as kohya ignores it: previews come at the ends of epochs";
  }
  if (main_ && !pub_ && (o_.sample_every_n_steps > 0 || o_.sample_every_n_epochs > 0 ||
                         o_.sample_at_first)) {
    LP_LOG(kWarning, kLog) << "--sample_every_n_* / --sample_at_first: lorapipe-sampler renders "
                              "what the trainer announces, and without --pub nothing is "
                              "announced (lorapipe run sets it; by hand, give --pub and start "
                              "lorapipe-sampler --sub on it)";
  }

  thread_ = std::thread([this, e = epoch_, i = next_index_] { producer(e, i); });
  auto stop_producer = [&] {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
  };
  const fs::path state_root = o_.output_dir / "state";
  int64_t bad_in_a_row = 0;
  // Where the step in progress started: a state saved before it completes must resume here.
  int64_t start_epoch = epoch_, start_index = next_index_;
  try {
    while (global_step_ < max_steps_) {
      // Every rank stops together: one asked (its SIGINT), all finish this step.
      const bool stop = ranks_ ? ranks_->sum(g_stop_requested ? 1.0 : 0.0) > 0 : g_stop_requested;
      if (stop) {
        stop_producer();
        summary.lora =
            o_.output_dir / "lora" / (step_stem(o_.output_name, global_step_) + ".safetensors");
        save_lora(summary.lora, global_step_, /*final=*/false, epoch_ - 1);
        summary.state = state_root / (last_stem(o_.output_name) + "-state");
        save_state(summary.state);
        LP_LOG(kInfo, kLog) << "interrupted at step " << global_step_ << " of " << max_steps_
                            << "; state saved in " << summary.state.string()
                            << " (--resume from it)";
        if (tensorboard_) tensorboard_->close();
        summary.interrupted = true;
        summary.steps = global_step_;
        summary.epochs = epoch_;
        summary.skipped_steps = skipped_;
        summary.last_loss = last_loss_;
        return summary;
      }
      const auto step_started = Clock::now();
      // Gradients at a schedule-free optimizer's training point (kohya's optimizer_train_fn),
      // after a save or validation put its average in the weights, or a state saved so resumed.
      step_->optimizer().train();
      start_epoch = epoch_, start_index = next_index_;
      double wait_ms = 0;
      double loss_sum = 0, share_sum = 0;
      struct MicroLoss {
        int64_t epoch, index;
        double loss;
      };
      std::vector<MicroLoss> micro_losses;  // recorded once the step is applied
      bool bad = false;
      // Ctrl-C while the data is late (a remote cacher that does not answer) stops now, from
      // where this step started, instead of after --timeout_s. Ranks stop together at a step's
      // start only, so with ranks the wait goes on.
      bool stopped_waiting = false;
      // The scheduler ends each step: after gradient_accumulation_steps micro-batches (an epoch's
      // last batch ends its step early, as accelerate syncs at the end of kohya's dataloader),
      // or after its bucket's micro-batches with bucket batch sizes.
      for (bool step_done = false; !step_done;) {
        const auto wait_started = Clock::now();
        PreparedBatch prepared;
        {
          std::unique_lock<std::mutex> lock(mutex_);
          while (queue_.empty() && !(g_stop_requested && !ranks_)) {
            cv_.wait_for(lock, std::chrono::milliseconds(200));
          }
          stopped_waiting = queue_.empty();
          if (!stopped_waiting) {
            prepared = std::move(queue_.front());
            queue_.pop_front();
            cv_.notify_all();
          }
        }
        wait_ms += std::chrono::duration<double, std::milli>(Clock::now() - wait_started).count();
        // The producer stopped waiting for the cacher because of that Ctrl-C: the same stop.
        if (!prepared.error.empty() && g_stop_requested && !ranks_) stopped_waiting = true;
        if (stopped_waiting) break;
        if (!prepared.error.empty()) {
          // The data went away (a remote cacher gone for longer than --timeout_s, a record
          // that vanished): keep what was trained.
          const fs::path dir = state_root / (last_stem(o_.output_name) + "-state");
          epoch_ = start_epoch, next_index_ = start_index;
          save_state(dir);
          throw Error(prepared.error + "; state saved in " + dir.string() +
                      " (--resume from it when the data is back)");
        }
        epoch_ = prepared.epoch;
        next_index_ = prepared.index + 1;
        if (!prepared.captions.empty()) {  // kohya's --debug_dataset shows the same
          LP_LOG(kDebug, kLog) << "step " << global_step_ + 1 << " (epoch " << prepared.epoch
                               << ", batch " << prepared.index << ") captions: "
                               << join_quoted(prepared.captions);
        }
        // Every random number of this micro-batch follows from (seed, epoch, index).
        torch::manual_seed(stream(o_.seed, prepared.epoch, prepared.index, "dropout")());
        const double loss =
            step_->accumulate(to_micro_batch(prepared),
                              generator_for(o_.seed, prepared.epoch, prepared.index, "noise"));
        if (!std::isfinite(loss)) bad = true;
        // The step's loss: the micro-batches' mean (kohya's), weighed by their shares of the
        // step's samples with bucket batch sizes. A short step's gradients keep their
        // 1/accumulation scale, as kohya's.
        const double share = prepared.share > 0 ? prepared.share : 1.0;
        loss_sum += loss * share;
        share_sum += share;
        micro_losses.push_back({prepared.epoch, prepared.index, loss});
        step_done = prepared.ends_step;
      }
      if (stopped_waiting) {  // back to where the step started, and out through the stop above
        step_->zero_grad();
        epoch_ = start_epoch, next_index_ = start_index;
        continue;
      }
      // Ranks: each loss is its rows' share, so the sum is the global batch's; a non-finite loss
      // on any rank makes every rank skip the step.
      if (ranks_) {  // every rank's share_sum is the same: the plan is
        loss_sum = ranks_->sum(loss_sum);
        for (MicroLoss& m : micro_losses) m.loss = ranks_->sum(m.loss);
      }
      if (!std::isfinite(loss_sum)) bad = true;
      const double loss = loss_sum / share_sum;
      UpdateResult update;
      if (bad) {
        step_->zero_grad();
      } else {
        update = step_->update();
        if (update.max_norm) max_norm_ = update.max_norm;
      }
      ++global_step_;
      ++steps_this_run_;
      // The step is whole: a rank lost from here on (at the next stop check, in a validation)
      // leaves a state that resumes after it, not one that trains its batches again.
      start_epoch = epoch_, start_index = next_index_;
      if (!update.applied && !bad && update.finding_the_scale()) {
        // fp16's scaler finding its scale: skipped as kohya's (accelerate's GradScaler) skips
        // it, and not counted toward --max_bad_steps, which would otherwise stop a run whose
        // first steps overflow the starting scale of 2^16 ten times in a row.
        ++skipped_;
        LP_LOG(kInfo, kLog) << "step " << global_step_ << ": fp16 gradients overflowed, skipped; "
                            << "the loss scale is lowered to " << update.loss_scale;
      } else if (!update.applied) {
        ++skipped_;
        ++bad_in_a_row;
        LP_LOG(kWarning, kLog) << "step " << global_step_ << ": "
                               << (bad ? "loss is not finite" : "gradients are not finite")
                               << ", skipped (" << bad_in_a_row << " in a row)";
        if (bad_in_a_row >= o_.max_bad_steps) {
          // A damaged model file gives the same symptom as a learning rate too high, and
          // lowering the rate would never cure it: the weights are looked at first.
          // The look must not hide the stop: a failure of its own is logged and left out.
          std::string weight;
          try {
            weight = non_finite_weight();
          } catch (const std::exception& e) {
            LP_LOG(kWarning, kLog) << "the weights could not be looked at for NaN: " << e.what();
          }
          // A LoRA that overflowed is no state to resume: saved, it would replace the last
          // good state of the same name, which `lorapipe resume` would then never reach.
          const bool lora_broken = weight.starts_with(kLoraNotFinite);
          const fs::path dir = state_root / (last_stem(o_.output_name) + "-state");
          if (!lora_broken) save_state(dir);
          throw Error("stopping: " + std::to_string(bad_in_a_row) +
                      " steps in a row had a non-finite loss or gradient (--max_bad_steps); " +
                      (lora_broken ? "no state saved, the states saved before are as they were"
                                   : "state saved in " + dir.string()) +
                      (weight.empty() ? " (lower the learning rate, or try another "
                                        "--mixed_precision, and --resume from it)"
                                      : ". " + weight));
        }
      } else {
        bad_in_a_row = 0;
        last_loss_ = loss;
        // kohya records every micro-batch's loss at its place in the epoch.
        for (const MicroLoss& m : micro_losses) losses_.add(m.epoch, m.index, m.loss);
      }
      const double seconds = std::chrono::duration<double>(Clock::now() - step_started).count();
      publish_progress(loss, seconds, wait_ms);

      const bool epoch_done = next_index_ >= batches;
      if (epoch_done && tensorboard_ && !losses_.empty()) {  // kohya's, at step = epoch
        tensorboard_->add_scalar("loss/epoch_average", losses_.moving_average(), epoch_);
        epoch_average_logged = epoch_;
      }
      bool saved = false;
      if (o_.save_every_n_steps > 0 && global_step_ % o_.save_every_n_steps == 0 &&
          global_step_ < max_steps_) {
        saved = true;
        const std::string name = step_stem(o_.output_name, global_step_);
        save_lora(o_.output_dir / "lora" / (name + ".safetensors"), global_step_, false,
                  epoch_ - 1);
        if (o_.save_state) save_state(state_root / (name + "-state"));
        retain(global_step_, /*epoch=*/0);
      }
      if (epoch_done && o_.save_every_n_epochs > 0 && epoch_ % o_.save_every_n_epochs == 0 &&
          global_step_ < max_steps_) {
        saved = true;
        const std::string name = epoch_stem(o_.output_name, epoch_);
        save_lora(o_.output_dir / "lora" / (name + ".safetensors"), global_step_, false, epoch_);
        if (o_.save_state) save_state(state_root / (name + "-state"));
        retain(/*step=*/0, epoch_);
      }
      // kohya's sample schedule: a save announces itself, and the final save ends the run. With
      // --sample_every_n_epochs the steps' flag is ignored (train_util.sample_images_common).
      const bool sample_step =
          o_.sample_every_n_epochs > 0
              ? epoch_done && epoch_ % o_.sample_every_n_epochs == 0
              : o_.sample_every_n_steps > 0 && global_step_ % o_.sample_every_n_steps == 0;
      if (sample_step && !saved && global_step_ < max_steps_) save_for_samples(global_step_);
      double validated = -1;
      // (The last step's is the run's final validation, below the loop.)
      if (o_.validate_every_n_steps > 0 && global_step_ % o_.validate_every_n_steps == 0 &&
          global_step_ < max_steps_) {
        validated = validation_loss();
        if (validated >= 0) {
          LP_LOG(kInfo, kLog) << "validation loss at step " << global_step_ << ": " << validated;
          record_validation("step", validated, global_step_);
        }
      }
      // kohya's epoch validation (every epoch unless --validate_every_n_epochs); the last
      // epoch's is the end-of-run validation, below the loop.
      const int64_t every_epochs = std::max<int64_t>(1, o_.validate_every_n_epochs);
      if (epoch_done && epoch_ % every_epochs == 0 && global_step_ < max_steps_) {
        if (validated < 0) validated = validation_loss();
        if (validated >= 0) {
          LP_LOG(kInfo, kLog) << "validation loss at the end of epoch " << epoch_ << ": "
                              << validated;
          record_validation("epoch", validated, epoch_);
        }
      }
    }
  } catch (const RankLostError& e) {
    // The step in progress is lost with the rank; rank 0 keeps everything before it.
    stop_producer();
    if (!main_) throw Error(e.what());
    const fs::path dir = state_root / (last_stem(o_.output_name) + "-state");
    epoch_ = start_epoch, next_index_ = start_index;
    save_state(dir);
    throw Error(std::string(e.what()) + "; state saved in " + dir.string() +
                " (start every rank again with --resume from it)");
  } catch (...) {
    stop_producer();
    throw;
  }
  stop_producer();
  // kohya ends its last epoch's loop at --max_train_steps and still writes that epoch's average.
  if (tensorboard_ && !losses_.empty() && epoch_average_logged != epoch_) {
    tensorboard_->add_scalar("loss/epoch_average", losses_.moving_average(), epoch_);
  }

  summary.last_validation_loss = validation_loss();
  if (summary.last_validation_loss >= 0) {
    LP_LOG(kInfo, kLog) << "validation loss at step " << global_step_ << ": "
                        << summary.last_validation_loss;
    // kohya validates after its last epoch too, finished or cut short by --max_train_steps.
    if (epoch_ % std::max<int64_t>(1, o_.validate_every_n_epochs) == 0) {
      LP_LOG(kInfo, kLog) << "validation loss at the end of epoch " << epoch_ << ": "
                          << summary.last_validation_loss;
      record_validation("epoch", summary.last_validation_loss, epoch_);
    }
    record_validation("step", summary.last_validation_loss, global_step_);  // lorapipe's own
  }
  summary.lora = o_.output_dir / "lora" / (last_stem(o_.output_name) + ".safetensors");
  save_lora(summary.lora, global_step_, /*final=*/true, epoch_);
  if (o_.save_state || o_.save_state_on_train_end) {
    save_state(state_root / (last_stem(o_.output_name) + "-state"));
  }
  // kohya saves a step file at the last step too when it is a save step, dropping an old one;
  // the final save stands in for it here. Epoch saves are kept as they are, as in kohya.
  if (o_.save_every_n_steps > 0 && global_step_ % o_.save_every_n_steps == 0) {
    retain(global_step_, /*epoch=*/0);
  }
  if (tensorboard_) tensorboard_->close();
  announce_final_to_late_subscribers();
  summary.steps = global_step_;
  summary.epochs = epoch_;
  summary.skipped_steps = skipped_;
  summary.last_loss = last_loss_;
  return summary;
}

}  // namespace detail

void request_stop() { detail::g_stop_requested = 1; }

Summary train(const Options& options) {
  Options o = options;
  validate(o);
  if (o.threads > 0) at::set_num_threads(o.threads);
  return detail::Run(o).train();
}

}  // namespace lorapipe::trainer
