#include "models/flow_matching.h"

#include <ATen/ATen.h>

#include <cmath>
#include <string>

#include "common/error.h"
#include "common/numbers.h"
#include "models/ddpm.h"

namespace lorapipe::models {

double flux_shift_mu(int64_t image_tokens) {
  const double m = (1.15 - 0.5) / (4096.0 - 256.0);
  return m * static_cast<double>(image_tokens) + (0.5 - m * 256.0);
}

at::Tensor flux_time_shift(double mu, const at::Tensor& t) {
  return std::exp(mu) / (std::exp(mu) + (1.0 / t - 1.0));
}

namespace {

// diffusers' FlowMatchEulerDiscreteScheduler's shift of s in [0, 1].
at::Tensor shifted(const at::Tensor& s, double shift) { return shift * s / (1 + (shift - 1) * s); }

class FlowMatchingObjective final : public TrainingObjective {
 public:
  explicit FlowMatchingObjective(const ObjectiveOptions& options) : TrainingObjective(options) {}

  at::Tensor draw_times(int64_t batch, at::Generator generator, const at::Device& device,
                        int64_t latent_height, int64_t latent_width) const override {
    const ObjectiveOptions& o = options();
    const auto f32 = at::TensorOptions().dtype(at::kFloat);
    at::Tensor sigma;
    if (o.timestep_sampling == "uniform") {
      sigma = at::rand({batch}, generator, f32);
    } else if (o.timestep_sampling == "sigmoid") {
      sigma = at::sigmoid(o.sigmoid_scale * at::randn({batch}, generator, f32));
    } else if (o.timestep_sampling == "shift") {
      sigma = shifted(at::sigmoid(at::randn({batch}, generator, f32) * o.sigmoid_scale),
                      o.discrete_flow_shift);
    } else if (o.timestep_sampling == "flux_shift") {
      const double mu = flux_shift_mu((latent_height / 2) * (latent_width / 2));
      sigma =
          flux_time_shift(mu, at::sigmoid(at::randn({batch}, generator, f32) * o.sigmoid_scale));
    } else {  // "sigma": a training timestep of the shifted discrete schedule
      at::Tensor u;
      if (o.weighting_scheme == "logit_normal") {
        u = at::sigmoid(at::normal(o.logit_mean, o.logit_std, {batch}, generator, f32));
      } else if (o.weighting_scheme == "mode") {
        u = at::rand({batch}, generator, f32);
        u = 1 - u - o.mode_scale * (at::cos(M_PI * u / 2).pow(2) - 1 + u);
      } else {
        u = at::rand({batch}, generator, f32);
      }
      const at::Tensor index = (u * 1000).to(at::kLong).clamp(0, 999);
      // diffusers' sigmas: linspace(1, 1000, 1000) reversed, / 1000, shifted.
      sigma = shifted((1000 - index).to(at::kFloat) / 1000, o.discrete_flow_shift);
    }
    return sigma.to(device);
  }

  std::vector<ValidationPoint> validation_points(int64_t batch,
                                                 const at::Device& device) const override {
    std::vector<ValidationPoint> out;
    for (int64_t t : kohya_validation_timesteps(0, 1000)) {
      out.push_back({t, at::full({batch}, static_cast<double>(t) / 1000.0, at::kFloat).to(device)});
    }
    return out;
  }

  at::Tensor noisy_latents(const at::Tensor& latents, const at::Tensor& noise,
                           const at::Tensor& times) const override {
    const at::Tensor s = column(times, latents);
    return (1 - s) * latents + s * noise;
  }

  at::Tensor target(const at::Tensor& latents, const at::Tensor& noise,
                    const at::Tensor&) const override {
    return noise - latents;
  }

  at::Tensor prediction(const at::Tensor& output, const at::Tensor& noisy,
                        const at::Tensor& times) const override {
    const std::string& type = options().model_prediction_type;
    if (type == "additive") return output + noisy;
    if (type == "sigma_scaled") return output * (-column(times, output)) + noisy;
    return output;
  }

  at::Tensor weighted(at::Tensor loss, const at::Tensor& times) const override {
    const ObjectiveOptions& o = options();
    if (o.model_prediction_type != "sigma_scaled") return loss;
    const at::Tensor s = times.to(loss.device(), at::kFloat);
    if (o.weighting_scheme == "sigma_sqrt") return loss * s.pow(-2.0);
    if (o.weighting_scheme == "cosmap") return loss * (2 / (M_PI * (1 - 2 * s + 2 * s.pow(2))));
    return loss;
  }

  at::Tensor huber_threshold(const at::Tensor& times) const override {
    const ObjectiveOptions& o = options();
    const at::Tensor t = times.to(at::kCPU, at::kFloat) * 1000;  // kohya's timesteps
    at::Tensor c;
    if (o.huber_schedule == "exponential") {
      c = at::exp(-(-std::log(o.huber_c) / 1000.0) * t) * o.huber_scale;
    } else if (o.huber_schedule == "constant") {
      c = at::full({t.size(0)}, o.huber_c * o.huber_scale, at::kFloat);
    } else {
      throw InputError("--huber_schedule " + o.huber_schedule +
                       ": kohya's SNR schedule needs a DDPM noise schedule; flow matching takes "
                       "--huber_schedule constant or exponential");
    }
    return c.view({-1, 1, 1, 1}).to(times.device());
  }

  void write_metadata(std::map<std::string, std::string>& m) const override {
    const ObjectiveOptions& o = options();
    // FluxNetworkTrainer.update_metadata's keys.
    m["ss_weighting_scheme"] = o.weighting_scheme;
    m["ss_logit_mean"] = python_float_repr(o.logit_mean);
    m["ss_logit_std"] = python_float_repr(o.logit_std);
    m["ss_mode_scale"] = python_float_repr(o.mode_scale);
    m["ss_timestep_sampling"] = o.timestep_sampling;
    m["ss_sigmoid_scale"] = python_float_repr(o.sigmoid_scale);
    m["ss_model_prediction_type"] = o.model_prediction_type;
    m["ss_guidance_scale"] = python_float_repr(o.guidance_scale);
    m["ss_discrete_flow_shift"] = python_float_repr(o.discrete_flow_shift);
    m["ss_huber_schedule"] = o.huber_schedule;
    m["ss_huber_scale"] = python_float_repr(o.huber_scale);
    m["ss_huber_c"] = python_float_repr(o.huber_c);
    // kohya's sai_model_spec writes no prediction type for FLUX.1 ("Flux models don't use
    // prediction_type").
  }

 private:
  // times [B] as [B, 1, ..., 1] for broadcasting against `like`, on its device and in fp32.
  static at::Tensor column(const at::Tensor& times, const at::Tensor& like) {
    std::vector<int64_t> shape(static_cast<size_t>(like.dim()), 1);
    shape[0] = -1;
    return times.to(like.device(), at::kFloat).view(shape);
  }
};

}  // namespace

std::unique_ptr<TrainingObjective> make_flow_matching_objective(const ModelFamily& family,
                                                                const ObjectiveOptions& o) {
  check_objective_options(o);
  // kohya's SD-only options, refused for a flow-matching family by name.
  const ObjectiveOptions defaults;
  auto refuse = [&family](const char* flag) {
    throw InputError(std::string(flag) + " is a Stable Diffusion (DDPM) option; " +
                     family.display_name + " trains by flow matching (see --timestep_sampling, " +
                     "--weighting_scheme and --model_prediction_type)");
  };
  if (o.v_prediction) refuse("--v_parameterization");
  if (o.zero_terminal_snr) refuse("--zero_terminal_snr");
  if (o.min_snr_gamma > 0) refuse("--min_snr_gamma");
  if (o.scale_v_pred_loss_like_noise_pred) refuse("--scale_v_pred_loss_like_noise_pred");
  if (o.v_pred_like_loss > 0) refuse("--v_pred_like_loss");
  if (o.debiased_estimation_loss) refuse("--debiased_estimation_loss");
  if (o.min_timestep != defaults.min_timestep) refuse("--min_timestep");
  if (o.max_timestep != defaults.max_timestep) refuse("--max_timestep");
  return std::make_unique<FlowMatchingObjective>(o);
}

}  // namespace lorapipe::models
