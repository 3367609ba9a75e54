// Model speed and memory at the real SD1.5 sizes, fp32 on CPU, random weights:
//   models_bench vae  [WEIGHTS]   VAE encode of one 512x512 image
//   models_bench unet [WEIGHTS]   UNet forward + backward, 64x64 latent, batch 1, 77x768 context
//   models_bench unet_sdxl [WEIGHTS] [bf16|fp32]   SDXL's U-Net forward + backward, 64x64 latent,
//                 77x2048 context, the pooled embedding and six time ids; with WEIGHTS its own
//                 weights are then the file's pages (map_own_weights), which the reference maps
//                 too, so that two copies of the 10 GiB fp32 U-Net fit beside each other
//   models_bench flux [WEIGHTS]   FLUX.1 [dev]'s transformer at full width and reduced depth (one
//                 double and one single block), fp32, forward + backward at 256x256 (256 image
//                 tokens) with 256 T5 tokens, batch 1, guidance 3.5; weights in Black Forest
//                 Labs' names
//   models_bench t5 [WEIGHTS]     T5 v1.1 XXL at full width, two blocks, fp32: 512 tokens encoded
// With WEIGHTS the random weights are written there first (safetensors, diffusers names), so the
// reference runs the very same weights. Then it prints "ready" and serves stdin, one command per
// line, so that bench/models_bench.py can interleave its steps with the reference's:
//   step          run the work once, print its wall and CPU milliseconds
//   profile PATH  run it once under the autograd profiler, write a chrome trace to PATH
// At end of input it prints "peak_rss <MiB>".
// Loading, one command each:
//   models_bench checkpoint FILE [fp16]   writes SD1.5 at full size, random weights, as one
//                                         original-layout file (what most users download)
//   models_bench load PATH [DTYPE]        loads a single file or diffusers folder through the
//                                         stages' entry point (models::load_model) into DTYPE
//                                         (fp32, fp16 or bf16; default fp32) on the CPU, and prints
//                                         the weights' size, the process's resident memory before
//                                         loading and its peak, and their ratio to the weights:
//                                         what loading costs beyond the model it makes (issue 30's
//                                         goal: peak <= 1.2x the bf16 weights)
// The UNet runs under the trainer's heap policy
// (common/heap.h) unless LORAPIPE_BENCH_DEFAULT_HEAP is set; the VAE, the cacher's work, under
// glibc's default heap, as the cacher does. Nothing here is a test.
#include <malloc.h>
#include <sys/resource.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>
#include <iostream>
#include <stdexcept>
#include <string>

#include <torch/csrc/autograd/profiler_legacy.h>
#include <torch/torch.h>

#include "common/heap.h"
#include "models/family.h"
#include "models/flux.h"
#include "models/mapped_weights.h"
#include "models/pipeline.h"
#include "models/placement.h"
#include "models/registry.h"
#include "models/safetensors.h"
#include "models/t5.h"
#include "models/unet.h"
#include "models/vae.h"
#include "models/weights.h"

namespace {

// The resident set now, from /proc/self/statm (pages).
double current_rss_mib() {
  std::FILE* f = std::fopen("/proc/self/statm", "r");
  if (f == nullptr) return 0;
  long size = 0, resident = 0;
  const int read = std::fscanf(f, "%ld %ld", &size, &resident);
  std::fclose(f);
  return read == 2 ? static_cast<double>(resident) * 4096.0 / (1 << 20) : 0;
}

// The peak resident set: VmHWM, which clear_refs "5" restarts (getrusage's maxrss need not).
double peak_rss_mib() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmHWM:", 0) == 0) return std::stod(line.substr(6)) / 1024.0;
  }
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return usage.ru_maxrss / 1024.0;
}

// User plus system CPU time of the whole process (all of its threads).
double cpu_ms() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  auto ms = [](const timeval& t) { return t.tv_sec * 1e3 + t.tv_usec / 1e3; };
  return ms(usage.ru_utime) + ms(usage.ru_stime);
}

// Makes `module`'s weights views of the pages of `path`, the file it has just written them to
// (models/mapped_weights.h), so that the reference mapping the same file
// (bench/mapped_safetensors.py) shares them instead of holding a second copy. What the module
// held is freed and handed back to the system (the heap policy would keep it), and the peak RSS
// restarts from here: the steps' peak is what is compared, as before.
void map_own_weights(torch::nn::Module& module, const std::string& path) {
  namespace m = lorapipe::models;
  m::MappedWeights mapped;
  {
    const m::SafetensorsFile file = m::SafetensorsFile::open(path);
    m::load_into(module, file, path);
  }
  if (mapped.copied_tensors() != 0) {
    throw std::runtime_error(path + ": " + std::to_string(mapped.copied_tensors()) +
                             " tensors could not be mapped");
  }
  malloc_trim(0);
  std::ofstream("/proc/self/clear_refs") << "5";
}

int serve(const std::function<void()>& work) {
  std::printf("ready\n");
  std::fflush(stdout);
  std::string line;
  while (std::getline(std::cin, line)) {
    if (line == "step") {
      const auto start = std::chrono::steady_clock::now();
      const double cpu_start = cpu_ms();
      work();
      std::printf("%.1f %.1f\n",
                  std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
                      .count(),
                  cpu_ms() - cpu_start);
    } else if (line.rfind("profile ", 0) == 0) {
      {
        torch::autograd::profiler::RecordProfile guard{line.substr(8)};
        work();
      }
      std::printf("profiled\n");
    } else {
      std::fprintf(stderr, "models_bench: unknown command '%s'\n", line.c_str());
      return 2;
    }
    std::fflush(stdout);
  }
  std::printf("peak_rss %.0f\n", peak_rss_mib());

  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  namespace m = lorapipe::models;
  const std::string what = argc > 1 ? argv[1] : "";
  const std::string weights_out = argc > 2 ? argv[2] : "";
  auto save_weights = [&](const torch::nn::Module& module) {
    if (weights_out.empty()) return;
    std::vector<torch::Tensor> storage;
    m::write_safetensors(weights_out, m::module_tensors(module, storage));
  };
  torch::manual_seed(0);
  if (what == "vae") {
    m::AutoencoderKL vae(m::VaeConfig::sd15());
    vae->eval();
    save_weights(*vae);
    const torch::Tensor image = torch::rand({1, 3, 512, 512}) * 2 - 1;
    return serve([&] {
      torch::NoGradGuard no_grad;
      vae->encode(image);
    });
  }
  if (what == "unet") {
    // The trainer's heap policy (common/heap.h), unless asked to measure glibc's default.
    if (std::getenv("LORAPIPE_BENCH_DEFAULT_HEAP") == nullptr) lorapipe::keep_freed_memory_for_reuse();
    m::UNet unet(m::UNetConfig::sd15());
    unet->train();
    save_weights(*unet);
    for (auto& p : unet->parameters()) p.set_requires_grad(false);  // frozen base, as in LoRA
    const torch::Tensor latents = torch::randn({1, 4, 64, 64}).requires_grad_(true);
    const torch::Tensor context = torch::randn({1, 77, 768});
    const torch::Tensor timestep = torch::tensor({500});
    return serve([&] { unet->forward(latents, timestep, context).square().mean().backward(); });
  }
  if (what == "unet_sdxl") {
    // SDXL's full-size U-Net in bf16, or fp32 (argv[3]: on a CPU without native bf16, where
    // LibTorch's bf16 convolutions fall back to a naive GEMM), a 64x64 latent (512 px), the
    // pooled embedding and SDXL's six time ids.
    if (std::getenv("LORAPIPE_BENCH_DEFAULT_HEAP") == nullptr) lorapipe::keep_freed_memory_for_reuse();
    const c10::ScalarType dtype =
        argc > 3 && std::string(argv[3]) == "fp32" ? torch::kFloat : torch::kBFloat16;
    const caffe2::TypeMeta saved = c10::get_default_dtype();
    c10::set_default_dtype(c10::scalarTypeToTypeMeta(dtype));
    m::UNet unet(m::UNetConfig::sdxl());
    c10::set_default_dtype(saved);
    unet->train();
    save_weights(*unet);
    if (!weights_out.empty()) map_own_weights(*unet, weights_out);
    for (auto& p : unet->parameters()) p.set_requires_grad(false);
    const auto in_dtype = torch::TensorOptions().dtype(dtype);
    const torch::Tensor latents = torch::randn({1, 4, 64, 64}, in_dtype).requires_grad_(true);
    const torch::Tensor context = torch::randn({1, 77, 2048}, in_dtype);
    const torch::Tensor pooled = torch::randn({1, 1280}, in_dtype);
    const torch::Tensor time_ids = torch::tensor({512.f, 512.f, 0.f, 0.f, 512.f, 512.f}).view({1, 6});
    const torch::Tensor timestep = torch::tensor({500});
    return serve([&] {
      unet->forward(latents, timestep, context, pooled, time_ids).to(torch::kFloat).square().mean().backward();
    });
  }
  if (what == "flux") {
    if (std::getenv("LORAPIPE_BENCH_DEFAULT_HEAP") == nullptr) lorapipe::keep_freed_memory_for_reuse();
    m::FluxConfig config = m::FluxConfig::dev();
    config.depth = 1;
    config.depth_single_blocks = 1;
    m::FluxTransformer flux(config, torch::TensorOptions().dtype(torch::kFloat));
    {
      torch::NoGradGuard no_grad;  // built uninitialised (models/flux.h): draw every weight
      for (auto& p : flux->parameters()) p.normal_(0, 0.02);
    }
    flux->train();
    save_weights(*flux);
    for (auto& p : flux->parameters()) p.set_requires_grad(false);
    m::FluxInput in;
    in.img = torch::randn({1, 256, 64}).requires_grad_(true);
    in.img_ids = m::image_ids(32, 32);
    in.txt = torch::randn({1, 256, 4096});
    in.txt_ids = torch::zeros({256, 3});
    in.timesteps = torch::tensor({0.5f});
    in.y = torch::randn({1, 768});
    in.guidance = torch::tensor({3.5f});
    return serve([&] { flux->forward(in).square().mean().backward(); });
  }
  if (what == "t5") {
    m::T5Config config = m::T5Config::xxl();
    config.num_layers = 2;
    m::T5Encoder t5(config, torch::TensorOptions().dtype(torch::kFloat));
    {
      torch::NoGradGuard no_grad;
      for (auto& p : t5->parameters()) p.normal_(0, 0.05);
    }
    t5->eval();
    save_weights(*t5);
    const torch::Tensor ids = torch::randint(0, config.vocab_size, {1, 512});
    return serve([&] {
      torch::NoGradGuard no_grad;
      t5->forward(ids);
    });
  }
  if (what == "checkpoint" && !weights_out.empty()) {
    m::StableDiffusion sd;
    sd.family = m::model_family("sd15");
    sd.unet = m::UNet(m::UNetConfig::sd15());
    sd.vae = m::AutoencoderKL(m::VaeConfig::sd15());
    sd.text_encoder = m::ClipTextModel(m::ClipTextConfig::sd15());
    const bool half = argc > 3 && std::string(argv[3]) == "fp16";
    m::save_single_file(sd, weights_out, half ? torch::kHalf : torch::kFloat);
    return 0;
  }
  if (what == "load" && !weights_out.empty()) {
    const std::string dtype_name = argc > 3 ? argv[3] : "fp32";
    const c10::ScalarType dtype = m::parse_precision(dtype_name, "--dtype");
    const double before = current_rss_mib();
    m::LoadOptions options;
    options.dtype = dtype;
    const std::unique_ptr<m::DiffusionModel> model = m::load_model(weights_out, options);
    double bytes = 0;
    for (const auto& c : model->components()) {
      for (const auto& p : c.module->parameters()) bytes += static_cast<double>(p.nbytes());
      for (const auto& b : c.module->buffers()) bytes += static_cast<double>(b.nbytes());
    }
    const double weights = bytes / (1 << 20), peak = peak_rss_mib();
    std::printf("loaded %s in %s: weights %.0f MiB; resident before loading %.0f MiB, peak %.0f "
                "MiB: peak / weights %.3f, (peak - before) / weights %.3f\n",
                weights_out.c_str(), dtype_name.c_str(), weights, before, peak, peak / weights,
                (peak - before) / weights);
    return 0;
  }
  std::fprintf(stderr, "usage: models_bench vae|unet|unet_sdxl|flux|t5 [WEIGHTS] | checkpoint FILE [fp16] | load PATH [DTYPE]\n");
  return 2;
}
