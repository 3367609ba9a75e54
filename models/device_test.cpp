#include "models/device.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "common/error.h"
#include "models/attention.h"

namespace lorapipe::models {
namespace {

TEST(ModelsDevice, ParsesEverySpelling) {
  EXPECT_EQ(resolve_device("cpu"), c10::Device(c10::kCPU));
  const c10::Device automatic = resolve_device("auto");
  if (torch::cuda::is_available()) {
    EXPECT_EQ(automatic, c10::Device(c10::kCUDA, 0));
    EXPECT_EQ(resolve_device("cuda"), c10::Device(c10::kCUDA, 0));
    EXPECT_EQ(resolve_device("cuda:0"), c10::Device(c10::kCUDA, 0));
  } else {
    EXPECT_EQ(automatic, c10::Device(c10::kCPU));
  }
}

TEST(ModelsDevice, RefusesMalformedAndMissingDevicesNamingTheValue) {
  for (const char* bad : {"gpu", "cuda:", "cuda:x", "cuda:-1", "cuda0", "cuda:1x", ""}) {
    try {
      resolve_device(bad);
      FAIL() << "accepted --device=" << bad;
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find("'" + std::string(bad) + "'"), std::string::npos)
          << e.what();
    }
  }
  const std::string beyond = "cuda:" + std::to_string(torch::cuda::device_count());
  EXPECT_THROW(resolve_device(beyond), InputError);
}

// What the sampler and the plan's probe take for the device's memory running out (a render or a
// candidate skipped, the process goes on), and what they must not.
TEST(ModelsDevice, KnowsOutOfMemoryByTypeAndByWhatTheLibrariesSay) {
  auto c10_error = [](const std::string& message) {
    return c10::Error({__func__, __FILE__, __LINE__}, message);
  };
  EXPECT_TRUE(is_out_of_memory(c10::OutOfMemoryError({__func__, __FILE__, __LINE__}, "CUDA")));
  EXPECT_TRUE(is_out_of_memory(std::bad_alloc()));
  EXPECT_TRUE(is_out_of_memory(c10_error("DefaultCPUAllocator: not enough memory: you tried")));
  EXPECT_TRUE(is_out_of_memory(
      c10_error("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`")));
  EXPECT_TRUE(is_out_of_memory(c10_error("cuDNN error: CUDNN_STATUS_ALLOC_FAILED")));
  EXPECT_FALSE(is_out_of_memory(c10_error("CUDA error: an illegal memory access was encountered")));
  EXPECT_FALSE(is_out_of_memory(std::runtime_error("out of memory")));  // not the library's
}

TEST(ModelsDevice, TensorsLandOnTheResolvedDevice) {
  const c10::Device device = resolve_device("auto");
  const torch::Tensor t = torch::ones({2, 3}, torch::TensorOptions().device(device));
  EXPECT_EQ(t.device(), device);
  EXPECT_EQ(t.sum().item<float>(), 6.0f);
  EXPECT_FALSE(describe_device(device).empty());
}

// FLUX.1's masked attention on CUDA, through whichever kernel SDPA picks there (cuDNN's on an
// H100 with a recent cuDNN, whose backward has given NaN query gradients with a mask at lengths
// of 64 mod 128: pytorch#196678), against the math path on the same device: a bucket of
// 896x1152 beside 512 T5 tokens is 4544 = 64 mod 128. bf16, 24 heads of 128 as FLUX.1's, half
// the text masked out. Outputs and the q, k, v gradients must be finite and within 3e-2 of the
// math path's largest value (bf16 keeps 8 bits, 4e-3 relative per rounding; the kernels sum in
// fp32 in other orders over 4544 keys).
TEST(ModelsAttention, OnCudaMaskedSdpaEqualsTheMathPathAtFluxLengths) {
  if (!torch::cuda::is_available()) {
    GTEST_SKIP() << "no CUDA device here; tests/gpu/run.sh runs this on one";
  }
  const c10::Device cuda(c10::kCUDA, 0);
  torch::manual_seed(3);
  const int64_t text = 512, tokens = text + (896 / 16) * (1152 / 16);
  auto draw = [&] { return torch::randn({1, 24, tokens, 128}).to(torch::kBFloat16).to(cuda); };
  const at::Tensor q0 = draw(), k0 = draw(), v0 = draw(), grad = draw();
  at::Tensor mask = torch::ones({1, tokens}, torch::kBool);
  mask.slice(1, text / 2, text).fill_(false);
  mask = mask.to(cuda);
  auto run = [&](bool math) {
    set_force_math_attention(math);
    at::Tensor q = q0.clone().requires_grad_(true), k = k0.clone().requires_grad_(true),
               v = v0.clone().requires_grad_(true);
    const at::Tensor out = masked_attention(q, k, v, mask);
    out.backward(grad);
    set_force_math_attention(false);
    return std::vector<at::Tensor>{out.detach(), q.grad(), k.grad(), v.grad()};
  };
  const std::vector<at::Tensor> fast = run(false), math = run(true);
  const char* names[] = {"output", "q grad", "k grad", "v grad"};
  for (size_t i = 0; i < fast.size(); ++i) {
    const at::Tensor f = fast[i].to(torch::kFloat), m = math[i].to(torch::kFloat);
    EXPECT_TRUE(torch::isfinite(f).all().item<bool>()) << names[i] << " has NaN or inf";
    const double error = ((f - m).abs().max() / m.abs().max()).item<double>();
    EXPECT_LE(error, 3e-2) << names[i];
    std::printf("[attention] masked SDPA on %s, %lld tokens: %s within %.2g of the math path\n",
                describe_device(cuda).c_str(), static_cast<long long>(tokens), names[i], error);
  }
}

}  // namespace
}  // namespace lorapipe::models
