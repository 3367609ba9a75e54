#pragma once
// AdamW with blockwise 8-bit state (bitsandbytes' AdamW8bit / PagedAdamW8bit), on raw buffers.
// No LibTorch here: the CPU reference (adamw8bit_cpu.cpp) and the CUDA kernel (adamw8bit.cu)
// share this contract, and trainer/ wraps them in its Optimizer seam.
//
// State. A tensor of n >= kAdamW8bitMinNumel elements keeps each moment as n bytes plus one fp32
// absmax per block of kAdamW8bitBlock elements: byte b of the first moment m stands for
// dynamic_map_signed()[b] * absmax1[block], of the second moment v for
// dynamic_map_unsigned()[b] * absmax2[block] (2 bytes + 8/256 bytes per parameter). A smaller
// tensor keeps both moments in fp32, as bitsandbytes does (min_8bit_size 4096, strict `<`).
//
// One step, per element, with g the gradient (bitsandbytes' kOptimizerStatic8bit2StateBlockwise
// where not said otherwise):
//   1. m, v = dequantised with the block's current absmax (fp32 state: read as is).
//   2. if g is finite:  m = beta1 * m + (1 - beta1) * g;   v = beta2 * v + (1 - beta2) * g * g.
//      A NaN or Inf g leaves m and v at their old values and the parameter untouched (bitsandbytes'
//      CUDA kernel zeroes that element's moments instead; its CPU path lets the NaN spread).
//   3. absmax1/absmax2 = max |m|, max |v| over the block's elements (only the real ones: the
//      CUDA kernel of bitsandbytes also folds in the padding lanes of a partial last block).
//   4. if g is finite:  p = p * (1 - lr * weight_decay);
//                        p = p - (lr / c1) * m / (sqrt(v) / c2 + eps),
//      with c1 = 1 - beta1^t and c2 = sqrt(1 - beta2^t), from the fresh fp32 moments, computed
//      in fp32 and rounded once into the parameter's dtype.
//      Order: weight decay first, as torch.optim.AdamW (and bitsandbytes' CPU path) do it, so
//      lorapipe's AdamW8bit and AdamW differ only by the state's quantisation. bitsandbytes' CUDA
//      kernel decays after the update (p' = (p - u)(1 - lr wd)): that differs from ours by
//      lr * wd * u per step, a relative 1e-6 of the update at kohya's lr 1e-4 and wd 0.01, and for
//      fp16/bf16 parameters it rounds twice where we round once. Its eps is eps * c2 inside the
//      division with step size lr * c2 / c1: the same value, rounded differently.
//   5. Requantise: the byte whose code is nearest to m / absmax1 (v / absmax2); ties and values
//      on a rounded midpoint go to the lower code. A block whose absmax is 0 stores the code of
//      0 (bitsandbytes' CUDA kernel divides 0 by 0 there and stores byte 255 for m, which also
//      reads back as 0). First-moment sign fix, as bitsandbytes' CUDA kernel: when the nearest
//      code has the other sign than m (a small negative m next to the code 0), take the
//      neighbour on m's side, so a momentum never flips sign in storage.
//
// The CPU reference and the CUDA kernel evaluate these steps with the same fp32 operations in
// the same order (no fused multiply-add on either side: adamw8bit_cpu.cpp is built with
// -ffp-contract=off, the kernel with --fmad=false; IEEE division and square root on both), so
// their results are meant to be bit-identical; tests/gpu checks that.

#include <array>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace lorapipe::kernels {

inline constexpr int64_t kAdamW8bitBlock = 256;
// Tensors with fewer elements keep fp32 moments (bitsandbytes' min_8bit_size).
inline constexpr int64_t kAdamW8bitMinNumel = 4096;

// bitsandbytes functional.create_dynamic_map(signed=true) and (signed=false), bit for bit: 256
// ascending fp32 codes. Signed: 127 negatives, 0 at index 127, 1.0 at 255. Unsigned: 0 at index
// 0, 1.0 at 255.
const std::array<float, 256>& dynamic_map_signed();
const std::array<float, 256>& dynamic_map_unsigned();

enum class ParamDtype { kFloat32, kBFloat16, kFloat16 };

// Blocks (and absmax entries) of an 8-bit state for `numel` elements.
inline int64_t adamw8bit_blocks(int64_t numel) {
  return (numel + kAdamW8bitBlock - 1) / kAdamW8bitBlock;
}

// One parameter tensor. `param` and `grad` hold `numel` elements of the step's ParamDtype
// (contiguous). With `quantized` (numel >= kAdamW8bitMinNumel): state1/state2 are uint8[numel],
// absmax1/absmax2 float[adamw8bit_blocks(numel)]. Without: state1/state2 are float[numel] and
// the absmax pointers are unused. `grad` null: the tensor has no gradient this step (its LoRA
// module dropped by module_dropout), and it and its state are left alone, as torch's optimizers
// leave a parameter without one; a step's table keeps its place, so the CUDA plan's table keeps
// its size from step to step.
struct AdamW8bitTensor {
  void* param = nullptr;
  const void* grad = nullptr;
  void* state1 = nullptr;
  void* state2 = nullptr;
  float* absmax1 = nullptr;
  float* absmax2 = nullptr;
  int64_t numel = 0;
  bool quantized = false;
  int group = 0;  // which AdamW8bitStep (learning rate) applies: an index into the step's array
};

// Parameter groups one step can carry: kohya's block-wise learning rates make one per block (25
// on SD1.5's U-Net, 23 on SDXL's) beside the text encoders' (two on SDXL), and LoRA+ doubles
// each. The CUDA kernel takes their constants as one launch argument: 64 of them are 2 KiB, under
// the 4 KiB every CUDA version allows a kernel's arguments.
inline constexpr int kAdamW8bitMaxGroups = 64;

// The step's scalars, computed once on the host so both implementations use the same floats.
struct AdamW8bitStep {
  float beta1 = 0.9f, beta2 = 0.999f;
  float one_minus_beta1 = 0.1f, one_minus_beta2 = 0.001f;
  float eps = 1e-8f;
  float decay = 1.0f;       // 1 - lr * weight_decay
  float step_size = 0.f;    // lr / (1 - beta1^t)
  float correction2 = 1.f;  // sqrt(1 - beta2^t)
};

// The scalars of step `t` (1-based) for these hyperparameters (computed in double, then fp32).
AdamW8bitStep adamw8bit_step_constants(double lr, double beta1, double beta2, double eps,
                                       double weight_decay, int64_t t);

// CPU reference: updates every tensor in place, tensor i with group_steps[tensors[i].group]
// (`groups` entries, at most kAdamW8bitMaxGroups). Blocks run in parallel on `threads` threads
// (0: OpenMP's default); the result does not depend on the thread count.
void adamw8bit_step_cpu(const AdamW8bitTensor* tensors, size_t count, ParamDtype dtype,
                        const AdamW8bitStep* group_steps, size_t groups, int threads = 0);

// mid[k] = (code[k] + code[k + 1]) / 2 for k < 255, mid[255] = +inf: what the nearest-code search
// compares against (the CUDA kernel gets the same floats).
std::array<float, 256> code_midpoints(const std::array<float, 256>& code);

// Blockwise quantisation with the rule of step 5 (exposed for tests): x[n] -> bytes[n] and
// absmax[adamw8bit_blocks(n)]. `sign_fix` applies the first-moment sign fix (use with the signed
// map).
void quantize_blockwise_cpu(const float* x, int64_t n, const std::array<float, 256>& code,
                            bool sign_fix, uint8_t* bytes, float* absmax);
void dequantize_blockwise_cpu(const uint8_t* bytes, const float* absmax, int64_t n,
                              const std::array<float, 256>& code, float* x);

// ---- CUDA (adamw8bit.cu; only in a build with LORAPIPE_CUDA, see built_with_cuda()) ----

// Device-side copy of the tensor table and the quantisation maps for repeated steps over the
// same tensors: built once, then one kernel launch per step updates them all.
class AdamW8bitCudaPlan {
 public:
  // `tensors`: pointers into the memory of CUDA device `device` (-1: the current one). The
  // table and the maps are uploaded there, and every step launches there, whichever device was
  // current at the call (a rank on cuda:1 need not make it current first). Like
  // torch.cuda.set_device, the plan's calls leave `device` current: switching back would create a
  // context on the other device. Throws std::invalid_argument for a tensor's group out of range.
  AdamW8bitCudaPlan(const AdamW8bitTensor* tensors, size_t count, ParamDtype dtype, int device);
  ~AdamW8bitCudaPlan();
  AdamW8bitCudaPlan(const AdamW8bitCudaPlan&) = delete;
  AdamW8bitCudaPlan& operator=(const AdamW8bitCudaPlan&) = delete;

  // One launch on `stream` (a cudaStream_t; void* keeps CUDA headers out of this header) updates
  // every tensor, tensor i with group_steps[tensors[i].group]. Throws std::invalid_argument when
  // `groups` does not reach every tensor's group (as adamw8bit_step_cpu does).
  void step(const AdamW8bitStep* group_steps, size_t groups, void* stream) const;

  // The same tensors (count, sizes, groups, quantisation) at new addresses: a gradient allocated
  // anew by the next backward. Rewrites the table on `stream`, after the launches queued there
  // and before the next, with no allocation and no device-wide wait (building a plan anew costs
  // both, and near a full device its cudaMalloc, outside torch's cache, can fail). Throws
  // std::invalid_argument when the tensors are not the plan's.
  void retarget(const AdamW8bitTensor* tensors, size_t count, void* stream);

 private:
  void* table_ = nullptr;    // device AdamW8bitTensor[count]
  void* offsets_ = nullptr;  // device int64[count + 1]: first thread block of each tensor
  void* maps_ = nullptr;     // device float[4][256]: signed, unsigned codes and their midpoints
  size_t count_ = 0;
  int64_t blocks_ = 0;
  ParamDtype dtype_;
  int device_ = 0;
  int groups_ = 0;  // the tensors' largest group + 1: what a step's group_steps must cover
  std::vector<AdamW8bitTensor> layout_;  // the table as uploaded, for retarget's check
};

// Managed memory for paged optimizer state (cudaMallocManaged): it lives on the device while
// there is room and spills to host memory under pressure. Returns nullptr when the build has no
// CUDA. `prefetch_managed` moves it to `device` on `stream` before a step; it is a no-op where
// the device cannot access managed memory concurrently (then use plain device memory: see
// managed_memory_supported).
// Allocated with `device` current, so the pointer reports that device (from_blob checks it).
void* alloc_managed(size_t bytes, int device);
void free_managed(void* ptr);
bool managed_memory_supported(int device);
void prefetch_managed(const void* ptr, size_t bytes, int device, void* stream);

}  // namespace lorapipe::kernels
