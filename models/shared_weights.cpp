#include "models/shared_weights.h"

#include <ATen/ATen.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <torch/cuda.h>
#include <torch/nn/module.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <exception>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#if __has_include(<c10/cuda/CUDACachingAllocator.h>) && __has_include(<c10/cuda/CUDAGuard.h>)
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#define LORAPIPE_SHARED_WEIGHTS_CUDA 1
#endif

#include "common/error.h"
#include "common/log.h"
#include "kernels/cuda_device.h"
#include "models/placement.h"

namespace lorapipe::models {
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

constexpr char kLog[] = "shared-weights";
constexpr int64_t kAlign = 64;  // each tensor's place in the CPU region: cache-line aligned

// "cuda" as the device it means now: the manifest names the publisher's device by its index, and
// a tensor's device always has one.
c10::Device with_index(const c10::Device& device) {
  if (!device.is_cuda() || device.has_index()) return device;
  return c10::Device(c10::kCUDA, at::detail::getCUDAHooks().current_device());
}

// Every parameter and buffer, by its dotted name (parameters first, as named_parameters lists).
std::vector<std::pair<std::string, at::Tensor>> tensors_of(torch::nn::Module& module) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& p : module.named_parameters(/*recurse=*/true)) out.emplace_back(p.key(), p.value());
  for (const auto& b : module.named_buffers(/*recurse=*/true)) {
    if (b.value().defined()) out.emplace_back(b.key(), b.value());
  }
  return out;
}

std::string hex(const std::string& bytes) {
  static const char digits[] = "0123456789abcdef";
  std::string out;
  out.reserve(bytes.size() * 2);
  for (unsigned char c : bytes) {
    out.push_back(digits[c >> 4]);
    out.push_back(digits[c & 15]);
  }
  return out;
}

std::string unhex(const std::string& text) {
  std::string out;
  for (size_t i = 0; i + 1 < text.size(); i += 2) {
    out.push_back(static_cast<char>(std::stoi(text.substr(i, 2), nullptr, 16)));
  }
  return out;
}

void write_whole(const fs::path& path, const std::string& text) {
  const fs::path tmp = path.string() + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out << text;
    if (!out.flush()) throw InputError(tmp.string() + ": cannot write: " + std::strerror(errno));
  }
  fs::rename(tmp, path);
}

// Rewrites the file behind `fd` with `text` (under the caller's exclusive lock: readers take the
// shared lock before they read, so none sees it half written).
void rewrite_locked(int fd, const std::string& text) {
  if (ftruncate(fd, 0) != 0 || pwrite(fd, text.data(), text.size(), 0) !=
                                   static_cast<ssize_t>(text.size())) {
    LP_LOG(kWarning, kLog) << "cannot mark the shared weights released: " << std::strerror(errno);
  }
  fsync(fd);
}

std::string read_fd(int fd) {
  std::string text;
  char buffer[65536];
  off_t at = 0;
  for (;;) {
    const ssize_t n = pread(fd, buffer, sizeof(buffer), at);
    if (n <= 0) break;
    text.append(buffer, static_cast<size_t>(n));
    at += n;
  }
  return text;
}

struct CpuRegion {
  void* data = MAP_FAILED;
  size_t bytes = 0;
  ~CpuRegion() {
    if (data != MAP_FAILED) munmap(data, bytes);
  }
};

}  // namespace

std::string shared_weights_key(const fs::path& model, const Placement& placement) {
  std::ostringstream key;
  std::error_code ec;
  const fs::path absolute = fs::absolute(model, ec);
  key << (ec ? model : absolute).string();
  if (fs::is_regular_file(model, ec)) {
    key << " " << fs::file_size(model, ec) << " "
        << fs::last_write_time(model, ec).time_since_epoch().count();
  }
  key << " " << c10::toString(placement.dtype) << (placement.fp8_denoiser ? " fp8" : "")
      << (placement.fp8_scaled ? " scaled" : "") << (placement.fp8_fast ? " fast" : "");
  return key.str();
}

SharedWeightsPublisher::SharedWeightsPublisher(torch::nn::Module& module, const c10::Device& given,
                                               const fs::path& manifest, const std::string& key)
    : manifest_(manifest) {
  const c10::Device device = with_index(given);
  torch::NoGradGuard no_grad;
  const auto tensors = tensors_of(module);
  for (const auto& [name, t] : tensors) {
    if (t.device() != device) {
      throw InputError("shared weights: " + name + " is on " + t.device().str() + ", not " +
                       device.str() + " (block swap keeps weights in host memory: a sampler "
                       "cannot share them; it renders after the training instead)");
    }
  }
  json doc = {{"version", 1}, {"state", "shared"}, {"pid", static_cast<int64_t>(getpid())},
              {"device", device.str()}, {"key", key}};
  // The GPU itself, for the attaching process to check: the index alone names another GPU in a
  // process that CUDA_VISIBLE_DEVICES orders differently. Empty where kernels/ has no CUDA.
  if (device.is_cuda()) doc["device_uuid"] = kernels::cuda_device_uuid(device.index());
  json entries = json::array();
  if (device.is_cpu()) {
    int64_t total = 0;
    std::vector<int64_t> offsets;
    for (const auto& [name, t] : tensors) {
      offsets.push_back(total);
      total += (static_cast<int64_t>(t.nbytes()) + kAlign - 1) / kAlign * kAlign;
    }
    memfd_ = memfd_create("lorapipe-shared-weights", MFD_CLOEXEC);
    if (memfd_ < 0 || ftruncate(memfd_, std::max<int64_t>(total, 1)) != 0) {
      throw InputError(std::string("shared weights: no shared memory for them: ") +
                       std::strerror(errno));
    }
    auto region = std::make_shared<CpuRegion>();
    region->bytes = static_cast<size_t>(std::max<int64_t>(total, 1));
    region->data = mmap(nullptr, region->bytes, PROT_READ | PROT_WRITE, MAP_SHARED, memfd_, 0);
    if (region->data == MAP_FAILED) {
      throw InputError(std::string("shared weights: cannot map them: ") + std::strerror(errno));
    }
    for (size_t i = 0; i < tensors.size(); ++i) {
      const auto& [name, t] = tensors[i];
      char* at_ = static_cast<char*>(region->data) + offsets[i];
      at::Tensor view = at::from_blob(
          at_, t.sizes(), [region](void*) {}, t.options().requires_grad(false));
      view.copy_(t);
      // The publisher's own tensor becomes the view: one copy on the machine.
      const bool grad = t.requires_grad();
      at::Tensor(t).set_data(view);
      at::Tensor(t).requires_grad_(grad);
      entries.push_back({{"name", name}, {"dtype", c10::toString(t.scalar_type())},
                         {"sizes", t.sizes().vec()}, {"offset", offsets[i]}});
      bytes_ += static_cast<int64_t>(t.nbytes());
    }
    region_ = region;
    doc["backend"] = "memfd";
    doc["fd"] = memfd_;
    doc["bytes"] = total;
  } else {
#ifdef LORAPIPE_SHARED_WEIGHTS_CUDA
    // CUDA IPC shares what cudaMalloc allocated. Expandable segments map memory through the
    // driver's virtual-memory API instead (their handles travel as file descriptors, which
    // sibling processes may not take from each other), and cudaMallocAsync has no IPC handles in
    // LibTorch: refused by name rather than failing in the sampler.
    if (c10::cuda::CUDACachingAllocator::CUDAAllocatorConfig::expandable_segments() ||
        c10::cuda::CUDACachingAllocator::name() != "native") {
      throw InputError(
          "shared weights on " + device.str() + ": PYTORCH_ALLOC_CONF (or "
          "PYTORCH_CUDA_ALLOC_CONF) sets " +
          std::string(c10::cuda::CUDACachingAllocator::name() != "native"
                          ? "backend:" + c10::cuda::CUDACachingAllocator::name()
                          : "expandable_segments:True") +
          ", whose memory CUDA IPC cannot hand to the sampler: unset it, or render the previews "
          "after the training (--sample_after_training)");
    }
    const c10::cuda::CUDAGuard guard(device);  // the handles are taken on the weights' device
    torch::cuda::synchronize(device.index() < 0 ? 0 : device.index());  // placed, all of it
    for (const auto& [name, t] : tensors) {
      if (t.nbytes() == 0) {  // no memory, no block: nothing to share
        entries.push_back({{"name", name}, {"dtype", c10::toString(t.scalar_type())},
                           {"sizes", t.sizes().vec()}, {"strides", t.strides().vec()},
                           {"handle", ""}, {"offset", 0}});
        continue;
      }
      const c10::cuda::CUDACachingAllocator::ShareableHandle handle =
          c10::cuda::CUDACachingAllocator::shareIpcHandle(t.storage().mutable_data());
      entries.push_back(
          {{"name", name}, {"dtype", c10::toString(t.scalar_type())}, {"sizes", t.sizes().vec()},
           {"strides", t.strides().vec()}, {"handle", hex(handle.handle)},
           {"offset", static_cast<int64_t>(handle.offset) +
                          t.storage_offset() * static_cast<int64_t>(t.element_size())}});
      bytes_ += static_cast<int64_t>(t.nbytes());
    }
    doc["backend"] = "cuda_ipc";
#else
    throw InputError("shared weights on " + device.str() + ": this build has no CUDA");
#endif
  }
  tensors_ = static_cast<int64_t>(tensors.size());
  doc["tensors"] = std::move(entries);
  write_whole(manifest_, doc.dump());
  LP_LOG(kInfo, kLog) << "published " << tensors_ << " base weights ("
                      << bytes_ / (1 << 20) << " MiB) on " << device.str() << " in "
                      << manifest_.string() << " for a sampler on the same "
                      << (device.is_cpu() ? "machine" : "device");
}

SharedWeightsPublisher::~SharedWeightsPublisher() {
  try {
    release(/*wait=*/std::uncaught_exceptions() == 0);
  } catch (const std::exception& e) {
    LP_LOG(kWarning, kLog) << "releasing the shared weights: " << e.what();
  }
}

void SharedWeightsPublisher::release(bool wait) {
  if (released_) return;
  released_ = true;
  const int fd = open(manifest_.c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) return;  // removed: nobody can attach
  const bool unused = flock(fd, LOCK_EX | LOCK_NB) == 0;
  if (!unused && !wait) {
    LP_LOG(kWarning, kLog) << "a sampler still renders over the shared weights; this failed "
                              "run frees them now, and its renders fail";
  } else if (!unused) {
    LP_LOG(kInfo, kLog) << "waiting for the sampler rendering from the shared weights to finish "
                           "before they are freed";
    while (flock(fd, LOCK_EX) != 0 && errno == EINTR) {
    }
  }
  rewrite_locked(fd, json{{"version", 1}, {"state", "released"}}.dump());
  close(fd);  // the lock goes with it
}

SharedWeightsAttachment::~SharedWeightsAttachment() {
  if (lock_fd_ >= 0) close(lock_fd_);
}

std::unique_ptr<SharedWeightsAttachment> attach_shared_weights(
    torch::nn::Module& module, const c10::Device& given, const fs::path& manifest,
    const std::string& key, const std::function<void()>& waiting) {
  const c10::Device device = with_index(given);
  int fd = -1;
  for (bool said = false;; ) {
    fd = open(manifest.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd >= 0) break;
    if (!said) {
      LP_LOG(kInfo, kLog) << "waiting for the trainer's shared weights (" << manifest.string()
                          << ")";
      said = true;
    }
    if (waiting) waiting();
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  std::unique_ptr<SharedWeightsAttachment> attachment(new SharedWeightsAttachment());
  attachment->lock_fd_ = fd;  // closed with the attachment, or below
  while (flock(fd, LOCK_SH) != 0 && errno == EINTR) {
  }
  json doc;
  try {
    doc = json::parse(read_fd(fd));
  } catch (const json::exception& e) {
    throw InputError(manifest.string() + ": not a shared-weights manifest: " + e.what());
  }
  if (doc.value("state", "") == "released") {
    LP_LOG(kInfo, kLog) << manifest.string() << ": the trainer has released its weights";
    return nullptr;
  }
  const pid_t pid = static_cast<pid_t>(doc.value("pid", 0));
  if (pid <= 0 || (kill(pid, 0) != 0 && errno == ESRCH)) {
    LP_LOG(kInfo, kLog) << manifest.string() << ": the process that published it (pid " << pid
                        << ") is gone";
    return nullptr;
  }
  if (doc.value("key", "") != key) {
    throw InputError(manifest.string() + ": the trainer's weights are of '" +
                     doc.value("key", "") + "', this sampler's of '" + key +
                     "': give both the same model, --mixed_precision and float8 flags");
  }
  const std::string backend = doc.value("backend", "");
  const c10::Device theirs(doc.value("device", "cpu"));
  if (theirs != device) {
    throw InputError(manifest.string() + ": the weights are on " + theirs.str() + ", this sampler's "
                     "device is " + device.str());
  }
  if (device.is_cuda()) {
    const std::string their_gpu = doc.value("device_uuid", "");
    const std::string our_gpu = kernels::cuda_device_uuid(device.index());
    if (!their_gpu.empty() && !our_gpu.empty() && their_gpu != our_gpu) {
      throw InputError(manifest.string() + ": the trainer's " + theirs.str() + " is " + their_gpu +
                       ", this sampler's " + device.str() + " is " + our_gpu +
                       ": the two processes number the GPUs differently (give both the same "
                       "CUDA_VISIBLE_DEVICES)");
    }
  }
  std::map<std::string, const json*> by_name;
  for (const json& e : doc.at("tensors")) by_name[e.at("name").get<std::string>()] = &e;
  const auto tensors = tensors_of(module);
  if (tensors.size() != by_name.size()) {
    throw InputError(manifest.string() + ": " + std::to_string(by_name.size()) +
                     " shared tensors, this model has " + std::to_string(tensors.size()));
  }
  for (const auto& [name, t] : tensors) {
    const auto it = by_name.find(name);
    if (it == by_name.end()) {
      throw InputError(manifest.string() + ": no shared tensor " + name);
    }
    const json& e = *it->second;
    if (e.at("dtype").get<std::string>() != c10::toString(t.scalar_type()) ||
        e.at("sizes").get<std::vector<int64_t>>() != t.sizes().vec()) {
      throw InputError(manifest.string() + ": " + name + " is " + e.at("dtype").get<std::string>() +
                       " " + e.at("sizes").dump() + " there, " + c10::toString(t.scalar_type()) +
                       " " + json(t.sizes().vec()).dump() + " here");
    }
  }
  torch::NoGradGuard no_grad;
  if (backend == "memfd") {
    const std::string path = "/proc/" + std::to_string(pid) + "/fd/" +
                             std::to_string(doc.at("fd").get<int>());
    const int memfd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (memfd < 0) {
      throw InputError(path + " (the trainer's shared weights): " + std::strerror(errno));
    }
    auto region = std::make_shared<CpuRegion>();
    region->bytes = static_cast<size_t>(std::max<int64_t>(doc.at("bytes").get<int64_t>(), 1));
    region->data = mmap(nullptr, region->bytes, PROT_READ, MAP_SHARED, memfd, 0);
    close(memfd);  // the mapping keeps the memory
    if (region->data == MAP_FAILED) {
      throw InputError(path + ": cannot map the trainer's shared weights: " + std::strerror(errno));
    }
    for (const auto& [name, t] : tensors) {
      const json& e = *by_name.at(name);
      char* data = static_cast<char*>(region->data) + e.at("offset").get<int64_t>();
      at::Tensor(t).set_data(at::from_blob(data, t.sizes(), [region](void*) {},
                                           t.options().requires_grad(false)));
      attachment->bytes_ += static_cast<int64_t>(t.nbytes());
    }
    // A mapping outlives the memfd's creator: nothing to hold the trainer for.
    close(attachment->lock_fd_);
    attachment->lock_fd_ = -1;
  } else if (backend == "cuda_ipc") {
#ifdef LORAPIPE_SHARED_WEIGHTS_CUDA
    const c10::cuda::CUDAGuard guard(device);
    // getIpcDevPtr opens the handle through this device's caching allocator, which LibTorch
    // sets up with the first tensor on the device: this process may have none yet.
    (void)at::zeros({1}, at::TensorOptions().device(device));
    // Tensors of one allocator segment share its handle: each handle is opened once. Every
    // handle is opened before any tensor is replaced, so a handle this process cannot open
    // (another user's process, a container without the host's IPC namespace) leaves the module
    // whole and is named.
    std::map<std::string, std::shared_ptr<void>> opened;
    for (const auto& [name, t] : tensors) {
      const std::string handle = unhex(by_name.at(name)->at("handle").get<std::string>());
      if (handle.empty() || opened.count(handle)) continue;
      try {
        opened[handle] = c10::cuda::CUDACachingAllocator::getIpcDevPtr(handle);
      } catch (const c10::Error& e) {
        throw InputError(manifest.string() + ": cannot open the trainer's CUDA memory (" + name +
                         "): " + e.what_without_backtrace() +
                         "; render the previews after the training (--sample_after_training)");
      }
    }
    for (const auto& [name, t] : tensors) {
      const json& e = *by_name.at(name);
      const std::string handle = unhex(e.at("handle").get<std::string>());
      if (handle.empty()) {
        at::Tensor(t).set_data(at::empty(t.sizes(), t.options().device(device)));
        continue;
      }
      const std::shared_ptr<void>& base = opened.at(handle);
      char* data = static_cast<char*>(base.get()) + e.at("offset").get<int64_t>();
      const auto strides = e.at("strides").get<std::vector<int64_t>>();
      at::Tensor(t).set_data(at::from_blob(data, t.sizes(), strides, [base](void*) {},
                                           t.options().device(device).requires_grad(false)));
      attachment->bytes_ += static_cast<int64_t>(t.nbytes());
    }
#else
    throw InputError(manifest.string() + ": CUDA weights, and this build has no CUDA");
#endif
  } else {
    throw InputError(manifest.string() + ": unknown backend '" + backend + "'");
  }
  attachment->tensors_ = static_cast<int64_t>(tensors.size());
  LP_LOG(kInfo, kLog) << "attached " << attachment->tensors_ << " base weights ("
                      << attachment->bytes_ / (1 << 20) << " MiB) the trainer (pid " << pid
                      << ") placed on " << device.str() << ": no copy of them here";
  return attachment;
}

}  // namespace lorapipe::models
