#pragma once
// Block swap (kohya's --blocks_to_swap): the frozen base weights of some of the denoiser's blocks
// live in host memory (pinned, for CUDA), and only a ring of device slots (two by default) holds
// any of them on the device. A block's weights are in a slot when it computes; the next swapped
// block's are copied into another slot meanwhile, one block ahead of compute, in forward and
// again in backward. In training the backward through a block reads its weights again, so block
// swap trains with gradient checkpointing: the recompute in backward is when the block is back.
// Frozen weights are never copied back (musubi-tuner's host-to-device-only scheme): the host copy
// is the only one kept. The adapters, norms, biases and float8 scales stay on the device: only
// the weight of each models::Linear and models::Conv2d travels, nearly all of a block's bytes.
//
// The copies and their order go through SwapDevice: on CUDA a copy stream and events; on the CPU
// the same machinery with the CPU as both device and host, copying synchronously, so a CPU run
// of --blocks_to_swap goes through every step but the streams (and a test can count them).
//
// For a swapped block b, in a pass going forward (or backward, the other way):
//   enter(b)  if b is in no slot, load it (a demand load); the compute waits for its copy
//             (wait_copied); then the next swapped block along the pass, if in no slot, is loaded
//             into another slot: the copy waits until the compute that last read that slot is
//             done (wait_used), the block there is evicted, the copy is issued and its end
//             recorded (copied).
//   leave(b)  the end of the compute reading b's slot is recorded (used).
// A slot is only ever loaded between a leave and the next enter's wait, so no copy overwrites
// weights a block still reads. An evicted block's weights are empty tensors on the device: a use
// outside enter/leave fails loudly rather than computing with stale weights.

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/Stream.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

namespace torch::nn {
class Module;
}

namespace lorapipe::models {

// Where swapped weights live and how they travel (the small device interface block swap runs on).
class SwapDevice {
 public:
  virtual ~SwapDevice() = default;
  virtual std::string name() const = 0;
  // The host copy of a weight (on the CPU when called): the tensor itself for the CPU, a pinned
  // copy for CUDA.
  virtual at::Tensor host(const at::Tensor& weight) = 0;
  // Said once before the host() calls: the bytes they will ask for in all (each weight rounded up
  // to 256), so pinned memory can be laid out for them and not much more.
  virtual void expect_host_bytes(int64_t /*bytes*/) {}
  // A device slot of `bytes` bytes (uint8).
  virtual at::Tensor slot(int64_t bytes) = 0;
  // dst (a view into a slot) = src (a host copy), issued on the copy stream.
  virtual void copy(const at::Tensor& dst, const at::Tensor& src) = 0;
  virtual void record_copied(int slot) = 0;  // on the copy stream, after the slot's copies
  virtual void wait_copied(int slot) = 0;    // the compute stream waits for that record
  virtual void record_used(int slot) = 0;    // on the compute stream, after a block's work
  virtual void wait_used(int slot) = 0;      // the copy stream waits for that record
  // Returns once every copy issued has landed and the compute that reads the slots is done:
  // before the slots go back to the allocator (a swap torn down by an exception may leave a
  // prefetch in flight).
  virtual void drain() {}
  // The stream the copies are issued on, where there is one (CUDA's): tests hold it back.
  virtual std::optional<c10::Stream> copy_stream() const { return std::nullopt; }
};

// The CPU's (synchronous copies) or a CUDA device's (a copy stream from torch's pool, events).
// Throws InputError for CUDA where this torch was built without it.
std::unique_ptr<SwapDevice> make_swap_device(c10::Device device);

// The pinned host arena CUDA's swap device opens for a weight of `weight` bytes when `to_come`
// more bytes are still to be placed: a power of two (LibTorch's pinned allocator rounds to one,
// so nothing is lost to it) of at least 1 MiB and the weight, grown toward what remains up to
// kPinnedArenaMax. Weights over a quarter of that are pinned alone.
inline constexpr int64_t kPinnedArenaMax = int64_t{1} << 30;
int64_t pinned_arena_bytes(int64_t weight, int64_t to_come);

// One step of the protocol, as trace() keeps it.
struct SwapEvent {
  enum class Kind { kLoad, kPrefetch, kEvict, kWaitCopied, kWaitUsed, kUsed };
  Kind kind;
  int block;  // the block's index in the list BlockSwap was given
  int slot;
  std::string str() const;  // "prefetch 5 -> slot 1"
};

// kohya's split of --blocks_to_swap for FLUX.1-like transformers: n / 2 double-stream blocks and
// (n - n / 2) * 2 single-stream blocks, the last ones of each list. Throws InputError naming the
// value where it would leave fewer than two blocks of a list on the device (kohya's bound: at
// most 35 for FLUX.1's 19 and 38 blocks). Returns the swapped indices into double blocks then
// single blocks, numbered in forward order (double i is i, single i is doubles + i).
std::vector<size_t> flux_swapped_blocks(int n, size_t doubles, size_t singles);

class BlockSwap {
 public:
  // `blocks`: the denoiser's blocks in forward order; `swapped`: which of them swap. Their frozen
  // weights move to the host now (call it on the CPU, before the model moves to its device: the
  // weights left in the blocks are empty, so the device never holds them). Throws Error for a
  // weight that takes gradients.
  BlockSwap(std::vector<torch::nn::Module*> blocks, std::vector<size_t> swapped,
            std::unique_ptr<SwapDevice> device, int slots = 2);
  ~BlockSwap();
  BlockSwap(const BlockSwap&) = delete;
  BlockSwap& operator=(const BlockSwap&) = delete;

  bool swaps(size_t block) const;
  void enter(size_t block, bool backward);
  void leave(size_t block, bool backward);

  int slots() const { return static_cast<int>(slot_buffers_.size()); }
  size_t swapped_count() const { return order_.size(); }
  int64_t host_bytes() const { return host_bytes_; }
  int64_t slot_bytes() const { return slot_bytes_; }
  int resident() const;
  int max_resident() const { return max_resident_; }
  void set_trace(bool on) { tracing_ = on; }
  const std::vector<SwapEvent>& trace() const { return trace_; }
  void clear_trace() { trace_.clear(); }
  // The host copy of `weight`, a weight this swap took (the module's own tensor, which is empty
  // or a slot's view meanwhile): the only copy of its values. Undefined for any other tensor.
  at::Tensor host_copy(const at::Tensor& weight) const;

 private:
  struct Weight {
    at::Tensor param;  // the layer's weight (shares its TensorImpl)
    at::Tensor host;
    int64_t offset = 0;  // in a slot, bytes
  };
  struct Block {
    std::vector<Weight> weights;
    int slot = -1;
    int64_t bytes = 0;
  };
  void load(int block, bool prefetch, int keep_slot);
  void evict(int block);
  void note(SwapEvent::Kind kind, int block, int slot);

  std::vector<Block> blocks_;  // every block; only the swapped ones have weights
  std::unordered_map<const void*, at::Tensor> host_of_;  // a swapped weight's TensorImpl: its host copy
  std::vector<int> order_;     // the swapped blocks, in forward order
  std::vector<int> position_;  // index into order_ per block, -1 if not swapped
  std::unique_ptr<SwapDevice> device_;
  std::vector<at::Tensor> slot_buffers_;
  std::vector<int> occupant_;       // per slot, the block in it or -1
  std::vector<uint64_t> last_use_;  // per slot, when it was last left
  uint64_t clock_ = 0;
  int64_t host_bytes_ = 0, slot_bytes_ = 0;
  int max_resident_ = 0;
  bool tracing_ = false;
  std::vector<SwapEvent> trace_;
};

}  // namespace lorapipe::models
