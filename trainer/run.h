#pragma once
// The trainer's run, shared by the files that implement it, one concept each (private to
// trainer/; trainer.h is the library's interface):
//   options.cpp        the options' checks (validate, check_options, apply_network_args)
//   run_setup.cpp      the run's data and model: manifest, pre-flight check of every record,
//                      the model loaded, checked against the cache and placed
//   batches.cpp        micro-batches from cached records, and their prefetch
//   validation.cpp     kohya's validation loss
//   train_state.cpp    the state saved for --resume, and reading it back
//   outputs.cpp        LoRA files, their names, the sampler's checkpoints, kohya's retention
//   lora_metadata.cpp  kohya's ss_* and modelspec.* metadata of a LoRA file
//   progress.cpp       progress: TrainProgress, TensorBoard, the terminal line
//   trainer.cpp        the loop

#include <torch/torch.h>

#include <chrono>
#include <condition_variable>
#include <csignal>
#include <cstdint>
#include <deque>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "models/diffusion_model.h"
#include "models/shared_weights.h"
#include "proto/wire.h"
#include "runtime/stage.h"
#include "trainer/dataset.h"
#include "trainer/lora_network.h"
#include "trainer/loss_recorder.h"
#include "trainer/ranks.h"
#include "trainer/records.h"
#include "trainer/step.h"
#include "trainer/tensorboard.h"
#include "trainer/trainer.h"

namespace lorapipe::trainer::detail {
namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

inline constexpr std::string_view kLog = "trainer";

// Set by request_stop() (from a signal handler), read between steps.
extern volatile std::sig_atomic_t g_stop_requested;

// A tensor from a record, as fp32 on the CPU (batches.cpp).
torch::Tensor from_record(const wire::Tensor& t);
// kohya's size conditioning of a cached sample (SDXL's time ids): its original size, the crop's
// top-left from crop_ltrb (flipped: the left is the target width minus crop_ltrb's right) and
// the target size, `latent` ([C, h, w]) in pixels at `downsample` pixels per latent.
models::SampleGeometry sample_geometry(const wire::LatentRecord& record, bool flipped,
                                       const torch::Tensor& latent, int64_t downsample);
// The CPU generator of one purpose at one place in the run: every random number of a
// micro-batch follows from (seed, epoch, index) (batches.cpp).
at::Generator generator_for(uint64_t seed, int64_t epoch, int64_t index, std::string_view purpose);
// kohya's legacy model hash (train_util.model_hash): 64 KiB at 1 MiB into the file
// (lora_metadata.cpp).
std::string legacy_model_hash(const fs::path& file);
// kohya's str(time.time()) (lora_metadata.cpp).
std::string unix_time_now();
// A number as a log line shows it, 17 significant digits (lora_metadata.cpp).
std::string number(double v);
// kohya's save names, without the extension (outputs.cpp).
std::string step_stem(const std::string& output_name, int64_t step);
std::string epoch_stem(const std::string& output_name, int64_t epoch);
std::string last_stem(const std::string& output_name);

struct PreparedBatch {
  int64_t epoch = 0;
  int64_t index = 0;  // micro-batch index within the epoch
  int64_t step = 0;   // the optimizer step within the epoch (PlannedBatch)
  bool ends_step = false;
  double share = 0;
  torch::Tensor latents;
  torch::Tensor hidden_states;  // cached text, or undefined
  torch::Tensor pooled;
  torch::Tensor text_mask;  // cached with the text, for families whose text has one
  std::vector<std::string> captions;
  torch::Tensor loss_weights;
  torch::Tensor masks;  // [B, 1, h, w] kohya's alpha masks when any image has one, or undefined
  std::vector<bool> flipped;  // which images are their flipped twins
  std::vector<models::SampleGeometry> geometry;  // each image's, as kohya builds SDXL's time ids
  std::string error;  // the producer failed: this message, then stop
};

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
  // `epoch` is the file's ss_epoch, as kohya writes it: a save at a step (or for samples) is in
  // the epoch kohya's loop counts from 0, a save at an epoch's end or the last the epochs done.
  void save_lora(const fs::path& path, int64_t step, bool final, int64_t epoch);
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
  // Why steps stopped being finite, where a weight says so: the first frozen weight of the model
  // (the denoiser's, and the text encoder's where it ran: trained, or encoding text online) or
  // the LoRA's own that holds NaN or infinity, named; empty where every weight looked at is
  // finite (the activations overflowed). The weights --blocks_to_swap keeps on the host are read
  // there (a block in no device slot holds empty tensors in their place).
  std::string non_finite_weight() const;
  std::map<std::string, std::string> metadata(int64_t step, int64_t epoch) const;

  Options o_;
  std::unique_ptr<RecordSource> records_;
  wire::Manifest manifest_;
  wire::Manifest validation_manifest_;
  DatasetMetadata dataset_metadata_;  // kohya's ss_tag_frequency and dirs: once, for every save
  std::unique_ptr<models::DiffusionModel> model_;
  // --share_weights: declared after model_, so released (waiting for the sampler) before the
  // weights it publishes are freed.
  std::unique_ptr<models::SharedWeightsPublisher> shared_weights_;
  at::Device device_{torch::kCPU};
  bool cached_text_ = false;
  // With cached_text_: the text-encoder LoRA trains some encoders (FLUX.1's CLIP-L), encoded at
  // every step from the caption the cache holds, over the cached output of the others (kohya's
  // partial caching).
  bool partial_text_ = false;
  std::unique_ptr<LoraNetwork> network_;
  // Whether a micro-batch's text was encoded online (weighted captions, or no cached text): the
  // frozen text encoder then ran in the steps.
  bool text_encoded_online_ = false;
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

}  // namespace lorapipe::trainer::detail
