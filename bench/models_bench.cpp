// Model speed and memory at the real SD1.5 sizes, fp32 on CPU, random weights:
//   models_bench vae   VAE encode of one 512x512 image
//   models_bench unet  UNet forward + backward, 64x64 latent, batch 1, 77x768 conditioning
// Prints "<what> <best ms> ms, peak RSS <MiB> MiB". With a third argument the weights are also
// written there (safetensors, diffusers names) so the reference runs the very same weights.
// bench/models_bench.py runs this and diffusers on the same work and prints the ratios; nothing
// here is a test.
#include <sys/resource.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>

#include <torch/torch.h>

#include "models/safetensors.h"
#include "models/unet.h"
#include "models/vae.h"
#include "models/weights.h"

namespace {

double peak_rss_mib() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return usage.ru_maxrss / 1024.0;
}

template <typename Fn>
double best_ms(int iterations, Fn fn) {
  double best = 1e30;
  for (int i = 0; i < iterations; ++i) {
    const auto start = std::chrono::steady_clock::now();
    fn();
    best = std::min(best, std::chrono::duration<double, std::milli>(
                              std::chrono::steady_clock::now() - start)
                              .count());
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  namespace m = lorapipe::models;
  const std::string what = argc > 1 ? argv[1] : "vae";
  const int iterations = argc > 2 ? std::atoi(argv[2]) : 3;
  const std::string weights_out = argc > 3 ? argv[3] : "";
  auto save_weights = [&](const torch::nn::Module& module) {
    if (weights_out.empty()) return;
    std::vector<torch::Tensor> storage;
    m::write_safetensors(weights_out, m::module_tensors(module, storage));
  };
  torch::manual_seed(0);
  if (what == "vae") {
    m::AutoencoderKL vae(m::VaeConfig::sd15());
    vae->eval();
    save_weights(*vae);
    torch::NoGradGuard no_grad;
    const torch::Tensor image = torch::rand({1, 3, 512, 512}) * 2 - 1;
    const double ms = best_ms(iterations, [&] { vae->encode(image); });
    std::printf("vae_encode_512 %.1f ms, peak RSS %.0f MiB\n", ms, peak_rss_mib());
  } else if (what == "unet") {
    m::UNet unet(m::UNetConfig::sd15());
    unet->train();
    save_weights(*unet);
    for (auto& p : unet->parameters()) p.set_requires_grad(false);  // frozen base, as in LoRA
    const torch::Tensor latents = torch::randn({1, 4, 64, 64}).requires_grad_(true);
    const torch::Tensor context = torch::randn({1, 77, 768});
    const torch::Tensor timestep = torch::tensor({500});
    const double ms = best_ms(iterations, [&] {
      torch::Tensor out = unet->forward(latents, timestep, context);
      out.square().mean().backward();
    });
    std::printf("unet_fwd_bwd_64 %.1f ms, peak RSS %.0f MiB\n", ms, peak_rss_mib());
  } else {
    std::fprintf(stderr, "usage: models_bench vae|unet [iterations]\n");
    return 2;
  }
  return 0;
}
