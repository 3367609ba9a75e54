#pragma once
// A model family: what differs between Stable Diffusion 1.5, SDXL and Flux.1 that the rest of
// lorapipe must know, so a new family adds modules, key maps and rules, not new pipeline code;
// and the detection that tells a checkpoint's family from its keys, its model_index.json or its
// metadata. No LibTorch: lorapipe-inspect names families too.

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace lorapipe::models {

struct TextConditioning {
  std::string encoder;         // "clip-l" (SD1.5), "clip-l+clip-g" (SDXL), later "t5+clip-l"
  int max_length = 77;         // tokens per chunk, BOS and EOS included
  int hidden_size = 768;       // width of the conditioning sequence the UNet attends to
  bool uses_pooled = false;    // SDXL and Flux also condition on a pooled embedding
  int default_clip_skip = 1;
  // kohya's partial text caching (its FLUX.1 is_partial): the encoders a text-encoder LoRA never
  // adapts ("T5-XXL": networks.lora_flux trains CLIP-L alone), whose output still comes from the
  // cache while the others train, encoded at every step (DiffusionModel::encode_trained_text).
  // Empty: the LoRA adapts every encoder.
  std::string untrained_encoders;
  // kohya's --weighted_captions: "(word:1.2)" weighs its tokens' states (SD, SDXL). kohya's
  // FLUX.1 trainer has no such option.
  bool weighted_captions = true;
  // kohya's --max_token_length 150/225: a long caption in chunks of max_length (SD, SDXL).
  // FLUX.1's T5 takes its own length (--t5xxl_max_token_length) and kohya ignores the flag there.
  bool long_prompts = true;
};

// The discrete noise schedule a DDPM family trains and samples with: diffusers'
// DDPMScheduler(beta_start, beta_end, beta_schedule="scaled_linear", num_train_timesteps). The
// trainer's noise schedule and every sampler's table are built from this one description
// (models/ddpm.h), so the two can never disagree.
struct DdpmSchedule {
  double beta_start = 0.00085;
  double beta_end = 0.012;
  int64_t steps = 1000;
};

// The sampling schedule of a flow-matching family: diffusers' FlowMatchEulerDiscreteScheduler as
// its scheduler_config.json sets it. With dynamic shifting (FLUX.1 [dev]) the sigmas
// linspace(1, 1/steps, steps) are shifted by mu, a line through (base_seq_len, base_shift) and
// (max_seq_len, max_shift) at the image's packed token count; without (schnell), by `shift`.
struct FlowSchedule {
  bool dynamic_shifting = true;
  double shift = 1.0;
  double base_shift = 0.5, max_shift = 1.15;
  int64_t base_seq_len = 256, max_seq_len = 4096;
};

// kohya's block table for block-wise network_args: the denoiser's blocks as kohya numbers them,
// `head` blocks before the inputs (SDXL's BASE: time and label embeddings), `side` input blocks,
// `mid` middle ones, `side` output blocks, then `tail` (SDXL's OUT: the final norm and conv).
// SD1.x's U-Net: IN00-IN11, MID, OUT00-OUT11 (25). SDXL's: BASE, IN00-IN08, MID00-MID02,
// OUT00-OUT08, OUT (23), as networks/lora.py's get_block_index numbers them with is_sdxl. The
// *_lr_weight lists give the side and middle blocks; head and tail weigh 1, as kohya adds them.
struct KohyaBlocks {
  int side = 12;
  int mid = 1;
  int head = 0;
  int tail = 0;
  size_t count() const { return static_cast<size_t>(head + 2 * side + mid + tail); }
  // "IN00-IN11, MID, OUT00-OUT11", for messages.
  std::string describe() const;
};

// What kohya writes into a LoRA's metadata for this family, and the names of its LoRA network.
struct KohyaFamilyNames {
  std::string network_module = "networks.lora";  // ss_network_module
  std::string base_model_version = "sd_v1";       // ss_base_model_version
  bool v2 = false;                                // ss_v2
  std::string modelspec_architecture = "stable-diffusion-v1";  // + "/lora"
  std::string modelspec_implementation = "diffusers";
  // kohya's block table for block-wise network_args (block_dims, down/mid/up_lr_weight).
  KohyaBlocks blocks;
  // kohya's network_args train_blocks (networks.lora_flux): each choice but "all", and the prefix
  // of the denoiser's LoRA names it keeps. Empty: the family's network has no such argument.
  std::vector<std::pair<std::string, std::string>> train_blocks;
  // kohya's network_args in_dims (networks.lora_flux): the groups of input layers, in the order
  // of its list, that get a module at the rank the list gives them (0 or none: no module). Empty:
  // the family's network has no such argument.
  std::vector<std::string> in_dims;
};

// How a family is trained: which TrainingObjective (models/objective.h) it gets. DDPM: integer
// timesteps over DdpmSchedule, the noise (or v) as the target. Flow matching (Flux.1 and the
// transformers after it): continuous sigmas in [0, 1], x_t = (1 - sigma) x0 + sigma noise, the
// velocity noise - x0 as the target (models/flow_matching.h).
enum class ObjectiveKind { kDdpm, kFlowMatching };

struct ModelFamily {
  std::string name;                 // "sd15"
  std::string display_name;         // "Stable Diffusion 1.5"
  int latent_channels = 4;
  // The denoiser's latents are (vae latents - shift) * scale, the VAE's inverse on the way out.
  double vae_scaling_factor = 0.18215;
  double vae_shift_factor = 0;
  int vae_downsample = 8;           // pixels per latent along each side
  // The VAE's activations pass fp16's 65504 (SDXL's VAE, FLUX.1's AE): it runs in fp32 unless
  // the user gives another VAE (--vae: SDXL's fixed fp16 one), as kohya's --no_half_vae advice
  // has it.
  bool vae_overflows_in_fp16 = false;
  std::string prediction_type;      // "epsilon" or "v_prediction"
  // What a loaded checkpoint says of its own objective, beyond its family's default: ComfyUI's
  // marker keys in an SDXL file (`v_pred`, `ztsnr`), or a diffusers folder's scheduler config.
  // `declared_by` names where ("its key v_pred"); empty where the checkpoint says nothing.
  std::string declared_by;
  bool declares_zero_terminal_snr = false;
  int default_resolution = 512;
  // What kohya users expect of the family's buckets: the largest side (0: preprocess's 1024), and
  // what every bucket side must be a multiple of (SDXL: 32, kohya's check on bucket_reso_steps).
  int default_max_bucket_reso = 0;
  int bucket_reso_multiple = 8;
  // Whether lorapipe run renders previews during the training on the trainer's own device, the
  // sampler over the trainer's published denoiser (models/shared_weights.h): its other parts (text
  // encoders, VAE) are its own there. FLUX.1's T5 XXL (9.5 GB in bf16) would be a second large
  // model beside the training, so there the sampler renders after the training instead.
  bool previews_beside_training = true;
  // A preview's steps where its prompt gives no --s: kohya's 30 for Stable Diffusion and 20 for
  // FLUX.1 [dev]; the 4 FLUX.1 [schnell] is distilled for, as its reference pipeline renders.
  int default_sample_steps = 30;
  // kohya's --cpu_offload_checkpointing (checkpointed block inputs in host memory): FLUX.1's, as
  // kohya offers it for FLUX.1 and SD3 alone.
  bool cpu_offload_checkpointing = false;
  TextConditioning text;
  ObjectiveKind objective = ObjectiveKind::kDdpm;
  DdpmSchedule schedule;  // the DDPM families' table (trainer and sampler alike)
  FlowSchedule flow;      // the flow-matching families' sampling schedule
  KohyaFamilyNames kohya;
  // Components and where they live in the original single file (their key prefixes).
  std::vector<std::pair<std::string, std::string>> single_file_components;
};

// The families lorapipe knows. Throws lorapipe::InputError listing them for an unknown name.
const ModelFamily& model_family(std::string_view name);
std::vector<std::string> model_family_names();

// The family of a checkpoint, and what told it.
struct FamilyDetection {
  std::string family;  // a name model_family() knows
  std::string reason;  // "--model_family", "its lorapipe.family metadata", "its keys (...)", ...
};

// Detects the family of `path`:
//  - `override` (the stages' --model_family) when not empty: it must name a known family;
//  - a single .safetensors file: by its lorapipe.family metadata (lorapipe's own files), else by
//    its keys (SD1.x: model.diffusion_model.* with a CLIP-L text encoder under
//    cond_stage_model.transformer.*; SDXL: model.diffusion_model.* with CLIP-L under
//    conditioner.embedders.0.transformer.* and OpenCLIP ViT-bigG under conditioner.embedders.1.model.*);
//  - a diffusers folder: by model_index.json's _class_name (StableDiffusionPipeline,
//    StableDiffusionXLPipeline), else by unet/config.json (a UNet2DConditionModel without added
//    conditions beside text_encoder/: SD1.x; with text_time added conditions beside
//    text_encoder_2/: SDXL).
// Throws lorapipe::InputError naming the path, what was found (the file's top-level key
// prefixes, or the folder's pipeline class and components) and the known families; where the
// keys are those of a family lorapipe does not train yet (SD2.x, Flux.1) it says which.
FamilyDetection detect_family(const std::filesystem::path& path, std::string_view override = {});

// What the checkpoint at `path` declares of its own objective, from its header or configs alone
// (nothing is loaded): a single file's keys (ComfyUI's v_pred, with ztsnr beside it: NoobAI-XL
// v-pred's markers) or a diffusers folder's scheduler/scheduler_config.json (prediction_type,
// rescale_betas_zero_snr). Sets `family`'s prediction_type, declared_by and
// declares_zero_terminal_snr where it declares v-prediction, and leaves it as it is otherwise.
// Throws lorapipe::InputError for EDM's markers (edm_mean, edm_std, edm_vpred.*: Playground
// v2.5), a schedule no family here has, and for a scheduler config that is not JSON.
void read_declared_objective(const std::filesystem::path& path, ModelFamily& family);
// The keys read_declared_objective reads: the weight loaders pass over them.
bool is_objective_marker_key(std::string_view key);

// Refuses flags that contradict what the checkpoint at `source` declares of itself
// (ModelFamily::declared_by): a v-prediction model trained as epsilon learns the wrong target,
// and rendered as epsilon draws noise. kohya reads no such marker, so its users give
// --v_parameterization (and --zero_terminal_snr) by hand; lorapipe holds them to the file.
// `zero_terminal_snr` is absent for a stage without that option (the sampler). Throws
// lorapipe::InputError naming the file, the marker and the flag to add.
void check_declared_objective(const ModelFamily& family, const std::string& source,
                              bool v_parameterization, std::optional<bool> zero_terminal_snr);
// The same for the checkpoint at `path` before anything is loaded (the stages' --check_flags).
void check_declared_objective(const std::filesystem::path& path, bool v_parameterization,
                              std::optional<bool> zero_terminal_snr);

}  // namespace lorapipe::models
