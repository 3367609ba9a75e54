#include "trainer/ranks.h"

// The torch wheel's libtorch_cpu is built with Gloo; its headers declare ProcessGroupGloo only
// under this macro, which the wheel's CMake config does not set.
#define USE_C10D_GLOO 1
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/torch.h>
// The wheel's libtorch_cuda holds ProcessGroupNCCL; its header declares it under this macro.
// LORAPIPE_NCCL is set by trainer/CMakeLists.txt where nccl.h was found.
#if defined(LORAPIPE_NCCL)
#define USE_C10D_NCCL 1
#include <c10/cuda/CUDAGuard.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include <cstdlib>
#include <string>

#include "common/error.h"
#include "models/device.h"

namespace lorapipe::trainer {
namespace {

int env_int(const char* name, int fallback) {
  const char* value = std::getenv(name);
  if (value == nullptr || *value == 0) return fallback;
  char* end = nullptr;
  const long parsed = std::strtol(value, &end, 10);
  if (*end != 0 || parsed < 0 || parsed > 1 << 20) {
    throw InputError(std::string(name) + "=" + value + " is not a rank number");
  }
  return static_cast<int>(parsed);
}

}  // namespace

RankEnvironment rank_environment() {
  RankEnvironment env;
  env.world_size = env_int("WORLD_SIZE", 1);
  if (env.world_size < 1) throw InputError("WORLD_SIZE must be at least 1");
  if (env.world_size > 1 && std::getenv("RANK") == nullptr) {
    throw InputError("WORLD_SIZE=" + std::to_string(env.world_size) +
                     " without RANK: start each trainer rank with its RANK (0.." +
                     std::to_string(env.world_size - 1) + ")");
  }
  env.rank = env_int("RANK", 0);
  if (env.rank >= env.world_size) {
    throw InputError("RANK=" + std::to_string(env.rank) + " is not below WORLD_SIZE=" +
                     std::to_string(env.world_size));
  }
  env.local_rank = env_int("LOCAL_RANK", 0);
  if (const char* addr = std::getenv("MASTER_ADDR"); addr != nullptr && *addr != 0) {
    env.master_addr = addr;
  }
  env.master_port = env_int("MASTER_PORT", 29500);
  if (env.master_port == 0 || env.master_port > 65535) {
    throw InputError("MASTER_PORT=" + std::to_string(env.master_port) + " is not a port");
  }
  return env;
}

c10::Device rank_device(std::string_view spec, const RankEnvironment& env) {
  if (env.world_size > 1 && (spec == "auto" || spec == "cuda")) {
    const int64_t gpus = static_cast<int64_t>(torch::cuda::device_count());
    if (gpus > 0) {
      if (env.local_rank >= gpus) {
        throw InputError("LOCAL_RANK=" + std::to_string(env.local_rank) + " but this host has " +
                         std::to_string(gpus) + " CUDA device(s): start at most one rank per GPU, " +
                         "or give each rank its --device=cuda:N");
      }
      return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(env.local_rank));
    }
  }
  return models::resolve_device(spec);
}

const char* rank_backend(const c10::Device& device) {
#if defined(LORAPIPE_NCCL)
  if (device.is_cuda()) return "nccl";
#endif
  return "gloo";
}

struct RankGroup::Impl {
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<c10d::Backend> group;
  // NCCL's wait() only orders the current stream after the collective unless given a timeout:
  // with one it blocks this thread and throws when the collective fails or outlasts it, so a
  // lost rank is a RankLostError here, as with Gloo, not a hang in the next .item().
  std::chrono::milliseconds wait_timeout{0};  // 0: c10d Work's kNoTimeout

  void wait(const c10::intrusive_ptr<c10d::Work>& work) const { work->wait(wait_timeout); }
};

RankGroup::RankGroup(RankEnvironment env, std::unique_ptr<Impl> impl)
    : env_(std::move(env)), impl_(std::move(impl)) {}
RankGroup::~RankGroup() = default;

std::unique_ptr<RankGroup> RankGroup::join(const RankEnvironment& env,
                                           std::chrono::milliseconds timeout, c10::Device device) {
  auto impl = std::make_unique<Impl>();
  const std::string backend = rank_backend(device);
  const std::string where = "rank " + std::to_string(env.rank) + " of " +
                            std::to_string(env.world_size) + " (" + backend + ", MASTER_ADDR=" +
                            env.master_addr + ", MASTER_PORT=" + std::to_string(env.master_port) +
                            ")";
  try {
    c10d::TCPStoreOptions store_options;
    store_options.port = static_cast<uint16_t>(env.master_port);
    store_options.isServer = env.rank == 0;
    store_options.numWorkers = env.world_size;
    store_options.waitWorkers = true;
    store_options.timeout = timeout;
    impl->store = c10::make_intrusive<c10d::TCPStore>(env.master_addr, store_options);
#if defined(LORAPIPE_NCCL)
    if (backend == "nccl") {
      // On a failed collective NCCL's watchdog aborts the communicators and leaves the process
      // to the caller (2: CleanUpOnly) rather than tearing it down (torch's default), so the
      // failure reaches sum() as an error and rank 0 saves its state. A value the user set wins.
      setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2", /*overwrite=*/0);
      auto options = c10d::ProcessGroupNCCL::Options::create();
      options->timeout = timeout;
      impl->wait_timeout = timeout;
      c10::cuda::CUDAGuard on(device);
      impl->group = c10::make_intrusive<c10d::ProcessGroupNCCL>(impl->store, env.rank,
                                                                env.world_size, options);
    }
#endif
    if (!impl->group) {
      auto options = c10d::ProcessGroupGloo::Options::create_default(timeout);
      options->devices = {c10d::ProcessGroupGloo::createDefaultDevice()};
      impl->group = c10::make_intrusive<c10d::ProcessGroupGloo>(impl->store, env.rank,
                                                                env.world_size, options);
    }
  } catch (const std::exception& e) {
    throw RankLostError(where + ": could not join the other ranks: " + e.what());
  }
  auto group = std::unique_ptr<RankGroup>(new RankGroup(env, std::move(impl)));
  // Gloo reduces host buffers; NCCL the device's own.
  group->device_ = backend == "nccl" ? device : c10::Device(c10::kCPU);
  return group;
}

const char* RankGroup::backend() const { return rank_backend(device_); }

void RankGroup::sum(const std::vector<at::Tensor>& tensors) {
  std::vector<at::Tensor> pieces;
  for (const at::Tensor& t : tensors) {
    pieces.push_back(t.defined() ? t.detach().to(device_, torch::kFloat32).reshape({-1})
                                 : at::Tensor());
  }
  int64_t total = 0;
  for (size_t i = 0; i < tensors.size(); ++i) total += tensors[i].defined() ? tensors[i].numel() : 0;
  std::vector<at::Tensor> flat = {
      torch::empty({total}, torch::TensorOptions().dtype(torch::kFloat32).device(device_))};
  int64_t at = 0;
  for (const at::Tensor& p : pieces) {
    if (!p.defined()) continue;
    flat[0].narrow(0, at, p.numel()).copy_(p);
    at += p.numel();
  }
  try {
    impl_->wait(impl_->group->allreduce(flat));
  } catch (const std::exception& e) {
    throw RankLostError("rank " + std::to_string(env_.rank) + ": another trainer rank is gone (" +
                        std::string(e.what()).substr(0, 300) + ")");
  }
  at = 0;
  for (const at::Tensor& t : tensors) {
    if (!t.defined()) continue;
    at::Tensor(t).copy_(flat[0].narrow(0, at, t.numel()).view(t.sizes()));
    at += t.numel();
  }
}

double RankGroup::sum(double value) {
  std::vector<at::Tensor> one = {
      torch::full({1}, value, torch::TensorOptions().dtype(torch::kFloat64).device(device_))};
  try {
    impl_->wait(impl_->group->allreduce(one));
  } catch (const std::exception& e) {
    throw RankLostError("rank " + std::to_string(env_.rank) + ": another trainer rank is gone (" +
                        std::string(e.what()).substr(0, 300) + ")");
  }
  return one[0].item<double>();
}

}  // namespace lorapipe::trainer
