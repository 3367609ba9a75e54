#include "models/checkpoint.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <torch/autograd.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <exception>
#include <mutex>
#include <optional>

#include "common/error.h"
#include "models/linear.h"

namespace lorapipe::models {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The block travels to backward through the context, refcounted with the graph node.
struct BlockHolder : torch::CustomClassHolder {
  BlockFunction block;
  BlockCalls calls;
  size_t input_count = 0;
  std::vector<at::Generator> generators;  // CPU, and the inputs' CUDA device when there is one
  std::vector<at::Tensor> rng_states;
  // --cpu_offload_checkpointing: the inputs' host copies, their devices and which needed grad.
  std::vector<at::Tensor> host_inputs;
  std::vector<c10::Device> devices;
  std::vector<bool> requires_grad;
};

// Calls `leave` as its scope ends, however it ends: a block that throws between `enter` and
// `leave` still records its use of a swap slot, so no later copy overwrites weights its queued
// kernels read. While the block's exception unwinds, an exception from `leave` is dropped (the
// block's own is the one that says what went wrong).
struct LeaveOnExit {
  const BlockCalls& calls;
  bool backward;
  int unwinding = std::uncaught_exceptions();  // at construction: only a newer one counts
  ~LeaveOnExit() noexcept(false) {
    if (!calls.leave) return;
    if (std::uncaught_exceptions() <= unwinding) {
      calls.leave(backward);
      return;
    }
    try {
      calls.leave(backward);
    } catch (...) {
    }
  }
};

// A device tensor's copy in pinned host memory, issued on the current stream.
at::Tensor to_pinned_host(const at::Tensor& x) {
  at::Tensor host = at::empty(x.sizes(), x.options().device(at::kCPU).pinned_memory(true));
  host.copy_(x.detach(), /*non_blocking=*/true);
  return host;
}

std::vector<at::Generator> generators_for(at::TensorList inputs) {
  std::vector<at::Generator> out{at::detail::getDefaultCPUGenerator()};
  for (const at::Tensor& x : inputs) {
    if (x.defined() && x.is_cuda()) {
      out.push_back(at::globalContext().defaultGenerator(x.device()));
      break;
    }
  }
  return out;
}

// A generator's state is read and set under its lock, as torch's own get_rng_state does: another
// thread may draw from the same generator meanwhile (a DataLoader-like producer).
at::Tensor generator_state(at::Generator& g) {
  std::lock_guard<std::mutex> lock(g.mutex());
  return g.get_state();
}
void set_generator_state(at::Generator& g, const at::Tensor& state) {
  std::lock_guard<std::mutex> lock(g.mutex());
  g.set_state(state);
}

struct CheckpointFunction : torch::autograd::Function<CheckpointFunction> {
  static variable_list forward(AutogradContext* ctx, c10::intrusive_ptr<BlockHolder> holder,
                               at::TensorList inputs, at::TensorList trainable) {
    holder->input_count = inputs.size();
    holder->generators = generators_for(inputs);
    for (auto& g : holder->generators) holder->rng_states.push_back(generator_state(g));
    ctx->saved_data["block"] = c10::IValue::make_capsule(holder);
    const bool offload = holder->calls.offload_inputs &&
                         std::any_of(inputs.begin(), inputs.end(), [](const at::Tensor& x) {
                           return x.defined() && x.is_cuda();
                         });
    std::vector<at::Tensor> saved;
    if (offload) {
      // Held here instead of in the graph: the device copies are free once forward moves on.
      for (const at::Tensor& x : inputs) {
        holder->devices.push_back(x.defined() ? x.device() : c10::Device(c10::kCPU));
        holder->requires_grad.push_back(x.defined() && x.requires_grad());
        holder->host_inputs.push_back(!x.defined() ? at::Tensor()
                                      : !x.is_cuda() ? x.detach()
                                                     : to_pinned_host(x));
        saved.push_back(at::Tensor());
      }
    } else {
      saved.assign(inputs.begin(), inputs.end());
    }
    saved.insert(saved.end(), trainable.begin(), trainable.end());
    ctx->save_for_backward(saved);
    at::NoGradGuard no_grad;
    if (holder->calls.enter) holder->calls.enter(false);
    const LeaveOnExit leave{holder->calls, /*backward=*/false};
    return holder->block(std::vector<at::Tensor>(inputs.begin(), inputs.end()));
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    auto holder =
        c10::static_intrusive_pointer_cast<BlockHolder>(ctx->saved_data["block"].toCapsule());
    const variable_list saved = ctx->get_saved_variables();
    const size_t n_inputs = holder->input_count;
    std::vector<at::Tensor> inputs;
    std::vector<at::Tensor> targets;
    std::vector<size_t> target_slot;  // index into the gradients returned below
    const bool offloaded = !holder->host_inputs.empty();
    for (size_t i = 0; i < n_inputs; ++i) {
      const at::Tensor& host = offloaded ? holder->host_inputs[i] : at::Tensor();
      at::Tensor x = !offloaded      ? saved[i].detach()
                     : host.defined() ? host.to(holder->devices[i], /*non_blocking=*/true)
                                      : at::Tensor();  // an input given undefined (no skip)
      if (offloaded ? holder->requires_grad[i] : saved[i].requires_grad()) {
        x.requires_grad_(true);
        targets.push_back(x);
        target_slot.push_back(i);
      }
      inputs.push_back(x);
    }
    for (size_t i = n_inputs; i < saved.size(); ++i) {
      targets.push_back(saved[i]);
      target_slot.push_back(i);
    }

    if (holder->calls.enter) holder->calls.enter(true);
    // `leave` once the gradients through the block are computed, whichever way this returns.
    const LeaveOnExit leave{holder->calls, /*backward=*/true};
    std::vector<at::Tensor> outputs;
    {
      // Same random numbers as the first run, then the stream continues where it was.
      std::vector<at::Tensor> now;
      for (size_t g = 0; g < holder->generators.size(); ++g) {
        now.push_back(generator_state(holder->generators[g]));
        set_generator_state(holder->generators[g], holder->rng_states[g]);
      }
      at::AutoGradMode grad_mode(true);
      outputs = holder->block(inputs);
      for (size_t g = 0; g < now.size(); ++g) set_generator_state(holder->generators[g], now[g]);
    }
    std::vector<at::Tensor> roots, root_grads;
    for (size_t i = 0; i < outputs.size(); ++i) {
      if (!grad_outputs[i].defined() || !outputs[i].requires_grad()) continue;
      roots.push_back(outputs[i]);
      root_grads.push_back(grad_outputs[i]);
    }
    // One gradient slot per forward argument as autograd flattened them: the holder, then each
    // input, then each trainable tensor.
    variable_list grads(1 + saved.size());
    if (roots.empty() || targets.empty()) return grads;
    const variable_list found = torch::autograd::grad(roots, targets, root_grads,
                                                      /*retain_graph=*/false,
                                                      /*create_graph=*/false,
                                                      /*allow_unused=*/true);
    for (size_t k = 0; k < found.size(); ++k) grads[1 + target_slot[k]] = found[k];
    return grads;
  }
};

}  // namespace

namespace {

bool keeps_graph(const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& trainable) {
  if (!at::GradMode::is_enabled()) return false;
  return !trainable.empty() ||
         std::any_of(inputs.begin(), inputs.end(),
                     [](const at::Tensor& t) { return t.defined() && t.requires_grad(); });
}

std::vector<at::Tensor> call(const BlockFunction& block, const std::vector<at::Tensor>& inputs,
                             const BlockCalls& calls) {
  if (calls.enter) calls.enter(false);
  const LeaveOnExit leave{calls, /*backward=*/false};
  return block(inputs);
}

}  // namespace

std::vector<at::Tensor> checkpoint(BlockFunction block, const std::vector<at::Tensor>& inputs,
                                   const std::vector<at::Tensor>& trainable, BlockCalls calls) {
  // Evaluation, or nothing inside or coming in needs a gradient: no graph would be kept, nothing
  // to save.
  if (!keeps_graph(inputs, trainable)) return call(block, inputs, calls);
  auto holder = c10::make_intrusive<BlockHolder>();
  holder->block = std::move(block);
  holder->calls = std::move(calls);
  return CheckpointFunction::apply(holder, at::TensorList(inputs), at::TensorList(trainable));
}

std::vector<at::Tensor> run_block(BlockFunction block, const std::vector<at::Tensor>& inputs,
                                  const std::vector<at::Tensor>& trainable, bool checkpointed,
                                  BlockCalls calls) {
  if (checkpointed) return checkpoint(std::move(block), inputs, trainable, std::move(calls));
  if ((calls.enter || calls.leave) && keeps_graph(inputs, trainable)) {
    throw Error("a swapped block run for training without gradient checkpointing: its backward "
                "would read weights that have left the device (block swap trains with "
                "--gradient_checkpointing)");
  }
  return call(block, inputs, calls);
}

std::vector<at::Tensor> trainable_adapter_tensors(const torch::nn::Module& module) {
  std::vector<at::Tensor> out;
  auto add = [&](const std::shared_ptr<LoraAdapter>& lora) {
    if (!lora) return;
    for (const at::Tensor& t : {lora->down, lora->up}) {
      if (t.defined() && t.requires_grad()) out.push_back(t);
    }
  };
  for (const auto& m : module.modules(/*include_self=*/true)) {
    if (auto linear = std::dynamic_pointer_cast<LinearImpl>(m)) add(linear->lora);
    if (auto conv = std::dynamic_pointer_cast<Conv2dImpl>(m)) add(conv->lora);
  }
  return out;
}

}  // namespace lorapipe::models
