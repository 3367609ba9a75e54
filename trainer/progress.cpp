// A step's progress: TrainProgress for the launcher, kohya's TensorBoard tags, the terminal line.
#include "trainer/run.h"

#include <sys/resource.h>
#include <unistd.h>

#include <cstdio>

#if __has_include(<c10/cuda/CUDACachingAllocator.h>)
#include <c10/cuda/CUDACachingAllocator.h>
#define LORAPIPE_HAVE_CUDA_ALLOCATOR 1
#endif

#include "common/log.h"
#include "models/tensor_memory.h"

namespace lorapipe::trainer::detail {

namespace {

uint64_t peak_rss() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<uint64_t>(usage.ru_maxrss) * 1024;
}

// The peak of the tensors allocated on the device: CUDA's allocator's count, or on the CPU the
// counter trainer/main.cpp installs first thing (the same tensors, less the kernels' own
// workspaces). Without it (a test's own step), the process's peak resident set.
uint64_t peak_memory(const at::Device& device) {
#ifdef LORAPIPE_HAVE_CUDA_ALLOCATOR
  if (device.is_cuda()) {
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index());
    return static_cast<uint64_t>(stats.allocated_bytes[0].peak);
  }
#endif
  if (models::TensorMemoryCounter* counter = models::TensorMemoryCounter::installed()) {
    return static_cast<uint64_t>(counter->peak_bytes());
  }
  return peak_rss();
}

}  // namespace

void Run::publish_progress(double loss, double seconds_per_step, double wait_ms) {
  if (!main_) return;
  const double average = losses_.empty() ? loss : losses_.moving_average();
  const double eta = seconds_per_step * static_cast<double>(max_steps_ - global_step_);
  const uint64_t peak = peak_memory(device_);
  const double lr = step_->optimizer().lr(0);
  if (tensorboard_) {
    tensorboard_->add_scalar("loss/current", loss, global_step_);
    tensorboard_->add_scalar("loss/average", average, global_step_);
    // kohya's tags, so a run shows beside kohya's in one TensorBoard: lr/textencoder, lr/unet,
    // lr/unet_block5 with block learning rates, and "lr/unet plus" for LoRA+'s up matrices.
    const std::vector<std::string>& groups = step_->group_names();
    for (size_t g = 0; g < groups.size(); ++g) {
      std::string tag = groups[g];
      if (tag.starts_with("text_encoder")) tag.replace(0, 12, "textencoder");
      if (tag.ends_with("_plus")) tag.replace(tag.size() - 5, 5, " plus");
      tensorboard_->add_scalar("lr/" + tag, step_->optimizer().lr(g), global_step_);
      if (const auto adapted = step_->optimizer().adapted_lr(g)) {  // Prodigy: kohya's d*lr
        tensorboard_->add_scalar("lr/d*lr/" + tag, *adapted, global_step_);
      }
    }
    tensorboard_->add_scalar("time/s_per_it", seconds_per_step, global_step_);
    tensorboard_->add_scalar("time/data_wait_ms", wait_ms, global_step_);
    tensorboard_->add_scalar("memory/peak_allocated_bytes", static_cast<double>(peak),
                             global_step_);
    if (device_.is_cpu()) {
      tensorboard_->add_scalar("memory/peak_rss_bytes", static_cast<double>(peak_rss()),
                               global_step_);
    }
    if (max_norm_) {  // --scale_weight_norms, under kohya's tags
      tensorboard_->add_scalar("max_norm/keys_scaled", static_cast<double>(max_norm_->keys_scaled),
                               global_step_);
      tensorboard_->add_scalar("norm/avg_key_norm", max_norm_->mean_norm, global_step_);
      tensorboard_->add_scalar("max_norm/max_key_norm", max_norm_->max_norm, global_step_);
    }
  }
  if (pub_) {
    wire::TrainProgress p;
    p.set_run_id(run_id_);
    p.set_step(static_cast<uint64_t>(global_step_));
    p.set_total_steps(static_cast<uint64_t>(max_steps_));
    p.set_epoch(static_cast<uint32_t>(epoch_));
    p.set_loss(loss);
    p.set_average_loss(average);
    p.set_learning_rate(lr);
    p.set_seconds_per_step(seconds_per_step);
    p.set_samples_per_second(seconds_per_step > 0
                                 ? scheduler_->batch_size() * o_.step.gradient_accumulation_steps /
                                       seconds_per_step
                                 : 0);
    p.set_data_wait_ms(wait_ms);
    p.set_peak_memory_bytes(peak);
    p.set_eta_seconds(eta);
    p.set_skipped_steps(static_cast<uint64_t>(skipped_));
    (void)wire::send(*pub_, p);
    status_.progress(static_cast<uint64_t>(global_step_), static_cast<uint64_t>(max_steps_),
                     "steps");
    status_.tick();
    const auto now = std::chrono::steady_clock::now();
    if (last_checkpoint_ &&
        std::chrono::duration<double>(now - last_announce_).count() > o_.checkpoint_reannounce_s) {
      (void)wire::send(*pub_, *last_checkpoint_);
      last_announce_ = now;
    }
  }
  char line[256];
  std::snprintf(line, sizeof line, "step %lld/%lld  loss %.4f  avg %.4f  %.2f s/it  ETA %.0f s",
                static_cast<long long>(global_step_), static_cast<long long>(max_steps_), loss,
                average, seconds_per_step, eta);
  if (isatty(STDERR_FILENO)) {
    std::fprintf(stderr, "\r%s\033[K", line);
    if (global_step_ == max_steps_) std::fputc('\n', stderr);
  } else {
    LP_LOG(kInfo, kLog) << line;
  }
}

}  // namespace lorapipe::trainer::detail
