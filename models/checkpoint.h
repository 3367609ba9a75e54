#pragma once
// Gradient checkpointing for C++ (which has no torch.utils.checkpoint): a reentrant autograd
// function that runs a block without keeping its activations and recomputes it, under grad
// mode, during backward.
//
// The frozen-base trap (STYLE.md): with the base frozen, no input of a block may require grad
// (the latents and the cached text do not), and a plain reentrant checkpoint whose inputs do not
// require grad is invisible to autograd, so the LoRA tensors inside the block get no gradients.
// Here the block's trainable tensors are explicit inputs of the function: they become edges of
// its node, and backward returns their gradients from the recomputation.
//
// The recomputation sees the same random numbers as the first run: the CPU generator's state
// (and the current CUDA device's, when inputs are on CUDA) is saved before the forward and put
// back around the recomputation, so dropout in the adapters masks the same elements.

#include <ATen/core/Tensor.h>

#include <functional>
#include <vector>

namespace torch::nn {
class Module;
}

namespace lorapipe::models {

using BlockFunction = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>;

// Called around each run of a block: `enter` before, `leave` after, with `backward` true for the
// recompute in backward, whose `leave` comes once the gradients through the block are computed:
// block swap (models/block_swap.h) keeps the block's weights on the device in between. Empty:
// nothing is called.
struct BlockCalls {
  std::function<void(bool backward)> enter, leave;
  // kohya's --cpu_offload_checkpointing: the inputs a checkpointed block keeps for its recompute
  // wait for backward in host memory (pinned) rather than on its CUDA device, and come back just
  // before the recompute. Inputs on the CPU stay where they are.
  bool offload_inputs = false;
};

// Runs `block(inputs)` under no-grad and returns its outputs with a backward that recomputes
// them. `trainable`: the tensors inside the block that need gradients (LoRA down/up); inputs
// that require grad get theirs too. Outputs that backward passes no gradient for are treated as
// zero-gradient. Without grad mode (evaluation), calls `block` directly.
std::vector<at::Tensor> checkpoint(BlockFunction block, const std::vector<at::Tensor>& inputs,
                                   const std::vector<at::Tensor>& trainable,
                                   BlockCalls calls = {});

// `block` checkpointed (as checkpoint) or run directly, with `calls` around each run. Run
// directly with `calls` and a graph to keep (grad mode, and an input or `trainable` needing
// grad), throws Error: its backward would read the block's weights after `leave`.
std::vector<at::Tensor> run_block(BlockFunction block, const std::vector<at::Tensor>& inputs,
                                  const std::vector<at::Tensor>& trainable, bool checkpointed,
                                  BlockCalls calls = {});

// The adapter tensors under `module` (every models::Linear / models::Conv2d with a LoRA slot
// filled) that require grad, in module order.
std::vector<at::Tensor> trainable_adapter_tensors(const torch::nn::Module& module);

}  // namespace lorapipe::models
