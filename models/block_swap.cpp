#include "models/block_swap.h"

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <iterator>

#if __has_include(<c10/cuda/CUDAStream.h>) && __has_include(<ATen/cuda/CUDAEvent.h>)
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#define LORAPIPE_SWAP_CUDA 1
#endif

#include "common/error.h"
#include "models/linear.h"

namespace lorapipe::models {
namespace {

// Each weight starts at a multiple of this in its slot: every dtype's alignment, and the CUDA
// allocator's.
constexpr int64_t kAlign = 256;

class CpuSwapDevice : public SwapDevice {
 public:
  std::string name() const override { return "cpu"; }
  // The host copy lives outside LibTorch's allocator (the process's heap, as a GPU's host memory
  // is outside its device allocator), so that on the CPU the allocated-tensor counter
  // (models/tensor_memory.h) sees what CUDA's would: the slots and the resident weights, not the
  // host copies.
  at::Tensor host(const at::Tensor& weight) override {
    const at::Tensor w = weight.detach().contiguous();
    void* bytes = std::malloc(std::max<size_t>(w.nbytes(), 1));
    if (bytes == nullptr) throw Error("block swap: no host memory for a weight");
    std::memcpy(bytes, w.data_ptr(), w.nbytes());
    return at::from_blob(bytes, w.sizes(), [](void* p) { std::free(p); }, w.options());
  }
  at::Tensor slot(int64_t bytes) override { return at::empty({bytes}, at::kByte); }
  void copy(const at::Tensor& dst, const at::Tensor& src) override {
    at::Tensor out = dst;
    out.copy_(src);
  }
  // One stream: every copy is done when issued, and every use before the next copy.
  void record_copied(int) override {}
  void wait_copied(int) override {}
  void record_used(int) override {}
  void wait_used(int) override {}
};

#ifdef LORAPIPE_SWAP_CUDA
class CudaSwapDevice : public SwapDevice {
 public:
  explicit CudaSwapDevice(c10::Device device)
      : index_(device.has_index() ? device.index() : c10::cuda::current_device()),
        copy_(c10::cuda::getStreamFromPool(/*isHighPriority=*/false, index_)) {}
  std::string name() const override { return "cuda:" + std::to_string(index_); }
  // Pinned, so the copy stream's copies are asynchronous. Packed into arenas rather than pinned
  // one by one: LibTorch's pinned allocator rounds every allocation up to a power of two, which
  // would page-lock a third more host memory than FLUX.1's blocks hold (a 132 MB weight takes
  // 256 MiB). An arena is a power of two itself (pinned_arena_bytes); each weight is a view at
  // an aligned offset of the first arena with room.
  void expect_host_bytes(int64_t bytes) override { to_come_ = bytes; }
  at::Tensor host(const at::Tensor& weight) override {
    const at::Tensor w = weight.detach().contiguous();
    const int64_t bytes = static_cast<int64_t>(w.nbytes());
    const int64_t aligned = (bytes + kAlign - 1) / kAlign * kAlign;
    to_come_ = std::max<int64_t>(to_come_ - aligned, 0);
    if (bytes > kPinnedArenaMax / 4) return w.to(at::kCPU).pin_memory();  // this large: alone
    auto arena = std::find_if(arenas_.begin(), arenas_.end(), [&](const Arena& a) {
      return a.used + bytes <= a.memory.numel();
    });
    if (arena == arenas_.end()) {
      const int64_t size = pinned_arena_bytes(aligned, to_come_);
      arenas_.push_back({at::empty({size}, at::TensorOptions().dtype(at::kByte).pinned_memory(true)), 0});
      arena = std::prev(arenas_.end());
    }
    at::Tensor view = arena->memory.narrow(0, arena->used, bytes).view(w.scalar_type()).view(w.sizes());
    arena->used += aligned;
    view.copy_(w);
    return view;
  }
  at::Tensor slot(int64_t bytes) override {
    copied_.push_back(std::make_unique<at::cuda::CUDAEvent>());
    used_.push_back(std::make_unique<at::cuda::CUDAEvent>());
    at::Tensor memory =
        at::empty({bytes}, at::TensorOptions().dtype(at::kByte).device(at::kCUDA, index_));
    // The allocator may hand back a block the compute stream freed and still uses: safe for that
    // stream alone. The copy stream waits for the compute queued so far before its first copy
    // into the slot (load() waits on a slot's "used" event only once a block has occupied it).
    used_.back()->record(compute());
    used_.back()->block(copy_);
    return memory;
  }
  void copy(const at::Tensor& dst, const at::Tensor& src) override {
    // The slots live as long as the swap: memory the copy stream writes is never freed under it.
    c10::cuda::CUDAStreamGuard guard(copy_);
    at::Tensor out = dst;
    out.copy_(src, /*non_blocking=*/true);
  }
  void record_copied(int slot) override { copied_.at(slot)->record(copy_); }
  void wait_copied(int slot) override { copied_.at(slot)->block(compute()); }
  void record_used(int slot) override { used_.at(slot)->record(compute()); }
  void wait_used(int slot) override { used_.at(slot)->block(copy_); }
  std::optional<c10::Stream> copy_stream() const override { return copy_.unwrap(); }
  void drain() override {  // the copies, and the compute that may still read the slots
    copy_.synchronize();
    compute().synchronize();
  }

 private:
  struct Arena {
    at::Tensor memory;  // pinned_arena_bytes() pinned bytes
    int64_t used;
  };
  c10::cuda::CUDAStream compute() const { return c10::cuda::getCurrentCUDAStream(index_); }
  std::vector<Arena> arenas_;
  int64_t to_come_ = 0;  // host bytes still to be asked for (expect_host_bytes)
  c10::DeviceIndex index_;
  c10::cuda::CUDAStream copy_;
  std::vector<std::unique_ptr<at::cuda::CUDAEvent>> copied_, used_;
};
#endif

}  // namespace

int64_t pinned_arena_bytes(int64_t weight, int64_t to_come) {
  int64_t size = int64_t{1} << 20;
  while (size < weight) size *= 2;
  while (size < kPinnedArenaMax && size < weight + to_come) size *= 2;
  return size;
}

std::unique_ptr<SwapDevice> make_swap_device(c10::Device device) {
  if (device.is_cpu()) return std::make_unique<CpuSwapDevice>();
#ifdef LORAPIPE_SWAP_CUDA
  if (device.is_cuda()) return std::make_unique<CudaSwapDevice>(device);
#endif
  throw InputError("--blocks_to_swap on " + device.str() +
                   ": block swap runs on the CPU and on CUDA devices");
}

std::string SwapEvent::str() const {
  const std::string b = std::to_string(block), s = std::to_string(slot);
  switch (kind) {
    case Kind::kLoad:
      return "load " + b + " -> slot " + s;
    case Kind::kPrefetch:
      return "prefetch " + b + " -> slot " + s;
    case Kind::kEvict:
      return "evict " + b + " from slot " + s;
    case Kind::kWaitCopied:
      return "wait copied " + b + " in slot " + s;
    case Kind::kWaitUsed:
      return "wait used slot " + s + " by " + b;
    case Kind::kUsed:
      return "used " + b + " in slot " + s;
  }
  return "?";
}

std::vector<size_t> flux_swapped_blocks(int n, size_t doubles, size_t singles) {
  auto fits = [&](int k) {
    const auto d = static_cast<size_t>(k / 2), s = static_cast<size_t>((k - k / 2) * 2);
    return d + 2 <= doubles && s + 2 <= singles;
  };
  if (n < 0) throw InputError("--blocks_to_swap=" + std::to_string(n) + ": must be 0 or more");
  if (!fits(n)) {
    int most = 0;
    while (fits(most + 1)) ++most;
    throw InputError("--blocks_to_swap=" + std::to_string(n) + ": n / 2 of the " +
                     std::to_string(doubles) + " double blocks and (n - n / 2) * 2 of the " +
                     std::to_string(singles) +
                     " single blocks swap, as kohya splits it, and two "
                     "of each stay on the device: at most " +
                     std::to_string(most));
  }
  std::vector<size_t> out;
  const auto d = static_cast<size_t>(n / 2), s = static_cast<size_t>((n - n / 2) * 2);
  for (size_t i = doubles - d; i < doubles; ++i) out.push_back(i);
  for (size_t i = singles - s; i < singles; ++i) out.push_back(doubles + i);
  return out;
}

BlockSwap::BlockSwap(std::vector<torch::nn::Module*> blocks, std::vector<size_t> swapped,
                     std::unique_ptr<SwapDevice> device, int slots)
    : blocks_(blocks.size()), position_(blocks.size(), -1), device_(std::move(device)) {
  if (slots < 2) throw Error("block swap needs two slots or more, not " + std::to_string(slots));
  std::sort(swapped.begin(), swapped.end());
  swapped.erase(std::unique(swapped.begin(), swapped.end()), swapped.end());
  torch::NoGradGuard no_grad;
  // The frozen weights that swap: every Linear's and Conv2d's of the swapped blocks.
  auto for_each_weight = [&](size_t b, const std::function<void(at::Tensor&, const std::string&)>& f) {
    for (const auto& item : blocks[b]->named_modules()) {
      if (auto linear = std::dynamic_pointer_cast<LinearImpl>(item.value())) {
        f(linear->weight, item.key() + ".weight");
      } else if (auto conv = std::dynamic_pointer_cast<Conv2dImpl>(item.value())) {
        f(conv->weight, item.key() + ".weight");
      }
    }
  };
  int64_t expected = 0;
  for (const size_t b : swapped) {
    if (b >= blocks.size()) throw Error("block swap: no block " + std::to_string(b));
    for_each_weight(b, [&](at::Tensor& weight, const std::string&) {
      if (weight.defined()) expected += (static_cast<int64_t>(weight.nbytes()) + kAlign - 1) / kAlign * kAlign;
    });
  }
  device_->expect_host_bytes(expected);
  for (const size_t b : swapped) {
    position_[b] = static_cast<int>(order_.size());
    order_.push_back(static_cast<int>(b));
    Block& block = blocks_[b];
    auto take = [&](at::Tensor& weight, const std::string& name) {
      if (!weight.defined() || weight.numel() == 0) return;
      if (weight.requires_grad()) {
        throw Error("block swap: " + name + " of block " + std::to_string(b) +
                    " takes gradients; only frozen weights swap");
      }
      Weight w;
      w.param = weight;
      w.host = device_->host(weight);
      w.offset = (block.bytes + kAlign - 1) / kAlign * kAlign;
      block.bytes = w.offset + static_cast<int64_t>(weight.nbytes());
      host_bytes_ += static_cast<int64_t>(weight.nbytes());
      weight.set_data(at::empty({0}, weight.options()));
      host_of_.emplace(weight.unsafeGetTensorImpl(), w.host);
      block.weights.push_back(std::move(w));
    };
    for_each_weight(b, take);
    slot_bytes_ = std::max(slot_bytes_, block.bytes);
  }
  if (order_.empty()) return;
  for (int s = 0; s < slots; ++s) slot_buffers_.push_back(device_->slot(slot_bytes_));
  occupant_.assign(static_cast<size_t>(slots), -1);
  last_use_.assign(static_cast<size_t>(slots), 0);
}

BlockSwap::~BlockSwap() {
  try {
    if (device_) device_->drain();
  } catch (const std::exception&) {  // a destructor does not throw; the device is failing anyway
  }
}

bool BlockSwap::swaps(size_t block) const {
  return block < position_.size() && position_[block] >= 0;
}

at::Tensor BlockSwap::host_copy(const at::Tensor& weight) const {
  const auto found = host_of_.find(weight.unsafeGetTensorImpl());
  return found == host_of_.end() ? at::Tensor() : found->second;
}

int BlockSwap::resident() const {
  return static_cast<int>(
      std::count_if(occupant_.begin(), occupant_.end(), [](int b) { return b >= 0; }));
}

void BlockSwap::note(SwapEvent::Kind kind, int block, int slot) {
  if (tracing_) trace_.push_back(SwapEvent{kind, block, slot});
}

void BlockSwap::evict(int block) {
  Block& b = blocks_[static_cast<size_t>(block)];
  note(SwapEvent::Kind::kEvict, block, b.slot);
  for (Weight& w : b.weights) w.param.set_data(at::empty({0}, w.param.options()));
  occupant_[static_cast<size_t>(b.slot)] = -1;
  b.slot = -1;
}

void BlockSwap::load(int block, bool prefetch, int keep_slot) {
  // An empty slot first, else the one left longest ago; never `keep_slot` (the block entering).
  int slot = -1;
  for (int s = 0; s < slots(); ++s) {
    if (s == keep_slot) continue;
    if (occupant_[static_cast<size_t>(s)] < 0) {
      slot = s;
      break;
    }
    if (slot < 0 || last_use_[static_cast<size_t>(s)] < last_use_[static_cast<size_t>(slot)]) {
      slot = s;
    }
  }
  const int previous = occupant_[static_cast<size_t>(slot)];
  if (previous >= 0) {
    note(SwapEvent::Kind::kWaitUsed, previous, slot);
    device_->wait_used(slot);
    evict(previous);
  }
  note(prefetch ? SwapEvent::Kind::kPrefetch : SwapEvent::Kind::kLoad, block, slot);
  Block& b = blocks_[static_cast<size_t>(block)];
  const at::Tensor& buffer = slot_buffers_[static_cast<size_t>(slot)];
  torch::NoGradGuard no_grad;
  for (Weight& w : b.weights) {
    const at::Tensor view = buffer.narrow(0, w.offset, static_cast<int64_t>(w.host.nbytes()))
                                .view(w.host.scalar_type())
                                .view(w.host.sizes());
    device_->copy(view, w.host);
    w.param.set_data(view);
  }
  device_->record_copied(slot);
  occupant_[static_cast<size_t>(slot)] = block;
  b.slot = slot;
  max_resident_ = std::max(max_resident_, resident());
}

void BlockSwap::enter(size_t block, bool backward) {
  if (!swaps(block)) return;
  const int b = static_cast<int>(block);
  Block& self = blocks_[block];
  if (self.slot < 0) load(b, /*prefetch=*/false, /*keep_slot=*/-1);
  note(SwapEvent::Kind::kWaitCopied, b, self.slot);
  device_->wait_copied(self.slot);
  // The next swapped block along this pass, into another slot, while this one computes.
  const int next = position_[block] + (backward ? -1 : 1);
  if (next < 0 || next >= static_cast<int>(order_.size())) return;
  const int ahead = order_[static_cast<size_t>(next)];
  if (blocks_[static_cast<size_t>(ahead)].slot < 0) load(ahead, /*prefetch=*/true, self.slot);
}

void BlockSwap::leave(size_t block, bool /*backward*/) {
  if (!swaps(block)) return;
  const int slot = blocks_[block].slot;
  note(SwapEvent::Kind::kUsed, static_cast<int>(block), slot);
  device_->record_used(slot);
  last_use_[static_cast<size_t>(slot)] = ++clock_;
}

}  // namespace lorapipe::models
