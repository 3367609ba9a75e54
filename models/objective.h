#pragma once
// A family's training objective: how a noise point is drawn, the noisy input the denoiser sees,
// the target it is trained towards, the weighting of each sample's loss, the Huber threshold at
// each point, kohya's validation points, and the metadata keys that describe all of it. The
// trainer holds one from make_training_objective() and never asks which family it serves: DDPM
// families (SD1.x) draw integer timesteps and predict noise or v (models/ddpm.h); flow-matching
// families draw continuous times and predict a velocity.
//
// kohya's knobs stay the trainer's options (ObjectiveOptions, filled from its flags); a family
// refuses those that do not apply to it, as kohya does, naming the flag.

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "models/family.h"

namespace lorapipe::models {

struct ObjectiveOptions {
  bool v_prediction = false;       // --v_parameterization
  bool zero_terminal_snr = false;  // --zero_terminal_snr
  double min_snr_gamma = 0;        // --min_snr_gamma (0: off)
  // kohya's other loss weightings by the point's SNR (library/custom_train_functions.py),
  // applied after min-SNR in kohya's order.
  bool scale_v_pred_loss_like_noise_pred = false;  // x snr / (snr + 1)
  double v_pred_like_loss = 0;                     // + loss * (snr + 1) / snr * this
  bool debiased_estimation_loss = false;           // x 1 / sqrt(snr), v-prediction 1 / (snr + 1)
  // --min_timestep / --max_timestep: the range noise points are drawn from, on kohya's scale of
  // 1000 training timesteps (max exclusive, as kohya's randint).
  int64_t min_timestep = 0;
  int64_t max_timestep = 1000;
  std::string huber_schedule = "snr";  // --huber_schedule constant | exponential | snr
  double huber_c = 0.1;                // --huber_c
  double huber_scale = 1.0;            // --huber_scale

  // Flow matching (kohya's flux_train_network.py and library/flux_train_utils.py; defaults are
  // kohya's). A DDPM family refuses them when set, a flow-matching family refuses the SD-only
  // knobs above, each by its flag.
  std::string timestep_sampling = "sigma";  // --timestep_sampling sigma|uniform|sigmoid|shift|flux_shift
  double discrete_flow_shift = 3.0;         // --discrete_flow_shift (the sigma schedule's and shift's)
  double sigmoid_scale = 1.0;               // --sigmoid_scale
  std::string weighting_scheme = "none";    // --weighting_scheme none|sigma_sqrt|logit_normal|mode|cosmap
  double logit_mean = 0.0;                  // --logit_mean
  double logit_std = 1.0;                   // --logit_std
  double mode_scale = 1.29;                 // --mode_scale
  std::string model_prediction_type = "sigma_scaled";  // --model_prediction_type raw|additive|sigma_scaled
  // --guidance_scale: the distilled guidance a guidance-embedded denoiser (FLUX.1 [dev]) is given
  // in training (kohya's default 3.5; kohya's docs advise 1.0 for dev LoRAs).
  double guidance_scale = 3.5;
};

// The checks every family makes of the options (ranges, names), without a family: the trainer
// runs them with its other flags, before a model is loaded. Throws InputError naming the flag.
void check_objective_options(const ObjectiveOptions& options);

// One of kohya's fixed validation points: its timestep on the 1000-step scale (which also seeds
// the point's noise, so a validation loss is comparable from run to run) and the model time the
// denoiser is given there, [batch] on the device.
struct ValidationPoint {
  int64_t timestep;
  at::Tensor time;
};

class TrainingObjective {
 public:
  virtual ~TrainingObjective() = default;

  const ObjectiveOptions& options() const { return options_; }

  // A batch's noise points as model times ([B], on `device`): every random number from
  // `generator` on the CPU, so a run draws the same points on every device. `latent_height` and
  // `latent_width` are the batch's latents' (kohya's flux_shift shifts by the image's token count).
  virtual at::Tensor draw_times(int64_t batch, at::Generator generator, const at::Device& device,
                                int64_t latent_height = 0, int64_t latent_width = 0) const = 0;
  // kohya's validation points for a batch of `batch` samples.
  virtual std::vector<ValidationPoint> validation_points(int64_t batch,
                                                         const at::Device& device) const = 0;
  // The denoiser's input: the latents noised with `noise` at `times`, in the latents' dtype.
  virtual at::Tensor noisy_latents(const at::Tensor& latents, const at::Tensor& noise,
                                   const at::Tensor& times) const = 0;
  // What the denoiser's output is trained towards (its parametrisation: noise, v, a velocity).
  virtual at::Tensor target(const at::Tensor& latents, const at::Tensor& noise,
                            const at::Tensor& times) const = 0;
  // What the loss compares with the target: the denoiser's `output` itself, or (kohya's
  // --model_prediction_type additive / sigma_scaled) a function of it and the `noisy` input.
  virtual at::Tensor prediction(const at::Tensor& output, const at::Tensor& noisy,
                                const at::Tensor& times) const {
    (void)noisy;
    (void)times;
    return output;
  }
  // Per-sample losses [B] times the objective's weighting of each point (kohya's min-SNR and
  // the others that are on); the losses unchanged when none is.
  virtual at::Tensor weighted(at::Tensor per_sample_loss, const at::Tensor& times) const = 0;
  // The Huber / smooth-L1 threshold c at each point under --huber_schedule, [B, 1, 1, 1] fp32 on
  // the times' device.
  virtual at::Tensor huber_threshold(const at::Tensor& times) const = 0;
  // kohya's metadata keys for the objective (ss_v_parameterization, ss_min_snr_gamma, ...,
  // modelspec.prediction_type, modelspec.timestep_range), written into `metadata`.
  virtual void write_metadata(std::map<std::string, std::string>& metadata) const = 0;

 protected:
  explicit TrainingObjective(const ObjectiveOptions& options) : options_(options) {}

 private:
  ObjectiveOptions options_;
};

// The objective of `family` under kohya's `options`. Throws InputError for options that fail
// check_objective_options() or that the family refuses.
std::unique_ptr<TrainingObjective> make_training_objective(const ModelFamily& family,
                                                           const ObjectiveOptions& options);

}  // namespace lorapipe::models
