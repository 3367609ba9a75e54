#pragma once
// The flow-matching objective (ObjectiveKind::kFlowMatching) as kohya's flux_train_network.py
// trains Flux.1 (library/flux_train_utils.py get_noisy_model_input_and_timesteps and
// apply_model_prediction_type), the pattern of the flow-matching transformers after it.
//
// A noise point is a sigma in [0, 1]; the denoiser sees x_t = (1 - sigma) x0 + sigma noise at
// model time sigma (kohya passes timesteps / 1000, which is sigma) and is trained towards the
// velocity noise - x0. How sigma is drawn (--timestep_sampling):
//  - sigma (kohya's default): u from diffusers' compute_density_for_timestep_sampling under
//    --weighting_scheme (logit_normal: sigmoid of N(logit_mean, logit_std); mode: kohya's mode
//    density with --mode_scale; otherwise uniform), then the sigma of training timestep
//    floor(u * 1000) in diffusers' FlowMatchEulerDiscreteScheduler(shift=--discrete_flow_shift):
//    s = (1000 - index) / 1000 shifted to shift s / (1 + (shift - 1) s);
//  - uniform: U(0, 1); sigmoid: sigmoid(--sigmoid_scale * N(0, 1));
//  - shift: sigmoid(--sigmoid_scale * N(0, 1)) shifted by --discrete_flow_shift as above;
//  - flux_shift: the same sigmoid, shifted by Flux's resolution-dependent mu (a line through
//    (256 tokens, 0.5) and (4096 tokens, 1.15), at the packed image's token count
//    (h / 2) * (w / 2)): exp(mu) / (exp(mu) + 1 / t - 1).
// What the loss compares (--model_prediction_type), exactly as kohya computes it:
//  - raw: the output (the recommendation of kohya's docs, and the README's);
//  - additive: output + x_t;
//  - sigma_scaled (kohya's default): -sigma * output + x_t, and the loss weighted per sample by
//    diffusers' compute_loss_weighting_for_sd3 (sigma_sqrt: sigma^-2; cosmap:
//    2 / (pi (1 - 2 sigma + 2 sigma^2)); otherwise 1). In kohya only this mode weights the loss.
// kohya leaves sigma undefined outside --timestep_sampling sigma and so cannot run sigma_scaled
// there; here sigma is the drawn t in every mode, so every combination runs.
//
// Validation points: kohya's validation timesteps (200, 400, 600, 800) as sigmas (/ 1000). The
// Huber threshold: constant and exponential as kohya computes them at timesteps sigma * 1000;
// kohya's snr schedule needs a DDPM schedule and is refused by name.

#include <memory>

#include "models/family.h"
#include "models/objective.h"

namespace lorapipe::models {

// Flux's resolution shift mu for `image_tokens` packed tokens (kohya get_lin_function(y1=0.5,
// y2=1.15) at x1=256, x2=4096), and the shift it makes of t (kohya time_shift(mu, 1, t)).
double flux_shift_mu(int64_t image_tokens);
at::Tensor flux_time_shift(double mu, const at::Tensor& t);

std::unique_ptr<TrainingObjective> make_flow_matching_objective(const ModelFamily& family,
                                                                const ObjectiveOptions& options);

}  // namespace lorapipe::models
