// The run's data and model: the manifest, the pre-flight check of every record it names, and
// the model loaded, checked against the cache (family, VAE, text encoder) and placed.
#include "trainer/run.h"

#include <c10/core/impl/VirtualGuardImpl.h>
#include <malloc.h>

#include <optional>
#include <set>
#include <utility>
#include <vector>

#include "cacher/records.h"
#include "common/error.h"
#include "common/log.h"
#include "common/sha256.h"
#include "models/fingerprint.h"
#include "models/float8.h"
#include "models/lora_merge.h"
#include "models/mapped_weights.h"
#include "models/shared_weights.h"
#include "models/placement.h"
#include "models/prompt_attention.h"
#include "models/registry.h"

namespace lorapipe::trainer::detail {

namespace {

// A module's floating-point parameters and buffers as loaded, to put back before each dtype a
// cache may have been made in is tried: the cacher converted its weights once, from the file,
// and a conversion from an earlier conversion rounds twice (fp32 -> fp16 -> bf16 is not
// fp32 -> bf16 for 6% of normally distributed weights), so its fingerprint would never match.
// Held tensors are the module's own (set_data keeps them its own through conversions).
class LoadedWeights {
 public:
  explicit LoadedWeights(torch::nn::Module& module) {
    torch::NoGradGuard no_grad;
    auto keep = [&](const at::Tensor& t) {
      if (t.defined() && t.is_floating_point()) held_.emplace_back(t, t.detach().clone());
    };
    for (const at::Tensor& p : module.parameters()) keep(p);
    for (const at::Tensor& b : module.buffers()) keep(b);
  }
  void restore() const {
    torch::NoGradGuard no_grad;
    for (const auto& [tensor, loaded] : held_) {
      at::Tensor t = tensor;
      t.set_data(loaded);  // the module's tensor, its loaded dtype and values (no copy)
    }
  }

 private:
  std::vector<std::pair<at::Tensor, at::Tensor>> held_;
};

}  // namespace

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
  if (o_.cache_text_encoder_outputs && !manifest_.text_cached()) {
    // The cacher left these captions to be drawn at every step. kohya's
    // is_text_encoder_output_cacheable refuses four of the augmentations with cached text; the
    // others (caption_dropout_every_n_epochs, wildcards) it trains from the text cached once,
    // without them, where lorapipe keeps them and encodes those captions at every step.
    std::set<std::string> refused, online;
    for (const wire::ManifestEntry& e : manifest_.entries()) {
      if (!e.text_key().empty()) continue;
      const wire::CaptionSettings& c = e.caption_settings();
      const bool kohya_refuses = c.shuffle_caption() || c.caption_dropout_rate() > 0 ||
                                 c.caption_tag_dropout_rate() > 0 || c.token_warmup_step() > 0;
      (kohya_refuses ? refused : online)
          .insert(e.subset_name().empty() ? e.path() : e.subset_name());
    }
    auto names = [](const std::set<std::string>& subsets) {
      std::string out;
      for (const std::string& n : subsets) out += (out.empty() ? "'" : ", '") + n + "'";
      return out;
    };
    if (!refused.empty()) {
      throw InputError("--cache_text_encoder_outputs: dataset '" + o_.dataset_id +
                       "' draws its captions anew at every step in " + names(refused) +
                       " (shuffle_caption, caption_dropout_rate, caption_tag_dropout_rate or "
                       "token_warmup_step), which cached text cannot hold: kohya refuses the "
                       "same; leave the flag out to encode them at every step, or turn those off");
    }
    LP_LOG(kWarning, kLog) << "--cache_text_encoder_outputs: the captions of " << names(online)
                           << " draw wildcards or caption_dropout_every_n_epochs at every step: "
                              "they are encoded as they train (kohya would train the text cached "
                              "once, without them), so the text encoders stay loaded";
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
  if (holds_out_for_validation(manifest_, o_.validation_split)) {
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
  scheduler_ = std::make_unique<BatchScheduler>(
      manifest_, o_.train_batch_size, o_.seed, o_.fill_last_batch, o_.ranks.world_size,
      o_.step.gradient_accumulation_steps, o_.bucket_batch_sizes);
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
  if (device_.is_cuda()) {
    // The current device from here on, as torch.cuda.set_device: whatever asks CUDA for "the"
    // device (a stream, a generator, a library handle) gets this one, and a rank on cuda:1 opens
    // no context on GPU 0, which would cost another rank's card hundreds of MB.
    c10::impl::VirtualGuardImpl(c10::kCUDA).setDevice(device_);
  }
  const c10::ScalarType dtype = o_.step.base_dtype;
  // Built on the CPU, then placed (models/placement.h). The denoiser loads straight into the
  // compute dtype, or fp32 when LoRAs are merged into it (kohya merges into fp32 weights and
  // narrows after). The VAE and the text encoder load in fp32: they are checked against the
  // cache's fingerprints in each dtype the cacher may have used, and the VAE is then dropped.
  models::LoadOptions load;
  load.family = o_.model_family;
  load.tokenizer = o_.tokenizer;
  load.dtype = o_.base_weights.empty() ? dtype : torch::kFloat;
  load.text_encoder_dtype = torch::kFloat;
  load.vae_dtype = torch::kFloat;
  load.vae = o_.vae;
  load.parts = o_.model_parts;
  {
    std::optional<models::MappedWeights> mapped;
    if (o_.map_weights) mapped.emplace();
    model_ = models::load_model(o_.model, load);
    if (mapped) models::log_mapped_weights(*mapped, "trainer");
  }
  models::DiffusionModel& model = *model_;
  if (!model.has_tokenizer()) {
    throw InputError(o_.model.string() + " carries no tokenizer: pass --tokenizer");
  }
  models::check_declared_objective(model.model_family(), o_.model.string(),
                                   o_.step.objective.v_prediction,
                                   o_.step.objective.zero_terminal_snr);
  // The records were encoded by a model of this family (manifests before families were
  // recorded hold SD1.x's).
  const std::string cached_family =
      manifest_.model_family().empty() ? "sd15" : manifest_.model_family();
  if (cached_family != model.model_family().name) {
    throw InputError("manifest '" + o_.dataset_id + "' was cached with a " + cached_family +
                     " model, and " + o_.model.string() + " is " + model.model_family().name +
                     " (" + model.model_family().display_name +
                     "): re-cache the dataset with this model (preprocess and the cacher)");
  }
  // Every bucket's sides must be what the family's denoiser takes (SDXL: multiples of 32, as
  // kohya requires of its bucket_reso_steps).
  const int multiple = model.model_family().bucket_reso_multiple;
  for (const wire::ManifestEntry& e : manifest_.entries()) {
    if (e.bucket().width() % multiple != 0 || e.bucket().height() % multiple != 0) {
      throw InputError(e.path() + ": its bucket " + std::to_string(e.bucket().width()) + "x" +
                       std::to_string(e.bucket().height()) + " is not made of multiples of " +
                       std::to_string(multiple) + ", which " + model.model_family().display_name +
                       " needs: preprocess again with --bucket_reso_steps 32 or 64");
    }
  }
  // Into the weights as loaded, before they take the compute dtype. The text encoder changes
  // with them, so text cached from the plain one no longer matches and is encoded online.
  models::merge_base_weights(model, o_.base_weights);
  // Latents from another VAE would train the LoRA on the wrong images. The cacher fingerprints
  // the VAE in its compute dtype, so each dtype it may have used is tried.
  bool vae_matches = false;
  {
    const LoadedWeights loaded(model.vae_module());
    for (auto vae_dtype : {torch::kFloat, torch::kHalf, torch::kBFloat16}) {
      loaded.restore();
      model.vae_module().to(vae_dtype);
      // Manifests cached before the latents' fingerprint was the encoder's alone hold the
      // whole VAE's: still theirs.
      const std::string& cached = manifest_.vae_fingerprint();
      if (models::vae_encoder_fingerprint(model.vae_module()) == cached ||
          models::weights_fingerprint(model.vae_module(), "vae") == cached) {
        vae_matches = true;
        break;
      }
    }
  }
  model.release(models::DiffusionModel::Role::kVae);  // training needs no VAE
  if (!vae_matches) {
    const std::string vae = o_.vae.empty() ? o_.model.string() + "'s" : "--vae=" + o_.vae.string();
    throw InputError("manifest '" + o_.dataset_id + "' was cached with another VAE (fingerprint " +
                     manifest_.vae_fingerprint().substr(0, 12) + ") than " + vae +
                     ": re-cache the dataset with this model (run preprocess and the cacher, "
                     "with the same --vae), or give the trainer the cacher's --vae");
  }
  const bool train_te = o_.network.train_text_encoder;
  // kohya's partial caching (its FLUX.1): the LoRA leaves some encoders untrained (T5), whose
  // output the cache holds; the trained ones (CLIP-L) encode at every step.
  const std::string& untrained = model.model_family().text.untrained_encoders;
  const bool partly_cached = train_te && !untrained.empty();
  check_family_options(o_, model.model_family());
  if (o_.max_token_length != 75 && !model.model_family().text.long_prompts) {
    LP_LOG(kWarning, kLog) << "--max_token_length=" << o_.max_token_length << ": "
                           << model.model_family().display_name
                           << "'s text encoders take their own length (kohya ignores the "
                              "flag there too)";
  }
  if (o_.weighted_captions) {
    LP_LOG(kInfo, kLog) << "--weighted_captions: captions are encoded online, their attention "
                           "syntax weighing their tokens";
  } else if (manifest_.text_cached() && (!train_te || partly_cached)) {
    const std::string settings =
        model.text_encoder_settings(o_.step.clip_skip, o_.max_token_length);
    // Each dtype the cacher may have used is tried on the weights as loaded, each converted from
    // them (LoadedWeights). When none matches and the text is to be encoded online, the loaded
    // fp32 weights are put back (else it would encode through weights rounded to bf16).
    torch::nn::Module& text_encoder = model.text_encoder_module();
    // As loaded (fp32) first: the copy to restore from is made only when a conversion is tried
    // (T5 XXL alone is 19 GB in fp32).
    cached_text_ = models::weights_fingerprint(text_encoder, settings) ==
                   manifest_.text_encoder_fingerprint();
    std::optional<LoadedWeights> loaded;
    if (!cached_text_) loaded.emplace(text_encoder);
    for (auto text_dtype : {torch::kHalf, torch::kBFloat16}) {
      if (cached_text_) break;
      loaded->restore();
      text_encoder.to(text_dtype);
      if (models::weights_fingerprint(text_encoder, settings) ==
          manifest_.text_encoder_fingerprint()) {
        cached_text_ = true;
      }
    }
    // A cacher under --fp8_base encoded from float8 weights (kohya's 10 and 8 GB tiers): the
    // same storage in each dtype, from the weights as loaded.
    const bool fp8_text = o_.fp8_base && !o_.fp8_base_unet;
    for (auto text_dtype : {torch::kFloat, torch::kHalf, torch::kBFloat16}) {
      if (cached_text_ || !fp8_text) break;
      loaded->restore();
      text_encoder.to(text_dtype);
      models::store_weights_in_float8(text_encoder, o_.fp8_scaled);
      if (models::weights_fingerprint(text_encoder, settings) ==
          manifest_.text_encoder_fingerprint()) {
        cached_text_ = true;
        // Placement converts and stores the weights itself, from the loaded ones: widened
        // again, float8 values lose their scales.
        loaded->restore();
      }
    }
    if (!cached_text_) {
      loaded->restore();
      LP_LOG(kWarning, kLog) << "cached text was made by another text encoder, tokenizer, clip "
                                "skip, max_token_length or T5 setting: captions are encoded "
                                "online (run the cacher again to cache them)";
    }
    // Partial caching: the trained encoders encode from the weights as loaded, not from those
    // a dtype above was tried on (placement converts them once).
    if (cached_text_ && partly_cached && loaded) loaded->restore();
  }
  if (cached_text_ && train_te) {
    partial_text_ = true;
    model.release_untrained_text_encoders();
    LP_LOG(kInfo, kLog) << "text-encoder LoRA: " << untrained
                        << "'s output comes from the cache and " << untrained
                        << " is dropped; the encoders the LoRA trains encode every caption at "
                           "every step (kohya's partial caching)";
  }
  models::Placement placement;
  placement.device = device_;
  placement.dtype = dtype;
  placement.fp8_denoiser = o_.fp8_base || o_.fp8_base_unet;
  placement.fp8_text_encoders = o_.fp8_base && !o_.fp8_base_unet;  // kohya: _unet wins
  placement.fp8_scaled = o_.fp8_scaled;
  placement.fp8_fast = o_.fp8_fast;
  placement.blocks_to_swap = o_.blocks_to_swap;
  // kohya keeps the text encoder off the device when its outputs come from the cache and it is
  // not trained.
  placement.text_encoders_on_device = !cached_text_ || train_te;
  models::place(model, placement);
  if (!o_.share_weights.empty() && main_) {
    for (const models::DiffusionModel::Component& c : model.components()) {
      if (c.role != models::DiffusionModel::Role::kDenoiser) continue;
      shared_weights_ = std::make_unique<models::SharedWeightsPublisher>(
          *c.module, device_, o_.share_weights, models::shared_weights_key(o_.model, placement));
    }
  }
  if (fs::is_regular_file(o_.model)) {
    model_hash_ = legacy_model_hash(o_.model);
    model_sha256_ = sha256_file(o_.model);
  } else if (fs::is_directory(o_.model)) {
    // kohya's model_hash and calculate_sha256 of a diffusers folder: open() fails with
    // IsADirectoryError, which both answer with "IsADirectory".
    model_hash_ = model_sha256_ = "IsADirectory";
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

}  // namespace lorapipe::trainer::detail
