#include "models/t5.h"

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <limits>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>

#include "common/error.h"
#include "common/log.h"
#include "models/empty_linear.h"
#include "models/safetensors.h"
#include "models/weights.h"

namespace lorapipe::models {
namespace {

bool is_16bit(at::ScalarType t) { return t == at::kHalf || t == at::kBFloat16; }

// torch.finfo(dtype).min, the additive mask of a padded key.
double lowest(at::ScalarType t) {
  switch (t) {
    case at::kHalf:
      return static_cast<double>(std::numeric_limits<c10::Half>::lowest());
    case at::kBFloat16:
      return static_cast<double>(std::numeric_limits<c10::BFloat16>::lowest());
    case at::kDouble:
      return std::numeric_limits<double>::lowest();
    default:
      return std::numeric_limits<float>::lowest();
  }
}

// transformers' fp16 guard after each layer: an overflow to inf is clamped just inside the range.
// The limit is chosen on the device (torch.where, as transformers does): no copy to the host and
// wait in each layer.
at::Tensor clamp_fp16(const at::Tensor& x) {
  if (x.scalar_type() != at::kHalf) return x;
  const double max = 65504.0;
  const at::TensorOptions fp32 = x.options().dtype(at::kFloat);
  const at::Tensor limit = at::where(x.isinf().any(), at::scalar_tensor(max - 1000, fp32),
                                     at::scalar_tensor(max, fp32));
  return at::clamp(x, -limit, limit);
}

// NewGELUActivation, op for op (the tanh approximation as transformers writes it).
at::Tensor gelu_new(const at::Tensor& x) {
  return 0.5 * x * (1.0 + at::tanh(std::sqrt(2.0 / M_PI) * (x + 0.044715 * at::pow(x, 3.0))));
}

std::shared_ptr<torch::nn::Module> holder(torch::nn::Module& parent, const std::string& name) {
  return parent.register_module(name, std::make_shared<torch::nn::Module>());
}

}  // namespace

T5Config T5Config::from_json(const std::string& json, const std::string& source) {
  T5Config c;
  try {
    const nlohmann::json j = nlohmann::json::parse(json);
    c.vocab_size = j.value("vocab_size", c.vocab_size);
    c.d_model = j.value("d_model", c.d_model);
    c.d_kv = j.value("d_kv", c.d_kv);
    c.d_ff = j.value("d_ff", c.d_ff);
    c.num_layers = j.value("num_layers", c.num_layers);
    c.num_heads = j.value("num_heads", c.num_heads);
    c.relative_attention_num_buckets =
        j.value("relative_attention_num_buckets", c.relative_attention_num_buckets);
    c.relative_attention_max_distance =
        j.value("relative_attention_max_distance", c.relative_attention_max_distance);
    c.layer_norm_epsilon = j.value("layer_norm_epsilon", c.layer_norm_epsilon);
    const std::string ff = j.value("feed_forward_proj", std::string("gated-gelu"));
    if (ff != "gated-gelu") {
      throw InputError(source + ": feed_forward_proj '" + ff +
                       "' (lorapipe builds T5 v1.1's gated-gelu encoder, as Flux.1 uses)");
    }
  } catch (const nlohmann::json::exception& e) {
    throw InputError(source + ": T5 config: " + e.what());
  }
  return c;
}

at::Tensor t5_relative_position_bucket(const at::Tensor& relative, int64_t num_buckets,
                                       int64_t max_distance) {
  const int64_t half = num_buckets / 2;  // bidirectional: half the buckets for keys after
  at::Tensor buckets = (relative > 0).to(at::kLong) * half;
  const at::Tensor n = relative.abs();
  const int64_t max_exact = half / 2;
  const at::Tensor large =
      (at::log(n.to(at::kFloat) / static_cast<double>(max_exact)) /
       std::log(static_cast<double>(max_distance) / static_cast<double>(max_exact)) *
       static_cast<double>(half - max_exact))
          .to(at::kLong) +
      max_exact;
  return buckets + at::where(n < max_exact, n, at::clamp_max(large, half - 1));
}

T5LayerNormImpl::T5LayerNormImpl(int64_t dim, double eps_, const at::TensorOptions& options)
    : eps(eps_) {
  weight = register_parameter("weight", at::empty({dim}, options));
}

at::Tensor T5LayerNormImpl::forward(const at::Tensor& x) {
  const at::Tensor variance = x.to(at::kFloat).pow(2).mean(-1, /*keepdim=*/true);
  at::Tensor h = x * at::rsqrt(variance + eps);
  if (is_16bit(weight.scalar_type())) h = h.to(weight.scalar_type());
  return weight * h;
}

T5BlockImpl::T5BlockImpl(const T5Config& c, bool relative_bias, const at::TensorOptions& options)
    : config(c) {
  const int64_t inner = c.num_heads * c.d_kv;
  auto layer = holder(*this, "layer");
  auto self_attention_layer = holder(*layer, "0");
  auto attn = holder(*self_attention_layer, "SelfAttention");
  q = attn->register_module("q", empty_linear(c.d_model, inner, false, options));
  k = attn->register_module("k", empty_linear(c.d_model, inner, false, options));
  v = attn->register_module("v", empty_linear(c.d_model, inner, false, options));
  o = attn->register_module("o", empty_linear(inner, c.d_model, false, options));
  if (relative_bias) {
    relative_attention_bias =
        holder(*attn, "relative_attention_bias")
            ->register_parameter(
                "weight", at::empty({c.relative_attention_num_buckets, c.num_heads}, options));
  }
  attention_norm = self_attention_layer->register_module(
      "layer_norm", T5LayerNorm(c.d_model, c.layer_norm_epsilon, options));
  auto ff_layer = holder(*layer, "1");
  auto ff = holder(*ff_layer, "DenseReluDense");
  wi_0 = ff->register_module("wi_0", empty_linear(c.d_model, c.d_ff, false, options));
  wi_1 = ff->register_module("wi_1", empty_linear(c.d_model, c.d_ff, false, options));
  const at::TensorOptions wo_options =
      c10::typeMetaToScalarType(options.dtype()) == at::kHalf ? options.dtype(at::kFloat) : options;
  wo = ff->register_module("wo", empty_linear(c.d_ff, c.d_model, false, wo_options));
  ff_norm = ff_layer->register_module("layer_norm",
                                      T5LayerNorm(c.d_model, c.layer_norm_epsilon, options));
}

// `wo`'s weights are set aside before the conversion and put back (moved, never rounded), so an
// fp32 wo keeps its exact values.
void T5BlockImpl::to(torch::Dtype dtype, bool non_blocking) {
  const at::Tensor kept = wo->weight.detach();
  torch::nn::Module::to(dtype, non_blocking);
  if (dtype != at::kHalf) return;
  wo->weight.set_data(kept.scalar_type() == at::kHalf ? kept.to(at::kFloat) : kept);
}

void T5BlockImpl::to(torch::Device device, torch::Dtype dtype, bool non_blocking) {
  const at::Tensor kept = wo->weight.detach();
  torch::nn::Module::to(device, dtype, non_blocking);
  if (dtype != at::kHalf) return;
  wo->weight.set_data(kept.to(device, kept.scalar_type() == at::kHalf ? at::kFloat
                                                                     : kept.scalar_type(),
                              non_blocking));
}

at::Tensor T5BlockImpl::position_bias(int64_t length) const {
  const auto positions = at::arange(length, relative_attention_bias.options().dtype(at::kLong));
  const at::Tensor relative = positions.unsqueeze(0) - positions.unsqueeze(1);  // key - query
  const at::Tensor buckets = t5_relative_position_bucket(
      relative, config.relative_attention_num_buckets, config.relative_attention_max_distance);
  return at::embedding(relative_attention_bias, buckets).permute({2, 0, 1}).unsqueeze(0);
}

at::Tensor T5BlockImpl::forward(const at::Tensor& x, const at::Tensor& bias) {
  const int64_t b = x.size(0), t = x.size(1), heads = config.num_heads, d = config.d_kv;
  const at::Tensor h = attention_norm(x);
  auto split = [&](const at::Tensor& y) { return y.view({b, t, heads, d}).transpose(1, 2); };
  // T5 does not scale the scores: its initialisation folds 1/sqrt(d) into q.
  at::Tensor scores = at::matmul(split(q(h)), split(k(h)).transpose(3, 2));
  scores += bias;
  const at::Tensor weights = at::softmax(scores.to(at::kFloat), -1).to(scores.scalar_type());
  const at::Tensor a = at::matmul(weights, split(v(h))).transpose(1, 2).reshape({b, t, -1});
  at::Tensor out = clamp_fp16(x + o(a));

  const at::Tensor n = ff_norm(out);
  at::Tensor gated = gelu_new(wi_0(n)) * wi_1(n);
  // wo computes in its weight's dtype (fp32 beside fp16: transformers' keep-in-fp32). A float8
  // wo (--fp8_base) computes in what it stood in for: fp32 beside fp16, else the block's dtype.
  const c10::ScalarType wo_dtype =
      !is_float8(wo->weight) ? wo->weight.scalar_type()
      : gated.scalar_type() == at::kHalf ? at::kFloat
                                         : gated.scalar_type();
  if (gated.scalar_type() != wo_dtype) gated = gated.to(wo_dtype);
  return clamp_fp16(out + wo(gated));
}

T5EncoderImpl::T5EncoderImpl(const T5Config& c, const at::TensorOptions& options) : config(c) {
  shared = holder(*this, "shared")
               ->register_parameter("weight", at::empty({c.vocab_size, c.d_model}, options));
  auto encoder = holder(*this, "encoder");
  for (int64_t i = 0; i < c.num_layers; ++i) blocks->push_back(T5Block(c, i == 0, options));
  encoder->register_module("block", blocks);
  final_layer_norm = encoder->register_module(
      "final_layer_norm", T5LayerNorm(c.d_model, c.layer_norm_epsilon, options));
}

at::Tensor T5EncoderImpl::forward(const at::Tensor& ids, const at::Tensor& mask) {
  at::Tensor x = at::embedding(shared, ids.to(shared.device()));
  const int64_t t = ids.size(1);
  at::Tensor bias = blocks[0]->as<T5BlockImpl>()->position_bias(t);
  if (mask.defined()) {
    const at::Tensor m = mask.to(x.device()).view({mask.size(0), 1, 1, t}).to(x.scalar_type());
    bias = bias + (1.0 - m) * lowest(x.scalar_type());
  }
  for (const auto& block : *blocks) x = block->as<T5BlockImpl>()->forward(x, bias);
  return final_layer_norm(x);
}

void load_t5_encoder(T5EncoderImpl& encoder, const SafetensorsFile& file) {
  load_t5_encoder(encoder, {&file}, file.path().string());
}

void load_t5_encoder(T5EncoderImpl& encoder, const std::vector<const SafetensorsFile*>& files,
                     const std::string& source, const std::string& prefix) {
  std::map<std::string, std::pair<const SafetensorsFile*, const TensorInfo*>> where;
  for (const SafetensorsFile* f : files) {
    for (const TensorInfo& t : f->tensors()) {
      if (t.name.rfind(prefix, 0) == 0) where[t.name.substr(prefix.size())] = {f, &t};
    }
  }
  // The embeddings are tied: files hold them as shared.weight, encoder.embed_tokens.weight or
  // both; one is read, the other is no surprise.
  if (auto it = where.find("encoder.embed_tokens.weight"); it != where.end()) {
    if (!where.count("shared.weight")) where["shared.weight"] = it->second;
    where.erase(it);
  }
  // A whole T5ForConditionalGeneration file carries the decoder and the LM head too; the encoder
  // is read from it and the rest left, as kohya's loader (strict=False) leaves it.
  int decoder = 0;
  for (auto it = where.begin(); it != where.end();) {
    if (it->first.rfind("decoder.", 0) == 0 || it->first == "lm_head.weight") {
      it = where.erase(it);
      ++decoder;
    } else {
      ++it;
    }
  }
  if (decoder > 0) {
    LP_LOG(kInfo, "models") << source << ": " << decoder
                            << " decoder and LM-head tensors left unread (T5's encoder only)";
  }
  std::set<std::string> names;
  for (const auto& [name, _] : where) names.insert(name);
  load_into(
      encoder, names,
      [&](const std::string& name) {
        const auto& [file, info] = where.at(name);
        return read_tensor(*file, *info);
      },
      [&](const std::string& name) {
        const auto& [file, info] = where.at(name);
        file->release(*info);
      },
      source);
}

}  // namespace lorapipe::models
