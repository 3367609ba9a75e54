#pragma once
// What the samplers share (private to sampler/): the table arithmetic as numpy and diffusers do
// it, the noise draw, and the factories of each sampler's class.

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>

#include <memory>
#include <vector>

#include "sampler/schedulers.h"

namespace lorapipe::sampler::detail {

inline constexpr int kTrainSteps = 1000;

// numpy.interp(x, arange(1000), table) for x in [0, 999], in double (table read as double).
double interp(double x, const at::Tensor& table);
// Karras et al. (2022) sigmas between the table's ends, rho 7 (diffusers _convert_to_karras).
std::vector<double> karras_sigmas(double sigma_min, double sigma_max, int steps);
// diffusers _sigma_to_t: the fractional timestep whose log-sigma interpolates to log(sigma).
// `log_sigmas` are the fp32 logs of the table; the denominator is an fp32 difference, as there.
double sigma_to_t(double sigma, const at::Tensor& log_sigmas);
// A 0-dim fp32 tensor: the scalars of a step are combined as diffusers combines them.
at::Tensor scalar_tensor(double v);
// Standard normal noise shaped as `model_output`, from `generator` on the CPU, then moved
// (diffusers' randn_tensor with a CPU generator).
at::Tensor noise_like(const at::Tensor& model_output, at::Generator generator);
// The training table's sigmas sqrt((1 - a) / a), [1000] fp32, contiguous.
at::Tensor train_sigmas(const at::Tensor& alphas_cumprod);

// sampler/scheduler_timesteps.cpp
std::unique_ptr<Scheduler> make_ddim(const SchedulerOptions& options, int steps);
std::unique_ptr<Scheduler> make_ddpm(const SchedulerOptions& options, int steps);
std::unique_ptr<Scheduler> make_pndm(const SchedulerOptions& options, int steps);
// sampler/scheduler_dpm_solver.cpp
std::unique_ptr<Scheduler> make_dpm_multistep(const SchedulerOptions& options, int steps);
std::unique_ptr<Scheduler> make_dpm_singlestep(const SchedulerOptions& options, int steps);
// sampler/scheduler_k.cpp
std::unique_ptr<Scheduler> make_euler(const SchedulerOptions& options, int steps);
std::unique_ptr<Scheduler> make_euler_ancestral(const SchedulerOptions& options, int steps);
std::unique_ptr<Scheduler> make_heun(const SchedulerOptions& options, int steps);
std::unique_ptr<Scheduler> make_dpm2(const SchedulerOptions& options, int steps);
std::unique_ptr<Scheduler> make_dpm2_ancestral(const SchedulerOptions& options, int steps);
std::unique_ptr<Scheduler> make_lms(const SchedulerOptions& options, int steps);

}  // namespace lorapipe::sampler::detail
