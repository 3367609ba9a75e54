#include "models/flux.h"

#include <ATen/ATen.h>
#include <torch/nn/functional/activation.h>

#include <cmath>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "common/error.h"
#include "models/attention.h"
#include "models/block_swap.h"
#include "models/checkpoint.h"
#include "models/empty_linear.h"
#include "models/loading.h"
#include "models/safetensors.h"
#include "models/weights.h"

namespace lorapipe::models {
namespace {

Linear make_linear(int64_t in, int64_t out, bool bias, const at::TensorOptions& options) {
  return empty_linear(in, out, bias, options);
}

// Every LayerNorm of Flux: no affine parameters, eps 1e-6.
at::Tensor plain_norm(const at::Tensor& x) { return at::layer_norm(x, {x.size(-1)}, {}, {}, 1e-6); }

// [B, L, 3 * H * D] -> q, k, v, each [B, H, L, D] (BFL's "B L (K H D) -> K B H L D").
std::vector<at::Tensor> split_heads(const at::Tensor& qkv, int64_t heads) {
  const int64_t b = qkv.size(0), l = qkv.size(1);
  const at::Tensor t = qkv.view({b, l, 3, heads, -1}).permute({2, 0, 3, 1, 4});
  return {t[0], t[1], t[2]};
}

// Rope, attention, and the heads joined again: [B, H, S, D] -> [B, S, H * D].
at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const Rope& pe,
                  const at::Tensor& key_mask) {
  const at::Tensor out = masked_attention(apply_rope(q, pe), apply_rope(k, pe), v, key_mask);
  return out.transpose(1, 2).flatten(2);
}

}  // namespace

// ---- config ------------------------------------------------------------------------------------

void FluxConfig::validate(const std::string& source) const {
  auto fail = [&source](const std::string& why) {
    throw InputError(source + ": not a Flux transformer lorapipe can build: " + why);
  };
  if (num_heads <= 0 || hidden_size <= 0 || hidden_size % num_heads != 0) {
    fail("hidden size " + std::to_string(hidden_size) + " is not a multiple of " +
         std::to_string(num_heads) + " heads");
  }
  int64_t axes = 0;
  for (int64_t d : axes_dim) {
    if (d <= 0 || d % 2 != 0) fail("rotary axis widths must be even and positive");
    axes += d;
  }
  if (axes != head_dim()) {
    fail("rotary axis widths sum to " + std::to_string(axes) + ", the head width is " +
         std::to_string(head_dim()));
  }
  if (depth < 0 || depth_single_blocks < 0 || in_channels <= 0 || vec_in_dim <= 0 ||
      context_in_dim <= 0) {
    fail("a width or block count is not positive");
  }
}

FluxConfig FluxConfig::from_diffusers_json(const std::string& json, const std::string& source) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(json);
  } catch (const std::exception& e) {
    throw InputError(source + ": not JSON: " + e.what());
  }
  FluxConfig c;
  try {
    c.in_channels = j.value("in_channels", int64_t{64});
    const int64_t head_dim = j.value("attention_head_dim", int64_t{128});
    c.num_heads = j.value("num_attention_heads", int64_t{24});
    c.hidden_size = head_dim * c.num_heads;
    c.depth = j.value("num_layers", int64_t{19});
    c.depth_single_blocks = j.value("num_single_layers", int64_t{38});
    c.context_in_dim = j.value("joint_attention_dim", int64_t{4096});
    c.vec_in_dim = j.value("pooled_projection_dim", int64_t{768});
    c.guidance_embed = j.value("guidance_embeds", false);
    if (j.contains("axes_dims_rope")) c.axes_dim = j["axes_dims_rope"].get<std::vector<int64_t>>();
    if (j.value("patch_size", int64_t{1}) != 1) {
      throw InputError(source + ": patch_size " + j["patch_size"].dump() +
                       " (Flux.1 packs 2x2 outside the transformer, with patch_size 1)");
    }
    if (j.contains("out_channels") && !j["out_channels"].is_null() &&
        j["out_channels"].get<int64_t>() != c.in_channels) {
      throw InputError(source + ": out_channels " + j["out_channels"].dump() +
                       " differs from in_channels (Flux.1 predicts what it takes)");
    }
  } catch (const nlohmann::json::exception& e) {
    throw InputError(source + ": " + e.what());
  }
  c.validate(source);
  return c;
}

FluxConfig FluxConfig::from_original_file(const SafetensorsFile& file, const std::string& prefix) {
  const std::string source = file.path().string();
  auto shape = [&](const std::string& name) -> std::vector<int64_t> {
    const TensorInfo* info = file.find(prefix + name);
    if (info == nullptr) {
      throw InputError(source + ": no " + prefix + name + " (not a Flux transformer in the " +
                       "original layout)");
    }
    return info->shape;
  };
  FluxConfig c;
  const auto img_in = shape("img_in.weight");
  c.hidden_size = img_in.at(0);
  c.in_channels = img_in.at(1);
  c.context_in_dim = shape("txt_in.weight").at(1);
  c.vec_in_dim = shape("vector_in.in_layer.weight").at(1);
  c.guidance_embed = file.find(prefix + "guidance_in.in_layer.weight") != nullptr;
  std::set<int64_t> doubles, singles;
  for (const TensorInfo& t : file.tensors()) {
    auto block = [&](const std::string& list, std::set<int64_t>& into) {
      const std::string head = prefix + list + ".";
      if (t.name.rfind(head, 0) != 0) return;
      into.insert(std::stoll(t.name.substr(head.size(), t.name.find('.', head.size()))));
    };
    block("double_blocks", doubles);
    block("single_blocks", singles);
  }
  c.depth = static_cast<int64_t>(doubles.size());
  c.depth_single_blocks = static_cast<int64_t>(singles.size());
  if (c.depth > 0) {
    const int64_t head_dim = shape("double_blocks.0.img_attn.norm.query_norm.scale").at(0);
    c.num_heads = c.hidden_size / head_dim;
    c.mlp_ratio = static_cast<double>(shape("double_blocks.0.img_mlp.0.weight").at(0)) /
                  static_cast<double>(c.hidden_size);
    c.qkv_bias = file.find(prefix + "double_blocks.0.img_attn.qkv.bias") != nullptr;
  }
  // The rotary widths are not in the weights: lorapipe's own files say them in their metadata,
  // otherwise they are Flux.1's (whose heads are 128 wide).
  const auto& meta = file.metadata();
  if (auto it = meta.find("lorapipe.flux.axes_dim"); it != meta.end()) {
    c.axes_dim.clear();
    std::istringstream in(it->second);
    for (std::string part; std::getline(in, part, ',');) c.axes_dim.push_back(std::stoll(part));
  } else if (c.head_dim() != 128) {
    throw InputError(source + ": heads " + std::to_string(c.head_dim()) +
                     " wide, and no lorapipe.flux.axes_dim metadata to say the rotary widths " +
                     "(Flux.1's are 16/56/56 over 128)");
  }
  c.validate(source);
  return c;
}

// ---- shared pieces -----------------------------------------------------------------------------

Rope flux_rope(const at::Tensor& ids, const std::vector<int64_t>& axes_dim, double theta) {
  TORCH_CHECK(ids.dim() == 2 || ids.dim() == 3, "flux_rope: ids must be [L, n] or [B, L, n]");
  TORCH_CHECK(ids.size(-1) == static_cast<int64_t>(axes_dim.size()), "flux_rope: ids have ",
              ids.size(-1), " axes, the config ", axes_dim.size());
  const at::Tensor pos = ids.to(at::kDouble);
  std::vector<at::Tensor> angles;
  for (size_t i = 0; i < axes_dim.size(); ++i) {
    const int64_t d = axes_dim[i];
    const at::Tensor omega =
        at::pow(theta, at::arange(0, d, 2, pos.options()) / static_cast<double>(d)).reciprocal();
    angles.push_back(pos.select(-1, static_cast<int64_t>(i)).unsqueeze(-1) * omega);
  }
  at::Tensor a = at::cat(angles, -1);  // [(B,) L, head_dim / 2]
  a = ids.dim() == 2 ? a.unsqueeze(0).unsqueeze(0) : a.unsqueeze(1);
  return {a.cos().to(at::kFloat), a.sin().to(at::kFloat)};
}

at::Tensor apply_rope(const at::Tensor& x, const Rope& rope) {
  const at::Tensor pairs = x.to(at::kFloat).unflatten(-1, {-1, 2});
  const at::Tensor x0 = pairs.select(-1, 0), x1 = pairs.select(-1, 1);
  return at::stack({rope.cos * x0 - rope.sin * x1, rope.sin * x0 + rope.cos * x1}, -1)
      .flatten(-2)
      .to(x.scalar_type());
}

at::Tensor flux_timestep_embedding(const at::Tensor& t, int64_t dim) {
  const int64_t half = dim / 2;
  const at::Tensor freqs =
      at::exp(-std::log(10000.0) * at::arange(0, half, t.options().dtype(at::kFloat)) /
              static_cast<double>(half));
  const at::Tensor args = (t.to(at::kFloat) * 1000.0).reshape({-1, 1}) * freqs.unsqueeze(0);
  return at::cat({args.cos(), args.sin()}, -1);
}

at::Tensor pack_latents(const at::Tensor& latents) {
  const int64_t b = latents.size(0), c = latents.size(1), h = latents.size(2), w = latents.size(3);
  TORCH_CHECK(h % 2 == 0 && w % 2 == 0, "pack_latents: latents of ", h, "x", w,
              " (Flux packs 2x2 patches: both sides must be even)");
  return latents.view({b, c, h / 2, 2, w / 2, 2})
      .permute({0, 2, 4, 1, 3, 5})
      .reshape({b, (h / 2) * (w / 2), c * 4});
}

at::Tensor unpack_latents(const at::Tensor& tokens, int64_t height, int64_t width) {
  const int64_t b = tokens.size(0), c = tokens.size(2) / 4;
  return tokens.view({b, height / 2, width / 2, c, 2, 2})
      .permute({0, 3, 1, 4, 2, 5})
      .reshape({b, c, height, width});
}

at::Tensor image_ids(int64_t height, int64_t width) {
  const int64_t h = height / 2, w = width / 2;
  at::Tensor ids = at::zeros({h, w, 3}, at::kFloat);
  ids.select(-1, 1).copy_(at::arange(h, at::kFloat).unsqueeze(1).expand({h, w}));
  ids.select(-1, 2).copy_(at::arange(w, at::kFloat).unsqueeze(0).expand({h, w}));
  return ids.view({h * w, 3});
}

// ---- modules -----------------------------------------------------------------------------------

FluxRmsNormImpl::FluxRmsNormImpl(int64_t dim, const at::TensorOptions& options) {
  scale = register_parameter("scale", at::empty({dim}, options));
}

at::Tensor FluxRmsNormImpl::forward(const at::Tensor& x) {
  const at::Tensor f = x.to(at::kFloat);
  const at::Tensor rrms = at::rsqrt(f.pow(2).mean(-1, /*keepdim=*/true) + 1e-6);
  return (f * rrms * scale.to(at::kFloat)).to(x.scalar_type());
}

FluxQkNormImpl::FluxQkNormImpl(int64_t dim, const at::TensorOptions& options) {
  query_norm = register_module("query_norm", FluxRmsNorm(dim, options));
  key_norm = register_module("key_norm", FluxRmsNorm(dim, options));
}

FluxMlpEmbedderImpl::FluxMlpEmbedderImpl(int64_t in_dim, int64_t hidden,
                                         const at::TensorOptions& options) {
  in_layer = register_module("in_layer", make_linear(in_dim, hidden, true, options));
  out_layer = register_module("out_layer", make_linear(hidden, hidden, true, options));
}

at::Tensor FluxMlpEmbedderImpl::forward(const at::Tensor& x) {
  return out_layer(at::silu(in_layer(x)));
}

FluxSelfAttentionImpl::FluxSelfAttentionImpl(int64_t dim, int64_t head_dim, bool qkv_bias,
                                             const at::TensorOptions& options) {
  qkv = register_module("qkv", make_linear(dim, dim * 3, qkv_bias, options));
  norm = register_module("norm", FluxQkNorm(head_dim, options));
  proj = register_module("proj", make_linear(dim, dim, true, options));
}

FluxMlpImpl::FluxMlpImpl(int64_t dim, int64_t hidden, const at::TensorOptions& options) {
  up = register_module("0", make_linear(dim, hidden, true, options));
  down = register_module("2", make_linear(hidden, dim, true, options));
}

at::Tensor FluxMlpImpl::forward(const at::Tensor& x) { return down(at::gelu(up(x), "tanh")); }

FluxModulationImpl::FluxModulationImpl(int64_t dim, int parts_, const at::TensorOptions& options)
    : parts(parts_) {
  lin = register_module("lin", make_linear(dim, 3 * parts * dim, true, options));
}

std::vector<at::Tensor> FluxModulationImpl::forward(const at::Tensor& vec) {
  return lin(at::silu(vec)).unsqueeze(1).chunk(3 * parts, -1);
}

FluxDoubleBlockImpl::FluxDoubleBlockImpl(const FluxConfig& config, const at::TensorOptions& options)
    : heads(config.num_heads) {
  img_mod = register_module("img_mod", FluxModulation(config.hidden_size, 2, options));
  img_attn = register_module("img_attn", FluxSelfAttention(config.hidden_size, config.head_dim(),
                                                           config.qkv_bias, options));
  img_mlp = register_module("img_mlp", FluxMlp(config.hidden_size, config.mlp_hidden(), options));
  txt_mod = register_module("txt_mod", FluxModulation(config.hidden_size, 2, options));
  txt_attn = register_module("txt_attn", FluxSelfAttention(config.hidden_size, config.head_dim(),
                                                           config.qkv_bias, options));
  txt_mlp = register_module("txt_mlp", FluxMlp(config.hidden_size, config.mlp_hidden(), options));
}

std::pair<at::Tensor, at::Tensor> FluxDoubleBlockImpl::forward(const at::Tensor& img,
                                                               const at::Tensor& txt,
                                                               const at::Tensor& vec,
                                                               const Rope& pe,
                                                               const at::Tensor& key_mask) {
  // (shift, scale, gate) before attention, then before the MLP.
  const std::vector<at::Tensor> im = img_mod(vec), tm = txt_mod(vec);
  auto qkv_of = [this](FluxSelfAttention& attn, const at::Tensor& x) {
    std::vector<at::Tensor> qkv = split_heads(attn->qkv(x), heads);
    const at::ScalarType dtype = qkv[2].scalar_type();
    qkv[0] = attn->norm->query_norm(qkv[0]).to(dtype);
    qkv[1] = attn->norm->key_norm(qkv[1]).to(dtype);
    return qkv;
  };
  const auto iq = qkv_of(img_attn, (1 + im[1]) * plain_norm(img) + im[0]);
  const auto tq = qkv_of(txt_attn, (1 + tm[1]) * plain_norm(txt) + tm[0]);
  const at::Tensor a = attend(at::cat({tq[0], iq[0]}, 2), at::cat({tq[1], iq[1]}, 2),
                              at::cat({tq[2], iq[2]}, 2), pe, key_mask);
  const int64_t t = txt.size(1);
  at::Tensor img_out = img + im[2] * img_attn->proj(a.slice(1, t));
  img_out = img_out + im[5] * img_mlp((1 + im[4]) * plain_norm(img_out) + im[3]);
  at::Tensor txt_out = txt + tm[2] * txt_attn->proj(a.slice(1, 0, t));
  txt_out = txt_out + tm[5] * txt_mlp((1 + tm[4]) * plain_norm(txt_out) + tm[3]);
  // fp16: FLUX.1's text stream outgrows half's range; clipped as diffusers clips it (an inf
  // would be NaN after the next block's norm).
  if (txt_out.scalar_type() == at::kHalf) txt_out = txt_out.clamp(-65504, 65504);
  return {img_out, txt_out};
}

FluxSingleBlockImpl::FluxSingleBlockImpl(const FluxConfig& config, const at::TensorOptions& options)
    : hidden(config.hidden_size), mlp_hidden(config.mlp_hidden()), heads(config.num_heads) {
  linear1 = register_module("linear1", make_linear(hidden, 3 * hidden + mlp_hidden, true, options));
  linear2 = register_module("linear2", make_linear(hidden + mlp_hidden, hidden, true, options));
  norm = register_module("norm", FluxQkNorm(config.head_dim(), options));
  modulation = register_module("modulation", FluxModulation(hidden, 1, options));
}

at::Tensor FluxSingleBlockImpl::forward(const at::Tensor& x, const at::Tensor& vec, const Rope& pe,
                                        const at::Tensor& key_mask) {
  const std::vector<at::Tensor> m = modulation(vec);  // shift, scale, gate
  const at::Tensor h = linear1((1 + m[1]) * plain_norm(x) + m[0]);
  std::vector<at::Tensor> qkv = split_heads(h.slice(-1, 0, 3 * hidden), heads);
  const at::ScalarType dtype = qkv[2].scalar_type();
  const at::Tensor q = norm->query_norm(qkv[0]).to(dtype);
  const at::Tensor k = norm->key_norm(qkv[1]).to(dtype);
  const at::Tensor a = attend(q, k, qkv[2], pe, key_mask);
  at::Tensor out = x + m[2] * linear2(at::cat({a, at::gelu(h.slice(-1, 3 * hidden), "tanh")}, 2));
  if (out.scalar_type() == at::kHalf) out = out.clamp(-65504, 65504);  // as the double block's
  return out;
}

FluxLastLayerImpl::FluxLastLayerImpl(int64_t hidden, int64_t out_channels,
                                     const at::TensorOptions& options) {
  linear = register_module("linear", make_linear(hidden, out_channels, true, options));
  auto ada = register_module("adaLN_modulation", std::make_shared<torch::nn::Module>());
  modulation = ada->register_module("1", make_linear(hidden, 2 * hidden, true, options));
}

at::Tensor FluxLastLayerImpl::forward(const at::Tensor& x, const at::Tensor& vec) {
  const std::vector<at::Tensor> m = modulation(at::silu(vec)).unsqueeze(1).chunk(2, -1);
  return linear((1 + m[1]) * plain_norm(x) + m[0]);
}

FluxTransformerImpl::FluxTransformerImpl(const FluxConfig& config_,
                                         const at::TensorOptions& options)
    : config(config_) {
  config.validate("the Flux config");
  const int64_t hidden = config.hidden_size;
  img_in = register_module("img_in", make_linear(config.in_channels, hidden, true, options));
  time_in = register_module("time_in", FluxMlpEmbedder(256, hidden, options));
  vector_in = register_module("vector_in", FluxMlpEmbedder(config.vec_in_dim, hidden, options));
  if (config.guidance_embed) {
    guidance_in = register_module("guidance_in", FluxMlpEmbedder(256, hidden, options));
  }
  txt_in = register_module("txt_in", make_linear(config.context_in_dim, hidden, true, options));
  for (int64_t i = 0; i < config.depth; ++i) {
    double_blocks->push_back(FluxDoubleBlock(config, options));
  }
  for (int64_t i = 0; i < config.depth_single_blocks; ++i) {
    single_blocks->push_back(FluxSingleBlock(config, options));
  }
  register_module("double_blocks", double_blocks);
  register_module("single_blocks", single_blocks);
  final_layer = register_module("final_layer", FluxLastLayer(hidden, config.in_channels, options));
}

std::vector<torch::nn::Module*> FluxTransformerImpl::blocks() {
  std::vector<torch::nn::Module*> out;
  for (const auto& b : *double_blocks) out.push_back(b.get());
  for (const auto& b : *single_blocks) out.push_back(b.get());
  return out;
}

at::Tensor FluxTransformerImpl::forward(const FluxInput& in) {
  const at::ScalarType dtype = in.img.scalar_type();
  at::Tensor img = img_in(in.img);
  at::Tensor vec = time_in(flux_timestep_embedding(in.timesteps).to(dtype));
  if (config.guidance_embed) {
    if (!in.guidance.defined()) {
      throw InputError("Flux dev takes a guidance value (its distilled guidance scale) per sample");
    }
    vec = vec + guidance_in(flux_timestep_embedding(in.guidance).to(dtype));
  }
  vec = vec + vector_in(in.y.to(dtype));
  at::Tensor txt = txt_in(in.txt.to(dtype));
  const int64_t b = img.size(0), t = txt.size(1), l = img.size(1);

  at::Tensor txt_ids = in.txt_ids, img_ids = in.img_ids;
  if (txt_ids.dim() != img_ids.dim()) {  // one per batch, the other shared: share neither
    if (txt_ids.dim() == 2) txt_ids = txt_ids.unsqueeze(0).expand({b, t, txt_ids.size(-1)});
    if (img_ids.dim() == 2) img_ids = img_ids.unsqueeze(0).expand({b, l, img_ids.size(-1)});
  }
  const Rope pe =
      flux_rope(at::cat({txt_ids, img_ids}, -2).to(img.device()), config.axes_dim, config.theta);
  at::Tensor key_mask;
  if (in.txt_mask.defined()) {
    TORCH_CHECK(in.txt_mask.size(0) == b && in.txt_mask.size(1) == t, "Flux: a text mask of ",
                in.txt_mask.sizes(), " for ", b, " samples of ", t, " text tokens");
    key_mask = at::cat({in.txt_mask.to(at::kBool),
                        at::ones({b, l}, in.txt_mask.options().dtype(at::kBool))},
                       1)
                   .to(img.device());
  }

  const bool recompute = gradient_checkpointing;
  const size_t doubles = double_blocks->size();
  BlockSwap* swap = block_swap.get();
  const bool offload = cpu_offload_checkpointing;
  auto calls = [swap, offload](size_t k) {
    BlockCalls c;
    c.offload_inputs = offload;
    if (swap == nullptr || !swap->swaps(k)) return c;
    c.enter = [swap, k](bool backward) { swap->enter(k, backward); };
    c.leave = [swap, k](bool backward) { swap->leave(k, backward); };
    return c;
  };
  for (size_t i = 0; i < doubles; ++i) {
    auto* raw = double_blocks[i]->as<FluxDoubleBlockImpl>();
    auto run = [raw, pe, key_mask](const std::vector<at::Tensor>& x) {
      auto [i_out, t_out] = raw->forward(x[0], x[1], x[2], pe, key_mask);
      return std::vector<at::Tensor>{i_out, t_out};
    };
    const std::vector<at::Tensor> out =
        run_block(run, {img, txt, vec}, trainable_adapter_tensors(*raw), recompute, calls(i));
    img = out[0];
    txt = out[1];
  }
  at::Tensor x = at::cat({txt, img}, 1);
  for (size_t i = 0; i < single_blocks->size(); ++i) {
    auto* raw = single_blocks[i]->as<FluxSingleBlockImpl>();
    auto run = [raw, pe, key_mask](const std::vector<at::Tensor>& in) {
      return std::vector<at::Tensor>{raw->forward(in[0], in[1], pe, key_mask)};
    };
    x = run_block(run, {x, vec}, trainable_adapter_tensors(*raw), recompute,
                  calls(doubles + i))[0];
  }
  return final_layer(x.slice(1, t), vec);
}

// ---- key maps and loading ----------------------------------------------------------------------

std::map<std::string, FluxTensorRecipe> flux_original_from_diffusers(const FluxConfig& config) {
  std::map<std::string, FluxTensorRecipe> map;
  // A layer's weight and bias from the same diffusers layer(s).
  auto layer = [&map](const std::string& ours, const std::vector<std::string>& theirs,
                      bool bias = true, bool swap = false) {
    for (const char* kind : {"weight", "bias"}) {
      if (std::string(kind) == "bias" && !bias) continue;
      FluxTensorRecipe r;
      for (const auto& t : theirs) r.sources.push_back(t + "." + kind);
      r.swap_halves = swap;
      map[ours + "." + kind] = r;
    }
  };
  auto tensor = [&map](const std::string& ours, const std::string& theirs) {
    map[ours] = FluxTensorRecipe{{theirs}, false};
  };
  layer("img_in", {"x_embedder"});
  layer("txt_in", {"context_embedder"});
  layer("time_in.in_layer", {"time_text_embed.timestep_embedder.linear_1"});
  layer("time_in.out_layer", {"time_text_embed.timestep_embedder.linear_2"});
  layer("vector_in.in_layer", {"time_text_embed.text_embedder.linear_1"});
  layer("vector_in.out_layer", {"time_text_embed.text_embedder.linear_2"});
  if (config.guidance_embed) {
    layer("guidance_in.in_layer", {"time_text_embed.guidance_embedder.linear_1"});
    layer("guidance_in.out_layer", {"time_text_embed.guidance_embedder.linear_2"});
  }
  for (int64_t i = 0; i < config.depth; ++i) {
    const std::string o = "double_blocks." + std::to_string(i) + ".";
    const std::string d = "transformer_blocks." + std::to_string(i) + ".";
    layer(o + "img_mod.lin", {d + "norm1.linear"});
    layer(o + "txt_mod.lin", {d + "norm1_context.linear"});
    layer(o + "img_attn.qkv", {d + "attn.to_q", d + "attn.to_k", d + "attn.to_v"}, config.qkv_bias);
    layer(o + "txt_attn.qkv", {d + "attn.add_q_proj", d + "attn.add_k_proj", d + "attn.add_v_proj"},
          config.qkv_bias);
    tensor(o + "img_attn.norm.query_norm.scale", d + "attn.norm_q.weight");
    tensor(o + "img_attn.norm.key_norm.scale", d + "attn.norm_k.weight");
    tensor(o + "txt_attn.norm.query_norm.scale", d + "attn.norm_added_q.weight");
    tensor(o + "txt_attn.norm.key_norm.scale", d + "attn.norm_added_k.weight");
    layer(o + "img_attn.proj", {d + "attn.to_out.0"});
    layer(o + "txt_attn.proj", {d + "attn.to_add_out"});
    layer(o + "img_mlp.0", {d + "ff.net.0.proj"});
    layer(o + "img_mlp.2", {d + "ff.net.2"});
    layer(o + "txt_mlp.0", {d + "ff_context.net.0.proj"});
    layer(o + "txt_mlp.2", {d + "ff_context.net.2"});
  }
  for (int64_t i = 0; i < config.depth_single_blocks; ++i) {
    const std::string o = "single_blocks." + std::to_string(i) + ".";
    const std::string d = "single_transformer_blocks." + std::to_string(i) + ".";
    layer(o + "linear1", {d + "attn.to_q", d + "attn.to_k", d + "attn.to_v", d + "proj_mlp"});
    layer(o + "linear2", {d + "proj_out"});
    tensor(o + "norm.query_norm.scale", d + "attn.norm_q.weight");
    tensor(o + "norm.key_norm.scale", d + "attn.norm_k.weight");
    layer(o + "modulation.lin", {d + "norm.linear"});
  }
  layer("final_layer.linear", {"proj_out"});
  layer("final_layer.adaLN_modulation.1", {"norm_out.linear"}, true, /*swap=*/true);
  return map;
}

void load_flux_original(FluxTransformerImpl& model, const SafetensorsFile& file,
                        const std::string& prefix) {
  std::map<std::string, const TensorInfo*> names;
  for (const TensorInfo& t : file.tensors()) {
    if (t.name.rfind(prefix, 0) == 0) names[t.name.substr(prefix.size())] = &t;
  }
  load_into(model, file, names, file.path().string());
}

void load_flux_diffusers(FluxTransformerImpl& model, const std::filesystem::path& folder) {
  const std::vector<SafetensorsFile> files = open_weight_files(folder, "diffusion_pytorch_model");
  std::map<std::string, std::pair<const SafetensorsFile*, const TensorInfo*>> where;
  for (const auto& f : files) {
    for (const TensorInfo& t : f.tensors()) where[t.name] = {&f, &t};
  }
  // The model's names that the folder can make, each from all of its recipe's tensors; what the
  // folder holds beyond the recipes is reported under diffusers' own name.
  const auto recipes = flux_original_from_diffusers(model.config);
  std::set<std::string> names, used;
  for (const auto& [name, recipe] : recipes) {
    bool complete = true;
    for (const auto& source : recipe.sources) complete = complete && where.count(source);
    if (!complete) continue;
    names.insert(name);
    used.insert(recipe.sources.begin(), recipe.sources.end());
  }
  for (const auto& [name, _] : where) {
    if (!used.count(name)) names.insert(name);
  }
  auto fetch = [&](const std::string& name) -> at::Tensor {
    const FluxTensorRecipe& recipe = recipes.at(name);
    std::vector<at::Tensor> parts;
    for (const auto& source : recipe.sources) {
      const auto& [file, info] = where.at(source);
      parts.push_back(read_tensor(*file, *info));
      file->release(*info);
    }
    at::Tensor t = parts.size() == 1 ? parts[0] : at::cat(parts, 0);
    if (recipe.swap_halves) {
      const auto halves = t.chunk(2, 0);
      t = at::cat({halves[1], halves[0]}, 0);
    }
    return t;
  };
  load_into(
      model, names, fetch, [](const std::string&) {}, folder.string());
}

double flux_forward_flops(const FluxConfig& config, int64_t batch, int64_t image_tokens,
                          int64_t text_tokens) {
  const double h = static_cast<double>(config.hidden_size);
  const double mlp = static_cast<double>(config.mlp_hidden());
  const double img = static_cast<double>(image_tokens), txt = static_cast<double>(text_tokens);
  const double tokens = img + txt;
  // Per token: a double block's stream has qkv, proj and the MLP; a single block linear1, linear2.
  const double double_weights = 3 * h * h + h * h + 2 * h * mlp;
  const double single_weights = h * (3 * h + mlp) + (h + mlp) * h;
  const double attention = 2 * 2 * tokens * tokens * h;  // q k^T and weights v, per block
  const double per_sample =
      static_cast<double>(config.depth) * (2 * double_weights * tokens + attention) +
      static_cast<double>(config.depth_single_blocks) * (2 * single_weights * tokens + attention) +
      2 * static_cast<double>(config.in_channels) * h * img * 2 +  // img_in and the final layer
      2 * static_cast<double>(config.context_in_dim) * h * txt;   // txt_in
  return static_cast<double>(batch) * per_sample;
}

}  // namespace lorapipe::models
