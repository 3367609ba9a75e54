// What a run writes for users and the sampler: LoRA files under kohya's names, the sampler's
// checkpoint events, and kohya's retention of older saves.
#include "trainer/run.h"

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <functional>

#include "common/log.h"
#include "models/placement.h"
#include "trainer/lora_file.h"

namespace lorapipe::trainer::detail {

// kohya's save names (train_util's get_step_ckpt_name and its kin), without the extension; the
// state saved with one is named NAME-state (kohya's STEP_STATE_NAME and its kin). Without
// --output_name each kind has its own name.
std::string step_stem(const std::string& output_name, int64_t step) {
  char suffix[32];
  std::snprintf(suffix, sizeof suffix, "-step%08lld", static_cast<long long>(step));
  return (output_name.empty() ? "at" : output_name) + suffix;
}

std::string epoch_stem(const std::string& output_name, int64_t epoch) {
  char suffix[32];
  std::snprintf(suffix, sizeof suffix, "-%06lld", static_cast<long long>(epoch));
  return (output_name.empty() ? "epoch" : output_name) + suffix;
}

std::string last_stem(const std::string& output_name) {
  return output_name.empty() ? "last" : output_name;
}

void Run::save_lora(const fs::path& path, int64_t step, bool final, int64_t epoch) {
  // A schedule-free optimizer's average is the model (kohya's optimizer_eval_fn before a save),
  // on every rank alike: the next step's train() moves each rank's weights back the same way.
  step_->optimizer().eval();
  if (!main_) return;  // every rank holds the same LoRA; rank 0 writes it
  fs::create_directories(path.parent_path());
  const WrittenLora written = write_lora_file(
      path, network_->state_dict(models::parse_precision(o_.save_precision, "--save_precision")), metadata(step, epoch));
  LP_LOG(kInfo, kLog) << "saved " << path.string();
  if (!pub_) return;
  wire::CheckpointReady event;
  event.set_run_id(run_id_);
  event.set_path(fs::absolute(path).string());
  event.set_step(static_cast<uint64_t>(step));
  event.set_epoch(static_cast<uint32_t>(epoch_));
  event.set_sha256(written.sha256);
  event.set_final(final);
  event.set_output_name(o_.output_name);
  (void)wire::send(*pub_, event);
  last_checkpoint_ = event;
  last_announce_ = std::chrono::steady_clock::now();
}

void Run::announce_final_to_late_subscribers() {
  if (!pub_ || !last_checkpoint_ || !last_checkpoint_->final()) return;
  // A sampler that started with the run may still be waiting to reconnect (ZeroMQ retries a
  // missing endpoint with a growing interval, up to wire's reconnect_interval_max): a run that
  // ends that soon after binding announces its final checkpoint again until every such sampler
  // has joined. A run that lasted longer has them all already, and waits for nothing.
  const auto joined_by = bound_at_ + wire::SocketOptions{}.reconnect_interval_max +
                         std::chrono::milliseconds(500);
  while (std::chrono::steady_clock::now() < joined_by) {
    std::this_thread::sleep_for(std::chrono::milliseconds(250));
    (void)wire::send(*pub_, *last_checkpoint_);
  }
}

void Run::save_for_samples(int64_t step) {
  if (!main_ || !pub_) return;  // nobody would render it
  const fs::path dir = o_.output_dir / "lora" / "sample_only";
  save_lora(dir / (step_stem(o_.output_name, step) + ".safetensors"), step, false, epoch_ - 1);
  // This run's newest three stay: the sampler renders the newest, and one it is still reading is
  // not pulled from under it. Only this --output_name's files are this run's (kohya's habit is
  // one folder for many runs); of those, a step past this one is a stale save of an earlier run
  // under the same name, which would otherwise sort as the newest.
  const std::string prefix = step_stem(o_.output_name, 0);
  const std::string head = prefix.substr(0, prefix.size() - 8);  // "NAME-step"
  std::vector<std::pair<int64_t, fs::path>> files;
  for (const auto& entry : fs::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    const std::string digits = name.substr(std::min(head.size(), name.size()));
    if (!name.starts_with(head) || digits.size() != 8 + 12 || !digits.ends_with(".safetensors") ||
        !std::all_of(digits.begin(), digits.begin() + 8,
                     [](unsigned char c) { return std::isdigit(c) != 0; })) {
      continue;
    }
    const int64_t saved = std::stoll(digits.substr(0, 8));
    if (saved > step) {
      fs::remove(entry.path());
    } else {
      files.emplace_back(saved, entry.path());
    }
  }
  std::sort(files.begin(), files.end());  // oldest first
  for (size_t i = 0; i + 3 < files.size(); ++i) fs::remove(files[i].second);
}

// 0 for `step` or `epoch` leaves that kind of save alone.
void Run::retain(int64_t step, int64_t epoch) {
  if (!main_) return;
  // kohya's --save_last_n_steps / --save_last_n_epochs remove older periodic saves, LoRA files
  // and states alike, unless --save_last_n_steps_state / --save_last_n_epochs_state keep states
  // by their own count.
  const fs::path lora_dir = o_.output_dir / "lora";
  const fs::path state_dir = o_.output_dir / "state";
  auto step_name = [&](int64_t s) { return step_stem(o_.output_name, s); };
  auto epoch_name = [&](int64_t e) { return epoch_stem(o_.output_name, e); };
  auto prune_steps = [&](int64_t last_n, const std::function<fs::path(int64_t)>& path) {
    if (step <= 0 || last_n <= 0 || o_.save_every_n_steps <= 0) return;
    for (int64_t s = step - last_n - 1; s > 0; --s) {  // kohya's rule, and what it left before
      if (s % o_.save_every_n_steps != 0) continue;
      if (!fs::exists(path(s))) break;
      fs::remove_all(path(s));
    }
  };
  auto prune_epochs = [&](int64_t last_n, const std::function<fs::path(int64_t)>& path) {
    if (epoch <= 0 || last_n <= 0 || o_.save_every_n_epochs <= 0) return;
    // kohya keeps the last N epoch saves: saving epoch e removes e - every * N, and older ones.
    for (int64_t e = epoch - o_.save_every_n_epochs * last_n; e > 0; --e) fs::remove_all(path(e));
  };
  prune_steps(o_.save_last_n_steps,
              [&](int64_t s) { return lora_dir / (step_name(s) + ".safetensors"); });
  prune_steps(o_.save_last_n_steps_state > 0 ? o_.save_last_n_steps_state : o_.save_last_n_steps,
              [&](int64_t s) { return state_dir / (step_name(s) + "-state"); });
  prune_epochs(o_.save_last_n_epochs,
               [&](int64_t e) { return lora_dir / (epoch_name(e) + ".safetensors"); });
  prune_epochs(o_.save_last_n_epochs_state > 0 ? o_.save_last_n_epochs_state
                                               : o_.save_last_n_epochs,
               [&](int64_t e) { return state_dir / (epoch_name(e) + "-state"); });
}

}  // namespace lorapipe::trainer::detail
