// CPU reference of kernels/adamw8bit.h: the oracle for the CUDA kernel and the optimizer used when
// training on the CPU. Work is split by 256-element blocks (each block's absmax depends on its
// elements only), so threads never share a block and the result does not depend on their count.
// Built with -ffp-contract=off (kernels/CMakeLists.txt): no fused multiply-add, as in the kernel.

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/adamw8bit.h"
#include "kernels/adamw8bit_rules.h"

namespace lorapipe::kernels {
namespace {

namespace rules = adamw8bit_rules;

// bitsandbytes create_dynamic_map(signed, max_exponent_bits=7, total_bits=8): for each decade
// 10^(i-6), i = 0..6, the midpoints of torch.linspace(0.1, 1, k) with k = 2^i + 1 (signed, and
// their negatives) or 2^(i+1) + 1 (unsigned), scaled; then 0 and 1, sorted. torch's float32
// linspace computes start + i * step for the first half and end - (k - 1 - i) * step for the
// second, each with one rounding (a fused multiply-add), and the midpoints and scaling are fp32:
// we do the same, and the test holds the result to bitsandbytes' map bit for bit.
std::array<float, 256> make_dynamic_map(bool is_signed) {
  std::vector<float> data;
  for (int i = 0; i < 7; ++i) {
    const int k = is_signed ? (1 << i) + 1 : (1 << (i + 1)) + 1;
    const float start = 0.1f, end = 1.0f;
    const float step = (end - start) / static_cast<float>(k - 1);
    std::vector<float> points(k);
    for (int j = 0; j < k; ++j) {
      points[j] = j < k / 2 ? std::fma(static_cast<float>(j), step, start)
                            : std::fma(-static_cast<float>(k - 1 - j), step, end);
    }
    const float scale = static_cast<float>(std::pow(10.0, i - 6));
    for (int j = 0; j + 1 < k; ++j) {
      const float mean = (points[j] + points[j + 1]) / 2.0f;
      data.push_back(scale * mean);
      if (is_signed) data.push_back(-scale * mean);
    }
  }
  data.push_back(0.0f);
  data.push_back(1.0f);
  if (data.size() != 256) throw std::logic_error("dynamic map has " + std::to_string(data.size()));
  std::sort(data.begin(), data.end());
  std::array<float, 256> out;
  std::copy(data.begin(), data.end(), out.begin());
  return out;
}

// Parameter and gradient storage: fp32, or bf16 / fp16 rounded to nearest even.
float bf16_to_float(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

uint16_t float_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

template <ParamDtype D>
float load(const void* data, int64_t i) {
  if constexpr (D == ParamDtype::kFloat32) {
    return static_cast<const float*>(data)[i];
  } else if constexpr (D == ParamDtype::kBFloat16) {
    return bf16_to_float(static_cast<const uint16_t*>(data)[i]);
  } else {
    return static_cast<float>(static_cast<const _Float16*>(data)[i]);
  }
}

template <ParamDtype D>
void store(void* data, int64_t i, float value) {
  if constexpr (D == ParamDtype::kFloat32) {
    static_cast<float*>(data)[i] = value;
  } else if constexpr (D == ParamDtype::kBFloat16) {
    static_cast<uint16_t*>(data)[i] = float_to_bf16(value);
  } else {
    static_cast<_Float16*>(data)[i] = static_cast<_Float16>(value);
  }
}

// The nearest code without the kernel's 8-step binary search (which is most of a CPU step): the
// top 13 bits of x (sign, exponent, 4 mantissa bits) pick a bucket of floats; the bucket's
// smallest and largest value bound the answer to codes [lo, hi], and the answer is lo plus the
// number of midpoints mid[lo..] below x. Midpoints from hi on are never below x, so comparing a
// fixed `window` (the widest bucket's hi - lo) of them counts exactly the same: the result equals
// adamw8bit_rules::nearest_code bit for bit, with independent loads instead of dependent ones.
class NearestTable {
 public:
  explicit NearestTable(const std::array<float, 256>& code) {
    const std::array<float, 256> mid = code_midpoints(code);
    std::copy(mid.begin(), mid.end(), mid_.begin());
    std::fill(mid_.begin() + 256, mid_.end(), INFINITY);
    for (uint32_t key = 0; key < kKeys; ++key) {
      const uint32_t first = key << kShift, last = first | ((1u << kShift) - 1);
      float a, b;
      std::memcpy(&a, &first, sizeof a);
      std::memcpy(&b, &last, sizeof b);
      if (!std::isfinite(a) || !std::isfinite(b)) continue;  // never normalised values
      const int ia = rules::nearest_code(mid.data(), a), ib = rules::nearest_code(mid.data(), b);
      lo_[key] = static_cast<uint8_t>(std::min(ia, ib));
      window_ = std::max(window_, std::abs(ib - ia));
    }
    if (window_ > kMaxWindow) throw std::logic_error("adamw8bit: nearest-code window too wide");
    // Comparing kMaxWindow >= window_ midpoints counts the same (those past hi are never below
    // x), so the search needs no mask.
  }
  int nearest(float x) const {
    uint32_t bits;
    std::memcpy(&bits, &x, sizeof bits);
    const int lo = lo_[bits >> kShift];
    int index = lo;
#pragma GCC unroll 8
    for (int k = 0; k < kMaxWindow; ++k) index += static_cast<int>(mid_[lo + k] < x);
    return index;
  }

 private:
  static constexpr int kShift = 19;
  static constexpr uint32_t kKeys = 1u << (32 - kShift);
  static constexpr int kMaxWindow = 8;
  std::array<float, 256 + kMaxWindow> mid_{};
  std::array<uint8_t, kKeys> lo_{};
  int window_ = 0;
};

struct Maps {
  const std::array<float, 256>& code1 = dynamic_map_signed();
  const std::array<float, 256>& code2 = dynamic_map_unsigned();
  const NearestTable nearest1{code1};
  const NearestTable nearest2{code2};
};

const Maps& maps() {
  static const Maps instance;
  return instance;
}

// One 256-element block of tensor t: steps 1-5 of the header.
template <ParamDtype D>
void update_block(const AdamW8bitTensor& t, int64_t block, const AdamW8bitStep& s, const Maps& q) {
  const int64_t begin = block * kAdamW8bitBlock;
  const int n = static_cast<int>(std::min<int64_t>(kAdamW8bitBlock, t.numel - begin));
  float m[kAdamW8bitBlock], v[kAdamW8bitBlock];
  if (!t.quantized) {
    float* m_state = static_cast<float*>(t.state1) + begin;
    float* v_state = static_cast<float*>(t.state2) + begin;
    for (int j = 0; j < n; ++j) {
      const float grad = load<D>(t.grad, begin + j);
      if (!rules::is_finite(grad)) continue;
      rules::update_moments(s, grad, m_state[j], v_state[j]);
      store<D>(t.param, begin + j,
               rules::update_param(s, load<D>(t.param, begin + j), m_state[j], v_state[j]));
    }
    return;
  }
  // Branch-free loops (selects instead of skips) so the compiler can vectorise them.
  const uint8_t* in1 = static_cast<const uint8_t*>(t.state1) + begin;
  const uint8_t* in2 = static_cast<const uint8_t*>(t.state2) + begin;
  const float old_max1 = t.absmax1[block], old_max2 = t.absmax2[block];
  bool finite[kAdamW8bitBlock];
  for (int j = 0; j < n; ++j) {
    const float grad = load<D>(t.grad, begin + j);
    float m_new = q.code1[in1[j]] * old_max1, v_new = q.code2[in2[j]] * old_max2;
    const float m_old = m_new, v_old = v_new;
    rules::update_moments(s, grad, m_new, v_new);
    finite[j] = rules::is_finite(grad);
    m[j] = finite[j] ? m_new : m_old;
    v[j] = finite[j] ? v_new : v_old;
  }
  float max1 = 0.f, max2 = 0.f;
  for (int j = 0; j < n; ++j) {
    max1 = std::max(max1, std::fabs(m[j]));
    max2 = std::max(max2, std::fabs(v[j]));
  }
  for (int j = 0; j < n; ++j) {
    const float p = load<D>(t.param, begin + j);
    const float updated = rules::update_param(s, p, m[j], v[j]);
    // A skipped element is written back as it was read: the same bits in every dtype.
    store<D>(t.param, begin + j, finite[j] ? updated : p);
  }
  uint8_t* out1 = static_cast<uint8_t*>(t.state1) + begin;
  uint8_t* out2 = static_cast<uint8_t*>(t.state2) + begin;
  for (int j = 0; j < n; ++j) {
    const int index1 = q.nearest1.nearest(rules::normalized(m[j], max1));
    out1[j] = static_cast<uint8_t>(rules::sign_fixed(q.code1.data(), index1, m[j]));
    out2[j] = static_cast<uint8_t>(q.nearest2.nearest(rules::normalized(v[j], max2)));
  }
  t.absmax1[block] = max1;
  t.absmax2[block] = max2;
}

}  // namespace

const std::array<float, 256>& dynamic_map_signed() {
  static const std::array<float, 256> map = make_dynamic_map(/*is_signed=*/true);
  return map;
}

const std::array<float, 256>& dynamic_map_unsigned() {
  static const std::array<float, 256> map = make_dynamic_map(/*is_signed=*/false);
  return map;
}

std::array<float, 256> code_midpoints(const std::array<float, 256>& code) {
  std::array<float, 256> mid;
  for (int k = 0; k < 255; ++k) mid[k] = (code[k] + code[k + 1]) * 0.5f;
  mid[255] = INFINITY;
  return mid;
}

AdamW8bitStep adamw8bit_step_constants(double lr, double beta1, double beta2, double eps,
                                       double weight_decay, int64_t t) {
  AdamW8bitStep s;
  s.beta1 = static_cast<float>(beta1);
  s.beta2 = static_cast<float>(beta2);
  s.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  s.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  s.eps = static_cast<float>(eps);
  s.decay = static_cast<float>(1.0 - lr * weight_decay);
  s.step_size = static_cast<float>(lr / (1.0 - std::pow(beta1, static_cast<double>(t))));
  s.correction2 = static_cast<float>(std::sqrt(1.0 - std::pow(beta2, static_cast<double>(t))));
  return s;
}

void adamw8bit_step_cpu(const AdamW8bitTensor* tensors, size_t count, ParamDtype dtype,
                        const AdamW8bitStep* group_steps, size_t groups, int threads) {
  // Every (tensor, block) pair is one work item; first[i] is tensor i's first item.
  std::vector<int64_t> first(count + 1, 0);
  for (size_t i = 0; i < count; ++i) {
    if (tensors[i].group < 0 || static_cast<size_t>(tensors[i].group) >= groups) {
      throw std::invalid_argument("adamw8bit: tensor " + std::to_string(i) + " has group " +
                                  std::to_string(tensors[i].group) + " of " +
                                  std::to_string(groups));
    }
    first[i + 1] = first[i] + adamw8bit_blocks(tensors[i].numel);
  }
  const Maps& q = maps();
  const int64_t items = first[count];
  const int team = threads > 0 ? threads : omp_get_max_threads();
#pragma omp parallel for schedule(static) num_threads(team) if (items > 16)
  for (int64_t item = 0; item < items; ++item) {
    const size_t i =
        static_cast<size_t>(std::upper_bound(first.begin(), first.end(), item) - first.begin() - 1);
    if (tensors[i].grad == nullptr) continue;  // no gradient this step: left alone
    const AdamW8bitStep& step = group_steps[tensors[i].group];
    switch (dtype) {
      case ParamDtype::kFloat32:
        update_block<ParamDtype::kFloat32>(tensors[i], item - first[i], step, q);
        break;
      case ParamDtype::kBFloat16:
        update_block<ParamDtype::kBFloat16>(tensors[i], item - first[i], step, q);
        break;
      case ParamDtype::kFloat16:
        update_block<ParamDtype::kFloat16>(tensors[i], item - first[i], step, q);
        break;
    }
  }
}

void quantize_blockwise_cpu(const float* x, int64_t n, const std::array<float, 256>& code,
                            bool sign_fix, uint8_t* bytes, float* absmax) {
  const NearestTable table(code);
  for (int64_t block = 0; block < adamw8bit_blocks(n); ++block) {
    const int64_t begin = block * kAdamW8bitBlock;
    const int64_t end = std::min(n, begin + kAdamW8bitBlock);
    float max = 0.f;
    for (int64_t i = begin; i < end; ++i) max = std::max(max, std::fabs(x[i]));
    for (int64_t i = begin; i < end; ++i) {
      const int index = table.nearest(rules::normalized(x[i], max));
      bytes[i] =
          static_cast<uint8_t>(sign_fix ? rules::sign_fixed(code.data(), index, x[i]) : index);
    }
    absmax[block] = max;
  }
}

void dequantize_blockwise_cpu(const uint8_t* bytes, const float* absmax, int64_t n,
                              const std::array<float, 256>& code, float* x) {
  for (int64_t i = 0; i < n; ++i) x[i] = code[bytes[i]] * absmax[i / kAdamW8bitBlock];
}

}  // namespace lorapipe::kernels
