#pragma once
// `lorapipe plan`: what fits a card, answered before training. For each resolution x batch size
// x memory option it predicts the trainer's peak allocated device memory and its time per step,
// says which fit a budget, and recommends the fastest that fits.
//
// The prediction is analytic where the bytes are known from the checkpoint's header alone -- the
// denoiser's weights by storage dtype (float8 and its scales included), the LoRA, its gradients
// and optimizer state by optimizer, the blocks block swap moves to the host and its device slots,
// the allocator's rounding -- and calibrated where they are not: the activations, a per-family
// function of the batch and the token count (linear and quadratic terms, and a per-block term for
// the transformer families), fitted by bench/plan_calibrate.py to the measured peaks of real
// steps (trainer_bench) and kept in deploy/plan_calibration.json. The time is the step's FLOPs
// (fitted the same way to the analytic counts) at an assumed share of the card's peak, plus
// what float8's upcasts and block swap's copies cost on its memory and bus.
//
// No LibTorch: it reads headers (models/safetensors.h) and names families as lorapipe-inspect
// does.

#include <cstdint>
#include <filesystem>
#include <iosfwd>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "deploy/launcher.h"

namespace lorapipe::launcher {

// What the memory model needs of a checkpoint's denoiser, from its header.
struct ModelStructure {
  std::string family;          // models::ModelFamily::name: sd15, sdxl, flux-dev, flux-schnell
  std::string display_name;
  int pixels_per_token = 8;    // latent downsampling, times the transformer's 2x2 packing
  int text_tokens = 77;        // the sequence the denoiser attends to (Flux: T5's length)
  int blocks = 0;              // transformer blocks (Flux: double + single), for activations
  uint64_t params = 0;         // every denoiser parameter
  uint64_t float8_params = 0;  // those --fp8_base stores in float8 (Linear/Conv weights)
  uint64_t float8_scales = 0;  // --fp8_scaled's float32 scales over them
  uint64_t largest_weight = 0; // the largest float8 weight: one upcast copy lives at a time
  uint64_t weight_tensors = 0;
  uint64_t lora_in_out = 0;    // sum of (in + out) over kohya's LoRA targets: rank r adds r x it
  int lora_modules = 0;
  // Flux's blocks in kohya's swap order: their frozen Linear weights (params) and scales.
  std::vector<uint64_t> double_blocks, single_blocks;
  std::vector<uint64_t> double_scales, single_scales;
};

// Reads `model` (a single file, a diffusers folder or a plan's structure folder) and `family`
// (empty: detect it). Throws InputError naming the file for anything it cannot read.
ModelStructure read_structure(const std::filesystem::path& model, const std::string& family = "");

// One setting the plan weighs.
struct Candidate {
  int width = 512, height = 512;
  int batch = 1;
  bool checkpointing = true;
  std::string float8;  // "", "fp8" or "fp8_scaled"
  int blocks_to_swap = 0;
  std::string optimizer = "AdamW";
};

// A candidate's predicted peak, part by part (bytes).
struct Prediction {
  double weights = 0, lora = 0, optimizer = 0, activations = 0, transient = 0, rounding = 0;
  // The largest float8 weight's widened copy (transient is the share of it alive at the peak).
  double float8_copy = 0;
  // The text encoders' weights, on the card where the run encodes its captions every step: it
  // trains a text-encoder LoRA (kohya's default) or its captions change every step (see
  // PlanOptions::captions_online); 0 where its text comes from the cache. Counted for the
  // families whose encoders the calibration measured (SD1.5, SDXL; print_plan says FLUX.1's
  // are not).
  double text_encoders = 0;
  double peak() const { return denoiser_peak() + text_encoders; }
  // What a step of the denoiser alone holds (what trainer_bench, the probe, measures).
  double denoiser_peak() const {
    return weights + lora + optimizer + activations + transient + rounding;
  }
  double flops = 0;      // one step's
  double s_per_it = 0;   // on the plan's card
  // The calibration's features: 1, B T, B T^2, B T n, B T^2 n (batch, tokens, blocks). The
  // FLOPs' are the same with B in place of 1 (what a step computes once per sample whatever its
  // size: the time and text embeddings, the text's keys and values).
  std::vector<double> features, flops_features;
};

// The card the times are for: bf16 dense tensor TFLOPS, memory and host-bus bandwidth (GB/s).
struct Card {
  std::string name;
  double tflops = 0, memory_gbps = 0, bus_gbps = 0;
};
// A card by (part of) its name ("RTX 3060", "4090", "H100"); throws InputError listing them.
Card find_card(const std::string& name);

struct PlanOptions {
  std::filesystem::path model;
  std::string family;           // --model_family
  double budget_bytes = 12.0 * (1 << 30);  // --vram_budget (12GB: GiB, as cards are sold)
  Card card;                    // --gpu
  std::vector<int> resolutions; // squares; empty: 256..1024 by 128 (Flux and SDXL: to 1024)
  std::vector<int> batches;     // empty: 1, 2, 4, 8
  int rank = 16;                // --network_dim
  int storage_bytes = 2;        // --mixed_precision: bf16/fp16 2, fp32 (no) 4
  int effective_batch = 0;      // train_batch_size x gradient_accumulation_steps (0: 4)
  double learning_rate = 1e-4;
  std::string optimizer;        // --optimizer_type given: only it
  std::vector<std::string> run_flags;  // passed through to the recommendation's flags
  Settings run;                        // the run flags as given
  // The run names a dataset (--data_dir, --dataset_config, ...): the plan weighs its buckets.
  bool dataset = false;
  // The run trains a text-encoder LoRA: kohya's default, unless --network_train_unet_only.
  bool trains_text_encoder = true;
  // Its captions are encoded every step, the text encoders on the card whatever trains: weighted
  // captions, or captions shuffled, dropped or warmed up (the cache holds one encoding of each),
  // as flags of the run say (a dataset config's own keys are not read here).
  bool captions_online = false;
};

Prediction predict(const ModelStructure& model, const Candidate& candidate, const PlanOptions& o);
// FLUX.1 with a CLIP-L LoRA the run did not ask for by name: the plan trains the transformer
// alone, as kohya's small-card FLUX.1 recipes do (CLIP-L would stay on the card beside it), and
// its settings carry --network_train_unet_only (candidates' flags, --plan_budget, --auto_batch).
bool plans_denoiser_alone(const ModelStructure& model, const PlanOptions& o);
// Whether the run keeps its text encoders on the card as the plan sets it up.
bool text_encoders_on_card(const ModelStructure& model, const PlanOptions& o);
// The smallest budget a prediction fits in: its peak and 10% for the prediction's error (the
// calibration's goal), plus what the CUDA context and the kernels' workspaces take (0.6 GB).
double budget_needed(const Prediction& prediction);

// Previews on the training card: where `lorapipe run` has its sampler share the trainer's GPU
// (deploy/launcher.h, preview_mode), the sampler renders over the trainer's own weights and
// holds only the rest beside the training -- its text encoders and VAE in the run's dtype, the
// LoRA it applies, one render's working memory at the prompt file's largest preview (its VAE
// decode dominates: linear in the pixels, about 3.4 KiB a pixel in fp32), and its own process's
// CUDA context. The encoders', VAE's and render's bytes are the family's measured on the CPU
// (bench/sampler_bench.cpp solo prints the share; bench/plan_calibrate.py --preview fits the
// calibration's "preview"); the training's budget is the card's less this share.
struct PreviewShare {
  int width = 0, height = 0;  // the largest preview; 0: previews take nothing of the card
  double text_encoders = 0, vae = 0, lora = 0, render = 0;
  double bytes() const { return text_encoders + vae + lora + render; }
  // What the card must hold for it: the share, 10% for the prediction's error, and the
  // sampler's own CUDA context and allocator slack (the trainer's reserve again); 0 without one.
  double budget_needed() const;
  std::string why_none;  // previews asked for but not on the card: where they render instead
};
// The share of `width` x `height` previews beside the training of `model` as `o` trains it;
// `float8` ("", "fp8" or "fp8_scaled") is the run's float8 base, which the sampler's text
// encoders take too (unless --fp8_base_unet).
PreviewShare predict_preview_share(const ModelStructure& model, int width, int height,
                                   const PlanOptions& o, const std::string& float8 = "");

// One aspect bucket of the run's dataset at a resolution, as its preprocess stage picks it.
struct DatasetBucket {
  int width = 0, height = 0;
  int64_t count = 0;  // images in it per epoch, repeats included
};

// What `lorapipe plan --probe` measured of a setting: real steps on the device.
struct ProbeResult {
  bool out_of_memory = false;  // it ran out of the budget's memory
  bool skipped = false;        // a smaller batch of its size did: not run
  double predicted_peak = 0;   // the plan's prediction of the very setting probed
  double peak_bytes = 0;       // peak allocated over the timed steps
  double s_per_it = 0, samples_per_s = 0;
  double mfu = -1;             // model FLOPs utilisation where the device's peak is known
  std::string failed;          // the bench ended on another error than memory: its last words
};

struct PlanRow {
  Candidate candidate;
  std::optional<ProbeResult> probe;
  // With a dataset: the prediction of its peak bucket (the largest batch of the largest bucket
  // decides), and the step time averaged over the epoch's steps, each bucket's last batch short.
  Prediction prediction;
  double samples_per_step = 0;  // the batch; with a dataset, the epoch's samples per step
  double samples_per_s() const { return samples_per_step / prediction.s_per_it; }
  bool fits = false;
  // The budget its fit was weighed against: the card's less the previews' share beside it (which
  // depends on its float8: the sampler's text encoders follow the run's --fp8_base).
  double training_budget = 0;
  std::vector<std::string> flags;  // the `lorapipe run` flags that reproduce it (kohya's names)
};

struct Plan {
  ModelStructure model;
  PlanOptions options;
  std::vector<PlanRow> rows;
  int recommended = -1;  // index into rows; -1: nothing fits
  int accumulation = 1;  // with the recommended batch, for options.effective_batch
  int resolution_cap = 0;  // the default sweep recommends no larger side than this (0: no cap)
  // With a dataset: its buckets at each resolution weighed (square side).
  std::map<int, std::vector<DatasetBucket>> buckets;
  double learning_rate = 0;
  std::string learning_rate_rule;
  // Previews rendered on the training card take their share of it: the training's budget is
  // what is left (options.budget_bytes without previews there). Without float8; each row has its
  // own (PlanRow::training_budget).
  PreviewShare preview;
  double training_budget = 0;
};

// Parses `lorapipe plan` arguments (see kUsage in main.cpp), or a run's (--plan_budget). A
// dataset among them (--data_dir, --dataset_config, ...) makes the plan weigh its buckets.
PlanOptions parse_plan_args(const std::vector<std::string>& args);
Plan make_plan(const PlanOptions& options);
// The table and the recommendation, for a terminal.
void print_plan(const Plan& plan, std::ostream& out);
// DIR/plan.json and DIR/plan.svg (and DIR/plan.png where libvips is built in). Returns the
// paths written.
std::vector<std::filesystem::path> write_plan(const Plan& plan, const std::filesystem::path& dir);
// One candidate's breakdown as JSON (bench/plan_calibrate.py reads it).
std::string explain_json(const ModelStructure& model, const Candidate& candidate,
                         const PlanOptions& options);

// `lorapipe run --plan_budget=12GB`: the plan's recommendation for the run's model and flags,
// set into `settings` (resolution, batch, accumulation, learning rate, memory options); returns
// the line that tells the user. Throws InputError when nothing fits.
std::string apply_plan_budget(Settings& settings);

// `lorapipe run --auto_batch` (with --vram_budget, or --plan_budget applied first): each of the
// dataset's buckets (its preprocess report at the run's resolution) gets the largest batch per
// rank, up to the run's samples per step (train_batch_size x gradient_accumulation_steps),
// whose predicted peak fits the budget as the plan's fit rule has it, set into `settings` as the
// trainer's --bucket_batch_sizes; the trainer keeps the samples per step (trainer/dataset.h),
// so the learning rate stays. Returns the lines that tell the user. A bucket that fits at no
// batch gets 1 and a warning: the run tries it.
// `plan_args`: the plan's own flags (--gpu) where `lorapipe plan --auto_batch` previews it.
std::string apply_auto_batch(Settings& settings, const std::vector<std::string>& plan_args = {});

// `lorapipe plan --probe`: the table's settings (each resolution x batch's shown one) run as
// short real steps on `device` (trainer_bench solo on the family's full-size architecture with
// random weights, the same shapes as the user's file; `size` overrides it, e.g. tiny), held to
// the budget's memory (less the CUDA context's reserve): one process per memory option, its
// sizes in order of batch, a size's larger batches skipped after an out-of-memory. The results
// go into the rows' `probe`. Throws InputError where trainer_bench is not beside lorapipe. A
// group of settings whose bench fails for another reason than memory marks its unmeasured rows
// `failed`, and the other groups are still probed; returns how many groups failed.
struct ProbeOptions {
  std::string device = "cuda";
  std::string size;  // trainer_bench's: empty: the family's full size
  int steps = 3;
};
int probe_plan(Plan& plan, const ProbeOptions& probe, std::ostream& progress);
// Measured next to predicted, for the probed rows.
void print_probe(const Plan& plan, std::ostream& out);

// `lorapipe plan [flags]`: the exit code.
int plan_command(const std::vector<std::string>& args, std::ostream& out);

}  // namespace lorapipe::launcher
