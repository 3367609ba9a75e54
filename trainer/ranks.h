#pragma once
// Data-parallel trainer ranks: a c10d process group that the ranks join with the
// environment torchrun, Slurm (deploy/slurm/ranks.sh) and Kubernetes set: RANK, WORLD_SIZE,
// LOCAL_RANK, MASTER_ADDR, MASTER_PORT. Rank 0 hosts the rendezvous (a c10d TCPStore).
//
// How the trainer uses it (trainer.cpp): every rank draws the same global batch of
// train_batch_size x WORLD_SIZE samples from one bucket, with the same noise and timesteps, and
// computes its own rows; each rank's loss is its rows' sum over the global batch size, so the
// summed LoRA gradients (one flat buffer, all-reduced) are the global batch's mean, and every
// rank takes the same optimizer step. Rank 0 alone saves and publishes. A rank that dies makes
// the others' next reduction fail at once (its TCP connection closes): they stop with an error
// naming the lost rank, rank 0 first saving a state to resume from.
//
// The backend follows the device: NCCL for ranks on CUDA devices (the gradients stay on the GPU),
// where this build has it (LORAPIPE_NCCL: the torch wheel's libtorch_cuda and nvidia-nccl's
// nccl.h), Gloo otherwise. c10d's headers stay in ranks.cpp; the Gloo headers come from Debian's
// libgloo-dev (the torch wheel ships the library inside libtorch_cpu but not its headers).

#include <ATen/core/Tensor.h>

#include <chrono>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace lorapipe::trainer {

struct RankEnvironment {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
};

// Reads RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT (all unset: one rank). Throws
// InputError naming the variable when one is malformed, or WORLD_SIZE > 1 comes without RANK.
RankEnvironment rank_environment();

// The device a rank trains on. With several ranks and --device auto or cuda (no index), the GPU
// that LOCAL_RANK names, as torchrun, Slurm (deploy/slurm/ranks.sh) and Kubernetes start one
// rank per GPU of a host; otherwise what `spec` names (models::resolve_device). Throws
// InputError when LOCAL_RANK names a GPU this host does not have.
c10::Device rank_device(std::string_view spec, const RankEnvironment& env);

// The c10d backend for ranks on `device`: "nccl" on CUDA where this build has NCCL, else "gloo".
const char* rank_backend(const c10::Device& device);

// A reduction that failed because another rank is gone (or never came).
class RankLostError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class RankGroup {
 public:
  // Joins the group, with rank_backend(device); every rank must call this within `timeout`.
  // Throws RankLostError when the others do not come, InputError for a bad address.
  static std::unique_ptr<RankGroup> join(const RankEnvironment& env,
                                         std::chrono::milliseconds timeout,
                                         c10::Device device = c10::Device(c10::kCPU));
  ~RankGroup();

  int rank() const { return env_.rank; }
  int world_size() const { return env_.world_size; }
  const char* backend() const;

  // Sums the tensors over every rank, in place, as one flat fp32 buffer: on the device with
  // NCCL, through host memory with Gloo. Undefined tensors are left out of the buffer: every
  // rank must give the same tensors defined, or the ranks' buffers differ in length (the step
  // gives each missing gradient as zeros first, trainer/step.cpp).
  void sum(const std::vector<at::Tensor>& tensors);
  double sum(double value);

 private:
  struct Impl;
  RankGroup(RankEnvironment env, std::unique_ptr<Impl> impl);
  RankEnvironment env_;
  c10::Device device_ = c10::Device(c10::kCPU);  // where the reductions' buffers live
  std::unique_ptr<Impl> impl_;
};

}  // namespace lorapipe::trainer
