#pragma once
// A placed denoiser's frozen weights, published by the process that placed them (the trainer) and
// attached by another process on the same machine and device (the sampler rendering its
// previews), which then holds no copy of them: previews on the training card without a second
// model (issue 33).
//
// What is shared is every parameter and buffer of the module as placement left it (dtype, float8
// and its scales), so the attaching process must have built and placed the same module: its own
// tensors' names, dtypes and shapes must be the manifest's, and the manifest's key (the model and
// the placement flags, from shared_weights_key) its own; anything else is refused by name.
//
// On CUDA: each tensor's block of LibTorch's caching allocator is exported as an IPC handle (as
// torch.multiprocessing shares CUDA tensors), and the attaching process builds its tensors over
// the opened handles; the manifest names the GPU by its UUID too, and a process that numbers the
// GPUs otherwise (another CUDA_VISIBLE_DEVICES) is refused instead of reading another GPU's
// memory under its own index. On the CPU: the publisher moves the tensors into one memfd region (its own
// tensors become views of it, so the machine holds one copy) and the attaching process maps that
// region read-only through /proc/PID/fd/FD. Attached weights are never written: a process that
// attached them must apply LoRAs beside them (models/lora.h), never merge them (the CPU's mapping
// is read-only, so a write would fault rather than change the trainer's weights).
//
// The manifest is a JSON file, written whole (a temporary renamed over it). Lifetime: CUDA memory
// must outlive every process that opened its handle, so an attaching process holds a shared
// flock on the manifest for as long as it holds CUDA weights; the publisher, at its end, takes the
// exclusive lock (waiting, and saying so, while a sampler still renders) and rewrites the
// manifest as released, in place, under that lock. A process that attaches after that finds
// "released" and places its own copy. A CPU mapping outlives the memfd's creator, so there the
// attaching process lets the lock go once it has mapped.

#include <c10/core/Device.h>

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>

namespace torch::nn {
class Module;
}

namespace lorapipe::models {

struct Placement;

// The key both sides compute: the model's path, size and modification time, and the placement
// flags that decide the placed tensors' values (dtype, float8, scaled, fast).
std::string shared_weights_key(const std::filesystem::path& model, const Placement& placement);

class SharedWeightsPublisher {
 public:
  // Publishes every parameter and buffer of `module`, which is placed on `device` (CUDA or the
  // CPU), under `key`, in `manifest`. Throws InputError when a tensor is not on `device` (block
  // swap keeps weights in host memory: nothing else can attach them).
  SharedWeightsPublisher(torch::nn::Module& module, const c10::Device& device,
                         const std::filesystem::path& manifest, const std::string& key);
  // release(), waiting for the samplers unless it runs while an exception unwinds (a failed
  // trainer frees its weights at once rather than hang beside a sampler following nothing).
  ~SharedWeightsPublisher();
  SharedWeightsPublisher(const SharedWeightsPublisher&) = delete;
  SharedWeightsPublisher& operator=(const SharedWeightsPublisher&) = delete;

  // Waits until no process holds the weights (CUDA), then marks the manifest released. Once.
  // Without `wait`, a process still holding them is warned about, and they are released anyway.
  void release(bool wait = true);

  int64_t tensors() const { return tensors_; }
  int64_t bytes() const { return bytes_; }

 private:
  std::filesystem::path manifest_;
  bool released_ = false;
  int64_t tensors_ = 0, bytes_ = 0;
  std::shared_ptr<void> region_;  // the CPU's memfd mapping (its tensors hold it too)
  int memfd_ = -1;
};

class SharedWeightsAttachment {
 public:
  ~SharedWeightsAttachment();
  SharedWeightsAttachment(const SharedWeightsAttachment&) = delete;
  SharedWeightsAttachment& operator=(const SharedWeightsAttachment&) = delete;

  int64_t tensors() const { return tensors_; }
  int64_t bytes() const { return bytes_; }

 private:
  friend std::unique_ptr<SharedWeightsAttachment> attach_shared_weights(
      torch::nn::Module&, const c10::Device&, const std::filesystem::path&, const std::string&,
      const std::function<void()>&);
  SharedWeightsAttachment() = default;
  int lock_fd_ = -1;  // the shared flock, held while CUDA weights are in use
  int64_t tensors_ = 0, bytes_ = 0;
};

// Waits for `manifest` to appear (calling `waiting` about every 200 ms meanwhile, which may throw
// to give up), then makes every parameter and buffer of `module` (built and placed as the
// publisher's, on the CPU so far) a tensor over the publisher's memory on `device`. Returns null
// when the publisher has released its weights (the caller places its own copy); throws InputError
// naming what differs when the manifest is not for this module, device or key.
std::unique_ptr<SharedWeightsAttachment> attach_shared_weights(
    torch::nn::Module& module, const c10::Device& device, const std::filesystem::path& manifest,
    const std::string& key, const std::function<void()>& waiting = {});

}  // namespace lorapipe::models
