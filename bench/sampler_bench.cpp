// lorapipe's render (sampler/render.h) on a diffusers folder, for bench/sampler_bench.py, which
// runs diffusers' StableDiffusionPipeline on the same folder beside it.
//
//   sampler_bench DIR WIDTH HEIGHT STEPS [--threads N] [--sampler NAME] [--keep-freed]
//
// Loads the model and prints "ready <load peak MiB> <RSS now MiB>"; then for each "render" line
// on stdin renders the bench's prompt (seed 0, CFG 7.5) and prints "<wall ms> <CPU ms> <mean
// pixel>"; at end of input prints "peak_rss <MiB>", the renders' peak (VmHWM restarted after
// loading).

#include <sys/resource.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <iostream>
#include <string>

#include "common/heap.h"
#include "models/pipeline.h"
#include "sampler/render.h"

namespace {

double status_mib(const std::string& field) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(field, 0) == 0) return std::stod(line.substr(field.size())) / 1024.0;
  }
  return -1;
}

double cpu_ms() {
  timespec t{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

}  // namespace

int main(int argc, char** argv) {
  // lorapipe-sampler runs on glibc's default heap; --keep-freed measures the trainer's policy
  // (common/heap.h) instead.
  bool keep_freed = false;
  for (int i = 1; i < argc; ++i) keep_freed |= std::string(argv[i]) == "--keep-freed";
  if (keep_freed) lorapipe::keep_freed_memory_for_reuse();
  if (argc < 5) {
    std::fprintf(stderr,
                 "usage: sampler_bench DIR WIDTH HEIGHT STEPS [--threads N] "
                 "[--sampler NAME]\n");
    return 2;
  }
  lorapipe::sampler::RenderRequest request;
  request.prompt = "a photo of a cat sitting on a wooden table, soft light";
  request.negative_prompt = "blurry, lowres";
  request.width = std::atoi(argv[2]);
  request.height = std::atoi(argv[3]);
  request.steps = std::atoi(argv[4]);
  request.seed = 0;
  for (int i = 5; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--keep-freed") {
      --i;
      continue;
    }
    if (flag == "--threads") torch::set_num_threads(std::atoi(argv[i + 1]));
    if (flag == "--sampler") request.sampler = argv[i + 1];
  }
  torch::NoGradGuard no_grad;
  lorapipe::models::StableDiffusion model = lorapipe::models::load_stable_diffusion(argv[1]);
  std::printf("ready %.0f %.0f\n", status_mib("VmHWM:"), status_mib("VmRSS:"));
  std::fflush(stdout);
  std::ofstream("/proc/self/clear_refs") << "5";
  std::string line;
  while (std::getline(std::cin, line)) {
    if (line != "render") continue;
    const auto start = std::chrono::steady_clock::now();
    const double cpu = cpu_ms();
    const auto result = lorapipe::sampler::render(model, request);
    const double wall =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    std::printf("%.1f %.1f %.4f\n", wall, cpu_ms() - cpu,
                result.image.to(torch::kFloat32).mean().item<double>());
    std::fflush(stdout);
  }
  std::printf("peak_rss %.0f\n", status_mib("VmHWM:"));
  return 0;
}
