// The state saved for --resume (the LoRA, the optimizer, the step, the data cursor, the loss
// recorder), written whole or not at all, and read back with the checks that it fits this run.
#include "trainer/run.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>

#include "common/error.h"
#include "common/hash.h"
#include "common/log.h"
#include "common/numbers.h"
#include "trainer/lora_file.h"

namespace lorapipe::trainer::detail {

using nlohmann::json;

namespace {

// Flushes a file's or a folder's contents (a folder's: its entries) to the disk.
void sync_to_disk(const fs::path& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw Error("cannot open " + path.string() + " to sync it: " + std::strerror(errno));
  const int rc = ::fsync(fd);
  const int error = errno;
  ::close(fd);
  if (rc != 0) throw Error("cannot sync " + path.string() + ": " + std::strerror(error));
}

// The folder a state at `dir` is in after a crash in write_folder's fallback, between moving the
// old state aside and moving the new one in.
fs::path moved_aside(const fs::path& dir) {
  return dir.parent_path() / ("." + dir.filename().string() + ".old");
}

// Writes a folder under a temporary name, flushes it to the disk, and puts it in place of `dir`,
// so that a crash or a full disk leaves the old folder or the new one whole, never a mix: Linux
// swaps the two in one step; where the file system cannot, the old one moves aside first
// (moved_aside(dir), where load_state looks when `dir` is missing) and is removed last. A fill
// that throws (a full disk) leaves `dir` as it was and removes what it wrote. It throws only
// before the new folder is in place: what can fail after (syncing the parent folder, removing
// the old one) is a warning, as the new folder is whole by then.
// write_folder's last steps, once the new `dir` is in place: flush the rename to the disk and
// remove the previous folder, now at `previous`. Failures are warnings: `dir` is whole.
void after_swap(const fs::path& dir, const fs::path& previous) {
  try {
    sync_to_disk(dir.parent_path());
  } catch (const std::exception& e) {
    LP_LOG(kWarning, kLog) << dir.string() << " is in place, but " << e.what();
  }
  std::error_code error;
  fs::remove_all(previous, error);
  if (error) {
    LP_LOG(kWarning, kLog) << "cannot remove " << previous.string() << ": " << error.message();
  }
}

template <typename Fill>
void write_folder(const fs::path& dir, Fill fill) {
  const fs::path temp = dir.parent_path() / ("." + dir.filename().string() + ".tmp");
  const fs::path old = moved_aside(dir);
  fs::remove_all(temp);
  fs::create_directories(temp);
  try {
    fill(temp);
    for (const auto& entry : fs::directory_iterator(temp)) {
      if (entry.is_regular_file()) sync_to_disk(entry.path());
    }
    sync_to_disk(temp);
  } catch (...) {
    std::error_code ignored;  // the error being thrown is the one to report
    fs::remove_all(temp, ignored);
    throw;
  }
  if (fs::exists(dir)) {
#ifdef RENAME_EXCHANGE
    if (::renameat2(AT_FDCWD, temp.c_str(), AT_FDCWD, dir.c_str(), RENAME_EXCHANGE) == 0) {
      after_swap(dir, temp);  // the old folder, now under the temporary name
      return;
    }
#endif
    fs::remove_all(old);
    fs::rename(dir, old);
  }
  fs::rename(temp, dir);
  after_swap(dir, old);
}

// What of the dataset the data cursor is a place in: how many samples, in which buckets and
// datasets, repeated how often, batched how. A state's cursor means nothing in another shape (a
// folder re-cached with images added or removed under the same --dataset_id); an edited caption
// or image keeps the shape, and resumes as kohya's does. Hashed as a sorted set: the cacher
// writes entries in the order preprocess finishes them.
std::string dataset_shape(const wire::Manifest& manifest) {
  std::vector<std::string> entries;
  for (const auto& e : manifest.entries()) {
    entries.push_back(std::to_string(e.dataset_index()) + "/" + std::to_string(e.subset_index()) +
                      " " + std::to_string(e.bucket().width()) + "x" +
                      std::to_string(e.bucket().height()) + " r" + std::to_string(e.repeats()) +
                      " b" + std::to_string(e.batch_size()) + (e.is_reg() ? " reg" : "") +
                      (e.flip() ? " flip" : ""));
  }
  std::sort(entries.begin(), entries.end());
  Hasher hasher;
  hasher.field("dataset shape v1");
  for (const std::string& entry : entries) hasher.field(entry);
  return std::to_string(entries.size()) + " samples, " + hasher.digest().hex().substr(0, 12);
}

}  // namespace

json Run::data_plan() const {
  json plan = {{"train_batch_size", o_.train_batch_size},
               {"gradient_accumulation_steps", o_.step.gradient_accumulation_steps},
               {"fill_last_batch", o_.fill_last_batch},
               {"bucket_batch_sizes", o_.bucket_batch_sizes.empty()
                                          ? std::string()
                                          : format_bucket_batch_sizes(o_.bucket_batch_sizes)},
               {"validation_split", o_.validation_split}};
  // Its seed decides the split only when there is one, by the flag or a dataset TOML (whose
  // own split and seed travel in the manifest, checked with it) (--seed, checked on its own,
  // the rest). The training entries keep the TOML's fields after the split.
  if (holds_out_for_validation(manifest_, o_.validation_split)) {
    plan["validation_seed"] = o_.validation_seed;
  }
  return plan;
}

void Run::save_state(const fs::path& dir) {
  if (!main_) return;
  fs::create_directories(dir.parent_path());
  try {
    save_state_folder(dir);
  } catch (const std::exception& e) {
    // write_folder throws only before the new state is in place (see there).
    std::error_code ignored;
    const bool before = fs::exists(dir / "trainer.json", ignored) ||
                        fs::exists(moved_aside(dir) / "trainer.json", ignored);
    throw Error("cannot save the state " + dir.string() + " at step " +
                std::to_string(global_step_) +
                (before ? " (the state saved there before stays whole): " : ": ") + e.what());
  }
  LP_LOG(kInfo, kLog) << "saved state " << dir.string() << " at step " << global_step_;
}

void Run::save_state_folder(const fs::path& dir) {
  write_folder(dir, [&](const fs::path& folder) {
    write_lora_file(folder / "lora.safetensors", network_->state_dict(torch::kFloat), {});
    step_->optimizer().save(folder / "optimizer.pt");
    json state{{"format", 1},
               {"dataset_id", o_.dataset_id},
               {"seed", o_.seed},
               {"global_step", global_step_},
               {"epoch", epoch_},
               {"next_index", next_index_},
               {"skipped_steps", skipped_},
               {"loss_list", losses_.losses},
               {"loss_total", losses_.total},
               {"loss_scale", step_->loss_scale()},
               {"scale_growth_tracker", step_->scale_growth_tracker()},
               {"run_id", run_id_},
               {"world_size", o_.ranks.world_size},
               {"training_started_at", training_started_at_},
               {"plan", data_plan()},
               {"dataset_shape", dataset_shape(manifest_)}};
    const fs::path file = folder / "trainer.json";
    std::ofstream out(file);
    out << state.dump(2);
    out.close();
    if (!out) throw Error("cannot write " + file.string() + ": " + std::strerror(errno));
  });
}

void Run::load_state(const fs::path& given) {
  const fs::path asked = given.has_filename() ? given : given.parent_path();  // "state/x/"
  fs::path dir = asked;
  if (!fs::exists(dir / "trainer.json") && fs::exists(moved_aside(asked) / "trainer.json")) {
    // A crash came while a save replaced this state: the old one is whole, moved aside.
    dir = moved_aside(asked);
    LP_LOG(kWarning, kLog) << "--resume=" << asked.string() << ": resuming from " << dir.string()
                           << ", the state a crash left while the next one was being saved";
  }
  const fs::path file = dir / "trainer.json";
  if (!fs::exists(file)) {
    throw InputError("--resume=" + asked.string() +
                     ": no trainer.json (not a state folder written "
                     "with --save_state)");
  }
  json state;
  try {
    state = json::parse(std::ifstream(file));
    for (const char* key : {"global_step", "epoch", "next_index", "skipped_steps",
                            "scale_growth_tracker"}) {
      if (!state.at(key).is_number_integer()) {
        throw InputError(file.string() + ": '" + key + "' is not a whole number");
      }
    }
    for (const char* key : {"loss_scale"}) {
      if (!state.at(key).is_number()) {
        throw InputError(file.string() + ": '" + key + "' is not a number");
      }
    }
    if (state.contains("loss_list")) {
      bool numbers = state["loss_list"].is_array() && state.value("loss_total", json()).is_number();
      for (const json& v : state["loss_list"]) numbers = numbers && v.is_number();
      if (!numbers) {
        throw InputError(file.string() + ": 'loss_list' is not a list of numbers with its total");
      }
    }
    // The keys read below with defaults: a hand-edited value of the wrong type is named here.
    for (const char* key : {"training_started_at", "dataset_id", "run_id"}) {
      if (state.contains(key) && !state[key].is_string()) {
        throw InputError(file.string() + ": '" + key + "' is not text");
      }
    }
    for (const char* key : {"seed", "world_size"}) {
      if (state.contains(key) && !state[key].is_number_unsigned()) {
        throw InputError(file.string() + ": '" + key + "' is not a whole number");
      }
    }
    if (state.contains("plan") && !state["plan"].is_object()) {
      throw InputError(file.string() + ": 'plan' is not an object of flags");
    }
  } catch (const json::exception& e) {
    throw InputError(file.string() + ": " + e.what());
  }
  if (state.value("dataset_id", "") != o_.dataset_id || state.value("seed", 0ull) != o_.seed) {
    throw InputError("--resume=" + dir.string() + ": that state trained dataset '" +
                     state.value("dataset_id", "") + "' with seed " +
                     std::to_string(state.value("seed", 0ull)) + ", this run asks for '" +
                     o_.dataset_id + "' with seed " + std::to_string(o_.seed));
  }
  // The data cursor counts global batches (train_batch_size x ranks): another rank count would
  // resume somewhere else in the epoch.
  if (state.value("world_size", 1) != o_.ranks.world_size) {
    throw InputError("--resume=" + dir.string() + ": that state was trained by " +
                     std::to_string(state.value("world_size", 1)) + " ranks, this run has " +
                     std::to_string(o_.ranks.world_size) + " (WORLD_SIZE)");
  }
  // The data cursor is a place in the plan these flags make: another plan would resume
  // somewhere else in the epoch (and change what was held out for validation).
  if (state.contains("plan")) {
    const json plan = data_plan();
    for (const auto& [flag, value] : state["plan"].items()) {
      if (plan.contains(flag) && plan[flag] != value) {
        throw InputError("--resume=" + asked.string() + ": that state was trained with --" +
                         flag + "=" + value.dump() + ", this run gives " + plan[flag].dump() +
                         ": resume with the same value");
      }
    }
  }
  // States before the shape was kept: not checked.
  if (state.contains("dataset_shape") && state["dataset_shape"] != dataset_shape(manifest_)) {
    throw InputError("--resume=" + asked.string() + ": the dataset '" + o_.dataset_id +
                     "' is not the one that state trained (" +
                     state["dataset_shape"].dump() + " then, \"" + dataset_shape(manifest_) +
                     "\" now: images added or removed, or other buckets or repeats), so its "
                     "place in the epoch is nowhere in this one. Cache the dataset as it was, or "
                     "start a new run (--network_weights takes the state's lora.safetensors)");
  }
  network_->load(dir / "lora.safetensors");
  step_->optimizer().load(dir / "optimizer.pt");
  global_step_ = state.at("global_step");
  epoch_ = state.at("epoch");
  next_index_ = state.at("next_index");
  skipped_ = state.at("skipped_steps");
  // A state before the loss recorder was kept: the average starts again.
  losses_.losses = state.value("loss_list", std::vector<double>{});
  losses_.total = state.value("loss_total", 0.0);
  step_->set_scaler(state.at("loss_scale"), state.at("scale_growth_tracker"));
  step_->set_updates(global_step_ - skipped_);
  run_id_ = state.value("run_id", run_id_);
  // States before the metadata's timestamps were Unix times held a date: this run's start then.
  const std::string started = state.value("training_started_at", training_started_at_);
  if (parse_double(started)) training_started_at_ = started;
  LP_LOG(kInfo, kLog) << "resumed from " << dir.string() << " at step " << global_step_
                      << ", epoch " << epoch_;
}

}  // namespace lorapipe::trainer::detail
