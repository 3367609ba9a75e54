// AdamW8bit and PagedAdamW8bit behind the Optimizer seam: kernels/adamw8bit.h's CPU reference on
// the CPU, its CUDA kernel (one launch for every LoRA tensor) on a GPU.
//
// All optimizer state lives in one byte arena: per parameter, both moments (8-bit or fp32) and
// the 8-bit moments' absmax arrays, each 16-byte aligned. Saving writes the arena as it is, so a
// resumed run continues from exactly the same bytes. PagedAdamW8bit allocates the arena in CUDA
// managed memory and prefetches it to the device before each step.

#include "trainer/adamw8bit_optimizer.h"

#include <torch/torch.h>

#include <cstdio>
#include <sstream>

#include "common/error.h"
#include "trainer/optimizer_state.h"
#include "kernels/adamw8bit.h"
#include "kernels/cuda_device.h"

#if __has_include(<c10/cuda/CUDAStream.h>)
#include <c10/cuda/CUDAStream.h>
#define LORAPIPE_TORCH_CUDA_STREAM 1
#endif

namespace lorapipe::trainer {
namespace {

namespace k = kernels;

int64_t align16(int64_t bytes) { return (bytes + 15) / 16 * 16; }

k::ParamDtype param_dtype(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return k::ParamDtype::kFloat32;
    case at::kBFloat16:
      return k::ParamDtype::kBFloat16;
    case at::kHalf:
      return k::ParamDtype::kFloat16;
    default:
      throw InputError(std::string("AdamW8bit: parameters must be fp32, bf16 or fp16, not ") +
                       c10::toString(t.scalar_type()));
  }
}

class AdamW8bit final : public Optimizer {
 public:
  AdamW8bit(const OptimizerOptions& options, std::vector<ParamGroup> groups, bool paged)
      : options_(options), paged_(paged) {
    if (groups.size() > static_cast<size_t>(k::kAdamW8bitMaxGroups)) {
      throw InputError("AdamW8bit: " + std::to_string(groups.size()) +
                       " parameter groups, at most " + std::to_string(k::kAdamW8bitMaxGroups));
    }
    const int64_t min_size = options.min_8bit_size.value_or(k::kAdamW8bitMinNumel);
    int64_t bytes = 0;
    for (size_t g = 0; g < groups.size(); ++g) {
      lrs_.push_back(groups[g].lr);
      for (const at::Tensor& p : groups[g].params) {
        TORCH_CHECK(p.is_contiguous(), "AdamW8bit: parameters must be contiguous");
        Slot slot{p, static_cast<int>(g), p.numel() >= min_size, {}};
        const int64_t n = p.numel(), blocks = k::adamw8bit_blocks(n);
        const int64_t state_bytes = slot.quantized ? n : 4 * n;
        for (int64_t size : {state_bytes, state_bytes, 4 * blocks, 4 * blocks}) {
          slot.offsets.push_back(bytes);
          bytes += align16(size);
        }
        if (slots_.empty()) device_ = p.device();
        // One arena and one launch serve every tensor: a tensor elsewhere would hand the kernel
        // a pointer it cannot read.
        if (p.device() != device_) {
          throw InputError("AdamW8bit: parameters on " + device_.str() + " and " +
                           p.device().str() + ": one optimizer steps the tensors of one device");
        }
        slots_.push_back(std::move(slot));
      }
    }
    if (device_.is_cuda() && !k::built_with_cuda()) {  // check_optimizer_device says it first
      throw InputError("AdamW8bit on " + device_.str() + ": this build of lorapipe has no CUDA "
                       "kernels (it was configured without nvcc)");
    }
    allocate(std::max<int64_t>(bytes, 16));
  }

  ~AdamW8bit() override {
    arena_ = at::Tensor();
    if (managed_ != nullptr) k::free_managed(managed_);
  }

  void step() override {
    ++step_;
    std::vector<k::AdamW8bitStep> constants;
    for (double lr : lrs_) {
      constants.push_back(k::adamw8bit_step_constants(lr, options_.beta1, options_.beta2,
                                                      options_.eps, weight_decay(), step_));
    }
    // One call per parameter dtype (LoRA parameters are all fp32 in practice).
    for (k::ParamDtype dtype :
         {k::ParamDtype::kFloat32, k::ParamDtype::kBFloat16, k::ParamDtype::kFloat16}) {
      std::vector<k::AdamW8bitTensor> views;
      for (Slot& slot : slots_) {
        // As torch's optimizers do, a parameter without a gradient this step is left alone: its
        // view goes in with a null gradient (the kernels skip it), so the set of tensors a CUDA
        // plan was made for stays the same when module_dropout drops a module for a step.
        if (param_dtype(slot.param) != dtype) continue;
        views.push_back(view(slot));
      }
      if (views.empty()) continue;
      if (device_.is_cpu()) {
        k::adamw8bit_step_cpu(views.data(), views.size(), dtype, constants.data(), constants.size(),
                              at::get_num_threads());
      } else {
        step_cuda(views, dtype, constants);
      }
    }
  }

  void zero_grad() override {
    // Freed, as torch's optimizers (and ours) do: gradients that lived from one step to the next
    // would sit beside the activations at the step's peak (on SDXL's rank-16 LoRA, 163 MiB). The
    // next backward allocates them anew; the CUDA plan follows their addresses (step_cuda).
    for (Slot& slot : slots_) slot.param.mutable_grad() = at::Tensor();
  }

  size_t group_count() const override { return lrs_.size(); }
  void set_lr(size_t group, double lr) override { lrs_.at(group) = lr; }
  double lr(size_t group) const override { return lrs_.at(group); }

  void save(const std::filesystem::path& file) const override {
    torch::serialize::OutputArchive archive;
    archive.write("type", torch::tensor(static_cast<int64_t>(paged_ ? 2 : 1)));
    archive.write("step", torch::tensor(step_));
    archive.write("layout", layout());
    archive.write("arena", arena_.cpu());
    save_archive(archive, file);
  }

  void load(const std::filesystem::path& file) override {
    torch::serialize::InputArchive archive;
    at::Tensor step, layout_saved, arena;
    try {
      archive.load_from(file.string());
      archive.read("step", step);
      archive.read("layout", layout_saved);
      archive.read("arena", arena);
    } catch (const c10::Error& e) {
      throw InputError(file.string() +
                       ": not an AdamW8bit optimizer state: " + e.what_without_backtrace());
    }
    if (!torch::equal(layout_saved, layout()) || arena.numel() != arena_.numel()) {
      throw InputError(file.string() +
                       ": optimizer state for other parameters (another network, dim or "
                       "min_8bit_size)");
    }
    arena_.copy_(arena);
    step_ = step.item<int64_t>();
  }

  // kohya's ss_optimizer: the class, and the arguments only where the user gave some.
  std::string describe() const override {
    return kohya_optimizer_name(
        std::string("bitsandbytes.optim.adamw.") + (paged_ ? "PagedAdamW8bit" : "AdamW8bit"),
        options_);
  }

 private:
  double weight_decay() const { return options_.weight_decay.value_or(0.01); }  // bitsandbytes'

  struct Slot {
    at::Tensor param;
    int group;
    bool quantized;
    std::vector<int64_t> offsets;  // state1, state2, absmax1, absmax2 in the arena
  };

  void allocate(int64_t bytes) {
    auto options = torch::TensorOptions().dtype(torch::kUInt8).device(device_);
    if (paged_ && device_.is_cuda()) {
      if (k::managed_memory_supported(device_.index())) {
        managed_ = k::alloc_managed(static_cast<size_t>(bytes), device_.index());
        arena_ = torch::from_blob(managed_, {bytes}, options);
      } else {
        std::fprintf(stderr,
                     "warning: PagedAdamW8bit: %s cannot access managed memory concurrently; "
                     "the optimizer state stays in plain device memory\n",
                     device_.str().c_str());
      }
    } else if (paged_) {
      std::fprintf(stderr,
                   "warning: PagedAdamW8bit on the CPU: nothing to page, the state stays in "
                   "host memory (as bitsandbytes does)\n");
    }
    if (!arena_.defined()) arena_ = torch::empty({bytes}, options);
    // Zero moments: the signed map's 0 is byte 127, the unsigned map's byte 0; absmax 0.
    arena_.zero_();
    for (const Slot& slot : slots_) {
      if (slot.quantized) {
        arena_.slice(0, slot.offsets[0], slot.offsets[0] + slot.param.numel()).fill_(127);
      }
    }
  }

  k::AdamW8bitTensor view(Slot& slot) {
    uint8_t* base = arena_.data_ptr<uint8_t>();
    k::AdamW8bitTensor t;
    t.param = slot.param.data_ptr();
    t.grad = slot.param.grad().defined() ? slot.param.grad().data_ptr() : nullptr;
    t.state1 = base + slot.offsets[0];
    t.state2 = base + slot.offsets[1];
    t.absmax1 = reinterpret_cast<float*>(base + slot.offsets[2]);
    t.absmax2 = reinterpret_cast<float*>(base + slot.offsets[3]);
    t.numel = slot.param.numel();
    t.quantized = slot.quantized;
    t.group = slot.group;
    TORCH_CHECK(!slot.param.grad().defined() ||
                    (slot.param.grad().is_contiguous() &&
                     slot.param.grad().scalar_type() == slot.param.scalar_type()),
                "AdamW8bit: a gradient must be contiguous and of its parameter's dtype");
    return t;
  }

  void step_cuda(const std::vector<k::AdamW8bitTensor>& views, k::ParamDtype dtype,
                 const std::vector<k::AdamW8bitStep>& constants) {
    void* stream = nullptr;  // the legacy default stream, unless torch's current one is known
#ifdef LORAPIPE_TORCH_CUDA_STREAM
    stream = c10::cuda::getCurrentCUDAStream(device_.index()).stream();
#endif
    if (managed_ != nullptr) {
      k::prefetch_managed(managed_, static_cast<size_t>(arena_.numel()), device_.index(), stream);
    }
    // The plan holds the tensors' addresses; when one changes (a gradient allocated anew: CUDA's
    // caching allocator mostly hands a step the blocks of the last, not always) its table is
    // rewritten in the step's stream order.
    auto& plan = plans_[static_cast<int>(dtype)];
    auto& key = plan_keys_[static_cast<int>(dtype)];
    std::vector<const void*> now;
    for (const auto& v : views) now.insert(now.end(), {v.param, v.grad});
    if (!plan) {
      plan = std::make_unique<k::AdamW8bitCudaPlan>(views.data(), views.size(), dtype,
                                                    device_.has_index() ? device_.index() : -1);
      key = std::move(now);
    } else if (key != now) {
      plan->retarget(views.data(), views.size(), stream);
      key = std::move(now);
    }
    plan->step(constants.data(), constants.size(), stream);
  }

  // What the arena was laid out for: each parameter's size and whether it is quantised.
  at::Tensor layout() const {
    std::vector<int64_t> values;
    for (const Slot& slot : slots_) {
      values.push_back(slot.param.numel());
      values.push_back(slot.quantized ? 1 : 0);
    }
    return torch::tensor(values, torch::kInt64);
  }

  OptimizerOptions options_;
  bool paged_;
  std::vector<double> lrs_;
  std::vector<Slot> slots_;
  at::Device device_{at::kCPU};
  at::Tensor arena_;
  void* managed_ = nullptr;
  int64_t step_ = 0;
  std::unique_ptr<k::AdamW8bitCudaPlan> plans_[3];
  std::vector<const void*> plan_keys_[3];
};

}  // namespace

std::unique_ptr<Optimizer> make_adamw8bit(const OptimizerOptions& options,
                                          std::vector<ParamGroup> groups, bool paged) {
  return std::make_unique<AdamW8bit>(options, std::move(groups), paged);
}

}  // namespace lorapipe::trainer
