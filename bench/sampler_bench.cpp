// lorapipe's render (sampler/render.h) on a diffusers folder, for bench/sampler_bench.py, which
// runs diffusers' StableDiffusionPipeline on the same folder beside it.
//
//   sampler_bench DIR WIDTH HEIGHT STEPS [--threads N] [--sampler NAME] [--keep-freed]
//
// Loads the model and prints "ready <load peak MiB> <RSS now MiB>"; then for each "render" line
// on stdin renders the bench's prompt (seed 0, CFG 7.5) and prints "<wall ms> <CPU ms> <mean
// pixel>"; at end of input prints "peak_rss <MiB>", the renders' peak (VmHWM restarted after
// loading).
//
//   sampler_bench solo [--family sd15|sdxl] [--device cpu|cuda|cuda:N] [--dtype fp32|bf16|fp16]
//       [--fp8_base] [--resolution PX] [--steps N] [--images N] [--sampler NAME] [--threads N]
//       [--lora_rank R [--lora_application slots|merged]]
//
// The same render alone, without files or Python (what tests/gpu/run.sh runs on a GPU machine):
// the family's real U-Net, VAE and text encoders at full size (SD1.5 by default; sdxl: SDXL's,
// both text encoders) on their own random initialisation, in --dtype on --device, with the tiny
// checkpoint's tokenizer (models/tiny.h; the text encoders keep CLIP's full vocabulary); with
// --fp8_base, the U-Net's and text encoders' Linear and Conv2d weights stored in float8 as the
// sampler's --fp8_base stores them. After one warm-up render it renders --images images (default
// 3) and prints s/image, images/s and the peak allocated memory (CUDA's caching allocator on a
// GPU; on the CPU every tensor's storage counted, models/tensor_memory.h), and the preview's own
// share of the device: what a sampler rendering over the trainer's shared U-Net holds beside it
// (its text encoders, its VAE, the LoRA and the render's peak working memory; `lorapipe plan`'s
// preview share is fitted to it, bench/plan_calibrate.py). With --lora_rank, a random LoRA
// of that rank on every linear target is applied as the sampler applies a checkpoint's: in the
// layers' slots (the sampler's way), or merged into the weights with copies kept to restore
// (the way before it): the two lines side by side give what a LoRA costs in memory and time.

#include <sys/resource.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <iostream>
#include <string>

#if __has_include(<c10/cuda/CUDACachingAllocator.h>)
#include <c10/cuda/CUDACachingAllocator.h>
#include <torch/cuda.h>
#define LORAPIPE_BENCH_CUDA 1
#endif
#include <unistd.h>

#include <filesystem>
#include <map>
#include <optional>

#include "bench/bench_flags.h"
#include "common/heap.h"
#include "models/device.h"
#include "models/float8.h"
#include "models/loading.h"
#include "models/lora_merge.h"
#include "models/pipeline.h"
#include "models/safetensors.h"
#include "models/sdxl.h"
#include "models/tensor_memory.h"
#include "models/tiny.h"
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

namespace m = lorapipe::models;

int solo(int argc, char** argv) {
  std::string device_spec = "cpu", dtype_name = "fp32";
  lorapipe::sampler::RenderRequest request;
  request.prompt = "a photo of a cat sitting on a wooden table, soft light";
  request.negative_prompt = "blurry, lowres";
  request.steps = 20;
  int images = 3;
  bool fp8_base = false;
  int lora_rank = 0;  // --lora_rank: render with a random LoRA of this rank on every target
  std::string lora_application = "slots";  // the sampler's; "merged" keeps copies instead
  std::string family = "sd15";
  for (int i = 2; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--fp8_base") {
      fp8_base = true;
      continue;
    }
    if (i + 1 >= argc) throw std::invalid_argument(flag + " wants a value");
    const std::string value = argv[++i];
    if (flag == "--family") {
      if (value != "sd15" && value != "sdxl") throw std::invalid_argument("--family sd15 or sdxl");
      family = value;
    } else if (flag == "--device") {
      device_spec = value;
    } else if (flag == "--dtype") {
      dtype_name = value;
    } else if (flag == "--resolution") {
      request.width = request.height = static_cast<int>(lorapipe::bench::flag_whole(flag, value));
    } else if (flag == "--steps") {
      request.steps = static_cast<int>(lorapipe::bench::flag_whole(flag, value));
      if (request.steps < 1) throw std::invalid_argument("--steps " + value + ": at least 1");
    } else if (flag == "--images") {
      images = static_cast<int>(lorapipe::bench::flag_whole(flag, value));
    } else if (flag == "--sampler") {
      request.sampler = value;
    } else if (flag == "--threads") {
      torch::set_num_threads(static_cast<int>(lorapipe::bench::flag_whole(flag, value)));
    } else if (flag == "--lora_rank") {
      lora_rank = static_cast<int>(lorapipe::bench::flag_whole(flag, value));
    } else if (flag == "--lora_application") {
      lora_application = value;
    } else {
      throw std::invalid_argument("unknown flag '" + flag + "'");
    }
  }
  const std::map<std::string, c10::ScalarType> dtypes{
      {"fp32", c10::kFloat}, {"bf16", c10::kBFloat16}, {"fp16", c10::kHalf}};
  if (!dtypes.count(dtype_name)) throw std::invalid_argument("--dtype fp32, bf16 or fp16");
  const c10::Device device = m::resolve_device(device_spec);

  // Every CPU tensor counted from here (the CPU's max_memory_allocated).
  m::TensorMemoryCounter& counter = m::TensorMemoryCounter::install();
  torch::NoGradGuard no_grad;
  torch::manual_seed(0);
  const std::filesystem::path tiny =
      std::filesystem::temp_directory_path() / ("lorapipe-sampler-bench-" + std::to_string(getpid()));
  const m::TinyCheckpoint checkpoint = m::write_tiny_checkpoint(tiny);
  const c10::ScalarType dtype = dtypes.at(dtype_name);
  std::unique_ptr<m::StableDiffusion> owned;
  {
    // Built in --dtype from the start (a full SDXL in fp32 first would take 14 GiB), on the CPU,
    // then moved, as the sampler does.
    m::DefaultDtype built_in(dtype == c10::kHalf ? c10::kFloat : dtype);
    if (family == "sdxl") {
      auto xl = std::make_unique<m::StableDiffusionXL>();
      xl->unet = m::UNet(m::UNetConfig::sdxl());
      xl->text_encoder_2 = m::ClipTextModel(m::ClipTextConfig::sdxl_clip_g());
      xl->tokenizer_2 = m::ClipTokenizer::from_file(checkpoint.tokenizer);
      xl->tokenizer_2->set_pad_token(xl->pad_token_2);
      owned = std::move(xl);
    } else {
      owned = std::make_unique<m::StableDiffusion>();
      owned->unet = m::UNet(m::UNetConfig::sd15());
    }
    owned->vae = m::AutoencoderKL(m::VaeConfig::sd15());  // SDXL's is SD's architecture
    owned->text_encoder = m::ClipTextModel(m::ClipTextConfig::sd15());
  }
  m::StableDiffusion& model = *owned;
  model.family = m::model_family(family);
  model.tokenizer = m::ClipTokenizer::from_file(checkpoint.tokenizer);
  model.tokenizer_path = checkpoint.tokenizer;
  std::filesystem::remove_all(tiny);
  if (auto* xl = dynamic_cast<m::StableDiffusionXL*>(&model)) {
    // text_encoder_module(): both encoders under their diffusers names, as the loader holds them.
    xl->text_encoders = std::make_shared<torch::nn::Module>("SdxlTextEncoders");
    xl->text_encoders->register_module("text_encoder", xl->text_encoder.ptr());
    xl->text_encoders->register_module("text_encoder_2", xl->text_encoder_2.ptr());
  }
  for (const auto& component : model.components()) {
    component.module->to(dtype);
    component.module->eval();
  }
  if (fp8_base) {
    for (const auto& component : model.components()) {
      if (component.role != m::DiffusionModel::Role::kVae) {
        m::store_weights_in_float8(*component.module);
      }
    }
  }
  for (const auto& component : model.components()) component.module->to(device);
  // The U-Net's own bytes: over shared weights, the trainer's, not the preview's.
  auto module_bytes = [](torch::nn::Module& module) {
    int64_t bytes = 0;
    for (const auto& p : module.parameters()) bytes += p.nbytes();
    for (const auto& b : module.buffers()) bytes += b.nbytes();
    return bytes;
  };
  int64_t unet_bytes = 0, text_bytes = 0, vae_bytes = 0;
  for (const auto& component : model.components()) {
    const int64_t bytes = module_bytes(*component.module);
    switch (component.role) {
      case m::DiffusionModel::Role::kDenoiser: unet_bytes += bytes; break;
      case m::DiffusionModel::Role::kVae: vae_bytes += bytes; break;
      default: text_bytes += bytes;
    }
  }
  // A random kohya LoRA over every linear target (kohya's default targets, both models), applied
  // as the sampler applies a checkpoint's: in the layers' slots, or merged with copies kept.
  std::optional<m::MergedLora> lora;
  if (lora_rank > 0) {
    if (lora_application != "slots" && lora_application != "merged") {
      throw std::invalid_argument("--lora_application slots or merged");
    }
    std::vector<torch::Tensor> keep;
    std::vector<m::TensorToWrite> entries;
    auto add = [&](const std::string& name, torch::Tensor t) {
      keep.push_back(t.contiguous());
      const torch::Tensor& k = keep.back();
      entries.push_back({name, m::Dtype::kF32, k.sizes().vec(),
                         std::string_view(static_cast<const char*>(k.data_ptr()), k.nbytes())});
    };
    for (const m::LoraTarget& t : model.lora_targets(/*text_encoder=*/true, /*conv_kxk=*/false)) {
      const int64_t in = t.weight().numel() / t.weight().size(0);
      add(t.name + ".lora_down.weight", torch::randn({lora_rank, in}) * 0.01);
      add(t.name + ".lora_up.weight", torch::randn({t.weight().size(0), lora_rank}) * 0.01);
    }
    const std::filesystem::path file = tiny.string() + "-lora.safetensors";
    m::write_safetensors(file, entries);
    keep.clear();
    lora.emplace(model, file, 1.0,
                 lora_application == "slots" ? m::MergedLora::Application::kInSlots
                                             : m::MergedLora::Application::kMergedRestorable);
    std::filesystem::remove(file);
  }
  auto synchronize = [&] {
#ifdef LORAPIPE_BENCH_CUDA
    if (device.is_cuda()) torch::cuda::synchronize(device.index());
#endif
  };
  (void)lorapipe::sampler::render(model, request);  // warm-up: kernels chosen, memory cached
  synchronize();
  // What is allocated between renders (the weights, the LoRA), and the peak over the renders.
  auto allocated = [&](bool peak) -> int64_t {
#ifdef LORAPIPE_BENCH_CUDA
    if (device.is_cuda()) {
      const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index());
      return peak ? stats.allocated_bytes[0].peak : stats.allocated_bytes[0].current;
    }
#endif
    return static_cast<int64_t>(peak ? counter.peak_bytes() : counter.alive_bytes());
  };
#ifdef LORAPIPE_BENCH_CUDA
  if (device.is_cuda()) c10::cuda::CUDACachingAllocator::resetPeakStats(device.index());
#endif
  counter.reset_peak();
  const int64_t resident = allocated(false);
  std::ofstream("/proc/self/clear_refs") << "5";
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < images; ++i) {
    request.seed = i + 1;
    (void)lorapipe::sampler::render(model, request);
  }
  synchronize();
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / images;
  const int64_t peak = allocated(true);
  const double mib = 1 << 20;
  const std::string with_lora =
      lora ? " LoRA rank " + std::to_string(lora_rank) + " " + lora_application + " (" +
                 std::to_string(lora->copied_bytes() >> 20) + " MiB of weights copied)"
           : std::string();
  std::printf("sampler %s %s %s%s%s %dx%d, %d steps %s, CFG %.1f: %.3f s/image, %.3f images/s, "
              "peak allocated %.0f MiB, peak RSS %.0f MiB\n",
              model.family.display_name.c_str(), m::describe_device(device).c_str(),
              dtype_name.c_str(), fp8_base ? " fp8_base" : "", with_lora.c_str(), request.width,
              request.height, request.steps, request.sampler.c_str(), request.cfg_scale, seconds,
              1 / seconds, peak / mib, status_mib("VmHWM:"));
  // Over the trainer's shared U-Net the preview holds all but the U-Net's own bytes: its text
  // encoders, its VAE, the LoRA (what is resident beyond the three) and the render's working
  // memory above what is resident.
  std::printf("preview share %.0f MiB: text encoders %.0f MiB, VAE %.0f MiB, LoRA and the rest "
              "%.0f MiB, render %.0f MiB (U-Net %.0f MiB not counted)\n",
              (peak - unet_bytes) / mib, text_bytes / mib, vae_bytes / mib,
              (resident - unet_bytes - text_bytes - vae_bytes) / mib, (peak - resident) / mib,
              unet_bytes / mib);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1 && std::string(argv[1]) == "solo") {
    try {
      return solo(argc, argv);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "sampler_bench: %s\n", e.what());
      return 1;
    }
  }
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
  if (request.steps < 1) {
    std::fprintf(stderr, "STEPS %s: at least 1\n", argv[4]);
    return 2;
  }
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
