#pragma once
// The optimizer seam: the training step talks to this interface, so the 8-bit and paged AdamW
// of kernels/ plug in beside torch's AdamW without the step knowing which it holds.

#include <ATen/core/Tensor.h>

#include <filesystem>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace lorapipe::trainer {

struct ParamGroup {
  std::vector<at::Tensor> params;
  double lr = 1e-4;
  std::string name;  // "unet", "text_encoder", "unet_plus", ... (for logs)
};

struct OptimizerOptions {
  std::string type = "AdamW";  // --optimizer_type, case-insensitive (kohya's names)
  double beta1 = 0.9, beta2 = 0.999;  // unless given, each optimizer's own (Lion: 0.9, 0.99)
  std::optional<double> beta3;  // a third beta (CAME's only: its instability's average)
  bool betas_given = false;
  double eps = 1e-8;
  // Unset: the optimizer's own default, which kohya keeps (torch's and bitsandbytes' AdamW 0.01,
  // Prodigy 0).
  std::optional<double> weight_decay;
  // AdamW8bit / PagedAdamW8bit only (bitsandbytes' argument): tensors with fewer elements keep
  // fp32 moments. Unset: bitsandbytes' 4096.
  std::optional<int64_t> min_8bit_size;
  // Prodigy's (and DAdaptAdam's: decouple, use_bias_correction, d0, growth_rate) arguments,
  // with prodigyopt's defaults; DAdaptAdam's decouple defaults to false unless given.
  struct ProdigyOptions {
    bool decouple = true;              // AdamW-style decoupled weight decay
    bool use_bias_correction = false;  // Adam's bias correction in the step size
    bool safeguard_warmup = false;     // lr out of the d estimate's denominator (for warm-up)
    double d0 = 1e-6;                  // the initial step-size estimate
    double d_coef = 1.0;               // scales the estimate: the knob prodigyopt advises
    double growth_rate = std::numeric_limits<double>::infinity();  // d's largest growth a step
    std::optional<double> beta3;       // unset: sqrt(beta2)
    int64_t slice_p = 1;               // estimate d from every slice_p-th element
  } prodigy;
  bool decouple_given = false;
  // Adafactor's: transformers' arguments, with its defaults (kohya's: relative_step True). CAME
  // takes eps (its defaults 1e-30, 1e-16: added to grad^2 and to the instability) and
  // clip_threshold from here too.
  struct AdafactorOptions {
    double eps1 = 1e-30, eps2 = 1e-3;  // eps=(1e-30,1e-3): added to grad^2; the RMS floor
    double clip_threshold = 1.0;       // the update's RMS is clipped to this
    double decay_rate = -0.8;          // beta2 at step t: 1 - t^decay_rate
    std::optional<double> beta1;       // unset: no first moment
    bool scale_parameter = true;       // step size times the parameter's RMS
    bool relative_step = true;         // Adafactor's own step size, the learning rate unused
    bool warmup_init = false;          // a step size growing from 1e-6 (needs relative_step)
  } adafactor;
  bool adafactor_eps_pair = false;  // eps given as a pair (Adafactor's form)
  // AdamWScheduleFree's: schedulefree's arguments, with its defaults.
  struct ScheduleFreeOptions {
    int64_t warmup_steps = 0;      // its own linear warm-up of the rate, in steps
    double r = 0;                  // the average's weights grow as step^r
    double weight_lr_power = 2.0;  // ... and as the largest rate so far to this power
  } schedulefree;
  // --optimizer_args as given (for kohya's ss_optimizer, "name(key=value,...)"), and their keys
  // (each optimizer refuses, by name, one it does not take).
  std::vector<std::string> given_args;
  std::vector<std::string> given_keys;
};

class Optimizer {
 public:
  virtual ~Optimizer() = default;
  virtual void step() = 0;
  virtual void zero_grad() = 0;
  virtual size_t group_count() const = 0;
  virtual void set_lr(size_t group, double lr) = 0;
  virtual double lr(size_t group) const = 0;
  // The step size an adaptive optimizer (Prodigy) takes in effect, d * lr, for kohya's
  // lr/d*lr logs; none for the others.
  virtual std::optional<double> adapted_lr(size_t /*group*/) const { return std::nullopt; }
  // Every piece of state, bit for bit, for exact resume.
  virtual void save(const std::filesystem::path& file) const = 0;
  virtual void load(const std::filesystem::path& file) = 0;
  // kohya's ss_optimizer value, e.g. "torch.optim.adamw.AdamW(weight_decay=0.01)".
  virtual std::string describe() const = 0;
  // A schedule-free optimizer's parameters hold the point its gradients are taken at while it
  // trains, and its average, the model, once eval() puts that there (kohya's
  // optimizer_eval_fn / optimizer_train_fn). The trainer calls eval() before anything reads the
  // weights as the model (a LoRA file, a validation), and train() before each step. Both
  // idempotent; nothing for the other optimizers.
  virtual void eval() {}
  virtual void train() {}
};

// kohya's ss_optimizer: the optimizer's class path, then the --optimizer_args as kohya's
// literal_eval reads and str() prints them, e.g. "prodigyopt.prodigy.Prodigy(d_coef=2,
// betas=(0.9, 0.99))", then `defaults` ("key=value" as printed) kohya adds where not given; the
// class alone without any.
std::string kohya_optimizer_name(const std::string& cls, const OptimizerOptions& options,
                                 const std::vector<std::string>& defaults = {});

// Parses --optimizer_args ("weight_decay=0.1", "betas=0.9,0.99", "eps=1e-6") into `options`;
// throws InputError naming an unknown or malformed argument.
void apply_optimizer_args(OptimizerOptions& options, const std::vector<std::string>& args);

// The optimizer named by options.type (case-insensitive, kohya's names):
//   AdamW           torch.optim.AdamW (LibTorch's), 8 bytes of state per parameter;
//   AdamW8bit       kernels/adamw8bit.h: blockwise 8-bit moments, about 2.03 bytes per parameter
//                   of tensors with >= min_8bit_size elements (fp32 moments below it);
//   PagedAdamW8bit  the same, its state in CUDA managed memory that can spill to host memory
//                   under pressure (on the CPU, or where the device cannot page, plain memory
//                   with a warning, as bitsandbytes does);
//   Prodigy         prodigyopt's adaptive Adam (trainer/prodigy_optimizer.h), 16 bytes of
//                   state per parameter, run with a learning rate near 1;
//   DAdaptAdam      dadaptation's D-Adaptation Adam, 12 bytes of state
//                   per parameter, run with a learning rate near 1;
//   Lion            lion-pytorch's sign-momentum optimizer, 4 bytes of state per parameter;
//   Adafactor       transformers' Adafactor, factored second moments (rows + columns);
//   CAME            came-pytorch's CAME (kohya's came_pytorch.CAME): Adafactor's factored
//                   moments, a first moment, and a factored confidence scaling the step;
//   AdamWScheduleFree  schedulefree's schedule-free AdamW, 8 bytes of state per parameter.
// Throws InputError naming an unknown type (and saying which are known).
std::unique_ptr<Optimizer> make_optimizer(const OptimizerOptions& options,
                                          std::vector<ParamGroup> groups);

// Throws InputError when --optimizer_type steps on `device` with kernels this build lacks: the
// 8-bit AdamWs on CUDA need the kernels nvcc compiles (LORAPIPE_CUDA). Said before the cacher
// runs, not at step 0 after the model loaded.
void check_optimizer_device(const OptimizerOptions& options, const c10::Device& device);

}  // namespace lorapipe::trainer
