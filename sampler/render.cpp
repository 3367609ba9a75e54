#include "sampler/render.h"

#include <torch/torch.h>

#include <cmath>
#include <vector>

#include "common/error.h"

namespace lorapipe::sampler {

double cfg_scale(const models::ModelFamily& family, const RenderRequest& request) {
  const bool flow = family.objective == models::ObjectiveKind::kFlowMatching;
  return flow && !request.cfg_scale_given ? 1.0 : request.cfg_scale;
}

int sample_steps(const models::ModelFamily& family, const RenderRequest& request) {
  return request.steps != 0 ? request.steps : family.default_sample_steps;
}

bool classifier_free(const models::ModelFamily& family, const RenderRequest& request) {
  if (family.objective == models::ObjectiveKind::kFlowMatching) {
    return cfg_scale(family, request) != 1.0;  // kohya: the negative prompt is "" where none
  }
  return request.cfg_scale > 1.0;
}

models::Conditioning encode_request(models::DiffusionModel& model, const RenderRequest& request,
                                    int clip_skip) {
  torch::NoGradGuard no_grad;
  // [negative, positive] in one batch, as diffusers concatenates them.
  std::vector<std::string> captions;
  if (classifier_free(model.model_family(), request)) captions.push_back(request.negative_prompt);
  captions.push_back(request.prompt);
  // As kohya conditions its sample images: attention weights, and up to 225 tokens in chunks,
  // both prompts of the pair at the chunk count of the longer.
  return model.encode_prompts(captions, clip_skip);
}

std::pair<int, int> rendered_size(const models::ModelFamily& family, const RenderRequest& request) {
  if (family.objective != models::ObjectiveKind::kFlowMatching) {
    return {request.width, request.height};
  }
  const int packed = 2 * family.vae_downsample;
  return {request.width / packed * packed, request.height / packed * packed};
}

at::Tensor flow_sigmas(const models::FlowSchedule& schedule, int steps, int64_t image_tokens) {
  // diffusers: np.linspace in double, cast to fp32, shifted in fp32 (numpy's arithmetic with
  // Python scalars), then a final 0.
  std::vector<float> base(static_cast<size_t>(steps));
  const double stop = 1.0 / steps, step = steps > 1 ? (stop - 1.0) / (steps - 1) : 0.0;
  for (int i = 0; i < steps; ++i) {
    base[i] = static_cast<float>(i + 1 == steps ? stop : static_cast<double>(i) * step + 1.0);
  }
  const torch::Tensor s = torch::tensor(base, torch::kFloat32);
  torch::Tensor shifted;
  if (schedule.dynamic_shifting) {
    const double m = (schedule.max_shift - schedule.base_shift) /
                     static_cast<double>(schedule.max_seq_len - schedule.base_seq_len);
    const double mu = static_cast<double>(image_tokens) * m +
                      (schedule.base_shift - m * static_cast<double>(schedule.base_seq_len));
    const torch::Tensor e = torch::tensor(static_cast<float>(std::exp(mu)));
    shifted = e / (e + (1 / s - 1));
  } else {
    const torch::Tensor shift = torch::tensor(static_cast<float>(schedule.shift));
    shifted = shift * s / (1 + (shift - 1) * s);
  }
  return torch::cat({shifted, torch::zeros({1})});
}

namespace {

// The render's last part, for every family: the latents decoded into the image, and where
// values stopped being finite, if they did.
RenderResult finish(models::DiffusionModel& model, const torch::Tensor& latents) {
  const auto finite = [](const torch::Tensor& t) { return torch::isfinite(t).all().item<bool>(); };
  RenderResult result;
  result.latents = latents.to(torch::kFloat32).cpu();
  const torch::Tensor decoded = model.decode_latents(latents).to(torch::kFloat32).cpu();
  result.not_finite = !finite(result.latents) ? "denoising" : !finite(decoded) ? "decoding" : "";
  result.image = to_uint8_image(decoded);
  return result;
}

// A flow-matching family's preview, as diffusers' FluxPipeline and kohya's Flux sampling make
// it: Euler steps along the predicted velocity over flow_sigmas, the denoiser given the sigma
// (as the pipeline's timestep / 1000) and --g as its distilled guidance (dev); with --l not 1,
// true classifier-free guidance (FluxPipeline's true_cfg_scale) against the negative prompt or
// the empty one: the negative and positive passes in one batch, uncond + scale * (cond - uncond).
RenderResult render_flow(models::DiffusionModel& model, const RenderRequest& request,
                         const RenderOptions& options) {
  torch::NoGradGuard no_grad;
  const models::ModelFamily& family = model.model_family();
  auto generator = at::detail::createCPUGenerator(static_cast<uint64_t>(request.seed));
  models::Conditioning conditioning;
  if (options.conditioning != nullptr) {
    conditioning = *options.conditioning;
  } else {
    conditioning = encode_request(model, request, options.clip_skip);
  }
  const bool guided = classifier_free(family, request);
  const double scale = cfg_scale(family, request);
  const torch::Tensor weight = model.denoiser_module().parameters().front();
  // Sizes round down to what 2x2 packing takes (16 px for an 8x AE), as FluxPipeline rounds them.
  const auto [width, height] = rendered_size(family, request);
  const int64_t h = height / family.vae_downsample, w = width / family.vae_downsample;
  if (h == 0 || w == 0) {
    throw InputError("image size " + std::to_string(request.width) + "x" +
                     std::to_string(request.height) + " is under " +
                     std::to_string(2 * family.vae_downsample) + " px, the smallest " +
                     family.display_name + " renders");
  }
  torch::Tensor latents =
      options.initial_latents.defined()
          ? options.initial_latents.to(torch::kFloat32)
          : torch::randn({1, family.latent_channels, h, w}, generator, torch::kFloat32);
  latents = latents.to(weight.device());
  const int steps = sample_steps(family, request);
  const torch::Tensor sigmas =
      flow_sigmas(family.flow, steps, (latents.size(2) / 2) * (latents.size(3) / 2));
  for (int i = 0; i < steps; ++i) {
    models::DenoiseInput input;
    input.latents = guided ? torch::cat({latents, latents}) : latents;
    input.time = sigmas[i] * 1000 / 1000;  // the pipeline's timestep, back in [0, 1]
    input.conditioning = &conditioning;
    input.guidance = request.guidance.value_or(3.5);  // kohya's default for --g
    torch::Tensor velocity = model.denoise(input).to(torch::kFloat32);
    if (guided) {
      const auto parts = velocity.chunk(2);
      velocity = parts[0] + scale * (parts[1] - parts[0]);
    }
    latents = latents + (sigmas[i + 1] - sigmas[i]).to(latents.device()) * velocity;
    if (options.on_step) options.on_step(i, latents);
  }
  return finish(model, latents);
}

}  // namespace

RenderResult render(models::DiffusionModel& model, const RenderRequest& request,
                    const RenderOptions& options) {
  if (request.width < 8 || request.height < 8 || request.width % 8 || request.height % 8) {
    throw InputError("image size " + std::to_string(request.width) + "x" +
                     std::to_string(request.height) + " must be positive multiples of 8");
  }
  const models::ModelFamily& family = model.model_family();
  if (sample_steps(family, request) < 1) throw InputError("a render needs at least one step");
  if (family.objective == models::ObjectiveKind::kFlowMatching) {
    return render_flow(model, request, options);
  }
  torch::NoGradGuard no_grad;
  const std::unique_ptr<Scheduler> scheduler =
      make_scheduler(scheduler_options(request.sampler, options.v_prediction, family.schedule),
                     sample_steps(family, request));
  auto generator = at::detail::createCPUGenerator(static_cast<uint64_t>(request.seed));

  const bool guided = classifier_free(family, request);
  const models::Conditioning conditioning = options.conditioning != nullptr
                                                ? *options.conditioning
                                                : encode_request(model, request, options.clip_skip);

  const torch::Tensor weight = model.denoiser_module().parameters().front();
  const int64_t h = request.height / family.vae_downsample,
                w = request.width / family.vae_downsample;
  // diffusers' prepare_latents: randn from the generator (or the latents given), times the
  // scheduler's init_noise_sigma.
  torch::Tensor latents =
      options.initial_latents.defined()
          ? options.initial_latents.to(torch::kFloat32)
          : torch::randn({1, family.latent_channels, h, w}, generator, torch::kFloat32);
  latents = (latents * scheduler->init_noise_sigma()).to(weight.device());

  for (int i = 0; i < scheduler->calls(); ++i) {
    torch::Tensor input = guided ? torch::cat({latents, latents}) : latents;
    input = scheduler->scale_model_input(input, i);
    const torch::Tensor t = scheduler->timesteps()[i];
    torch::Tensor prediction = model.denoise(input, t, conditioning).to(torch::kFloat32);
    if (guided) {
      const auto parts = prediction.chunk(2);
      prediction = parts[0] + request.cfg_scale * (parts[1] - parts[0]);
    }
    latents = scheduler->step(prediction, i, latents, generator);
    if (options.on_step) options.on_step(i, latents);
  }
  return finish(model, latents);
}

at::Tensor to_uint8_image(const at::Tensor& decoded) {
  // NaN is made 0 (black) here: its conversion to uint8 is not defined.
  const torch::Tensor x = (decoded[0] / 2 + 0.5).clamp(0, 1).nan_to_num(0);
  // diffusers' numpy_to_pil: (images * 255).round().astype("uint8").
  return (x.permute({1, 2, 0}) * 255).round().to(torch::kUInt8).contiguous();
}

}  // namespace lorapipe::sampler
