#include "models/placement.h"

#include <torch/torch.h>

#include "common/error.h"
#include "common/log.h"
#include "models/device.h"
#include "models/float8.h"

namespace lorapipe::models {
namespace {

constexpr std::string_view kLog = "models";
using Role = DiffusionModel::Role;

}  // namespace

c10::ScalarType parse_precision(std::string_view name, std::string_view flag) {
  if (name == "no" || name == "float" || name == "fp32") return c10::kFloat;
  if (name == "fp16") return c10::kHalf;
  if (name == "bf16") return c10::kBFloat16;
  throw InputError(std::string(flag) + "=" + std::string(name) + ": expected " +
                   (flag == "--mixed_precision" ? "no" : flag == "--save_precision" ? "float" : "fp32") +
                   ", fp16 or bf16");
}

DiffusionModel::BlockSwapReport DiffusionModel::enable_block_swap(int blocks, c10::Device,
                                                                 int) {
  throw InputError("--blocks_to_swap=" + std::to_string(blocks) + ": " +
                   model_family().display_name +
                   " has no block swap yet; fit it with "
                   "--fp8_base and --gradient_checkpointing");
}

Conditioning DiffusionModel::encode_trained_text(const TokenBatch&, int, const Conditioning&) {
  throw Error(model_family().display_name +
              ": its text-encoder LoRA adapts every text encoder, so none of their output can "
              "come from the cache while it trains");
}

void DiffusionModel::release_untrained_text_encoders() {
  throw Error(model_family().display_name + ": its text-encoder LoRA adapts every text encoder");
}

void DiffusionModel::set_cpu_offload_checkpointing(bool enabled) {
  if (!enabled) return;
  throw InputError("--cpu_offload_checkpointing: " + model_family().display_name +
                   " has no offloaded checkpoints (kohya offers them for FLUX.1 and SD3 alone); "
                   "--gradient_checkpointing and --fp8_base fit it");
}

PlacementReport place(DiffusionModel& model, const Placement& placement) {
  torch::NoGradGuard no_grad;
  PlacementReport report;
  if (placement.fp8_fast && (!placement.fp8_scaled || !placement.fp8_denoiser)) {
    throw InputError("--fp8_fast multiplies the denoiser's scaled float8 weights in float8: "
                     "give --fp8_scaled with --fp8_base or --fp8_base_unet");
  }
  if (placement.fp8_fast && !float8_matmul_supported(placement.device)) {
    throw InputError("--fp8_fast: " + describe_device(placement.device) +
                     " has no float8 matrix units (CUDA compute capability 8.9 and above: RTX "
                     "40xx, L4, H100 and later); --fp8_scaled alone keeps the memory saving");
  }
  for (const DiffusionModel::Component& c : model.components()) {
    torch::nn::Module& module = *c.module;
    const bool text = c.role == Role::kTextEncoder;
    c10::ScalarType dtype = placement.dtype;
    if (c.role == Role::kVae) {
      if (placement.vae_dtype) {
        dtype = *placement.vae_dtype;
      } else if (dtype == c10::kHalf) {
        dtype = module.parameters().empty() ? dtype : module.parameters().front().scalar_type();
      }
    }
    const bool fp8 = (c.role == Role::kDenoiser && placement.fp8_denoiser) ||
                     (text && placement.fp8_text_encoders);
    const c10::Device device =
        text && !placement.text_encoders_on_device ? c10::Device(c10::kCPU) : placement.device;
    module.to(dtype);  // on the CPU, where it was built
    if (fp8) {
      // "the U-Net's", "the text encoders'"
      const std::string owner = c.label + (c.label.back() == 's' ? "'" : "'s");
      const bool fast = placement.fp8_fast && c.role == Role::kDenoiser;
      const Float8Storage s = store_weights_in_float8(module, placement.fp8_scaled, fast);
      report.float8_tensors += s.tensors;
      report.float8_bytes_before += s.bytes_before;
      report.float8_bytes_after += s.bytes_after;
      report.float8_saturated += s.saturated;
      LP_LOG(kInfo, kLog) << "float8 (--fp8_base" << (placement.fp8_scaled ? " --fp8_scaled" : "")
                          << "): the " << owner << " " << s.tensors << " Linear and Conv2d weights stored in "
                          << (placement.fp8_scaled ? "scaled " : "") << "float8_e4m3fn, "
                          << s.bytes_before / (1 << 20) << " MiB -> " << s.bytes_after / (1 << 20)
                          << " MiB";
      if (fast) {
        LP_LOG(kInfo, kLog) << "float8 matmuls (--fp8_fast): " << s.float8_matmuls
                            << " of the " << owner << " Linear weights scaled per row and "
                            << "multiplied in float8 on " << describe_device(placement.device);
      }
      if (s.saturated > 0) {
        LP_LOG(kWarning, kLog) << "float8 (--fp8_base): " << s.saturated << " of the " << owner
                               << " weights hold values beyond float8's +-448, clamped to it";
      }
    }
    if (placement.freeze) {  // before the swap: only frozen weights leave the device
      for (auto& p : module.parameters()) p.requires_grad_(false);
    }
    if (c.role == Role::kDenoiser && placement.attach_denoiser) {
      if (placement.blocks_to_swap > 0) {
        throw InputError("--blocks_to_swap: a denoiser attached to another process's weights "
                         "swaps none of them");
      }
      if (placement.attach_denoiser(module)) {
        module.eval();
        continue;
      }
    }
    if (c.role == Role::kDenoiser && placement.blocks_to_swap > 0) {
      // After the dtype and float8, before the move: the swapped weights never reach the device.
      const DiffusionModel::BlockSwapReport swap =
          model.enable_block_swap(placement.blocks_to_swap, device, placement.swap_slots);
      report.swap_host_bytes = swap.host_bytes;
      report.swap_slot_bytes = swap.slot_bytes * swap.slots;
      LP_LOG(kInfo, kLog) << "block swap (--blocks_to_swap=" << placement.blocks_to_swap
                          << "): " << swap.blocks << ", " << swap.host_bytes / (1 << 20)
                          << " MiB in host memory, " << swap.slots << " slots of "
                          << swap.slot_bytes / (1 << 20) << " MiB on " << device.str();
    }
    module.to(device);  // device only: a dtype would widen the float8 weights again
    module.eval();
    if (text && !placement.text_encoders_on_device && placement.device != device) {
      LP_LOG(kInfo, kLog) << "the " << c.label << " stays on the CPU: "
                          << placement.text_encoders_off_device_because;
    }
  }
  return report;
}

c10::ScalarType vae_compute_dtype(const ModelFamily& family, c10::ScalarType dtype,
                                  bool vae_given, bool no_half_vae) {
  if (no_half_vae) return c10::kFloat;
  if (dtype == c10::kHalf && family.vae_overflows_in_fp16 && !vae_given) return c10::kFloat;
  return dtype;
}

}  // namespace lorapipe::models
