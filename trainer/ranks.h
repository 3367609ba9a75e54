#pragma once
// Data-parallel trainer ranks: a c10d process group (Gloo) that the ranks join with the
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
// c10d's headers stay in ranks.cpp; the Gloo headers come from Debian's libgloo-dev (the torch
// wheel ships the library inside libtorch_cpu but not its headers).

#include <ATen/core/Tensor.h>

#include <chrono>
#include <memory>
#include <string>
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

// A reduction that failed because another rank is gone (or never came).
class RankLostError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class RankGroup {
 public:
  // Joins the group; every rank must call this within `timeout`. Throws RankLostError when the
  // others do not come, InputError for a bad address.
  static std::unique_ptr<RankGroup> join(const RankEnvironment& env,
                                         std::chrono::milliseconds timeout);
  ~RankGroup();

  int rank() const { return env_.rank; }
  int world_size() const { return env_.world_size; }

  // Sums the tensors over every rank, in place, as one flat fp32 buffer (device tensors travel
  // through host memory). Undefined tensors count as zeros and stay undefined.
  void sum(const std::vector<at::Tensor>& tensors);
  double sum(double value);

 private:
  struct Impl;
  RankGroup(RankEnvironment env, std::unique_ptr<Impl> impl);
  RankEnvironment env_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace lorapipe::trainer
