#include "trainer/trainer.h"

#include <fcntl.h>
#include <malloc.h>
#include <csignal>
#include <sys/resource.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <deque>
#include <fstream>
#include <functional>
#include <iomanip>
#include <mutex>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <sstream>
#include <thread>

#if __has_include(<c10/cuda/CUDACachingAllocator.h>)
#include <c10/cuda/CUDACachingAllocator.h>
#define LORAPIPE_HAVE_CUDA_ALLOCATOR 1
#endif

#include "cacher/records.h"
#include "common/error.h"
#include "common/log.h"
#include "common/numbers.h"
#include "common/random.h"
#include "common/sha256.h"
#include "models/device.h"
#include "models/fingerprint.h"
#include "models/float8.h"
#include "models/lora_merge.h"
#include "models/pipeline.h"
#include "models/prompt_attention.h"
#include "proto/wire.h"
#include "runtime/stage.h"
#include "trainer/dataset.h"
#include "trainer/lora_file.h"
#include "trainer/loss_recorder.h"
#include "trainer/ranks.h"
#include "trainer/records.h"
#include "trainer/tensorboard.h"

namespace lorapipe::trainer {
namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using nlohmann::json;

namespace {

constexpr std::string_view kLog = "trainer";
constexpr int kPrefetchDepth = 2;
// kohya's validation timesteps (train_network.py): four, evenly inside [min_timestep,
// max_timestep] (np.linspace(min, max, 6, dtype=int)[1:-1]; 200, 400, 600, 800 by default), fixed
// so validation losses compare.
std::vector<int64_t> validation_timesteps(const NoiseOptions& noise) {
  std::vector<int64_t> out;
  const double step = static_cast<double>(noise.max_timestep - noise.min_timestep) / 5.0;
  for (int k = 1; k <= 4; ++k) {
    out.push_back(static_cast<int64_t>(std::floor(static_cast<double>(noise.min_timestep) + k * step)));
  }
  return out;
}

c10::ScalarType precision(const std::string& name, const char* flag) {
  if (name == "no" || name == "float" || name == "fp32") return torch::kFloat;
  if (name == "fp16") return torch::kHalf;
  if (name == "bf16") return torch::kBFloat16;
  throw InputError(std::string(flag) + "='" + name + "': use " +
                   (std::string(flag) == "--mixed_precision" ? "no" : "float") + ", fp16 or bf16");
}

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

at::Generator generator_for(uint64_t seed, int64_t epoch, int64_t index, std::string_view purpose) {
  return at::make_generator<at::CPUGeneratorImpl>(stream(seed, epoch, index, purpose)());
}

// kohya's legacy model hash (train_util.model_hash): 64 KiB at 1 MiB into the file.
std::string legacy_model_hash(const fs::path& file) {
  std::ifstream in(file, std::ios::binary);
  if (!in) return "NOFILE";
  in.seekg(0x100000);
  std::string bytes(0x10000, '\0');
  in.read(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  bytes.resize(static_cast<size_t>(in.gcount()));
  return sha256_hex(bytes).substr(0, 8);
}

// kohya's str(time.time()): seconds since the epoch as a Python float. Web UIs read the
// training timestamps back with float() (A1111's metadata editor shows them as dates).
std::string unix_time_now() {
  const auto now = std::chrono::system_clock::now().time_since_epoch();
  return python_float_repr(std::chrono::duration<double>(now).count());
}

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

std::string iso_now() {
  const std::time_t now = std::time(nullptr);
  char buffer[32];
  std::strftime(buffer, sizeof buffer, "%Y-%m-%dT%H:%M:%S", std::gmtime(&now));
  return buffer;
}

std::string number(double v) {
  std::ostringstream out;
  out << std::setprecision(17) << v;
  return out.str();
}

// 'a', 'b': each caption in single quotes, as a log line shows them.
std::string join_quoted(const std::vector<std::string>& texts) {
  std::string out;
  for (const std::string& text : texts) out += (out.empty() ? "'" : ", '") + text + "'";
  return out;
}

uint64_t peak_memory(const at::Device& device) {
#ifdef LORAPIPE_HAVE_CUDA_ALLOCATOR
  if (device.is_cuda()) {
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index());
    return static_cast<uint64_t>(stats.allocated_bytes[0].peak);
  }
#endif
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<uint64_t>(usage.ru_maxrss) * 1024;
}

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

struct PreparedBatch {
  int64_t epoch = 0;
  int64_t index = 0;  // micro-batch index within the epoch
  torch::Tensor latents;
  torch::Tensor hidden_states;  // cached text, or undefined
  torch::Tensor pooled;
  std::vector<std::string> captions;
  torch::Tensor loss_weights;
  torch::Tensor masks;  // [B, 1, h, w] kohya's alpha masks when any image has one, or undefined
  std::vector<bool> flipped;  // which images are their flipped twins
  std::string error;  // the producer failed: this message, then stop
};

}  // namespace

void apply_network_args(Options& options) {
  BlockArgs blocks;
  for (const std::string& arg : options.network_args) {
    const size_t eq = arg.find('=');
    if (eq == std::string::npos)
      throw InputError("--network_args '" + arg + "': expected key=value");
    const std::string key = arg.substr(0, eq), value = arg.substr(eq + 1);
    if (key == "block_dims" || key == "block_alphas" || key == "conv_block_dims" ||
        key == "conv_block_alphas" || key == "down_lr_weight" || key == "mid_lr_weight" ||
        key == "up_lr_weight") {
      blocks.values[key] = value;  // lists and curves: resolve_block_args reads them
      continue;
    }
    double v = 0;
    try {
      size_t used = 0;
      v = std::stod(value, &used);
      if (used != value.size()) throw std::invalid_argument(value);
    } catch (const std::exception&) {
      throw InputError("--network_args '" + arg + "': '" + value + "' is not a number");
    }
    if (key == "conv_dim") {
      options.network.conv_dim = static_cast<int64_t>(v);
    } else if (key == "conv_alpha") {
      options.network.conv_alpha = v;
    } else if (key == "rank_dropout") {
      options.network.rank_dropout = v;
    } else if (key == "module_dropout") {
      options.network.module_dropout = v;
    } else if (key == "loraplus_lr_ratio") {
      options.step.optimizer_groups.loraplus_lr_ratio = v;
    } else if (key == "loraplus_unet_lr_ratio") {
      options.step.optimizer_groups.loraplus_unet_lr_ratio = v;
    } else if (key == "loraplus_text_encoder_lr_ratio") {
      options.step.optimizer_groups.loraplus_text_encoder_lr_ratio = v;
    } else if (key == "block_lr_zero_threshold") {
      blocks.zero_threshold = v;
    } else {
      throw InputError("--network_args '" + arg + "': unknown argument '" + key +
                       "' (known: conv_dim, conv_alpha, rank_dropout, module_dropout, "
                       "loraplus_lr_ratio, loraplus_unet_lr_ratio, "
                       "loraplus_text_encoder_lr_ratio, block_dims, block_alphas, "
                       "conv_block_dims, conv_block_alphas, down_lr_weight, mid_lr_weight, "
                       "up_lr_weight, block_lr_zero_threshold)");
    }
  }
  // After the loop: conv_dim and conv_alpha may come after the block lists.
  for (const std::string& warning : resolve_block_args(blocks, options.network)) {
    LP_LOG(kWarning, kLog) << "--network_args: " << warning;
  }
}

void check_options(const Options& o) {
  validate(o);
  // The files and folders the flags name are there (read only once the data is cached).
  auto there = [](const fs::path& path, const std::string& flag) {
    std::error_code ec;
    if (!path.empty() && !fs::exists(path, ec)) {
      throw InputError(path.string() + " (" + flag + "): no such file or folder");
    }
  };
  there(o.model, "--pretrained_model_name_or_path");
  there(o.tokenizer, "--tokenizer");
  there(o.vae, "--vae");
  there(o.network_weights, "--network_weights");
  there(o.resume, "--resume");
  for (const auto& [file, multiplier] : o.base_weights) there(file, "--base_weights");
  LoraNetwork::check(o.network);
  TrainingStep::check(o.step);
  // The optimizer's type and arguments, over a stand-in tensor: its real groups come with the
  // model.
  std::vector<ParamGroup> groups;
  groups.push_back(ParamGroup{{torch::zeros({1}).requires_grad_()},
                              o.step.optimizer_groups.learning_rate, "check"});
  (void)make_optimizer(o.step.optimizer, std::move(groups));
}

void validate(const Options& o) {
  auto need = [](bool ok, const std::string& message) {
    if (!ok) throw InputError(message);
  };
  need(!o.model.empty(), "--pretrained_model_name_or_path is required");
  need(!o.dataset_id.empty(),
       "--dataset_id is required (the manifest preprocess and the cacher wrote)");
  need(!o.output_dir.empty(), "--output_dir is required");
  need(o.output_name.find('/') == std::string::npos,
       "--output_name='" + o.output_name + "' must be a plain file name");
  need(!o.dim_from_weights || !o.network_weights.empty(),
       "--dim_from_weights takes the ranks from --network_weights, which is unset");
  need(!o.dim_from_weights || o.network.block_dims.empty(),
       "block-wise network_args (block_dims, *_lr_weight) shape a new network; --dim_from_weights "
       "takes the ranks of --network_weights instead");
  need(o.max_train_steps > 0 || o.max_train_epochs > 0,
       "--max_train_steps=" + std::to_string(o.max_train_steps) + ": must be at least 1");
  need(o.max_train_epochs >= 0, "--max_train_epochs must not be negative");
  need(o.train_batch_size >= 1,
       "--train_batch_size=" + std::to_string(o.train_batch_size) + ": must be at least 1");
  need(o.network.dim >= 1,
       "--network_dim=" + std::to_string(o.network.dim) + ": must be at least 1");
  need(o.network.alpha >= 0, "--network_alpha must not be negative");
  const auto& lr = o.step.optimizer_groups;
  need(lr.learning_rate >= 0,
       "--learning_rate=" + number(lr.learning_rate) + ": must not be negative");
  need(o.step.gradient_accumulation_steps >= 1, "--gradient_accumulation_steps must be at least 1");
  need(o.max_bad_steps >= 1, "--max_bad_steps must be at least 1");
  need(o.validation_split >= 0 && o.validation_split < 1, "--validation_split must be in [0, 1)");
  need(o.save_every_n_steps >= 0 && o.save_every_n_epochs >= 0, "--save_every_n_* must be >= 0");
  need(o.save_n_epoch_ratio >= 0, "--save_n_epoch_ratio must be >= 0");
  need(o.sample_every_n_steps >= 0 && o.sample_every_n_epochs >= 0,
       "--sample_every_n_* must be >= 0");
  need(o.prior_loss_weight >= 0, "--prior_loss_weight must not be negative");
  need(o.threads >= 0, "--threads must not be negative");
  need(o.step.clip_skip >= 1, "--clip_skip must be at least 1");
  need(o.max_token_length == 75 || o.max_token_length == 150 || o.max_token_length == 225,
       "--max_token_length=" + std::to_string(o.max_token_length) +
           ": expected 75, 150 or 225 (kohya's)");
  precision(o.mixed_precision, "--mixed_precision");
  precision(o.save_precision, "--save_precision");
  LrScheduleOptions schedule = o.step.schedule;
  trainer::validate(schedule);
  // What kohya refuses at start rather than train with silently.
  need(!(schedule.name == "constant" && o.lr_warmup_steps > 0),
       "--lr_scheduler=constant takes no --lr_warmup_steps: use constant_with_warmup");

  need(!(schedule.name == "polynomial" && lr.learning_rate <= schedule.lr_end),
       "--lr_scheduler=polynomial decays to " + number(schedule.lr_end) +
           ": --learning_rate=" + number(lr.learning_rate) + " must be above it");
  need(o.step.noise.adaptive_noise_scale == 0 || o.step.noise.noise_offset > 0,
       "--adaptive_noise_scale needs --noise_offset");
  (void)elementwise_loss(torch::zeros({1}), torch::zeros({1}), o.step.loss_type, torch::ones({1}));
  OptimizerOptions optimizer = o.step.optimizer;
  (void)make_optimizer(optimizer,
                       {ParamGroup{{torch::zeros({1}, torch::requires_grad())}, 1e-4, "x"}});
}

namespace {

// Set by request_stop() (from a signal handler), read between steps.
volatile std::sig_atomic_t g_stop_requested = 0;

class Run {
 public:
  explicit Run(const Options& options) : o_(options) {}
  Summary train();
  Summary train_steps();

 private:
  void load_data();
  void preflight();
  void load_model();
  void prepare_validation();
  Summary show_dataset();
  double validation_loss();
  void producer(int64_t epoch, int64_t index);
  PreparedBatch prepare(int64_t epoch, int64_t index, const PlannedBatch& plan);
  MicroBatch to_micro_batch(const PreparedBatch& prepared);
  void save_lora(const fs::path& path, int64_t step, bool final);
  void save_state(const fs::path& dir);
  void save_state_folder(const fs::path& dir);  // save_state's files, without its messages
  void load_state(const fs::path& dir);
  void announce_final_to_late_subscribers();
  // The flags that decide which batch comes where (saved with a state, checked on resume).
  nlohmann::json data_plan() const;
  void retain(int64_t step, int64_t epoch);
  // A LoRA for the sampler alone (kohya's sample schedule between saves), announced like a save.
  void save_for_samples(int64_t step);
  void publish_progress(double loss, double seconds_per_step, double wait_ms);
  std::map<std::string, std::string> metadata(int64_t step) const;

  Options o_;
  std::unique_ptr<RecordSource> records_;
  wire::Manifest manifest_;
  wire::Manifest validation_manifest_;
  DatasetMetadata dataset_metadata_;  // kohya's ss_tag_frequency and dirs: once, for every save
  models::StableDiffusion model_;
  at::Device device_{torch::kCPU};
  bool cached_text_ = false;
  std::unique_ptr<LoraNetwork> network_;
  std::unique_ptr<TrainingStep> step_;
  std::unique_ptr<BatchScheduler> scheduler_;
  std::optional<TensorBoardWriter> tensorboard_;  // rank 0 only
  std::unique_ptr<RankGroup> ranks_;              // with WORLD_SIZE > 1
  bool main_ = true;                              // rank 0: saves, publishes, logs
  zmq::context_t context_;
  std::optional<zmq::socket_t> pub_;
  runtime::StatusPublisher status_{nullptr, "trainer"};  // on pub_ once it is bound
  // The newest CheckpointReady, sent again every checkpoint_reannounce_s while the run goes on: a
  // sampler that starts (or restarts) mid-run renders the newest checkpoint without waiting for
  // the next save. Samplers skip a step they have already rendered.
  std::optional<wire::CheckpointReady> last_checkpoint_;
  std::chrono::steady_clock::time_point last_announce_;
  std::chrono::steady_clock::time_point bound_at_;  // when pub_ was bound
  std::string run_id_;
  std::string model_hash_, model_sha256_, vae_hash_, vae_sha256_;
  std::string training_started_at_;

  int64_t max_steps_ = 0;
  int64_t global_step_ = 0;
  int64_t epoch_ = 1;
  int64_t next_index_ = 0;  // the next micro-batch of epoch_
  int64_t skipped_ = 0;
  int64_t masked_images_ = 0;  // latent records with kohya's alpha mask
  LossRecorder losses_;  // kohya's average loss; saved with a state
  double last_loss_ = 0;
  Clock::time_point started_ = Clock::now();
  int64_t steps_this_run_ = 0;

  // Prefetch.
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<PreparedBatch> queue_;
  bool stop_ = false;
  std::thread thread_;

  // Validation: fixed latents, conditioning inputs and noise.
  std::vector<PreparedBatch> validation_;
  // --scale_weight_norms: the last max-norm pass, for TensorBoard.
  std::optional<MaxNormResult> max_norm_;
};

void Run::load_data() {
  records_ = o_.cacher_endpoint.empty()
                 ? open_local_records(o_.cache_dir)
                 : open_remote_records(
                       o_.cacher_endpoint,
                       std::chrono::milliseconds(static_cast<int64_t>(o_.timeout_s * 1000)));
  // Ctrl-C while a remote cacher does not answer stops the waiting (see train_steps); ranks
  // stop together at a step's start only, so they go on waiting.
  if (o_.ranks.world_size <= 1) records_->cancel_waiting_when([] { return g_stop_requested != 0; });
  std::string resolved;
  manifest_ = records_->manifest(o_.dataset_id, &resolved);
  if (resolved != o_.dataset_id) {
    LP_LOG(kInfo, kLog) << "dataset " << o_.dataset_id << ": manifest " << resolved
                        << " (named by its content)";
    o_.dataset_id = resolved;
  }
  if (o_.weighted_captions) {
    // A caption whose attention syntax cannot be read (a weight like "1.2.3") is refused here,
    // naming its image, not when its batch comes up hours into the run.
    std::vector<std::string> bad;
    for (const wire::ManifestEntry& e : manifest_.entries()) {
      try {
        (void)models::parse_prompt_attention(e.caption());
      } catch (const InputError& error) {
        bad.push_back(e.path() + ": " + error.what());
      }
    }
    if (!bad.empty()) {
      std::string message = "--weighted_captions: " + std::to_string(bad.size()) +
                            " caption(s) whose attention syntax cannot be read";
      for (size_t i = 0; i < bad.size() && i < 5; ++i) message += "\n  " + bad[i];
      throw InputError(message);
    }
  }
  if (o_.validation_split > 0) {
    const ValidationSplit split =
        split_for_validation(manifest_, o_.validation_split, o_.validation_seed);
    wire::Manifest train = manifest_;
    train.clear_entries();
    validation_manifest_ = manifest_;
    validation_manifest_.clear_entries();
    for (int i = 0; i < manifest_.entries_size(); ++i) {
      const auto k = static_cast<size_t>(i);
      if (split.trains[k]) *train.add_entries() = manifest_.entries(i);
      if (split.validates[k]) *validation_manifest_.add_entries() = manifest_.entries(i);
    }
    manifest_ = std::move(train);
  }
  scheduler_ = std::make_unique<BatchScheduler>(manifest_, o_.train_batch_size, o_.seed,
                                                o_.fill_last_batch, o_.ranks.world_size);
  dataset_metadata_ = kohya_dataset_metadata(manifest_, *scheduler_);  // the training images
}

void Run::preflight() {
  // --dim_from_weights: the file the network is built from, read before any compute.
  if (o_.dim_from_weights) o_.network.ranks_from_weights = lora_file_ranks(o_.network_weights);
  // Every record the run will read, read once and checked, before any compute.
  std::vector<std::string> latent_keys, text_keys;
  std::set<std::string> seen;
  for (const wire::Manifest* m : {&manifest_, &validation_manifest_}) {
    for (const auto& e : m->entries()) {
      if (seen.insert(e.latent_key()).second) latent_keys.push_back(e.latent_key());
      if (cached_text_ && seen.insert(e.text_key()).second) text_keys.push_back(e.text_key());
    }
  }
  std::vector<std::string> problems;
  auto check = [&](RecordKind kind, const std::vector<std::string>& keys) {
    for (size_t at = 0; at < keys.size(); at += 256) {
      const std::vector<std::string> chunk(keys.begin() + at,
                                           keys.begin() + std::min(keys.size(), at + 256));
      const auto values = records_->get(kind, chunk);
      for (size_t i = 0; i < chunk.size(); ++i) {
        if (!values[i]) {
          problems.push_back(chunk[i] + ": missing");
          continue;
        }
        const std::string why = kind == RecordKind::kLatent
                                    ? cacher::check_latent_record(*values[i])
                                    : cacher::check_text_record(*values[i]);
        if (!why.empty()) problems.push_back(chunk[i] + ": " + why);
        wire::LatentRecord latent;
        if (why.empty() && kind == RecordKind::kLatent && latent.ParseFromString(*values[i]) &&
            latent.has_mask()) {
          ++masked_images_;
        }
      }
    }
  };
  check(RecordKind::kLatent, latent_keys);
  check(RecordKind::kText, text_keys);
  // kohya masks the loss whenever the batch carries alpha masks; --masked_loss asks for masks.
  if (masked_images_ > 0) {
    LP_LOG(kInfo, kLog) << masked_images_ << " of " << latent_keys.size()
                        << " images carry an alpha mask: their loss is masked by it";
  } else if (o_.masked_loss) {
    LP_LOG(kWarning, kLog) << "--masked_loss: no image of manifest '" << o_.dataset_id
                           << "' carries an alpha mask (preprocess with --alpha_mask, or "
                              "alpha_mask = true in the dataset TOML): the loss is not masked";
  }
  if (problems.empty()) return;
  std::string message = "manifest '" + o_.dataset_id + "' in " + records_->describe() + ": " +
                        std::to_string(problems.size()) + " records missing or damaged (re-run " +
                        "the cacher on the dataset):";
  for (size_t i = 0; i < problems.size() && i < 10; ++i) message += "\n  " + problems[i];
  if (problems.size() > 10) message += "\n  ...";
  throw InputError(message);
}

void Run::load_model() {
  device_ = rank_device(o_.device, o_.ranks);  // --device, or LOCAL_RANK's GPU with ranks
  models::LoadOptions load;
  load.tokenizer = o_.tokenizer;
  load.device = torch::kCPU;
  load.dtype = torch::kFloat;
  load.vae = o_.vae;
  model_ = models::load_stable_diffusion(o_.model, load);
  if (!model_.tokenizer) {
    throw InputError(o_.model.string() + " carries no tokenizer: pass --tokenizer");
  }
  for (const auto& [file, multiplier] : o_.base_weights) {
    // Into the fp32 weights, before they take the compute dtype. The text encoder changes with
    // them, so text cached from the plain one no longer matches and is encoded online.
    const models::MergedLora merged(model_, file, multiplier, /*keep_originals=*/false);
    LP_LOG(kInfo, kLog) << "--base_weights: merged " << file.string() << " x" << multiplier
                        << " into the base model";
  }
  // Latents from another VAE would train the LoRA on the wrong images. The cacher fingerprints
  // the VAE in its compute dtype, so each dtype it may have used is tried.
  models::DiffusionModel& family_model = model_;
  bool vae_matches = false;
  for (auto dtype : {torch::kFloat, torch::kHalf, torch::kBFloat16}) {
    family_model.vae_module().to(dtype);
    if (models::weights_fingerprint(family_model.vae_module(), "vae") ==
        manifest_.vae_fingerprint()) {
      vae_matches = true;
      break;
    }
  }
  model_.vae = nullptr;  // training needs no VAE
  if (!vae_matches) {
    const std::string vae = o_.vae.empty() ? o_.model.string() + "'s" : "--vae=" + o_.vae.string();
    throw InputError("manifest '" + o_.dataset_id + "' was cached with another VAE (fingerprint " +
                     manifest_.vae_fingerprint().substr(0, 12) + ") than " + vae +
                     ": re-cache the dataset with this model (run preprocess and the cacher, "
                     "with the same --vae), or give the trainer the cacher's --vae");
  }
  const bool train_te = o_.network.train_text_encoder;
  if (o_.weighted_captions) {
    LP_LOG(kInfo, kLog) << "--weighted_captions: captions are encoded online, their attention "
                           "syntax weighing their tokens";
  } else if (manifest_.text_cached() && !train_te) {
    const std::string settings =
        family_model.text_encoder_settings(o_.step.clip_skip, o_.max_token_length);
    // Each dtype the cacher may have used is tried on the weights as loaded. A conversion rounds
    // them, so when none matches and the text is to be encoded online, the loaded fp32 weights
    // are put back (else it would encode through weights rounded to bf16).
    torch::nn::Module& text_encoder = family_model.text_encoder_module();
    std::vector<torch::Tensor> loaded;
    for (const torch::Tensor& p : text_encoder.parameters()) loaded.push_back(p.detach().clone());
    for (auto dtype : {torch::kFloat, torch::kHalf, torch::kBFloat16}) {
      text_encoder.to(dtype);
      if (models::weights_fingerprint(text_encoder, settings) ==
          manifest_.text_encoder_fingerprint()) {
        cached_text_ = true;
        break;
      }
    }
    if (!cached_text_) {
      torch::NoGradGuard no_grad;
      text_encoder.to(torch::kFloat);
      const auto params = text_encoder.parameters();
      for (size_t i = 0; i < params.size(); ++i) params[i].copy_(loaded[i]);
      LP_LOG(kInfo, kLog) << "cached text was made by another text encoder, clip skip or "
                             "max_token_length: captions are encoded online";
    }
  }
  const c10::ScalarType dtype = o_.step.base_dtype;
  const bool unet_fp8 = o_.fp8_base || o_.fp8_base_unet;
  const bool text_encoder_fp8 = o_.fp8_base && !o_.fp8_base_unet;  // kohya: _unet wins
  if (unet_fp8 || text_encoder_fp8) {
    // Converted on the CPU, then moved: the device never holds the wider weights.
    model_.unet->to(dtype);
    model_.text_encoder->to(dtype);
    auto store = [](torch::nn::Module& module, const char* name) {
      const models::Float8Storage s = models::store_weights_in_float8(module);
      LP_LOG(kInfo, kLog) << "--fp8_base: the " << name << "'s " << s.tensors
                          << " Linear and Conv2d weights stored in float8_e4m3fn, "
                          << s.bytes_before / (1 << 20) << " MiB -> " << s.bytes_after / (1 << 20)
                          << " MiB";
      if (s.saturated > 0) {
        LP_LOG(kWarning, kLog) << "--fp8_base: " << s.saturated << " of the " << name
                               << "'s weights hold values beyond float8's +-448, clamped to it";
      }
    };
    if (unet_fp8) store(*model_.unet, "U-Net");
    if (text_encoder_fp8) store(*model_.text_encoder, "text encoder");
    model_.unet->to(device_);  // device only: a dtype would widen the float8 weights again
    model_.text_encoder->to(device_);
  } else {
    model_.unet->to(device_, dtype);
    model_.text_encoder->to(device_, dtype);
  }
  for (auto& p : model_.unet->parameters()) p.requires_grad_(false);
  for (auto& p : model_.text_encoder->parameters()) p.requires_grad_(false);
  if (fs::is_regular_file(o_.model)) {
    model_hash_ = legacy_model_hash(o_.model);
    model_sha256_ = sha256_file(o_.model);
  }
  if (fs::is_regular_file(o_.vae)) {
    vae_hash_ = legacy_model_hash(o_.vae);
    vae_sha256_ = sha256_file(o_.vae);
  }
#ifdef __GLIBC__
  // Loading went through copies of every weight (and the VAE, dropped above); under the heap
  // policy of keep_freed_memory_for_reuse they would stay resident for the whole run. Hand them
  // back once: at SD1.5 size that is about 3 GB of the process's peak.
  malloc_trim(0);
#endif
}

PreparedBatch Run::prepare(int64_t epoch, int64_t index, const PlannedBatch& plan) {
  PreparedBatch out;
  out.epoch = epoch;
  out.index = index;
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
  const int64_t accumulation = o_.step.gradient_accumulation_steps;
  const auto batches = static_cast<int64_t>(scheduler_->batches_per_epoch());
  const CaptionClock clock{
      epoch, (epoch - 1) * ((batches + accumulation - 1) / accumulation) + index / accumulation,
      max_steps_};
  std::vector<torch::Tensor> latent_list, hidden_list, pooled_list, mask_list;
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
      hidden_list.push_back(from_record(text.hidden_states()));
      if (text.has_pooled()) pooled_list.push_back(from_record(text.pooled()));
    } else {
      out.captions.push_back(process_caption(e.caption(), e.caption_settings(), clock, rng));
    }
  }
  out.latents = torch::stack(latent_list) * o_.step.vae_scaling_factor;
  if (cached_text_) out.hidden_states = torch::stack(hidden_list);
  if (cached_text_ && pooled_list.size() == hidden_list.size())
    out.pooled = torch::stack(pooled_list);
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
  if (p.hidden_states.defined()) {
    batch.encoder_hidden_states = p.hidden_states;
    batch.pooled = p.pooled;
  } else {
    batch.input_ids = o_.weighted_captions ? model_.tokenize_weighted(p.captions, o_.max_token_length,
                                                                      batch.token_weights)
                                           : model_.tokenize(p.captions, o_.max_token_length);
  }
  if (ranks_) {  // this rank's share of the global batch, the last rank's possibly shorter
    const int64_t n = batch.latents.size(0), world = ranks_->world_size();
    const int64_t per = (n + world - 1) / world;
    batch.rows_begin = std::min(n, per * ranks_->rank());
    batch.rows = std::min(per, n - batch.rows_begin);
  }
  return batch;
}

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
    p.latents = from_record(record.mean()).unsqueeze(0) * o_.step.vae_scaling_factor;
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

// kohya's --debug_dataset: every micro-batch of the run as training would take it (the same
// plan, flips and captions, drawn from the same streams), printed; nothing is trained or saved.
Summary Run::show_dataset() {
  cached_text_ = false;  // captions through process_caption, as online text is; fixed ones stay
  const int64_t accumulation = o_.step.gradient_accumulation_steps;
  const auto batches = static_cast<int64_t>(scheduler_->batches_per_epoch());
  const int64_t steps_per_epoch = (batches + accumulation - 1) / accumulation;
  Summary summary;
  summary.dataset_only = true;
  for (int64_t epoch = epoch_;; ++epoch) {
    const std::vector<PlannedBatch> plan = scheduler_->epoch(epoch);
    for (int64_t index = 0; index < static_cast<int64_t>(plan.size()); ++index) {
      const int64_t step = (epoch - 1) * steps_per_epoch + index / accumulation + 1;
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

double Run::validation_loss() {
  if (validation_.empty()) return -1;
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
    for (int64_t t : validation_timesteps(o_.step.noise)) {
      at::Generator g = generator_for(o_.validation_seed, static_cast<int64_t>(i), t, "val-noise");
      const torch::Tensor latents = batch.latents.to(device_, torch::kFloat);
      // kohya validates through its training's process_batch: the noise is drawn as in training
      // (--noise_offset, multires noise and --ip_noise_gamma act), from the fixed generator.
      const torch::Tensor noise = draw_noise(latents, o_.step.noise, g);
      const torch::Tensor timesteps = torch::full({latents.size(0)}, t, torch::kInt64).to(device_);
      const torch::Tensor input_noise = draw_input_noise(noise, o_.step.noise, g);
      // kohya's process_batch weighs the validation loss as the training loss: the samples'
      // loss weights, then the SNR weightings.
      torch::Tensor loss =
          step_->per_sample_loss(latents, noise, timesteps, conditioning, input_noise, batch.masks);
      if (batch.loss_weights.defined()) loss = loss * batch.loss_weights.to(device_, torch::kFloat);
      sum += step_->weighted_by_snr(loss, timesteps).mean().item<double>();
      ++n;
    }
  }
  network_->set_training(true);
  return sum / static_cast<double>(n);
}

std::map<std::string, std::string> Run::metadata(int64_t step) const {
  const auto& s = o_.step;
  std::map<std::string, std::string> m;
  const int64_t batches = static_cast<int64_t>(scheduler_->batches_per_epoch());
  m["ss_session_id"] = run_id_;
  m["ss_training_started_at"] = training_started_at_;
  m["ss_output_name"] = o_.output_name.empty() ? "None" : o_.output_name;  // kohya's argument
  // Floats as kohya's str() writes them (Python's repr); None for an option not given.
  auto float_or_none = [](double v) { return v > 0 ? python_float_repr(v) : std::string("None"); };
  const auto& lr = s.optimizer_groups;
  m["ss_learning_rate"] = python_float_repr(lr.learning_rate);
  m["ss_unet_lr"] = python_float_repr(lr.unet_lr >= 0 ? lr.unet_lr : lr.learning_rate);
  m["ss_text_encoder_lr"] =
      python_float_repr(lr.text_encoder_lr >= 0 ? lr.text_encoder_lr : lr.learning_rate);
  m["ss_num_train_images"] = std::to_string(scheduler_->train_images());
  m["ss_num_reg_images"] = std::to_string(scheduler_->reg_images());
  uint64_t validation_images = 0;  // kohya's: repeats included
  for (const auto& e : validation_manifest_.entries()) {
    if (!e.is_reg()) validation_images += std::max<uint32_t>(1, e.repeats());
  }
  m["ss_num_validation_images"] = std::to_string(validation_images);
  m["ss_num_batches_per_epoch"] = std::to_string(batches);
  // Epochs end on steps (an epoch's last batch ends its step): ceil(batches / accumulation) each.
  const int64_t steps_per_epoch = std::max<int64_t>(
      1, (batches + s.gradient_accumulation_steps - 1) / s.gradient_accumulation_steps);
  m["ss_num_epochs"] = std::to_string((max_steps_ + steps_per_epoch - 1) / steps_per_epoch);
  if (!dataset_metadata_.dataset_config) {  // kohya's, for a dataset without a TOML
    m["ss_batch_size_per_device"] =
        std::to_string(scheduler_->batch_size() / std::max(1, o_.ranks.world_size));
    m["ss_total_batch_size"] =
        std::to_string(scheduler_->batch_size() * s.gradient_accumulation_steps);
  }
  m["ss_gradient_checkpointing"] = s.gradient_checkpointing ? "True" : "False";
  m["ss_gradient_accumulation_steps"] = std::to_string(s.gradient_accumulation_steps);
  m["ss_max_train_steps"] = std::to_string(max_steps_);
  m["ss_lr_warmup_steps"] = std::to_string(s.schedule.warmup_steps);
  m["ss_lr_scheduler"] = s.schedule.name;
  m["ss_network_module"] = "networks.lora";
  m["ss_network_dim"] = std::to_string(o_.network.dim);
  m["ss_network_alpha"] = number(o_.network.alpha == 0 ? o_.network.dim : o_.network.alpha);
  if (o_.dim_from_weights) {
    // The network is the file's, not the flags': its largest rank and that module's alpha (kohya
    // writes the flags' here, which then describe no module of the file).
    const LoraNetwork::Module* widest = nullptr;
    for (const auto& module : network_->modules()) {
      if (widest == nullptr || module.adapter->rank() > widest->adapter->rank()) widest = &module;
    }
    if (widest != nullptr) {
      m["ss_network_dim"] = std::to_string(widest->adapter->rank());
      m["ss_network_alpha"] = number(widest->alpha);
    }
  }
  m["ss_network_dropout"] = float_or_none(o_.network.dropout);
  json args = json::object();
  for (const std::string& a : o_.network_args) {
    const size_t eq = a.find('=');
    args[a.substr(0, eq)] = a.substr(eq + 1);
  }
  m["ss_network_args"] = args.dump();
  m["ss_mixed_precision"] = o_.mixed_precision;
  m["ss_full_fp16"] = "False";
  m["ss_v2"] = "False";
  m["ss_base_model_version"] = "sd_v1";
  m["ss_clip_skip"] = std::to_string(s.clip_skip);
  // kohya writes its argument: None when not given, which is 75.
  m["ss_max_token_length"] = o_.max_token_length == 75 ? "None" : std::to_string(o_.max_token_length);
  m["ss_cache_latents"] = "True";
  m["ss_seed"] = std::to_string(o_.seed);
  m["ss_lowram"] = o_.lowram ? "True" : "False";
  m["ss_noise_offset"] = float_or_none(s.noise.noise_offset);
  m["ss_noise_offset_random_strength"] = s.noise.noise_offset_random_strength ? "True" : "False";
  m["ss_adaptive_noise_scale"] =
      s.noise.adaptive_noise_scale != 0 ? python_float_repr(s.noise.adaptive_noise_scale) : "None";
  m["ss_multires_noise_iterations"] = s.noise.multires_noise_iterations > 0
                                          ? std::to_string(s.noise.multires_noise_iterations)
                                          : "None";
  m["ss_multires_noise_discount"] = python_float_repr(s.noise.multires_noise_discount);
  m["ss_min_snr_gamma"] = float_or_none(s.min_snr_gamma);
  m["ss_debiased_estimation"] = s.debiased_estimation_loss ? "True" : "False";
  m["ss_zero_terminal_snr"] = s.zero_terminal_snr ? "True" : "False";
  m["ss_masked_loss"] = o_.masked_loss ? "True" : "False";
  m["ss_scale_weight_norms"] = float_or_none(s.scale_weight_norms);
  m["ss_ip_noise_gamma"] = float_or_none(s.noise.ip_noise_gamma);
  m["ss_ip_noise_gamma_random_strength"] =
      s.noise.ip_noise_gamma_random_strength ? "True" : "False";
  m["ss_prior_loss_weight"] = python_float_repr(o_.prior_loss_weight);
  m["ss_max_grad_norm"] = python_float_repr(s.max_grad_norm);
  m["ss_loss_type"] = s.loss_type;
  m["ss_huber_schedule"] = s.huber_schedule;
  m["ss_huber_scale"] = python_float_repr(s.huber_scale);
  m["ss_fp8_base"] = o_.fp8_base ? "True" : "False";
  m["ss_fp8_base_unet"] = o_.fp8_base_unet ? "True" : "False";
  m["ss_huber_c"] = python_float_repr(s.huber_c);
  m["ss_optimizer"] = step_->optimizer().describe();
  m["ss_training_comment"] = o_.training_comment.empty() ? "None" : o_.training_comment;
  m["ss_sd_model_name"] = o_.model.filename().string();
  m["ss_sd_model_hash"] = model_hash_;
  m["ss_new_sd_model_hash"] = model_sha256_;
  if (!o_.vae.empty()) {  // kohya's: the file's name and hashes (a folder: its path alone)
    const fs::path name = o_.vae.has_filename() ? o_.vae.filename() : o_.vae.parent_path().filename();
    m["ss_vae_name"] = name.string();
    if (!vae_hash_.empty()) {
      m["ss_vae_hash"] = vae_hash_;
      m["ss_new_vae_hash"] = vae_sha256_;
    }
  }
  m.insert(dataset_metadata_.keys.begin(), dataset_metadata_.keys.end());
  m["ss_steps"] = std::to_string(step);
  m["ss_epoch"] = std::to_string(epoch_);
  m["ss_training_finished_at"] = unix_time_now();
  m["ss_validation_split"] = python_float_repr(o_.validation_split);
  m["ss_validation_seed"] = std::to_string(o_.validation_seed);
  m["ss_validate_every_n_steps"] = std::to_string(o_.validate_every_n_steps);
  m["ss_validate_every_n_epochs"] =
      o_.validate_every_n_epochs > 0 ? std::to_string(o_.validate_every_n_epochs) : "None";
  m["ss_max_validation_steps"] =
      o_.max_validation_steps > 0 ? std::to_string(o_.max_validation_steps) : "None";
  m["ss_v_parameterization"] = s.v_prediction ? "True" : "False";
  if (o_.no_metadata) {
    // kohya's minimum metadata (SS_METADATA_MINIMUM_KEYS): what a loader needs to apply the file.
    std::map<std::string, std::string> minimum;
    for (const char* key : {"ss_v2", "ss_base_model_version", "ss_network_module", "ss_network_dim",
                            "ss_network_alpha"}) {
      minimum[key] = m.at(key);
    }
    if (!o_.network_args.empty()) minimum["ss_network_args"] = m.at("ss_network_args");
    m = std::move(minimum);
  }
  // ModelSpec 1.0.1, as kohya's sai_model_spec writes it for an SD1.x LoRA.
  m["modelspec.sai_model_spec"] = "1.0.1";
  m["modelspec.architecture"] = "stable-diffusion-v1/lora";
  m["modelspec.implementation"] = "diffusers";
  // kohya's: --metadata_title (below), else --output_name, else "LoRA@" and the time.
  m["modelspec.title"] = o_.output_name.empty() ? "LoRA@" + unix_time_now() : o_.output_name;
  m["modelspec.date"] = iso_now().substr(0, 19);
  m["modelspec.prediction_type"] = s.v_prediction ? "v" : "epsilon";
  m["modelspec.resolution"] =
      std::to_string(dataset_metadata_.width) + "x" + std::to_string(dataset_metadata_.height);
  if (s.clip_skip != 1) m["modelspec.encoder_layer"] = std::to_string(s.clip_skip);
  if (s.noise.min_timestep != 0 || s.noise.max_timestep != 1000) {
    m["modelspec.timestep_range"] =
        std::to_string(s.noise.min_timestep) + "," + std::to_string(s.noise.max_timestep);
  }
  for (const auto& [field, value] : o_.modelspec) m["modelspec." + field] = value;
  return m;
}

void Run::save_lora(const fs::path& path, int64_t step, bool final) {
  if (!main_) return;  // every rank holds the same LoRA; rank 0 writes it
  fs::create_directories(path.parent_path());
  const WrittenLora written = write_lora_file(
      path, network_->state_dict(precision(o_.save_precision, "--save_precision")), metadata(step));
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

json Run::data_plan() const {
  json plan = {{"train_batch_size", o_.train_batch_size},
               {"gradient_accumulation_steps", o_.step.gradient_accumulation_steps},
               {"fill_last_batch", o_.fill_last_batch},
               {"validation_split", o_.validation_split}};
  // Its seed decides the split only when there is one (--seed, checked on its own, the rest).
  if (o_.validation_split > 0) plan["validation_seed"] = o_.validation_seed;
  return plan;
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
               {"plan", data_plan()}};
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
    if (state.contains("training_started_at") && !state["training_started_at"].is_string()) {
      throw InputError(file.string() + ": 'training_started_at' is not text");
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

void Run::save_for_samples(int64_t step) {
  if (!main_ || !pub_) return;  // nobody would render it
  const fs::path dir = o_.output_dir / "lora" / "sample_only";
  save_lora(dir / (step_stem(o_.output_name, step) + ".safetensors"), step, false);
  // The newest three stay: the sampler renders the newest, and one it is still reading is not
  // pulled from under it.
  std::vector<fs::path> files;
  for (const auto& entry : fs::directory_iterator(dir)) {
    if (entry.path().extension() == ".safetensors") files.push_back(entry.path());
  }
  std::sort(files.begin(), files.end());  // zero-padded steps: oldest first
  for (size_t i = 0; i + 3 < files.size(); ++i) fs::remove(files[i]);
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
    tensorboard_->add_scalar("memory/peak_bytes", static_cast<double>(peak), global_step_);
    if (max_norm_) {  // --scale_weight_norms, under kohya's tags
      tensorboard_->add_scalar("max_norm/keys_scaled", static_cast<double>(max_norm_->keys_scaled),
                               global_step_);
      tensorboard_->add_scalar("max_norm/average_key_norm", max_norm_->mean_norm, global_step_);
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
  run_id_ = last_stem(o_.output_name) + "-" + std::to_string(std::time(nullptr));
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
  network_ = std::make_unique<LoraNetwork>(model_, o_.network,
                                           at::make_generator<at::CPUGeneratorImpl>(o_.seed));
  if (!o_.network_weights.empty()) network_->load(o_.network_weights);
  const int64_t batches = static_cast<int64_t>(scheduler_->batches_per_epoch());
  const int64_t accumulation = o_.step.gradient_accumulation_steps;
  const int64_t steps_per_epoch = (batches + accumulation - 1) / accumulation;
  max_steps_ = o_.max_train_epochs > 0 ? o_.max_train_epochs * steps_per_epoch : o_.max_train_steps;
  if (o_.save_n_epoch_ratio > 0) {  // kohya: floor(num_train_epochs / ratio) or 1
    const int64_t epochs = (max_steps_ + steps_per_epoch - 1) / steps_per_epoch;
    o_.save_every_n_epochs = std::max<int64_t>(1, epochs / o_.save_n_epoch_ratio);
    LP_LOG(kInfo, kLog) << "--save_n_epoch_ratio=" << o_.save_n_epoch_ratio << ": a LoRA every "
                        << o_.save_every_n_epochs << " epochs of " << epochs;
  }
  StepOptions step_options = o_.step;
  step_options.schedule.training_steps = max_steps_;
  step_options.schedule.warmup_steps = warmup_steps_from(o_.lr_warmup_steps, max_steps_);
  step_options.schedule.initial_lr = o_.step.optimizer_groups.learning_rate;
  step_ = std::make_unique<TrainingStep>(model_, *network_, step_options);
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
                      << " steps per epoch; " << max_steps_ << " steps in all on "
                      << models::describe_device(device_)
                      << (cached_text_ ? "; text from the cache" : "; text encoded online")
                      << "; optimizer " << step_->optimizer().describe()
                      << (ranks_ ? "; rank " + std::to_string(ranks_->rank()) + " of " +
                                       std::to_string(ranks_->world_size()) + " over " +
                                       ranks_->backend() + " (the batch is per rank)"
                                 : std::string());
  if (o_.debug_dataset) return show_dataset();

  if (main_) {
    fs::create_directories(o_.output_dir / "lora");
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

  Summary summary;
  summary.first_validation_loss = validation_loss();
  if (summary.first_validation_loss >= 0) {
    LP_LOG(kInfo, kLog) << "validation loss at step " << global_step_ << ": "
                        << summary.first_validation_loss;
    if (tensorboard_) {
      tensorboard_->add_scalar("loss/validation", summary.first_validation_loss, global_step_);
    }
  }

  if (o_.sample_at_first) save_for_samples(global_step_);  // kohya's, before the first step
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
        save_lora(summary.lora, global_step_, /*final=*/false);
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
      start_epoch = epoch_, start_index = next_index_;
      double wait_ms = 0;
      double loss_sum = 0;
      int64_t micro_batches = 0;
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
      for (int64_t micro = 0; micro < accumulation; ++micro) {
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
        loss_sum += loss;
        ++micro_batches;
        micro_losses.push_back({prepared.epoch, prepared.index, loss});
        // An epoch's last batch ends the step, as accelerate syncs at the end of kohya's
        // dataloader: a short step's gradients keep their 1/accumulation scale, and epochs end
        // on steps (steps_per_epoch above).
        if (next_index_ >= batches) break;
      }
      if (stopped_waiting) {  // back to where the step started, and out through the stop above
        step_->zero_grad();
        epoch_ = start_epoch, next_index_ = start_index;
        continue;
      }
      // Ranks: each loss is its rows' share, so the sum is the global batch's; a non-finite loss
      // on any rank makes every rank skip the step.
      if (ranks_) {
        loss_sum = ranks_->sum(loss_sum);
        for (MicroLoss& m : micro_losses) m.loss = ranks_->sum(m.loss);
      }
      if (!std::isfinite(loss_sum)) bad = true;
      const double loss = loss_sum / static_cast<double>(micro_batches);
      UpdateResult update;
      if (bad) {
        step_->zero_grad();
      } else {
        update = step_->update();
        if (update.max_norm) max_norm_ = update.max_norm;
      }
      ++global_step_;
      ++steps_this_run_;
      if (!update.applied) {
        ++skipped_;
        ++bad_in_a_row;
        LP_LOG(kWarning, kLog) << "step " << global_step_ << ": "
                               << (bad ? "loss is not finite" : "gradients are not finite")
                               << ", skipped (" << bad_in_a_row << " in a row)";
        if (bad_in_a_row >= o_.max_bad_steps) {
          const fs::path dir = state_root / (last_stem(o_.output_name) + "-state");
          save_state(dir);
          throw Error("stopping: " + std::to_string(bad_in_a_row) +
                      " steps in a row had a non-finite loss or gradient (--max_bad_steps); "
                      "state saved in " +
                      dir.string() +
                      " (lower the learning rate, or try "
                      "another --mixed_precision, and --resume from it)");
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
        tensorboard_->add_scalar("loss/epoch", losses_.moving_average(), epoch_);
      }
      bool saved = false;
      if (o_.save_every_n_steps > 0 && global_step_ % o_.save_every_n_steps == 0 &&
          global_step_ < max_steps_) {
        saved = true;
        const std::string name = step_stem(o_.output_name, global_step_);
        save_lora(o_.output_dir / "lora" / (name + ".safetensors"), global_step_, false);
        if (o_.save_state) save_state(state_root / (name + "-state"));
        retain(global_step_, /*epoch=*/0);
      }
      if (epoch_done && o_.save_every_n_epochs > 0 && epoch_ % o_.save_every_n_epochs == 0 &&
          global_step_ < max_steps_) {
        saved = true;
        const std::string name = epoch_stem(o_.output_name, epoch_);
        save_lora(o_.output_dir / "lora" / (name + ".safetensors"), global_step_, false);
        if (o_.save_state) save_state(state_root / (name + "-state"));
        retain(/*step=*/0, epoch_);
      }
      // kohya's sample schedule: a save announces itself, and the final save ends the run.
      const bool sample_step =
          (o_.sample_every_n_steps > 0 && global_step_ % o_.sample_every_n_steps == 0) ||
          (epoch_done && o_.sample_every_n_epochs > 0 && epoch_ % o_.sample_every_n_epochs == 0);
      if (sample_step && !saved && global_step_ < max_steps_) save_for_samples(global_step_);
      double validated = -1;
      if (o_.validate_every_n_steps > 0 && global_step_ % o_.validate_every_n_steps == 0) {
        validated = validation_loss();
        if (validated >= 0) {
          LP_LOG(kInfo, kLog) << "validation loss at step " << global_step_ << ": " << validated;
          if (tensorboard_) tensorboard_->add_scalar("loss/validation", validated, global_step_);
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
          if (tensorboard_) {
            tensorboard_->add_scalar("loss/validation/epoch_average", validated, epoch_);
          }
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

  summary.last_validation_loss = validation_loss();
  if (summary.last_validation_loss >= 0) {
    LP_LOG(kInfo, kLog) << "validation loss at step " << global_step_ << ": "
                        << summary.last_validation_loss;
    // kohya validates after its last epoch too, finished or cut short by --max_train_steps.
    if (epoch_ % std::max<int64_t>(1, o_.validate_every_n_epochs) == 0) {
      LP_LOG(kInfo, kLog) << "validation loss at the end of epoch " << epoch_ << ": "
                          << summary.last_validation_loss;
      if (tensorboard_) {
        tensorboard_->add_scalar("loss/validation/epoch_average", summary.last_validation_loss,
                                 epoch_);
      }
    }
    if (tensorboard_) {
      tensorboard_->add_scalar("loss/validation", summary.last_validation_loss, global_step_);
    }
  }
  summary.lora = o_.output_dir / "lora" / (last_stem(o_.output_name) + ".safetensors");
  save_lora(summary.lora, global_step_, /*final=*/true);
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

}  // namespace

void request_stop() { g_stop_requested = 1; }

Summary train(const Options& options) {
  Options o = options;
  validate(o);
  if (o.threads > 0) at::set_num_threads(o.threads);
  return Run(o).train();
}

}  // namespace lorapipe::trainer
