#pragma once
// The trainer stage as a library: loads the base model, checks the cached dataset against it,
// builds the LoRA network and trains it from the cache with kohya's options, saving LoRA files,
// resumable state, TensorBoard events and progress events. main.cpp only parses flags into
// Options, so tests drive this directly.

#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "models/model_parts.h"
#include "trainer/lora_network.h"
#include "trainer/ranks.h"
#include "trainer/step.h"

namespace lorapipe::trainer {

struct Options {
  // What to train on.
  std::filesystem::path model;  // --pretrained_model_name_or_path: single file or diffusers folder
  std::string model_family;     // --model_family: load as this family (empty: detect it)
  std::filesystem::path tokenizer;  // for single files (folders carry theirs)
  // kohya's --vae: the VAE the cacher encoded with, in place of the checkpoint's (the manifest's
  // VAE fingerprint is checked against it).
  std::filesystem::path vae;
  models::ModelParts model_parts;  // FLUX.1's --clip_l, --t5xxl, --ae and T5 settings
  std::filesystem::path cache_dir;  // empty: the default shared cache
  std::string cacher_endpoint;      // --cacher: read records from a remote cacher instead
  std::string dataset_id;
  std::string device = "auto";
  std::string mixed_precision = "no";  // no, fp16, bf16
  // Whether --clip_skip was given (kohya's ss_clip_skip is None otherwise); step.clip_skip holds
  // the layer either way.
  bool clip_skip_given = false;
  // kohya's --fp8_base (the U-Net's and the text encoder's Linear and Conv2d weights stored in
  // float8, models/float8.h) and --fp8_base_unet (the U-Net's alone; it wins over fp8_base).
  bool fp8_base = false;
  bool fp8_base_unet = false;
  // --fp8_scaled (musubi-tuner's, with --fp8_base or --fp8_base_unet): those float8 weights with a
  // scale per 64 input features of each output row (models/float8.h).
  bool fp8_scaled = false;
  // --fp8_fast (musubi-tuner's, with --fp8_scaled): the denoiser's Linear layers multiply in
  // float8 (models/float8.h).
  bool fp8_fast = false;
  // kohya's --blocks_to_swap (models/block_swap.h): this many of the denoiser's blocks keep their
  // frozen weights in host memory; the step then recomputes every block in backward.
  int blocks_to_swap = 0;
  // --map_weights: base weights the file holds as the model does are its mapped pages, shared
  // with a sampler that maps them too (models/mapped_weights.h).
  bool map_weights = false;
  // --share_weights=MANIFEST: the placed denoiser's frozen weights published for a sampler on the
  // same device (models/shared_weights.h); the trainer's end waits for that sampler to let go.
  std::filesystem::path share_weights;
  int threads = 0;                     // CPU compute threads (0: LibTorch's default, one per core)
  // Data-parallel ranks (trainer/ranks.h), from the environment torchrun sets. train_batch_size
  // is per rank, as kohya's: a step trains train_batch_size x world_size samples.
  RankEnvironment ranks;
  // Output.
  std::filesystem::path output_dir;
  // kohya's --output_name. Empty (not given) names files as kohya does then: step saves
  // "at-stepNNNNNNNN", epoch saves "epoch-NNNNNN", the final save and its state "last".
  std::string output_name;
  std::string save_precision = "float";  // float, fp16, bf16
  int64_t save_every_n_steps = 0;
  int64_t save_every_n_epochs = 0;
  // kohya's --save_n_epoch_ratio: when above 0, save_every_n_epochs becomes
  // max(1, floor(epochs of the run / N)).
  int64_t save_n_epoch_ratio = 0;
  int64_t save_last_n_steps = 0;
  int64_t save_last_n_epochs = 0;
  bool save_state = false;
  // kohya's retention of states: 0 keeps them as the LoRA files are kept (save_last_n_steps /
  // save_last_n_epochs); otherwise states follow these instead.
  int64_t save_last_n_steps_state = 0;
  int64_t save_last_n_epochs_state = 0;
  bool save_state_on_train_end = false;  // the final state even without --save_state
  std::filesystem::path resume;  // a state folder written with --save_state
  // kohya's --no_metadata: the LoRA keeps only kohya's minimum ss_* keys (network module, dim,
  // alpha, args, base model version, v2) and the modelspec.* keys.
  bool no_metadata = false;
  // kohya's --metadata_<field> flags, as modelspec.<field> (title defaults to output_name; a
  // thumbnail that is a file becomes a data: URL).
  std::map<std::string, std::string> modelspec;
  std::string pub_endpoint;      // TrainProgress and CheckpointReady
  // The newest CheckpointReady is sent again this often (seconds) while training goes on, so a
  // sampler that (re)starts mid-run renders the newest checkpoint without waiting for a save.
  double checkpoint_reannounce_s = 5.0;
  // kohya's sample schedule. lorapipe-sampler renders every checkpoint announced on --pub;
  // these announce more: at each such step or epoch that is not a save, a sample-only LoRA in
  // OUT/lora/sample_only/ (named as a step save; the newest three kept), and with
  // sample_at_first one of the untrained network before the first step. Without --pub nothing
  // would render them, and none are written.
  int64_t sample_every_n_steps = 0;
  int64_t sample_every_n_epochs = 0;
  bool sample_at_first = false;
  std::string training_comment;
  bool lowram = false;  // kohya's --lowram: accepted and written to the metadata, as kohya does
  // kohya's --max_token_length: captions of up to 75 tokens (one chunk), or 150 / 225 encoded in
  // chunks of 75 (models::ClipTextModelImpl::encode_chunked). Cached text is used only when the
  // cacher encoded it with the same length.
  int max_token_length = 75;
  // kohya's --weighted_captions: captions' A1111 attention syntax weighs their tokens' states
  // (models::DiffusionModel::encode_weighted_text); they are always encoded online.
  bool weighted_captions = false;
  // kohya's --cache_text_encoder_outputs. The cacher caches every caption it can; the flag asks
  // that all of them be cached, so a dataset whose captions change at every step (shuffle,
  // dropout, warm-up, wildcards) is refused as kohya refuses it, rather than run with the text
  // encoders resident and encoding.
  bool cache_text_encoder_outputs = false;
  // kohya's --masked_loss. The loss is masked whenever the cache holds alpha masks (kohya masks
  // whenever a batch carries them); the flag only says so in ss_masked_loss and warns without.
  bool masked_loss = false;
  // kohya's --debug_dataset: print every micro-batch of the run (images, buckets, flips, captions
  // after process_caption) and stop without training.
  bool debug_dataset = false;
  // TensorBoard event files: OUT/tensorboard unless given (kohya's --logging_dir layout).
  std::filesystem::path tensorboard_dir;
  // Length.
  int64_t max_train_steps = 1600;
  int64_t max_train_epochs = 0;  // wins over max_train_steps when set, as kohya
  int train_batch_size = 1;
  // --bucket_batch_sizes (lorapipe run --auto_batch): a batch size per rank for each bucket,
  // the samples per step kept at train_batch_size x gradient_accumulation_steps (BatchScheduler).
  std::map<std::pair<uint32_t, uint32_t>, int> bucket_batch_sizes;  // BucketBatchSizes
  bool fill_last_batch = false;
  uint64_t seed = 42;
  double prior_loss_weight = 1.0;
  int max_bad_steps = 10;
  double timeout_s = 300;  // a remote cacher silent this long: give up (with a saved state)
  // Validation as kohya: a held-out share of the images, fixed timesteps and noise.
  double validation_split = 0;
  uint64_t validation_seed = 0;  // the split's and the validation noise's (main: --seed's)
  int64_t validate_every_n_steps = 0;
  // kohya's epoch validation: at the end of every N epochs (0: every epoch, kohya's default),
  // logged as loss/validation/epoch_average at the epoch.
  int64_t validate_every_n_epochs = 0;
  // kohya's --max_validation_steps: the first N held-out images only (0: all). kohya counts
  // batches of its validation loader; lorapipe validates one image at a time.
  int64_t max_validation_steps = 0;
  // The network and the step.
  NetworkOptions network;
  std::vector<std::string> network_args;  // as given, for ss_network_args
  std::filesystem::path network_weights;
  bool dim_from_weights = false;  // kohya's: the network's modules and ranks from network_weights
  // kohya's --base_weights / --base_weights_multiplier: LoRAs merged into the base model for good
  // before the network is built (a multiplier of 1 for those not given one).
  std::vector<std::pair<std::filesystem::path, double>> base_weights;
  double lr_warmup_steps = 0;  // a count, or below 1 a ratio of the steps
  StepOptions step;
};

struct Summary {
  int64_t steps = 0;
  int64_t epochs = 0;
  int64_t skipped_steps = 0;
  double last_loss = 0;
  double first_validation_loss = -1;
  double last_validation_loss = -1;
  std::filesystem::path lora;  // the final LoRA file, or the one saved when interrupted
  bool interrupted = false;    // request_stop() ended the run early; a state was saved
  bool dataset_only = false;   // --debug_dataset: batches shown, nothing trained
  std::filesystem::path state;  // that state (--resume from it)
};

// Asks a running train() to stop after the step in progress: it saves the LoRA and a resumable
// state (always, in output_dir/state/<output_name>-state), publishes the LoRA as a checkpoint and
// returns with Summary::interrupted. Async-signal-safe: main's SIGINT/SIGTERM handler calls it.
void request_stop();

// Checks every option that can be checked without files; throws InputError naming the flag.
void validate(const Options& options);

// Trains. Throws InputError for bad options, models, caches or manifests (before any compute),
// Error when training cannot go on (too many non-finite losses, a cacher gone for good; a state
// is saved first when --save_state or --resume is in use, and always in output_dir/state).
Summary train(const Options& options);

// Fills network and optimizer options from kohya's --network_args ("conv_dim=4",
// "conv_alpha=1", "rank_dropout=0.1", "module_dropout=0.1", "loraplus_lr_ratio=16", and the
// block-wise "block_dims=...", "down_lr_weight=..." of resolve_block_args). Call it once, after
// --network_dim/--network_alpha are set: unset blocks take those.
void apply_network_args(Options& options);

// Every check of `options` that needs no model, data or disk (validate's, the network's, the
// step's, the optimizer's type and arguments): InputError naming what is wrong. What
// --check_flags runs, so that lorapipe run refuses a bad trainer flag before any data is cached.
void check_options(const Options& options);

// The flags `family` cannot train with, refused by name (InputError) before any data is cached
// or loaded: --check_flags, the trainer before its data, and again with the loaded model's family.
//  - --cache_text_encoder_outputs with a text-encoder LoRA, unless `family` caches the encoders
//    its LoRA leaves untrained (FLUX.1's T5; kohya refuses it for SD and SDXL);
//  - --weighted_captions where its captions have no attention weights (FLUX.1, as kohya's);
//  - --cpu_offload_checkpointing where the family has no offloaded checkpoints (SD, SDXL).
void check_family_options(const Options& options, const models::ModelFamily& family);

}  // namespace lorapipe::trainer
