#pragma once
// One preview image through any model family (models/diffusion_model.h): the prompt and the
// negative prompt into conditionings, the initial latents from the seed, the scheduler's steps
// with classifier-free guidance, the VAE's decode. StableDiffusionPipeline's loop, step for step;
// for a flow-matching family (Flux.1) FluxPipeline's: Euler steps over the family's flow
// schedule, --g as the distilled guidance, and true classifier-free guidance only with --l
// (--sample_sampler is ignored there, as kohya ignores it for Flux).

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <utility>
#include <optional>
#include <string>

#include "models/diffusion_model.h"
#include "sampler/schedulers.h"

namespace lorapipe::sampler {

// One prompt as kohya's prompt files give it (defaults: kohya's sample_image_inference).
struct RenderRequest {
  std::string prompt;
  std::string negative_prompt;
  int width = 512;  // rounded down to a multiple of 8 by the prompt parser
  int height = 512;
  // 0: the family's default (ModelFamily::default_sample_steps): sample_steps() says which.
  int steps = 0;
  double cfg_scale = 7.5;
  // Whether the prompt set its CFG scale (--l, scale): a flow-matching family's default is 1
  // (no classifier-free guidance), kohya's, not Stable Diffusion's 7.5.
  bool cfg_scale_given = false;
  // --g (guidance_scale): the distilled guidance of a guidance-embedded denoiser (FLUX.1 [dev]);
  // unset: kohya's 3.5. Stable Diffusion has none and ignores it.
  std::optional<double> guidance;
  int64_t seed = 0;
  std::string sampler = "ddim";
  int index = 0;  // its place in the prompt file, counting lines that could not be read (kohya's)
};

// Whether `request` renders with classifier-free guidance (a negative and a positive pass): for
// Stable Diffusion when its scale is above 1; for a flow-matching family, as kohya's Flux
// sampling does, when --l is given and not 1, against the negative prompt or, without one, the
// empty prompt.
bool classifier_free(const models::ModelFamily& family, const RenderRequest& request);
// The CFG scale `request` renders with (a flow-matching family's default is 1).
double cfg_scale(const models::ModelFamily& family, const RenderRequest& request);
// The steps `request` renders with: its own, else its family's default.
int sample_steps(const models::ModelFamily& family, const RenderRequest& request);
// The image size `request` renders at, width then height: its own, except that a flow-matching
// family's rounds down to what 2x2 packing of its latents takes (16 px for an 8x AE).
std::pair<int, int> rendered_size(const models::ModelFamily& family, const RenderRequest& request);

struct RenderResult {
  at::Tensor latents;  // [1, C, H/8, W/8] fp32: the denoised latents
  at::Tensor image;    // [H, W, 3] uint8
  // Where NaN or infinity came in, if anywhere: "denoising" (the latents) or "decoding" (the
  // VAE's output, from finite latents); empty where every value was finite. A non-finite image
  // is written black, as diffusers' and kohya's are: this says why.
  std::string not_finite;
};

struct RenderOptions {
  bool v_prediction = false;
  int clip_skip = 1;
  // Initial latents instead of the seed's (tests hand diffusers' in); fp32 [1, C, H/8, W/8].
  at::Tensor initial_latents;
  // The request's prompts already encoded (encode_request), as the sampler keeps them across
  // checkpoints whose LoRA leaves the text encoder alone; null: encoded here.
  const models::Conditioning* conditioning = nullptr;
  // Called after each model call with its index and the latents (progress, tests); Heun, DPM2
  // and PNDM call the model more often than their step count.
  std::function<void(int, const at::Tensor&)> on_step;
};

// The request's negative and positive prompt as one batch ([negative, positive]; the positive
// alone without guidance), conditioned as kohya conditions its sample images.
models::Conditioning encode_request(models::DiffusionModel& model, const RenderRequest& request,
                                    int clip_skip);

// The seed's generator draws the initial latents (randn, fp32, CPU) and then Euler ancestral's
// noise, in diffusers' order: the same seed gives diffusers' image with a CPU generator.
RenderResult render(models::DiffusionModel& model, const RenderRequest& request,
                    const RenderOptions& options = {});

// A flow-matching family's sampling sigmas for `steps` Euler steps over an image of
// `image_tokens` packed tokens, with a final 0: [steps + 1] fp32, as diffusers'
// FlowMatchEulerDiscreteScheduler.set_timesteps makes them for FluxPipeline.
at::Tensor flow_sigmas(const models::FlowSchedule& schedule, int steps, int64_t image_tokens);

// [B, 3, H, W] in [-1, 1] -> [H, W, 3] uint8 of the first image, as diffusers' image processor
// rounds it ((x / 2 + 0.5).clamp(0, 1) * 255, rounded).
at::Tensor to_uint8_image(const at::Tensor& decoded);

}  // namespace lorapipe::sampler
