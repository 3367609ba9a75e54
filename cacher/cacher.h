#pragma once
// The cacher stage as a library: the single writer of an LMDB cache. It pulls ImageSamples from
// preprocess, answers HasKeys, encodes latents bucket by bucket and captions once each, writes
// the dataset's Manifest in one transaction at the end of the stream, and, with `serve`, stays
// up to answer GetRecords and HasKeys for trainers and samplers, local or remote. main.cpp only
// parses flags into Options.

#include <cstdint>
#include <filesystem>
#include <string>

#include "models/model_parts.h"

namespace lorapipe::cacher {

struct Options {
  std::filesystem::path cache_dir;  // empty: default_cache_dir()
  std::filesystem::path model;      // single .safetensors or diffusers folder
  std::string model_family;         // --model_family: load as this family (empty: detect)
  std::filesystem::path tokenizer;  // for single files (folders carry theirs)
  std::filesystem::path vae;        // kohya's --vae: another VAE than the checkpoint's
  models::ModelParts model_parts;   // FLUX.1's --clip_l, --t5xxl, --ae and T5 settings
  std::string device = "auto";      // auto, cpu, cuda, cuda:N
  std::string dtype = "fp32";       // compute dtype: fp32, fp16, bf16 (records are fp16)
  int vae_batch_size = 4;
  bool no_half_vae = false;  // kohya's --no_half_vae: the VAE in fp32 whatever dtype says
  // kohya's --fp8_base: the text encoders (FLUX.1's T5 XXL among them) encode from float8
  // weights, as kohya's 10 and 8 GB tiers cache with them; --fp8_base_unet leaves them as they
  // are; --fp8_scaled scales them (models/float8.h). The text key follows the weights as stored.
  bool fp8_base = false;
  bool fp8_base_unet = false;
  bool fp8_scaled = false;
  int text_batch_size = 32;
  int clip_skip = 1;
  int max_token_length = 75;  // kohya's: 75 (one chunk), 150 or 225 (chunks of 75)
  uint64_t max_map_bytes = uint64_t{1} << 40;
  // Another cacher writing the same cache: wait this long for it before failing. The sockets
  // are bound only once the cache is ours, so preprocess can wait for them to appear.
  double wait_for_writer_s = 0;

  std::string pull_endpoint;  // ImageSample, DatasetReport from preprocess
  std::string rep_endpoint;   // Hello, HasKeys, GetRecords
  std::string pub_endpoint;   // CacheReport
  bool serve = false;         // stay up after the stream ends
  int idle_timeout_ms = 600000;  // no message for this long while a stream is expected: error
  double delay_per_batch_s = 0;  // testing: each latent batch takes at least this long
  int test_oom_latent_batches = 0;  // testing: the first this many latent encodes run out of memory
};

struct Summary {
  std::string dataset_id;
  uint64_t encoded = 0;        // latents encoded this run
  uint64_t hits = 0;           // samples whose latent was already cached
  uint64_t rejected = 0;       // NaN/Inf latents, not in the manifest
  uint64_t texts_encoded = 0;
  uint64_t text_bytes = 0;     // the text records encoded this run, in all (states, pooled, mask)
  uint64_t texts_cached = 0;
  uint64_t manifest_entries = 0;
  double images_per_second = 0;
};

// Runs until the stream's DatasetReport has been handled (or forever with serve). Throws
// InputError for bad options, models or a cache that cannot be written.
Summary run(const Options& options);

}  // namespace lorapipe::cacher
