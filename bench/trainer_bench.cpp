// One LoRA training step, fp32 on CPU, as the trainer runs it (trainer::TrainingStep): forward of
// the UNet on noised latents, the l2 loss against the noise, backward, gradient clipping at 1.0
// and AdamW (lr 1e-4) on a kohya LoRA of rank 16, alpha 16 over the UNet's transformer blocks.
// The text encoder is not trained: the conditioning is a fixed tensor.
//   trainer_bench config tiny|full|sdxl
//       prints the UNet config (diffusers' config.json) that bench/trainer_bench.py builds the
//       shared weights from, so both sides run one architecture.
//   trainer_bench step tiny|full|sdxl DIR [--gradient_checkpointing] [--dtype fp32|bf16]
//       [--threads N] [--map_weights]
//       loads DIR/diffusion_pytorch_model.safetensors (diffusers names) and DIR/inputs.safetensors
//       (latents, noise, timesteps, context, loss_weights, and SDXL's pooled), the base in
//       --dtype (the LoRA fp32, as --mixed_precision trains); with --map_weights the base is the
//       file's own pages, as the trainer's --map_weights makes it (models/mapped_weights.h), so a
//       reference that maps the same file holds no second copy (the weights are then not among
//       the counted tensors); prints
//       "ready <load peak MiB> <RSS now MiB> <LoRA modules> <LoRA parameters>" and serves
//       stdin, one command per line, so that bench/trainer_bench.py can interleave its steps
//       with the reference's:
//         step          one training step; prints its wall and CPU milliseconds, the loss, and
//                       the milliseconds of forward+backward and of clip+optimizer
//         profile PATH  one step under the autograd profiler, a chrome trace to PATH
//       At end of input it prints "peak_rss <MiB> <tensor peak MiB> <tensors at ready MiB>": the
//       steps' peak RSS, from "ready" on (the load's own peak is the one printed with "ready"; the
//       memory it freed is handed back before), then the most tensor storage alive at once over
//       the steps and what was alive at "ready" (the weights and inputs): the CPU's counterparts
//       of torch.cuda.max_memory_allocated and memory_allocated, free of the heap's slack.
//   trainer_bench solo tiny|full|sdxl|flux|flux_tiny [--device cpu|cuda|cuda:N]
//       [--dtype fp32|bf16|fp16]
//       [--batch N] [--resolution PX] [--steps N] [--warmup N (2)] [--warmup_resolution PX (the
//       warm-up steps at batch 1 and PX square: the state a step leaves, the optimizer's and the
//       LoRA's gradients, is the same at any size, so a peak measured on the CPU needs only a
//       cheap warm-up; not for timings, whose warm-up picks kernels for the timed shapes)]
//       [--gradient_checkpointing]
//       [--fp8_base]
//       [--fp8_scaled] [--fp8_fast] [--blocks_to_swap N (FLUX.1: kohya's split; the U-Nets: the transformer
//       blocks of the last N of kohya's blocks with any; the trainer's placement)]
//       [--cpu_offload_checkpointing (FLUX.1)] [--depth D (FLUX.1 at full width, D double and
//       2D single blocks)]
//       [--threads N] [--write_structure DIR (the denoiser's header for `lorapipe plan --model`;
//       with --steps 0 it stops there, after printing the LoRA's module and parameter counts)]
//       [--peak_tflops T] [--optimizer_type NAME [--optimizer_args K=V ...] [--learning_rate LR]]
//       [--network_dim R (16)] [--settings WxH:B,... (several sizes and batches on the one model,
//       a line each; one that runs out of memory says so and skips its size's larger batches)]
//       [--memory_limit BYTES (a smaller card: CUDA's allocator held to that share of the
//       device, the CPU's counted tensors to the bytes)]: `lorapipe plan --probe` runs these
//       the same step alone, on the UNet's own random initialisation and random inputs (no files,
//       no Python); `sdxl` is SDXL's full-size U-Net (1024x1024 by default, the pooled embedding
//       and the default time ids as added conditions, kohya's SDXL LoRA targets); `flux` is
//       FLUX.1 [dev]'s full-size transformer (512x512 by default, 512 T5 tokens, guidance 3.5,
//       kohya's Flux LoRA targets; `flux_tiny` the same at a tiny width): what
//       tests/gpu/run.sh runs on a GPU machine. The base is frozen in --dtype
//       (the LoRA stays fp32, as --mixed_precision trains), batch 1 at 512x512 (64x64 latents)
//       by default. After --warmup steps (two by default: kernels chosen, optimizer state made;
//       on the CPU one makes the state, and the next steps allocate alike) it times --steps steps
//       (default 5) and prints one
//       line: s/it, samples/s, peak allocated memory over the timed steps (CUDA's caching
//       allocator's peak, or on the CPU every tensor's storage counted as below) with the weights,
//       and MFU: the model FLOPs of a step over the time, against --peak_tflops (defaults for
//       the data-centre GPUs we know; otherwise not printed). A step's model FLOPs are the
//       UNet forward's (models::unet_forward_flops) twice over: the frozen base's backward
//       computes input gradients only, about the forward's work again; checkpointing's
//       recomputation is not counted, as MFU conventionally leaves it out. --optimizer_type
//       takes the trainer's names (AdamW by default) and --learning_rate the step's rate (1e-4
//       by default; Prodigy and DAdaptAdam want 1.0), so each optimizer runs on the device where
//       the trainer would run it; the line names it. --fp8_base stores the UNet's Linear and Conv2d
//       weights in float8 as the trainer's --fp8_base does (computing in --dtype).
// Runs under the trainer's heap policy (common/heap.h), as lorapipe-trainer does. Nothing here is
// a test.
#include <sys/resource.h>
#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <ATen/core/Generator.h>
#if __has_include(<c10/cuda/CUDACachingAllocator.h>)
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>
#include <torch/cuda.h>
#define LORAPIPE_BENCH_CUDA 1
#endif
#include <torch/csrc/autograd/profiler_legacy.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <exception>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <optional>
#include <string>

#include "bench/bench_flags.h"
#include "common/heap.h"
#include "models/device.h"
#include "models/float8.h"
#include "models/flux.h"
#include "models/flux_model.h"
#include "models/loading.h"
#include "models/mapped_weights.h"
#include "models/pipeline.h"
#include "models/sdxl.h"
#include "models/tensor_memory.h"
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

m::TensorMemoryCounter* tensor_memory = nullptr;  // models/tensor_memory.h, set first in main

using Clock = std::chrono::steady_clock;
double ms_since(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

m::UNetConfig config_for(const std::string& size) {
  if (size == "tiny") return m::tiny_unet_config();
  if (size == "full") return m::UNetConfig::sd15();
  if (size == "sdxl") return m::UNetConfig::sdxl();
  throw std::invalid_argument("size must be tiny, full (SD1.5) or sdxl, got '" + size + "'");
}

int serve(m::StableDiffusion& model, const fs::path& dir, bool checkpointing,
          c10::ScalarType dtype) {
  const auto inputs = t::read_tensor_file(dir / "inputs.safetensors");
  t::MicroBatch batch;
  batch.latents = inputs.at("latents");
  batch.noise = inputs.at("noise");
  batch.times = inputs.at("timesteps");
  batch.encoder_hidden_states = inputs.at("context");
  batch.loss_weights = inputs.at("loss_weights");
  // SDXL: the pooled text embedding; the time ids are the default geometry's (original = target
  // = the latents' size, no crop), which the reference passes as well.
  if (inputs.count("pooled")) batch.pooled = inputs.at("pooled");

  t::NetworkOptions net;
  net.dim = 16;
  net.alpha = 16;
  net.train_text_encoder = false;
  t::LoraNetwork network(model, net, at::make_generator<at::CPUGeneratorImpl>(/*seed_in=*/7));
  t::StepOptions options;  // l2, epsilon, no min-SNR, max_grad_norm 1.0, AdamW, lr 1e-4
  options.gradient_checkpointing = checkpointing;
  options.base_dtype = dtype;
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
  const double tensors_at_ready = tensor_memory->alive_mib();
  tensor_memory->reset_peak();
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
  std::printf("peak_rss %.0f %.0f %.0f\n", peak_rss_mib(), tensor_memory->peak_mib(),
              tensors_at_ready);
  return 0;
}

// Dense bf16/fp16 peak TFLOPS of GPUs by the name CUDA gives them (vendor data sheets, without
// sparsity); 0 where unknown.
double known_peak_tflops(const c10::Device& device) {
#ifdef LORAPIPE_BENCH_CUDA
  if (device.is_cuda()) {
    const std::string name = m::describe_device(device);
    for (const auto& [part, tflops] : std::vector<std::pair<std::string, double>>{
             {"H200", 989.4}, {"H100 80GB HBM3", 989.4}, {"H100 PCIe", 756.0},
             {"A100", 312.0}, {"L40S", 362.1}, {"L4", 121.0}}) {
      if (name.find(part) != std::string::npos) return tflops;
    }
  }
#endif
  (void)device;
  return 0;
}

// Peak allocated bytes since the last reset, in MiB: CUDA's caching allocator on a GPU, the
// counted tensor storage on the CPU.
double peak_allocated_mib(const c10::Device& device) {
#ifdef LORAPIPE_BENCH_CUDA
  if (device.is_cuda()) {
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index());
    return static_cast<double>(stats.allocated_bytes[0].peak) / (1 << 20);
  }
#endif
  return tensor_memory->peak_mib();
}

void reset_peak_allocated(const c10::Device& device) {
#ifdef LORAPIPE_BENCH_CUDA
  if (device.is_cuda()) c10::cuda::CUDACachingAllocator::resetPeakStats(device.index());
#endif
  tensor_memory->reset_peak();
}

void synchronize(const c10::Device& device) {
#ifdef LORAPIPE_BENCH_CUDA
  if (device.is_cuda()) torch::cuda::synchronize(device.index());
#endif
  (void)device;
}

int64_t lora_parameters(const t::LoraNetwork& network) {
  int64_t n = 0;
  for (const at::Tensor& p : network.unet_parameters()) n += p.numel();
  return n;
}

// --write_structure: the denoiser's parameters as a checkpoint header the plan reads
// (`lorapipe plan --model`), over a sparse data section: names, dtypes and shapes as the model
// holds them, no weights written. U-Nets: a diffusers folder (model_index.json and
// unet/diffusion_pytorch_model.safetensors, diffusers' names); FLUX.1: one transformer file in
// the original layout. Returns what --model takes.
fs::path write_structure(const fs::path& dir, torch::nn::Module& denoiser, const std::string& size) {
  const bool flux = size.rfind("flux", 0) == 0;
  fs::create_directories(flux ? dir : dir / "unet");
  if (!flux) {
    std::ofstream(dir / "model_index.json")
        << "{\"_class_name\": \"" << (size == "sdxl" ? "StableDiffusionXLPipeline" : "StableDiffusionPipeline")
        << "\"}\n";
  }
  const fs::path file = flux ? dir / "flux-transformer.safetensors"
                             : dir / "unet" / "diffusion_pytorch_model.safetensors";
  std::string header = "{";
  uint64_t offset = 0;
  for (const auto& item : denoiser.named_parameters()) {
    const at::Tensor& p = item.value();
    const char* dtype = p.scalar_type() == c10::kBFloat16 ? "BF16"
                        : p.scalar_type() == c10::kHalf   ? "F16"
                                                          : "F32";
    const uint64_t bytes = static_cast<uint64_t>(p.numel()) * (dtype[0] == 'F' && dtype[1] == '3' ? 4 : 2);
    std::string shape;
    for (int64_t d : p.sizes()) shape += (shape.empty() ? "" : ",") + std::to_string(d);
    header += (offset == 0 && header.size() == 1 ? "\"" : ",\"") + item.key() + "\":{\"dtype\":\"" +
              dtype + "\",\"shape\":[" + shape + "],\"data_offsets\":[" + std::to_string(offset) +
              "," + std::to_string(offset + bytes) + "]}";
    offset += bytes;
  }
  header += "}";
  while (header.size() % 8 != 0) header += ' ';
  {
    std::ofstream out(file, std::ios::binary | std::ios::trunc);
    const uint64_t length = header.size();
    out.write(reinterpret_cast<const char*>(&length), 8);
    out << header;
  }
  fs::resize_file(file, 8 + header.size() + offset);  // sparse: the data section takes no disk
  return flux ? file : dir;
}

int solo(const std::string& size, int argc, char** argv) {
  std::string device_spec = "cpu", dtype_name = "fp32";
  int64_t batch = 1, steps = 5, warmup = 2;
  int64_t warmup_resolution = 0;  // 0: the warm-up runs each measured setting's own shape
  int64_t resolution = size == "tiny" || size == "flux_tiny" ? 128 : size == "sdxl" ? 1024 : 512;
  bool checkpointing = false, fp8_base = false, fp8_scaled = false, offload = false;
  bool fp8_fast = false;
  int blocks_to_swap = 0;
  fs::path structure;  // --write_structure DIR
  std::string settings_list;  // --settings WxH:B,...
  double memory_limit = 0;    // --memory_limit BYTES
  int network_dim = 16;       // --network_dim
  int depth = 0;  // FLUX.1 at full width with this many double blocks and twice as many single
  double peak_tflops = -1;
  t::OptimizerOptions optimizer;
  std::vector<std::string> optimizer_args;
  double learning_rate = -1;
  for (int i = 3; i < argc; ++i) {
    const std::string flag = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument(flag + " wants a value");
      return argv[++i];
    };
    if (flag == "--device") {
      device_spec = value();
    } else if (flag == "--dtype") {
      dtype_name = value();
    } else if (flag == "--batch") {
      batch = lorapipe::bench::flag_whole(flag, value());
    } else if (flag == "--resolution") {
      resolution = lorapipe::bench::flag_whole(flag, value());
    } else if (flag == "--steps") {
      steps = lorapipe::bench::flag_whole(flag, value());
    } else if (flag == "--warmup") {
      warmup = lorapipe::bench::flag_whole(flag, value());
    } else if (flag == "--warmup_resolution") {
      warmup_resolution = lorapipe::bench::flag_whole(flag, value());
      if (warmup_resolution < 64 || warmup_resolution % 64 != 0) {
        throw std::invalid_argument("--warmup_resolution " + std::to_string(warmup_resolution) +
                                    ": a positive multiple of 64 pixels (what every family's "
                                    "denoiser takes)");
      }
    } else if (flag == "--gradient_checkpointing") {
      checkpointing = true;
    } else if (flag == "--fp8_base") {
      fp8_base = true;
    } else if (flag == "--fp8_scaled") {
      fp8_scaled = true;
    } else if (flag == "--fp8_fast") {
      fp8_fast = fp8_scaled = true;
    } else if (flag == "--cpu_offload_checkpointing") {
      offload = checkpointing = true;
    } else if (flag == "--blocks_to_swap") {
      blocks_to_swap = static_cast<int>(lorapipe::bench::flag_whole(flag, value()));
    } else if (flag == "--write_structure") {
      structure = value();
    } else if (flag == "--settings") {
      settings_list = value();
    } else if (flag == "--memory_limit") {
      memory_limit = lorapipe::bench::flag_number(flag, value());
    } else if (flag == "--network_dim") {
      network_dim = static_cast<int>(lorapipe::bench::flag_whole(flag, value()));
    } else if (flag == "--depth") {
      depth = static_cast<int>(lorapipe::bench::flag_whole(flag, value()));
    } else if (flag == "--threads") {
      at::set_num_threads(static_cast<int>(lorapipe::bench::flag_whole(flag, value())));
    } else if (flag == "--peak_tflops") {
      peak_tflops = lorapipe::bench::flag_number(flag, value());
    } else if (flag == "--optimizer_type") {
      optimizer.type = value();
    } else if (flag == "--optimizer_args") {
      while (i + 1 < argc && std::string(argv[i + 1]).rfind("--", 0) != 0) {
        optimizer_args.emplace_back(argv[++i]);
      }
    } else if (flag == "--learning_rate") {
      learning_rate = lorapipe::bench::flag_number(flag, value());
    } else {
      throw std::invalid_argument("unknown flag '" + flag + "'");
    }
  }
  const std::map<std::string, c10::ScalarType> dtypes{
      {"fp32", c10::kFloat}, {"bf16", c10::kBFloat16}, {"fp16", c10::kHalf}};
  if (!dtypes.count(dtype_name)) throw std::invalid_argument("--dtype fp32, bf16 or fp16");
  const c10::ScalarType dtype = dtypes.at(dtype_name);
  const c10::Device device = m::resolve_device(device_spec);
  if (peak_tflops < 0) peak_tflops = known_peak_tflops(device);

  torch::manual_seed(0);
  std::unique_ptr<m::DiffusionModel> owned;
  m::Float8Storage float8;                      // what --fp8_base stored
  m::DiffusionModel::BlockSwapReport swap;     // what --blocks_to_swap moved to the host
  // A step's inputs and model FLOPs at a batch and size in pixels.
  std::function<std::pair<t::MicroBatch, double>(int64_t, int64_t, int64_t)> inputs;
  if (size.rfind("flux", 0) == 0) {
    // FLUX.1 [dev] (`flux`, full size, or `flux_tiny`), built in --dtype and drawn at random on
    // the CPU, then placed; kohya's Flux LoRA targets; T5 states of kohya's dev length (512).
    auto flux = std::make_unique<m::FluxModel>();
    flux->family = m::flux_model_family(true);
    m::FluxConfig config = m::FluxConfig::dev();
    if (size == "flux_tiny") {
      config.hidden_size = 32, config.num_heads = 2, config.axes_dim = {4, 6, 6};
      config.depth = 1, config.depth_single_blocks = 2;
      config.context_in_dim = 32, config.vec_in_dim = 32;
    } else if (size != "flux") {
      throw std::invalid_argument("size must be tiny, full, sdxl, flux or flux_tiny");
    }
    if (depth > 0) config.depth = depth, config.depth_single_blocks = 2 * depth;
    // The full-size transformer's structure alone (`--steps 0 --write_structure`, no --depth) is
    // built on the meta device: its 11.9 B parameters need no memory to have names and shapes.
    const bool structure_only = steps == 0 && !structure.empty() && size == "flux" && depth == 0;
    {
      torch::NoGradGuard no_grad;
      auto options = torch::TensorOptions().dtype(dtype);
      if (structure_only) options = options.device(torch::kMeta);
      flux->transformer = m::FluxTransformer(config, options);
      if (!structure_only) {
        // Built uninitialised. The draws are made on the device where there is one and copied
        // back to the host, where placement starts as the trainer's does (float8, swap, then the
        // move): the CPU's generator draws one value at a time, minutes for 11.9 B of them, and
        // a lent GPU's minutes are few. These are stand-ins for loaded weights, not the LoRA's.
        for (auto& p : flux->transformer->parameters()) {
          if (device.is_cpu()) {
            p.normal_(0, 0.02);
          } else {
            p.copy_(torch::empty(p.sizes(), p.options().device(device)).normal_(0, 0.02));
          }
        }
      }
    }
    if (!structure.empty()) {
      std::printf("structure %s\n", write_structure(structure, *flux->transformer, size).c_str());
    }
    if (structure_only) return 0;
    if (fp8_base) float8 = m::store_weights_in_float8(*flux->transformer, fp8_scaled, fp8_fast);
    // As the trainer's placement: frozen, then the swapped weights go to host memory before the
    // move.
    for (auto& p : flux->transformer->parameters()) p.requires_grad_(false);
    if (blocks_to_swap > 0) swap = flux->enable_block_swap(blocks_to_swap, device, 2);
    flux->transformer->to(device);
    flux->transformer->train();
    const int64_t text = size == "flux_tiny" ? 16 : 512;
    inputs = [config, text](int64_t batch, int64_t width, int64_t height) {
      t::MicroBatch micro;
      micro.latents = torch::randn({batch, 16, height / 8, width / 8});
      micro.encoder_hidden_states = torch::randn({batch, text, config.context_in_dim});
      micro.pooled = torch::randn({batch, config.vec_in_dim});
      return std::make_pair(
          micro, 2 * m::flux_forward_flops(config, batch, (height / 16) * (width / 16), text));
    };
    owned = std::move(flux);
  } else {
    // SDXL through its own model (its LoRA targets, names and added conditions); the others SD1.x.
    std::unique_ptr<m::StableDiffusion> sd = size == "sdxl"
                                                 ? std::make_unique<m::StableDiffusionXL>()
                                                 : std::make_unique<m::StableDiffusion>();
    m::StableDiffusion& model = *sd;
    model.family = m::model_family(size == "sdxl" ? "sdxl" : "sd15");
    {
      // Built in --dtype from the start: a full SDXL U-Net in fp32 first would take 10 GiB.
      m::DefaultDtype built_in(dtype == c10::kHalf ? c10::kFloat : dtype);
      model.unet = m::UNet(config_for(size));
    }
    model.unet->to(dtype);
    if (!structure.empty()) {
      std::printf("structure %s\n", write_structure(structure, *model.unet, size).c_str());
    }
    // On the CPU, then moved, as the trainer's placement: float8, frozen, the swap, the move.
    if (fp8_base) float8 = m::store_weights_in_float8(*model.unet, fp8_scaled, fp8_fast);
    for (auto& p : model.unet->parameters()) p.requires_grad_(false);
    if (blocks_to_swap > 0) swap = model.enable_block_swap(blocks_to_swap, device, 2);
    model.unet->to(device);
    model.unet->train();
    inputs = [config = model.unet->config()](int64_t batch, int64_t width, int64_t height) {
      t::MicroBatch micro;
      micro.latents = torch::randn({batch, config.in_channels, height / 8, width / 8});
      micro.encoder_hidden_states = torch::randn({batch, 77, config.cross_attention_dim});
      if (!config.addition_embed_type.empty()) {  // SDXL: the pooled embedding; default time ids
        micro.pooled = torch::randn({batch, config.projection_class_embeddings_input_dim -
                                                6 * config.addition_time_embed_dim});
      }
      return std::make_pair(micro,
                            2 * m::unet_forward_flops(config, batch, height / 8, width / 8, 77));
    };
    owned = std::move(sd);
  }
  m::DiffusionModel& model = *owned;
  t::NetworkOptions net;
  net.dim = network_dim;
  net.alpha = static_cast<double>(network_dim);
  net.train_text_encoder = false;
  t::LoraNetwork network(model, net, at::make_generator<at::CPUGeneratorImpl>(/*seed_in=*/7));
  if (steps == 0) {  // the model and its LoRA only (with --write_structure: what the plan reads)
    std::printf("LoRA modules %zu, LoRA parameters %lld\n", network.unet_module_count(),
                static_cast<long long>(lora_parameters(network)));
    // And the analytic FLOPs of a step at --resolution and --batch (what a timed step prints),
    // which `lorapipe plan`'s fitted count is checked against at sizes no step ran.
    std::printf("step flops %.9g at %lldx%lld batch %lld\n", inputs(batch, resolution, resolution).second,
                static_cast<long long>(resolution), static_cast<long long>(resolution),
                static_cast<long long>(batch));
    return 0;
  }
  t::StepOptions options;
  options.base_dtype = dtype;
  options.gradient_checkpointing = checkpointing;
  options.cpu_offload_checkpointing = offload;
  t::apply_optimizer_args(optimizer, optimizer_args);
  options.optimizer = optimizer;
  if (learning_rate > 0) options.optimizer_groups.learning_rate = learning_rate;

  // --settings: several sizes and batches on the one model, in the order given (the probe gives
  // them by resolution, batches rising); a setting that runs out of memory is said so, and the
  // larger batches of its size are skipped. --memory_limit caps the device as a smaller card
  // would: CUDA's allocator a fraction of the device, the CPU's counted tensors at the bytes.
  struct Setting {
    int64_t width, height, batch;
  };
  std::vector<Setting> settings;
  if (settings_list.empty()) settings.push_back({resolution, resolution, batch});
  for (size_t begin = 0; begin < settings_list.size();) {
    size_t end = settings_list.find(',', begin);
    if (end == std::string::npos) end = settings_list.size();
    const std::string piece = settings_list.substr(begin, end - begin);
    const size_t x = piece.find('x'), colon = piece.find(':');
    if (x == std::string::npos || colon == std::string::npos || colon < x) {
      throw std::invalid_argument("--settings: '" + piece + "' is not WIDTHxHEIGHT:BATCH");
    }
    const auto whole = [&](const std::string& text) {
      return lorapipe::bench::flag_whole("--settings " + piece, text);
    };
    settings.push_back({whole(piece.substr(0, x)), whole(piece.substr(x + 1, colon - x - 1)),
                        whole(piece.substr(colon + 1))});
    begin = end + 1;
  }
  if (memory_limit > 0) {
#ifdef LORAPIPE_BENCH_CUDA
    if (device.is_cuda()) {
      size_t free_bytes = 0, total_bytes = 0;
      const c10::cuda::CUDAGuard on(device.index());  // cudaMemGetInfo reads the current device
      C10_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
      c10::cuda::CUDACachingAllocator::setMemoryFraction(
          std::min(1.0, memory_limit / static_cast<double>(total_bytes)), device.index());
    }
#endif
    if (!device.is_cuda()) tensor_memory->set_limit(static_cast<size_t>(memory_limit));
  }
  int64_t out_of_memory_at = -1;  // the width x height whose batches stopped fitting
  for (const Setting& s : settings) {
    const std::string label =
        size + " " + m::describe_device(device) + " " + dtype_name + (fp8_base ? " fp8_base" : "") +
        (fp8_scaled ? " scaled" : "") + (fp8_fast ? " fp8_fast" : "") +
        (blocks_to_swap > 0 ? " blocks_to_swap " + std::to_string(blocks_to_swap) : "") +
        (offload ? " cpu_offload_checkpointing" : "") +
        (depth > 0 ? " depth " + std::to_string(depth) : "") + " " + optimizer.type + " batch " +
        std::to_string(s.batch) + " " + std::to_string(s.width) + "x" + std::to_string(s.height) +
        (checkpointing ? ", checkpointing" : "");
    if (out_of_memory_at == s.width * 100000 + s.height) {
      std::printf("%s: skipped (a smaller batch ran out of memory)\n", label.c_str());
      std::fflush(stdout);
      continue;
    }
    try {
      auto [micro, flops] = inputs(s.batch, s.width, s.height);
      micro.loss_weights = torch::ones({s.batch});
      t::TrainingStep step(model, network, options);
      int64_t seed = 0;
      auto one_step = [&](const t::MicroBatch& batch_inputs) {
        const double loss =
            step.accumulate(batch_inputs, at::make_generator<at::CPUGeneratorImpl>(seed++));
        if (!step.update().applied) {
          throw std::runtime_error("the update was skipped (loss " + std::to_string(loss) + ")");
        }
      };
      if (warmup_resolution > 0) {
        t::MicroBatch small = inputs(1, warmup_resolution, warmup_resolution).first;
        small.loss_weights = torch::ones({1});
        for (int64_t i = 0; i < warmup; ++i) one_step(small);
      } else {
        for (int64_t i = 0; i < warmup; ++i) one_step(micro);
      }
      synchronize(device);
      reset_peak_allocated(device);
      const auto start = Clock::now();
      for (int64_t i = 0; i < steps; ++i) one_step(micro);
      synchronize(device);
      const double seconds = ms_since(start) / 1e3 / static_cast<double>(steps);
      std::printf("%s: %.3f s/it, %.2f samples/s, peak allocated %.0f MiB", label.c_str(), seconds,
                  static_cast<double>(s.batch) / seconds, peak_allocated_mib(device));
      // The bytes each option takes off the device by its own account (bench/small_card_bench.sh
      // sets them against the measured peaks): float8's weights before less after (scales
      // included), and the swapped weights less the ring's slots.
      const double mib = 1 << 20;
      if (fp8_base) {
        std::printf(", float8 analytic saving %.0f MiB",
                    static_cast<double>(float8.bytes_before - float8.bytes_after) / mib);
      }
      if (blocks_to_swap > 0) {
        std::printf(", swap analytic saving %.0f MiB (%.0f MiB to the host, %d slots of %.0f MiB)",
                    static_cast<double>(swap.host_bytes - swap.slots * swap.slot_bytes) / mib,
                    static_cast<double>(swap.host_bytes) / mib, swap.slots,
                    static_cast<double>(swap.slot_bytes) / mib);
      }
      std::printf(", %.3g TFLOPS, step flops %.6g, LoRA parameters %lld", flops / seconds / 1e12,
                  flops, static_cast<long long>(lora_parameters(network)));
      if (peak_tflops > 0) {
        std::printf(", MFU %.1f%% of %.4g TFLOPS", 100 * flops / seconds / 1e12 / peak_tflops,
                    peak_tflops);
      }
      std::printf("\n");
    } catch (const std::exception& e) {
      // The allocator's typed error, and the libraries' own (cuBLAS's workspace, pinned host
      // memory for the swap) that say so in words: each is this setting not fitting.
      if (!m::is_out_of_memory(e)) throw;
      out_of_memory_at = s.width * 100000 + s.height;
      std::string what = e.what();
      what = what.substr(0, what.find('\n'));
      std::printf("%s: out of memory (%s)\n", label.c_str(), what.c_str());
    }
    std::fflush(stdout);
    // What the step held goes back before the next setting (its gradients with it).
    for (at::Tensor& p : network.unet_parameters()) p.mutable_grad() = at::Tensor();
#ifdef LORAPIPE_BENCH_CUDA
    if (device.is_cuda()) c10::cuda::CUDACachingAllocator::emptyCache();
#endif
  }
  return 0;
}

int run(int argc, char** argv) {
  const std::string command = argc > 1 ? argv[1] : "";
  const std::string size = argc > 2 ? argv[2] : "";
  if (command == "config" && argc == 3) {
    std::printf("%s\n", m::to_config_json(config_for(size)).c_str());
    return 0;
  }
  if (command == "solo" && argc >= 3) return solo(size, argc, argv);
  if (command != "step" || argc < 4) {
    std::fprintf(stderr,
                 "usage: trainer_bench config tiny|full|sdxl\n"
                 "       trainer_bench step tiny|full|sdxl DIR [--gradient_checkpointing] "
                 "[--dtype fp32|bf16] [--threads N] [--map_weights]\n"
                 "       trainer_bench solo tiny|full|sdxl|flux|flux_tiny [--device D] "
                 "[--dtype fp32|bf16|fp16] "
                 "[--batch N]\n"
                 "             [--resolution PX] [--steps N] [--warmup N] [--warmup_resolution PX] "
                 "[--gradient_checkpointing] "
                 "[--threads N] [--peak_tflops T]\n");
    return 2;
  }
  const fs::path dir = argv[3];
  bool checkpointing = false, map_weights = false;
  c10::ScalarType dtype = c10::kFloat;
  for (int i = 4; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--gradient_checkpointing") {
      checkpointing = true;
    } else if (flag == "--map_weights") {
      map_weights = true;
    } else if (flag == "--dtype" && i + 1 < argc) {
      const std::string name = argv[++i];
      if (name != "fp32" && name != "bf16") throw std::invalid_argument("--dtype fp32 or bf16");
      dtype = name == "bf16" ? c10::kBFloat16 : c10::kFloat;
    } else if (flag == "--threads" && i + 1 < argc) {
      at::set_num_threads(static_cast<int>(lorapipe::bench::flag_whole(flag, argv[++i])));
    } else {
      std::fprintf(stderr, "trainer_bench: unknown flag '%s'\n", flag.c_str());
      return 2;
    }
  }
  // SDXL through its own model (its LoRA targets and added conditions), built in the base dtype
  // from the start as the trainer builds it.
  std::unique_ptr<m::StableDiffusion> owned =
      size == "sdxl" ? std::make_unique<m::StableDiffusionXL>() : std::make_unique<m::StableDiffusion>();
  m::StableDiffusion& model = *owned;
  model.family = m::model_family(size == "sdxl" ? "sdxl" : "sd15");
  {
    m::DefaultDtype built_in(dtype);
    model.unet = m::UNet(config_for(size));
  }
  {
    std::optional<m::MappedWeights> mapped;
    if (map_weights) mapped.emplace();
    m::load_unet_diffusers(model.unet, dir);
    if (mapped && mapped->copied_tensors() != 0) {
      throw std::runtime_error("--map_weights: " + std::to_string(mapped->copied_tensors()) +
                               " weights could not be the file's pages");
    }
  }
  model.unet->to(dtype);
  for (auto& p : model.unet->parameters()) p.requires_grad_(false);  // frozen base, as the trainer
  model.unet->train();
  return serve(model, dir, checkpointing, dtype);
}

}  // namespace

int main(int argc, char** argv) {
  lorapipe::keep_freed_memory_for_reuse();  // the trainer's heap policy, first thing in main
  tensor_memory = &m::TensorMemoryCounter::install();
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "trainer_bench: %s\n", e.what());
    return 1;
  }
}
