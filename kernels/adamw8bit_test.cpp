// kernels/adamw8bit.h's CPU reference against bitsandbytes 0.50 (its CPU backend) and
// torch.optim.AdamW, both run by kernels/reference/adamw8bit_reference.py on the same inputs.
//
// bitsandbytes' CPU path is a loose reference, not its CUDA kernel's arithmetic, and lorapipe
// follows the CUDA kernel's rules (adamw8bit.h). Every difference, and what the tests do with it:
//   - Rounding to a code: bitsandbytes' CPU quantiser looks the code up in a 65,536-entry table
//     over [-1, 1] (cpu_ops.cpp), which is not always the nearest code (about 0.1% of
//     normal-distributed values of m, 3% of v land up to 7 codes off) and never maps 0 to the
//     code 0. Ours is the exact nearest: AdamW8bitQuantize checks it against a brute-force argmin.
//     So the 8-bit moments after 100 steps differ by a few quantisation steps, not bit for bit.
//   - First-moment sign fix: ours (as the CUDA kernel), not bitsandbytes' CPU path.
//   - Weight decay: bitsandbytes' CPU path decays before the update, as we do; its CUDA kernel
//     after. Compared with weight decay only against torch's AdamW (the fp32 case).
//   - A NaN gradient: bitsandbytes' CPU path writes NaN into that parameter and moment and lets
//     it stay; ours leaves both untouched. The NaN lane is left out of the comparison and
//     checked on its own.
//   - eps: bitsandbytes divides by sqrt(v) / c2 + eps with step lr / c1, as torch does and as we
//     do (its CUDA kernel folds c2 into the step size).
//
// Tolerances (bitsandbytes' scales throughout: parameters ~0.1, gradients ~0.01, lr 1e-3).
//   - Per step, as bitsandbytes' own test_optimizer8bit (fp32) does it: LibTorch's fp32 AdamW is
//     re-synchronised to our parameter and dequantised moments before each step, then both take
//     the step. bitsandbytes' limits on the parameters: mean |dp| < 6e-5 and mean |dp| / |p| <
//     6e-4. Its limit on the moments (fewer than 20 elements outside atol 3e-3) is larger than
//     every moment at these scales and would check nothing; ours is the quantiser's own bound:
//     each moment within half the widest gap between neighbouring codes (0.0071 of the block's
//     absmax on the signed map, 0.0079 on the unsigned) of the fp32 value.
//   - 100 steps without re-synchronising, against bitsandbytes' CPU AdamW8bit on the same
//     inputs: the parameters within its per-step limit mean |dp| < 6e-5 (the drift of 100 steps
//     of differently rounded moments stays under it), and against fp32 AdamW our drift no more
//     than 10% above bitsandbytes' own drift from fp32 AdamW on the same inputs (parameters'
//     mean |dp|, each moment's max |dm| over its scale): both are 8-bit quantisations of the same
//     optimizer, so bitsandbytes' drift measures what 8 bits cost, and ours may not cost more
//     beyond the difference of rounding rules. The measured figures are printed.
//   - Fewer than 4096 elements keep fp32 moments on both sides: the same fp32 Adam in another
//     operation order, within 1e-5 of each value's scale after 100 steps.

#include "kernels/adamw8bit.h"

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "kernels/cuda_device.h"
#include "models/parity_util.h"
#include "models/safetensors.h"
#include "models/weights.h"

namespace lorapipe::kernels {
namespace {

namespace fs = std::filesystem;
using Tensors = std::map<std::string, torch::Tensor>;

const fs::path& reference_dir() {
  static const fs::path dir =
      models::testing::reference_output("kernels/reference/adamw8bit_reference.py");
  return dir;
}

Tensors read(const std::string& name) {
  return models::read_tensors(
      models::SafetensorsFile::open(reference_dir() / (name + ".safetensors")));
}

nlohmann::json cases() {
  std::ifstream in(reference_dir() / "cases.json");
  return nlohmann::json::parse(in);
}

torch::Tensor as_tensor(const std::array<float, 256>& a) {
  return torch::from_blob(const_cast<float*>(a.data()), {256}, torch::kFloat32).clone();
}

// One parameter tensor with its AdamW8bit state, fp32, on the CPU.
struct State {
  torch::Tensor p, s1, s2, absmax1, absmax2;
  bool quantized;
  explicit State(torch::Tensor p0) : p(p0.clone()), quantized(p0.numel() >= kAdamW8bitMinNumel) {
    const int64_t n = p.numel();
    if (quantized) {
      // Zero moments: byte 127 is the signed map's 0, byte 0 the unsigned map's.
      s1 = torch::full({n}, 127, torch::kUInt8);
      s2 = torch::zeros({n}, torch::kUInt8);
    } else {
      s1 = torch::zeros({n});
      s2 = torch::zeros({n});
    }
    absmax1 = torch::zeros({adamw8bit_blocks(n)});
    absmax2 = torch::zeros({adamw8bit_blocks(n)});
  }
  void step(const torch::Tensor& grad, const AdamW8bitStep& constants) {
    AdamW8bitTensor t;
    t.param = p.data_ptr();
    t.grad = grad.data_ptr();
    t.state1 = s1.data_ptr();
    t.state2 = s2.data_ptr();
    t.absmax1 = absmax1.data_ptr<float>();
    t.absmax2 = absmax2.data_ptr<float>();
    t.numel = p.numel();
    t.quantized = quantized;
    adamw8bit_step_cpu(&t, 1, ParamDtype::kFloat32, &constants, 1);
  }
  torch::Tensor m() const { return dequantized(s1, absmax1, dynamic_map_signed()); }
  torch::Tensor v() const { return dequantized(s2, absmax2, dynamic_map_unsigned()); }
  torch::Tensor dequantized(const torch::Tensor& s, const torch::Tensor& absmax,
                            const std::array<float, 256>& code) const {
    if (!quantized) return s.clone();
    torch::Tensor out = torch::empty({s.numel()});
    dequantize_blockwise_cpu(s.data_ptr<uint8_t>(), absmax.data_ptr<float>(), s.numel(), code,
                             out.data_ptr<float>());
    return out;
  }
};

struct OurRun {
  State state;
  std::vector<torch::Tensor> lane_params;  // the NaN lane's parameter after every step
};

// The case's 100 steps on our CPU reference, drawing the reference script's inputs.
OurRun run_ours(const nlohmann::json& all, const std::string& name, const torch::Tensor& p0) {
  const auto& c = all["cases"][name];
  const int64_t n = c["numel"], zero_block = c["zero_block"], nan_lane = c["nan_lane"];
  auto gen = at::detail::createCPUGenerator(c["seed"].get<uint64_t>());
  const torch::Tensor drawn_p0 = torch::randn({n}, gen) * 0.1;
  EXPECT_TRUE(torch::equal(drawn_p0, p0)) << name << ": the inputs are not the reference's";
  OurRun run{State(p0), {}};
  const double lr = all["lr"], eps = all["eps"], wd = c["weight_decay"];
  const double b1 = all["betas"][0], b2 = all["betas"][1];
  const int64_t nan_begin = all["nan_steps"][0], nan_end = all["nan_steps"][1];
  for (int64_t step = 0; step < all["steps"].get<int64_t>(); ++step) {
    torch::Tensor g = torch::randn({n}, gen) * 0.01;
    if (zero_block >= 0) g.slice(0, zero_block * 256, (zero_block + 1) * 256).zero_();
    if (nan_lane >= 0 && step >= nan_begin && step < nan_end) g[nan_lane] = NAN;
    run.state.step(g, adamw8bit_step_constants(lr, b1, b2, eps, wd, step + 1));
    if (nan_lane >= 0) run.lane_params.push_back(run.state.p[nan_lane].clone());
  }
  return run;
}

double mean_abs(const torch::Tensor& a, const torch::Tensor& b) {
  return (a.to(torch::kFloat64) - b.to(torch::kFloat64)).abs().mean().item<double>();
}
double mean_rel(const torch::Tensor& a, const torch::Tensor& b) {
  const auto a64 = a.to(torch::kFloat64), b64 = b.to(torch::kFloat64);
  return ((a64 - b64).abs() / (b64.abs() + 1e-9)).mean().item<double>();
}
double scaled_max(const torch::Tensor& a, const torch::Tensor& b) {
  const auto d = (a.to(torch::kFloat64) - b.to(torch::kFloat64)).abs().max().item<double>();
  return d / std::max(b.abs().max().item<double>(), 1e-30);
}

// bitsandbytes' per-step limits on the parameters (fp32, test_optimizer8bit).
constexpr double kBnbMeanAbs = 6e-5, kBnbMeanRel = 6e-4;
// Ours against fp32 AdamW may drift at most this much more than bitsandbytes' AdamW8bit does.
constexpr double kDriftRatio = 1.1;
// fp32 moments (under 4096 elements): the same fp32 Adam in another operation order.
constexpr double kFp32Tolerance = 1e-5;

struct Drift {
  double p_abs, p_rel, m, v;
};
Drift drift(const torch::Tensor& p, const torch::Tensor& m, const torch::Tensor& v,
            const torch::Tensor& ref_p, const torch::Tensor& ref_m, const torch::Tensor& ref_v) {
  return {mean_abs(p, ref_p), mean_rel(p, ref_p), scaled_max(m, ref_m), scaled_max(v, ref_v)};
}
void print(const std::string& what, const Drift& d) {
  std::printf("[adamw8bit] %-40s p: mean abs %.2e, mean rel %.2e; m %.2e, v %.2e of scale\n",
              what.c_str(), d.p_abs, d.p_rel, d.m, d.v);
}

// The case's 100 steps against the reference (the NaN lane, if any, left out: see the header).
void compare_case(const std::string& name) {
  const nlohmann::json all = cases();
  const Tensors ref = read(name);
  OurRun run = run_ours(all, name, ref.at("p0"));
  const State& s = run.state;
  torch::Tensor keep = torch::ones({s.p.numel()}, torch::kBool);
  const int64_t nan_lane = all["cases"][name]["nan_lane"];
  if (nan_lane >= 0) keep[nan_lane] = false;
  auto k = [&](const std::string& key) { return ref.at(key).masked_select(keep); };
  const torch::Tensor p = s.p.masked_select(keep), m = s.m().masked_select(keep),
                      v = s.v().masked_select(keep);
  const bool with_bnb = all["cases"][name]["weight_decay"].get<double>() == 0.0;
  const Drift ours = drift(p, m, v, k("adamw_p"), k("adamw_m"), k("adamw_v"));
  print(name + ": ours vs torch AdamW", ours);
  EXPECT_TRUE(torch::isfinite(s.p).all().item<bool>()) << name;
  if (!s.quantized) {
    // fp32 state on both sides: the same optimizer.
    EXPECT_LE(scaled_max(p, k("adamw_p")), kFp32Tolerance) << name;
    EXPECT_LE(ours.m, kFp32Tolerance) << name;
    EXPECT_LE(ours.v, kFp32Tolerance) << name;
    if (with_bnb) {
      EXPECT_LE(scaled_max(p, k("bnb_p")), kFp32Tolerance) << name;
      EXPECT_LE(scaled_max(m, k("bnb_m")), kFp32Tolerance) << name;
      EXPECT_LE(scaled_max(v, k("bnb_v")), kFp32Tolerance) << name;
    }
    return;
  }
  ASSERT_TRUE(with_bnb) << name << ": 8-bit cases compare with bitsandbytes, without decay";
  const Drift bnb =
      drift(k("bnb_p"), k("bnb_m"), k("bnb_v"), k("adamw_p"), k("adamw_m"), k("adamw_v"));
  print(name + ": bitsandbytes vs torch AdamW", bnb);
  const Drift direct = drift(p, m, v, k("bnb_p"), k("bnb_m"), k("bnb_v"));
  print(name + ": ours vs bitsandbytes", direct);
  EXPECT_LT(direct.p_abs, kBnbMeanAbs) << name;
  EXPECT_LE(ours.p_abs, bnb.p_abs * kDriftRatio) << name;
  EXPECT_LE(ours.m, bnb.m * kDriftRatio) << name;
  EXPECT_LE(ours.v, bnb.v * kDriftRatio) << name;
}

// Half the widest gap between neighbouring codes: the quantiser's worst rounding, per absmax.
double half_widest_gap(const std::array<float, 256>& code) {
  double gap = 0;
  for (int k = 0; k + 1 < 256; ++k) gap = std::max(gap, double(code[k + 1]) - code[k]);
  return gap / 2;
}

// bitsandbytes' per-step method: LibTorch's fp32 AdamW re-synchronised to our parameter and
// dequantised moments before every step, then one step each on the same gradient.
void compare_per_step(int64_t n, int64_t steps, uint64_t seed) {
  const double lr = 1e-3, b1 = 0.9, b2 = 0.999, eps = 1e-8;
  auto gen = at::detail::createCPUGenerator(seed);
  State s(torch::randn({n}, gen) * 0.1);
  double worst_abs = 0, worst_rel = 0, worst_m = 0, worst_v = 0;
  const double gap1 = half_widest_gap(dynamic_map_signed());
  const double gap2 = half_widest_gap(dynamic_map_unsigned());
  for (int64_t t = 1; t <= steps; ++t) {
    const torch::Tensor g = torch::randn({n}, gen) * 0.01;
    torch::Tensor ref_p = s.p.clone().requires_grad_(true);
    torch::optim::AdamW adamw(
        {ref_p}, torch::optim::AdamWOptions(lr).betas({b1, b2}).eps(eps).weight_decay(0));
    auto state = std::make_unique<torch::optim::AdamWParamState>();
    state->step(t - 1).exp_avg(s.m().clone()).exp_avg_sq(s.v().clone());
    adamw.state()[ref_p.unsafeGetTensorImpl()] = std::move(state);
    ref_p.mutable_grad() = g.clone();
    adamw.step();
    s.step(g, adamw8bit_step_constants(lr, b1, b2, eps, 0.0, t));
    const auto& ref_state =
        static_cast<torch::optim::AdamWParamState&>(*adamw.state().at(ref_p.unsafeGetTensorImpl()));
    const torch::Tensor scale1 = s.absmax1.repeat_interleave(256).slice(0, 0, n);
    const torch::Tensor scale2 = s.absmax2.repeat_interleave(256).slice(0, 0, n);
    worst_abs = std::max(worst_abs, mean_abs(s.p, ref_p.detach()));
    worst_rel = std::max(worst_rel, mean_rel(s.p, ref_p.detach()));
    // Each moment's error in units of its block's absmax: at most half the widest code gap
    // (plus 1e-5 for the fp32 operation order, torch's lerp against our multiply-add).
    worst_m =
        std::max(worst_m, ((s.m() - ref_state.exp_avg()).abs() / scale1).max().item<double>());
    worst_v =
        std::max(worst_v, ((s.v() - ref_state.exp_avg_sq()).abs() / scale2).max().item<double>());
  }
  std::printf(
      "[adamw8bit] per step, %lld elements, %lld steps: worst p mean abs %.2e, mean rel "
      "%.2e; m %.4f, v %.4f of absmax (bounds %.4f, %.4f)\n",
      static_cast<long long>(n), static_cast<long long>(steps), worst_abs, worst_rel, worst_m,
      worst_v, gap1, gap2);
  EXPECT_LT(worst_abs, kBnbMeanAbs);
  EXPECT_LT(worst_rel, kBnbMeanRel);
  EXPECT_LE(worst_m, gap1 + 1e-5);
  EXPECT_LE(worst_v, gap2 + 1e-5);
}

TEST(AdamW8bitMaps, EqualBitsandbytesDynamicMapBitForBit) {
  const Tensors maps = read("maps");
  EXPECT_TRUE(torch::equal(as_tensor(dynamic_map_signed()), maps.at("signed")));
  EXPECT_TRUE(torch::equal(as_tensor(dynamic_map_unsigned()), maps.at("unsigned")));
  EXPECT_EQ(dynamic_map_signed()[127], 0.f);
  EXPECT_EQ(dynamic_map_unsigned()[0], 0.f);
}

// The rule of step 5: every byte is the nearest code (brute-force argmin; on an exact tie the
// lower), the round trip is within half the gap to the next code, and the sign fix holds.
TEST(AdamW8bitQuantize, NearestCodeAndRoundTrip) {
  torch::manual_seed(0);
  for (bool is_signed : {true, false}) {
    const auto& code = is_signed ? dynamic_map_signed() : dynamic_map_unsigned();
    const int64_t n = 256 * 64 + 77;  // a partial last block
    torch::Tensor x = torch::randn({n}) * torch::exp(torch::randn({n}) * 3);
    if (!is_signed) x = x.abs();
    x.slice(0, 256, 512).zero_();            // an all-zero block
    x[600] = 1e-12f * (is_signed ? -1 : 1);  // nearest code 0
    torch::Tensor bytes = torch::empty({n}, torch::kUInt8);
    torch::Tensor absmax = torch::empty({adamw8bit_blocks(n)});
    quantize_blockwise_cpu(x.data_ptr<float>(), n, code, /*sign_fix=*/is_signed,
                           bytes.data_ptr<uint8_t>(), absmax.data_ptr<float>());
    torch::Tensor back = torch::empty({n});
    dequantize_blockwise_cpu(bytes.data_ptr<uint8_t>(), absmax.data_ptr<float>(), n, code,
                             back.data_ptr<float>());
    const torch::Tensor codes = as_tensor(code);
    const torch::Tensor scale = absmax.repeat_interleave(256).slice(0, 0, n);
    const torch::Tensor normalized = torch::where(scale > 0, x / scale, torch::zeros_like(x));
    const torch::Tensor nearest = (normalized.unsqueeze(1) - codes.unsqueeze(0)).abs().argmin(1);
    int64_t mismatches = 0;
    for (int64_t i = 0; i < n; ++i) {
      int64_t expect = nearest[i].item<int64_t>();
      const float value = x[i].item<float>();
      if (is_signed && value < 0 && code[expect] >= 0) --expect;  // sign fix
      if (bytes[i].item<int64_t>() != expect) ++mismatches;
    }
    EXPECT_EQ(mismatches, 0) << (is_signed ? "signed" : "unsigned");
    EXPECT_TRUE(torch::equal(back.slice(0, 256, 512), torch::zeros({256})));
    if (is_signed) {
      EXPECT_LT(back[600].item<float>(), 0.f) << "a negative value kept its sign";
    }
    // Round trip: within half the largest gap between neighbouring codes, times absmax.
    const double half_gap = (codes.slice(0, 1) - codes.slice(0, 0, 255)).max().item<double>() / 2;
    EXPECT_TRUE(((back - x).abs() <= scale * half_gap * 1.0001 + 1e-30).all().item<bool>());
  }
}

TEST(AdamW8bitParity, PerStepAgainstAdamWWithinBitsandbytesLimits) {
  compare_per_step(4096, 50, 11);
  compare_per_step(256 * 4097, 10, 12);
}

TEST(AdamW8bitParity, FourThousandNinetyFiveKeepsFp32State) { compare_case("n4095"); }
TEST(AdamW8bitParity, FourThousandNinetySixIsQuantized) { compare_case("n4096"); }
TEST(AdamW8bitParity, LargeTensor256x4097) { compare_case("n256x4097"); }
TEST(AdamW8bitParity, WeightDecayAsTorchAdamW) { compare_case("n4095_decay"); }

TEST(AdamW8bitParity, AllZeroBlockStaysZero) {
  compare_case("zero_block");
  const nlohmann::json all = cases();
  const Tensors ref = read("zero_block");
  OurRun run = run_ours(all, "zero_block", ref.at("p0"));
  const int64_t block = all["cases"]["zero_block"]["zero_block"];
  EXPECT_EQ(run.state.absmax1[block].item<float>(), 0.f);
  EXPECT_EQ(run.state.absmax2[block].item<float>(), 0.f);
  EXPECT_TRUE(
      torch::equal(run.state.m().slice(0, block * 256, (block + 1) * 256), torch::zeros({256})));
  EXPECT_TRUE(torch::equal(run.state.p.slice(0, block * 256, (block + 1) * 256),
                           ref.at("p0").slice(0, block * 256, (block + 1) * 256)))
      << "zero gradients and no weight decay move nothing";
}

TEST(AdamW8bitParity, NanLaneIsSkippedAndContained) {
  compare_case("nan_lane");
  const nlohmann::json all = cases();
  const Tensors ref = read("nan_lane");
  OurRun run = run_ours(all, "nan_lane", ref.at("p0"));
  const int64_t begin = all["nan_steps"][0], end = all["nan_steps"][1];
  for (int64_t step = begin; step < end; ++step) {
    EXPECT_TRUE(torch::equal(run.lane_params[step], run.lane_params[begin - 1]))
        << "the NaN lane's parameter moved at step " << step;
  }
  EXPECT_FALSE(torch::equal(run.lane_params.back(), run.lane_params[end - 1]))
      << "the lane trains again once its gradient is finite";
  EXPECT_TRUE(torch::isfinite(run.state.m()).all().item<bool>());
  EXPECT_TRUE(torch::isfinite(run.state.v()).all().item<bool>());
}

// Threads split the work by blocks: any thread count gives the same bytes.
TEST(AdamW8bitCpu, ResultDoesNotDependOnThreadCount) {
  torch::manual_seed(1);
  const int64_t n = 256 * 300 + 5;
  std::vector<State> states;
  for (int threads : {1, 2}) {
    torch::manual_seed(1);
    State s(torch::randn({n}) * 0.1);
    for (int t = 1; t <= 5; ++t) {
      torch::manual_seed(100 + t);
      const torch::Tensor g = torch::randn({n}) * 0.01;
      AdamW8bitTensor view{s.p.data_ptr(),
                           g.data_ptr(),
                           s.s1.data_ptr(),
                           s.s2.data_ptr(),
                           s.absmax1.data_ptr<float>(),
                           s.absmax2.data_ptr<float>(),
                           n,
                           true,
                           0};
      const AdamW8bitStep c = adamw8bit_step_constants(1e-3, 0.9, 0.999, 1e-8, 0.01, t);
      adamw8bit_step_cpu(&view, 1, ParamDtype::kFloat32, &c, 1, threads);
    }
    states.push_back(s);
  }
  EXPECT_TRUE(torch::equal(states[0].p, states[1].p));
  EXPECT_TRUE(torch::equal(states[0].s1, states[1].s1));
  EXPECT_TRUE(torch::equal(states[0].s2, states[1].s2));
  EXPECT_TRUE(torch::equal(states[0].absmax1, states[1].absmax1));
}

// bf16 and fp16 parameters: the update is computed in fp32 and rounded once to nearest even, so
// one step equals the fp32 step rounded into the parameter's dtype.
TEST(AdamW8bitCpu, HalfPrecisionParametersRoundOnce) {
  for (auto [dtype, torch_dtype] : {std::pair{ParamDtype::kBFloat16, torch::kBFloat16},
                                    std::pair{ParamDtype::kFloat16, torch::kFloat16}}) {
    torch::manual_seed(2);
    const int64_t n = 4096 + 300;
    const torch::Tensor p_half = (torch::randn({n}) * 0.1).to(torch_dtype);
    const torch::Tensor g_half = (torch::randn({n}) * 0.01).to(torch_dtype);
    State fp32(p_half.to(torch::kFloat32));
    State half(p_half.to(torch::kFloat32));
    torch::Tensor p = p_half.clone();
    const AdamW8bitStep c = adamw8bit_step_constants(1e-2, 0.9, 0.999, 1e-8, 0.01, 1);
    fp32.step(g_half.to(torch::kFloat32), c);
    AdamW8bitTensor view{p.data_ptr(),
                         g_half.data_ptr(),
                         half.s1.data_ptr(),
                         half.s2.data_ptr(),
                         half.absmax1.data_ptr<float>(),
                         half.absmax2.data_ptr<float>(),
                         n,
                         true,
                         0};
    adamw8bit_step_cpu(&view, 1, dtype, &c, 1);
    EXPECT_TRUE(torch::equal(p, fp32.p.to(torch_dtype)));
    EXPECT_TRUE(torch::equal(half.s1, fp32.s1));
    EXPECT_TRUE(torch::equal(half.s2, fp32.s2));
  }
}

// ---- CUDA (tests/gpu/run.sh runs these on a GPU; without one they skip) ----

// Several tensors in one launch, fp32 and 8-bit state, two learning-rate groups, a partial last
// block, an all-zero block and NaN lanes: the kernel and the CPU reference run the same fp32
// operations (adamw8bit_rules.h, no FMA on either side), so parameters, state bytes and absmax
// must be bit-identical after every step. Tolerance: none.
struct Case {
  std::vector<torch::Tensor> p, g, s1, s2, a1, a2;
  std::vector<AdamW8bitTensor> views;
};

Case make_case(torch::ScalarType dtype, const torch::Device& device, uint64_t seed) {
  const std::vector<int64_t> sizes{100, 4095, 4096, 256 * 33 + 17, 70000};
  auto gen = at::detail::createCPUGenerator(seed);
  Case c;
  for (size_t i = 0; i < sizes.size(); ++i) {
    const int64_t n = sizes[i];
    const bool quantized = n >= kAdamW8bitMinNumel;
    c.p.push_back((torch::randn({n}, gen) * 0.1).to(dtype).to(device));
    c.g.push_back(torch::zeros({n}, dtype).to(device));
    if (quantized) {
      c.s1.push_back(torch::full({n}, 127, torch::kUInt8).to(device));
      c.s2.push_back(torch::zeros({n}, torch::kUInt8).to(device));
    } else {
      c.s1.push_back(torch::zeros({n}).to(device));
      c.s2.push_back(torch::zeros({n}).to(device));
    }
    c.a1.push_back(torch::zeros({adamw8bit_blocks(n)}).to(device));
    c.a2.push_back(torch::zeros({adamw8bit_blocks(n)}).to(device));
    c.views.push_back({c.p[i].data_ptr(), c.g[i].data_ptr(), c.s1[i].data_ptr(), c.s2[i].data_ptr(),
                       c.a1[i].data_ptr<float>(), c.a2[i].data_ptr<float>(), n, quantized,
                       i + 1 == sizes.size() ? kAdamW8bitMaxGroups - 1 : static_cast<int>(i % 2)});
  }
  return c;
}

// The constants of step t for every group a step can carry (block-wise learning rates make one
// group per block): groups 0 and 1 with other betas and decay, the rest at their own rates. The
// cases put their last tensor in the last group.
std::vector<AdamW8bitStep> group_steps(int64_t t) {
  std::vector<AdamW8bitStep> steps{adamw8bit_step_constants(1e-3, 0.9, 0.999, 1e-8, 0.01, t),
                                   adamw8bit_step_constants(3e-4, 0.9, 0.99, 1e-6, 0.0, t)};
  for (int g = 2; g < kAdamW8bitMaxGroups; ++g) {
    steps.push_back(adamw8bit_step_constants(1e-4 * g, 0.9, 0.999, 1e-8, 0.01, t));
  }
  return steps;
}

// The gradients of step t, the same on both sides (drawn on the CPU, copied).
void fill_gradients(Case& c, int64_t t, torch::ScalarType dtype) {
  auto gen = at::detail::createCPUGenerator(1000 + t);
  for (size_t i = 0; i < c.g.size(); ++i) {
    torch::Tensor g = torch::randn({c.g[i].numel()}, gen) * 0.01;
    if (i == 3) g.slice(0, 256, 512).zero_();                      // an all-zero block
    if (t % 3 == 0) g[std::min<int64_t>(5, g.numel() - 1)] = NAN;  // a NaN lane
    if (t == 4) g[g.numel() - 1] = INFINITY;
    c.g[i].copy_(g.to(dtype));
  }
}

// A tensor without a gradient this step (null in the table: its LoRA module dropped by
// module_dropout) is left alone, its parameter and state bytes as they were; the others step.
TEST(AdamW8bitCpu, ATensorWithoutAGradientIsLeftAlone) {
  Case c = make_case(torch::kFloat32, torch::kCPU, 7);
  const std::vector<AdamW8bitStep> steps = group_steps(1);
  fill_gradients(c, 1, torch::kFloat32);
  c.views[2].grad = nullptr;
  std::vector<torch::Tensor> p, s1, s2;
  for (size_t i = 0; i < c.p.size(); ++i) {
    p.push_back(c.p[i].clone());
    s1.push_back(c.s1[i].clone());
    s2.push_back(c.s2[i].clone());
  }
  adamw8bit_step_cpu(c.views.data(), c.views.size(), ParamDtype::kFloat32, steps.data(),
                     steps.size());
  for (size_t i = 0; i < c.p.size(); ++i) {
    const bool left = i == 2;
    EXPECT_EQ(torch::equal(c.p[i], p[i]), left) << "tensor " << i;
    EXPECT_EQ(torch::equal(c.s1[i], s1[i]) && torch::equal(c.s2[i], s2[i]), left) << "tensor " << i;
  }
}

// Six steps of every parameter dtype on `gpu` against the CPU reference, bit for bit.
void expect_cuda_equals_cpu(const torch::Device& gpu) {
  for (auto [dtype, param_dtype] : {std::pair{torch::kFloat32, ParamDtype::kFloat32},
                                    std::pair{torch::kBFloat16, ParamDtype::kBFloat16},
                                    std::pair{torch::kFloat16, ParamDtype::kFloat16}}) {
    Case cpu = make_case(dtype, torch::kCPU, 7), cuda = make_case(dtype, gpu, 7);
    AdamW8bitCudaPlan plan(cuda.views.data(), cuda.views.size(), param_dtype, gpu.index());
    for (int64_t t = 1; t <= 6; ++t) {
      if (t % 2 == 0) {
        // Gradients allocated anew, as the trainer's next backward does after zero_grad: the
        // plan's table follows them (retarget), the old ones alive until then so every address
        // changes.
        std::vector<torch::Tensor> old = std::move(cuda.g);
        cuda.g.clear();
        for (size_t i = 0; i < old.size(); ++i) {
          cuda.g.push_back(torch::empty_like(old[i]));
          cuda.views[i].grad = cuda.g[i].data_ptr();
        }
        plan.retarget(cuda.views.data(), cuda.views.size(), /*stream=*/nullptr);
      }
      fill_gradients(cpu, t, dtype);
      fill_gradients(cuda, t, dtype);
      // Step 5: tensors 0 and 2 (fp32 and 8-bit state) have no gradient (their modules dropped
      // by module_dropout): null in the table, which keeps its size, and left alone on both
      // sides. Step 6's retarget above gives them theirs again.
      const std::vector<size_t> dropped = t == 5 ? std::vector<size_t>{0, 2} : std::vector<size_t>{};
      std::vector<torch::Tensor> before;
      for (size_t i : dropped) {
        cpu.views[i].grad = nullptr;
        cuda.views[i].grad = nullptr;
        before.insert(before.end(), {cpu.p[i].clone(), cpu.s1[i].clone(), cpu.a1[i].clone()});
      }
      if (!dropped.empty()) plan.retarget(cuda.views.data(), cuda.views.size(), nullptr);
      const std::vector<AdamW8bitStep> steps = group_steps(t);
      adamw8bit_step_cpu(cpu.views.data(), cpu.views.size(), param_dtype, steps.data(),
                         steps.size());
      plan.step(steps.data(), steps.size(), /*stream=*/nullptr);
      torch::cuda::synchronize();
      for (size_t k = 0; k < dropped.size(); ++k) {
        const size_t i = dropped[k];
        EXPECT_TRUE(torch::equal(cpu.p[i], before[3 * k])) << "tensor " << i << " moved";
        EXPECT_TRUE(torch::equal(cpu.s1[i], before[3 * k + 1])) << "tensor " << i << "'s state";
        EXPECT_TRUE(torch::equal(cpu.a1[i], before[3 * k + 2])) << "tensor " << i << "'s absmax";
        cpu.views[i].grad = cpu.g[i].data_ptr();
      }
      for (size_t i = 0; i < cpu.p.size(); ++i) {
        const std::string what = std::string(c10::toString(dtype)) + " tensor " +
                                 std::to_string(i) + " step " + std::to_string(t);
        // Bits, not values: NaN-free by construction, and -0.0 vs 0.0 would also count.
        EXPECT_TRUE(torch::equal(cuda.p[i].cpu().view(torch::kUInt8), cpu.p[i].view(torch::kUInt8)))
            << what;
        EXPECT_TRUE(torch::equal(cuda.s1[i].cpu(), cpu.s1[i])) << what;
        EXPECT_TRUE(torch::equal(cuda.s2[i].cpu(), cpu.s2[i])) << what;
        EXPECT_TRUE(torch::equal(cuda.a1[i].cpu(), cpu.a1[i])) << what;
        EXPECT_TRUE(torch::equal(cuda.a2[i].cpu(), cpu.a2[i])) << what;
      }
    }
  }
}

TEST(AdamW8bitCuda, EqualsCpuReferenceBitForBit) {
  if (!torch::cuda::is_available() || !built_with_cuda()) {
    GTEST_SKIP() << "lorapipe-skip: needs a CUDA device and a build with LORAPIPE_CUDA "
                    "(tests/gpu/run.sh)";
  }
  expect_cuda_equals_cpu(torch::Device(torch::kCUDA, 0));
}

// A plan for tensors on cuda:1 allocates and launches there while device 0 is current (a rank
// with LOCAL_RANK=1 never makes its GPU current): same bits as the CPU reference.
TEST(AdamW8bitCuda, StepsOnItsTensorsDeviceWhicheverIsCurrent) {
  if (!built_with_cuda() || torch::cuda::device_count() < 2) {
    GTEST_SKIP() << "lorapipe-skip: needs two CUDA devices and a build with LORAPIPE_CUDA";
  }
  expect_cuda_equals_cpu(torch::Device(torch::kCUDA, 1));
}

// As the CPU step does, a step whose group constants do not reach a tensor's group is refused
// (it would otherwise update that tensor's moments with a zero step size).
TEST(AdamW8bitCuda, RefusesAStepThatLeavesATensorsGroupOut) {
  if (!torch::cuda::is_available() || !built_with_cuda()) {
    GTEST_SKIP() << "lorapipe-skip: needs a CUDA device and a build with LORAPIPE_CUDA "
                    "(tests/gpu/run.sh)";
  }
  Case cuda = make_case(torch::kFloat32, torch::Device(torch::kCUDA, 0), 7);
  ASSERT_TRUE(std::any_of(cuda.views.begin(), cuda.views.end(),
                          [](const AdamW8bitTensor& v) { return v.group == 1; }));
  AdamW8bitCudaPlan plan(cuda.views.data(), cuda.views.size(), ParamDtype::kFloat32, 0);
  const AdamW8bitStep one = adamw8bit_step_constants(1e-3, 0.9, 0.999, 1e-8, 0.01, 1);
  EXPECT_THROW(plan.step(&one, 1, /*stream=*/nullptr), std::invalid_argument);
  // And a retarget to tensors that are not the plan's: one fewer, or one of another size.
  EXPECT_THROW(plan.retarget(cuda.views.data(), cuda.views.size() - 1, nullptr),
               std::invalid_argument);
  std::vector<AdamW8bitTensor> resized = cuda.views;
  resized[1].numel -= 1;
  EXPECT_THROW(plan.retarget(resized.data(), resized.size(), nullptr), std::invalid_argument);
}

// Paged state (CUDA managed memory, prefetched before the step) gives the same bytes as plain
// device memory.
TEST(AdamW8bitCuda, PagedStateEqualsPlainDeviceState) {
  if (!torch::cuda::is_available() || !built_with_cuda()) {
    GTEST_SKIP() << "lorapipe-skip: needs a CUDA device and a build with LORAPIPE_CUDA "
                    "(tests/gpu/run.sh)";
  }
  if (!managed_memory_supported(0))
    GTEST_SKIP() << "lorapipe-skip: device 0 cannot page (no concurrent managed access)";
  const torch::Device gpu(torch::kCUDA, 0);
  const int64_t n = 1 << 20, blocks = adamw8bit_blocks(n);
  auto gen = at::detail::createCPUGenerator(3);
  const torch::Tensor p0 = torch::randn({n}, gen) * 0.1;
  torch::Tensor p_plain = p0.to(gpu), p_paged = p0.to(gpu), g = torch::zeros({n}, gpu);
  const size_t bytes = static_cast<size_t>(2 * n + 8 * blocks);
  torch::Tensor plain = torch::zeros({static_cast<int64_t>(bytes)},
                                     torch::TensorOptions().dtype(torch::kUInt8).device(gpu));
  void* managed = alloc_managed(bytes, 0);
  ASSERT_NE(managed, nullptr);
  torch::Tensor paged = torch::from_blob(managed, {static_cast<int64_t>(bytes)},
                                         torch::TensorOptions().dtype(torch::kUInt8).device(gpu));
  paged.zero_();
  auto view = [&](torch::Tensor& p, torch::Tensor& arena) {
    auto* base = arena.data_ptr<uint8_t>();
    return AdamW8bitTensor{p.data_ptr(),
                           g.data_ptr(),
                           base,
                           base + n,
                           reinterpret_cast<float*>(base + 2 * n),
                           reinterpret_cast<float*>(base + 2 * n + 4 * blocks),
                           n,
                           true,
                           0};
  };
  const AdamW8bitTensor v_plain = view(p_plain, plain), v_paged = view(p_paged, paged);
  AdamW8bitCudaPlan plan_plain(&v_plain, 1, ParamDtype::kFloat32, 0);
  AdamW8bitCudaPlan plan_paged(&v_paged, 1, ParamDtype::kFloat32, 0);
  for (int64_t t = 1; t <= 5; ++t) {
    g.copy_(torch::randn({n}, gen) * 0.01);
    const AdamW8bitStep c = adamw8bit_step_constants(1e-3, 0.9, 0.999, 1e-8, 0.01, t);
    plan_plain.step(&c, 1, nullptr);
    prefetch_managed(managed, bytes, 0, nullptr);
    plan_paged.step(&c, 1, nullptr);
  }
  torch::cuda::synchronize();
  EXPECT_TRUE(torch::equal(plain.cpu(), paged.cpu()));
  EXPECT_TRUE(torch::equal(p_plain.cpu(), p_paged.cpu()));
  paged = torch::Tensor();
  free_managed(managed);
}

}  // namespace
}  // namespace lorapipe::kernels
