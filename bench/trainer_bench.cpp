// One LoRA training step, fp32 on CPU, as the trainer runs it (trainer::TrainingStep): forward of
// the UNet on noised latents, the l2 loss against the noise, backward, gradient clipping at 1.0
// and AdamW (lr 1e-4) on a kohya LoRA of rank 16, alpha 16 over the UNet's transformer blocks.
// The text encoder is not trained: the conditioning is a fixed tensor.
//   trainer_bench config tiny|full
//       prints the UNet config (diffusers' config.json) that bench/trainer_bench.py builds the
//       shared weights from, so both sides run one architecture.
//   trainer_bench step tiny|full DIR [--gradient_checkpointing] [--threads N]
//       loads DIR/diffusion_pytorch_model.safetensors (diffusers names) and DIR/inputs.safetensors
//       (latents, noise, timesteps, context, loss_weights), prints
//       "ready <load peak MiB> <RSS now MiB> <LoRA modules> <LoRA parameters>" and serves
//       stdin, one command per line, so that bench/trainer_bench.py can interleave its steps
//       with the reference's:
//         step          one training step; prints its wall and CPU milliseconds, the loss, and
//                       the milliseconds of forward+backward and of clip+optimizer
//         profile PATH  one step under the autograd profiler, a chrome trace to PATH
//       At end of input it prints "peak_rss <MiB>": the steps' peak, from "ready" on (the load's
//       own peak is the one printed with "ready"; the memory it freed is handed back before).
// Runs under the trainer's heap policy (common/heap.h), as lorapipe-trainer does. Nothing here is
// a test.
#include <sys/resource.h>
#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <ATen/core/Generator.h>
#include <torch/csrc/autograd/profiler_legacy.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <exception>
#include <fstream>
#include <functional>
#include <iostream>
#include <string>

#include "common/heap.h"
#include "models/pipeline.h"
#include "models/tiny.h"
#include "models/unet.h"
#include "trainer/lora_file.h"
#include "trainer/lora_network.h"
#include "trainer/step.h"

namespace {

namespace fs = std::filesystem;
namespace m = lorapipe::models;
namespace t = lorapipe::trainer;

// A field of /proc/self/status ("VmHWM:", "VmRSS:") in MiB; -1 where there is none.
double status_mib(const std::string& field) {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);) {
    if (line.rfind(field, 0) == 0) return std::stod(line.substr(field.size())) / 1024.0;
  }
  return -1;
}

// VmHWM (ru_maxrss where there is none), MiB.
double peak_rss_mib() {
  if (const double hwm = status_mib("VmHWM:"); hwm >= 0) return hwm;
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return usage.ru_maxrss / 1024.0;
}

// Restarts VmHWM from the current RSS (Linux clear_refs "5"), so the peak read at the end is
// the steps', not the transient one of loading the weights through a mapping.
void reset_peak_rss() { std::ofstream("/proc/self/clear_refs") << "5"; }

// User plus system CPU time of the whole process (all of its threads).
double cpu_ms() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  auto ms = [](const timeval& tv) { return tv.tv_sec * 1e3 + tv.tv_usec / 1e3; };
  return ms(usage.ru_utime) + ms(usage.ru_stime);
}

using Clock = std::chrono::steady_clock;
double ms_since(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

m::UNetConfig config_for(const std::string& size) {
  if (size == "tiny") return m::tiny_unet_config();
  if (size == "full") return m::UNetConfig::sd15();
  throw std::invalid_argument("size must be tiny or full, got '" + size + "'");
}

int serve(m::StableDiffusion& model, const fs::path& dir, bool checkpointing) {
  const auto inputs = t::read_tensor_file(dir / "inputs.safetensors");
  t::MicroBatch batch;
  batch.latents = inputs.at("latents");
  batch.noise = inputs.at("noise");
  batch.timesteps = inputs.at("timesteps");
  batch.encoder_hidden_states = inputs.at("context");
  batch.loss_weights = inputs.at("loss_weights");

  t::NetworkOptions net;
  net.dim = 16;
  net.alpha = 16;
  net.train_text_encoder = false;
  t::LoraNetwork network(model, net, at::make_generator<at::CPUGeneratorImpl>(/*seed_in=*/7));
  t::StepOptions options;  // l2, epsilon, no min-SNR, max_grad_norm 1.0, AdamW, lr 1e-4
  options.gradient_checkpointing = checkpointing;
  t::TrainingStep step(model, network, options);
  int64_t lora_numel = 0;
  for (const auto& p : network.unet_parameters()) lora_numel += p.numel();

  double accumulate_ms = 0, update_ms = 0, loss = 0;
  int64_t steps = 0;
  auto work = [&] {
    const auto start = Clock::now();
    loss = step.accumulate(batch, at::make_generator<at::CPUGeneratorImpl>(steps++));
    accumulate_ms = ms_since(start);
    const auto update_start = Clock::now();
    const t::UpdateResult result = step.update();
    update_ms = ms_since(update_start);
    if (!result.applied) throw std::runtime_error("the update was skipped (non-finite gradient)");
  };

  // The load's copies of the weights are freed by now, but the heap policy keeps them resident,
  // where the step's activations would reuse them and hide what the step itself needs. Hand them
  // back, so the step's peak (and gradient checkpointing's saving) shows. The trainer does not.
#if defined(__GLIBC__)
  malloc_trim(0);
#endif
  std::printf("ready %.0f %.0f %zu %lld\n", peak_rss_mib(), status_mib("VmRSS:"),
              network.unet_module_count(), static_cast<long long>(lora_numel));
  std::fflush(stdout);
  reset_peak_rss();
  std::string line;
  while (std::getline(std::cin, line)) {
    if (line == "step") {
      const auto start = Clock::now();
      const double cpu_start = cpu_ms();
      work();
      std::printf("%.1f %.1f %.6f %.1f %.1f\n", ms_since(start), cpu_ms() - cpu_start, loss,
                  accumulate_ms, update_ms);
    } else if (line.rfind("profile ", 0) == 0) {
      {
        torch::autograd::profiler::RecordProfile guard{line.substr(8)};
        work();
      }
      std::printf("profiled\n");
    } else {
      std::fprintf(stderr, "trainer_bench: unknown command '%s'\n", line.c_str());
      return 2;
    }
    std::fflush(stdout);
  }
  std::printf("peak_rss %.0f\n", peak_rss_mib());
  return 0;
}

int run(int argc, char** argv) {
  const std::string command = argc > 1 ? argv[1] : "";
  const std::string size = argc > 2 ? argv[2] : "";
  if (command == "config" && argc == 3) {
    std::printf("%s\n", m::to_config_json(config_for(size)).c_str());
    return 0;
  }
  if (command != "step" || argc < 4) {
    std::fprintf(stderr,
                 "usage: trainer_bench config tiny|full\n"
                 "       trainer_bench step tiny|full DIR [--gradient_checkpointing] "
                 "[--threads N]\n");
    return 2;
  }
  const fs::path dir = argv[3];
  bool checkpointing = false;
  for (int i = 4; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--gradient_checkpointing") {
      checkpointing = true;
    } else if (flag == "--threads" && i + 1 < argc) {
      at::set_num_threads(std::stoi(argv[++i]));
    } else {
      std::fprintf(stderr, "trainer_bench: unknown flag '%s'\n", flag.c_str());
      return 2;
    }
  }
  m::StableDiffusion model;
  model.family = m::model_family("sd15");
  model.unet = m::UNet(config_for(size));
  m::load_unet_diffusers(model.unet, dir);
  for (auto& p : model.unet->parameters()) p.requires_grad_(false);  // frozen base, as the trainer
  model.unet->train();
  return serve(model, dir, checkpointing);
}

}  // namespace

int main(int argc, char** argv) {
  lorapipe::keep_freed_memory_for_reuse();  // the trainer's heap policy, first thing in main
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "trainer_bench: %s\n", e.what());
    return 1;
  }
}
