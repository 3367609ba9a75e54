// lorapipe-sampler: flags in, sampler::run_sampler out.
//   one shot:      --lora=FILE[:multiplier] (repeatable, comma-separated too)
//   follow a run:  --sub=TRAINER_PUB_ENDPOINT [--pub=ENDPOINT]
//   after a run:   --replay_dir=RUN/lora [--pub=ENDPOINT]
#include <gflags/gflags.h>

#include <cstdio>
#include <optional>
#include <sstream>
#include <string>

#include "common/error.h"
#include "common/kohya_flags.h"
#include "common/log.h"
#include "common/numbers.h"
#include "common/text.h"
#include "sampler/sampler.h"
#include "runtime/exit_code.h"
#include "runtime/flags.h"

DEFINE_string(pretrained_model_name_or_path, "",
              "Base model: single .safetensors or diffusers folder");
DEFINE_string(model, "", "Alias of --pretrained_model_name_or_path");
DEFINE_string(model_family, "",
              "Load the model as this family (sd15) instead of detecting it from its keys, its "
              "model_index.json or its metadata");
DEFINE_string(tokenizer, "",
              "Another CLIP vocabulary (folder, merges.txt or .gz); CLIP's own is built in");
DEFINE_string(vae, "", "Decode with another VAE than the checkpoint's (kohya's --vae)");
DEFINE_string(sample_prompts, "", "kohya prompt file: .txt, .toml or .json");
DEFINE_string(output_dir, "", "Run folder: images go to OUTPUT_DIR/samples/");
DEFINE_string(base_weights, "",
              "The trainer's --base_weights: LoRAs merged into the base for good, space-separated");
DEFINE_string(base_weights_multiplier, "", "Their multipliers, in order (1 for those not given)");
DEFINE_string(lora, "", "One shot: FILE[:multiplier][,FILE[:multiplier]...] merged together");
DEFINE_string(sub, "", "Follow a run: the trainer's --pub endpoint (CheckpointReady)");
DEFINE_string(replay_dir, "",
              "After a run: render every LoRA saved in this folder (and its sample_only/) in "
              "step order, then exit");
DEFINE_string(pub, "", "Bind a PUB endpoint for SampleReady");
DEFINE_string(device, "auto", "auto, cpu, cuda or cuda:N");
DEFINE_string(mixed_precision, "no",
              "no, fp16 or bf16: the models' dtype, as kohya renders samples in its training's");
DEFINE_bool(fp8_base, false,
            "Store the U-Net's and text encoder's Linear/Conv2d weights in float8 (the LoRA is "
            "then applied beside them, not merged)");
DEFINE_bool(fp8_base_unet, false, "--fp8_base for the U-Net alone");
DEFINE_bool(fp8_scaled, false,
            "With --fp8_base(_unet): float8 with a scale per 64 input features of each output "
            "row (musubi-tuner's)");
DEFINE_bool(fp8_fast, false,
            "With --fp8_scaled: the denoiser's Linear layers multiply in float8 (at::_scaled_mm), "
            "on CUDA devices of compute capability 8.9 and above");
DEFINE_bool(merge_lora, false,
            "Merge each checkpoint's LoRA into the weights, keeping a copy of those it changes "
            "(faster renders, more memory); by default it is computed beside them, copying none");
DEFINE_int32(blocks_to_swap, 0,
             "kohya's --blocks_to_swap: keep the weights of this many of the denoiser's blocks, "
             "and the text encoders, in host memory (previews on a card the model does not fit)");
DEFINE_bool(map_weights, false,
            "On the CPU: base weights the model file holds in their dtype are the file's mapped "
            "pages, shared with a trainer that maps them too (lorapipe run sets it when both "
            "share the CPU)");
DEFINE_string(shared_weights, "",
              "A trainer's shared-weights manifest (its --share_weights): render over the "
              "trainer's placed denoiser on the same device instead of a copy of it (CUDA IPC on "
              "a GPU, shared memory on the CPU); waits for the trainer to publish it");
DEFINE_string(sample_sampler, "ddim", "Sampler for prompts without --ss (kohya's names)");
DEFINE_bool(v_parameterization, false, "The model predicts v (SD2.x 768-v)");
DEFINE_int32(clip_skip, 1, "Text-encoder layers to skip from the end (1: the last)");
DEFINE_int64(seed, 1234, "Seed of the first prompt without --d (the next gets seed+1, ...)");
DEFINE_double(idle_timeout_s, 0, "Following: stop after this long without a checkpoint (0: never)");
DEFINE_double(delay_per_image_s, 0, "Testing: sleep this long after each image");
DEFINE_double(device_share, -1,
              "The share of the device's time renders take (0 < share <= 1): after each model "
              "call the sampler waits (1/share - 1) times that call's time, so a trainer on the "
              "same GPU keeps the rest (not for the final checkpoint: the training is over); -1: 0.1 "
              "over a trainer's shared weights on CUDA, else 1");
DEFINE_int32(threads, 0, "CPU threads for compute (0: one per core)");
DEFINE_bool(check_flags, false,
            "Check the flags, the device, the sampler's name and the prompt file without loading "
            "the model, and exit: 0 when they are fine, 2 naming what is not. lorapipe run does "
            "this before it starts any stage");

int main(int argc, char** argv) {
  // glibc's default heap, not the trainer's keep-freed-memory policy (common/heap.h): at SD1.5
  // size the policy kept 1.9 GB more resident for no measurable speed (0.91x against 0.90x
  // diffusers' time; bench/sampler_bench.py --size full [--keep-freed]), and the sampler shares
  // its machine with a trainer or runs on a small card's host.
  gflags::SetUsageMessage(
      "renders sample images for LoRA checkpoints\n"
      "  lorapipe-sampler --pretrained_model_name_or_path=MODEL --sample_prompts=FILE "
      "--output_dir=OUT --lora=FILE[:multiplier]\n"
      "  lorapipe-sampler --pretrained_model_name_or_path=MODEL --sample_prompts=FILE "
      "--output_dir=OUT --sub=TRAINER_PUB_ENDPOINT");
  lorapipe::runtime::parse_flags(&argc, &argv);
  namespace s = lorapipe::sampler;
  try {
    if (argc > 1) throw lorapipe::InputError(std::string("unexpected argument '") + argv[1] + "'");
    s::SamplerOptions o;
    o.model = FLAGS_pretrained_model_name_or_path.empty() ? FLAGS_model
                                                          : FLAGS_pretrained_model_name_or_path;
    o.model_family = FLAGS_model_family;
    o.tokenizer = FLAGS_tokenizer;
    o.vae = FLAGS_vae;
    o.model_parts = lorapipe::models::model_parts_from_flags();
    o.sample_prompts = FLAGS_sample_prompts;
    o.output_dir = FLAGS_output_dir;
    o.device = FLAGS_device;
    o.mixed_precision = FLAGS_mixed_precision;
    o.fp8_base = FLAGS_fp8_base;
    o.fp8_base_unet = FLAGS_fp8_base_unet;
    o.fp8_scaled = FLAGS_fp8_scaled;
    o.fp8_fast = FLAGS_fp8_fast;
    o.merge_lora = FLAGS_merge_lora;
    o.blocks_to_swap = FLAGS_blocks_to_swap;
    o.map_weights = FLAGS_map_weights;
    o.shared_weights = FLAGS_shared_weights;
    o.sampler = FLAGS_sample_sampler;
    o.v_prediction = FLAGS_v_parameterization;
    o.clip_skip = FLAGS_clip_skip;
    o.first_seed = FLAGS_seed;
    o.sub_endpoint = FLAGS_sub;
    o.pub_endpoint = FLAGS_pub;
    o.idle_timeout_s = FLAGS_idle_timeout_s;
    o.delay_per_image_s = FLAGS_delay_per_image_s;
    o.device_share = FLAGS_device_share;
    o.threads = FLAGS_threads;
    o.replay_dir = FLAGS_replay_dir;
    for (const auto& [file, multiplier] :
         lorapipe::kohya::parse_base_weights(FLAGS_base_weights, FLAGS_base_weights_multiplier)) {
      o.base_weights.emplace_back(file, multiplier);
    }
    std::stringstream list(FLAGS_lora);
    std::string item;
    while (std::getline(list, item, ',')) {
      if (item.empty()) continue;
      double multiplier = 1.0;
      const size_t colon = item.rfind(':');
      if (colon != std::string::npos && colon + 1 < item.size() &&
          item.find_first_not_of("0123456789.-", colon + 1) == std::string::npos) {
        const std::optional<double> parsed = lorapipe::parse_double(item.substr(colon + 1));
        if (!parsed) {
          throw lorapipe::InputError("--lora=" + item + ": the multiplier after ':' is not a number");
        }
        multiplier = *parsed;
        item = item.substr(0, colon);
      }
      o.loras.emplace_back(item, multiplier);
    }
    if (FLAGS_check_flags) {
      // The largest preview by pixels, for `lorapipe plan` (its share of a card it shares).
      const s::PromptSet prompts = s::check_sampler_options(o);
      const s::RenderRequest* largest = &prompts.prompts.front();
      for (const s::RenderRequest& r : prompts.prompts) {
        if (int64_t{r.width} * r.height > int64_t{largest->width} * largest->height) largest = &r;
      }
      std::printf("sampler: the flags are fine; previews up to %dx%d\n", largest->width,
                  largest->height);
      return lorapipe::runtime::kExitOk;
    }
    const s::SamplerSummary summary = s::run_sampler(o);
    std::printf("sampler: %d checkpoints rendered, %d skipped, %d superseded; %d images; "
                "prompts encoded %d times\n",
                summary.checkpoints_rendered, summary.checkpoints_skipped,
                summary.checkpoints_superseded, summary.images, summary.prompt_encodings);
    return lorapipe::runtime::kExitOk;
  } catch (const std::exception& e) {
    LP_LOG(kError, "sampler") << e.what();
    return lorapipe::runtime::kExitError;
  }
}
