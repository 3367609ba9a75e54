#include "models/unet.h"

#include <torch/torch.h>

#include <cmath>
#include <nlohmann/json.hpp>

#include "common/error.h"
#include "models/attention.h"
#include "models/block_swap.h"
#include "models/checkpoint.h"
#include "models/weights.h"

namespace lorapipe::models {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr const char* kCrossAttnDown = "CrossAttnDownBlock2D";
constexpr const char* kDown = "DownBlock2D";
constexpr const char* kCrossAttnUp = "CrossAttnUpBlock2D";
constexpr const char* kUp = "UpBlock2D";
constexpr const char* kMidCrossAttn = "UNetMidBlock2DCrossAttn";

// diffusers' Transformer2DModel builds its GroupNorm with eps 1e-6 and its LayerNorms with its own
// default norm_eps 1e-5; the UNet's norm_eps reaches only the resnets and conv_norm_out.
constexpr double kTransformerGroupNormEps = 1e-6;
constexpr double kTransformerLayerNormEps = 1e-5;

// A config field, or nullptr when absent or null (diffusers reads null as "use the default").
const json* field(const json& config, const char* key) {
  auto it = config.find(key);
  if (it == config.end() || it->is_null()) return nullptr;
  return &*it;
}

[[noreturn]] void refuse(const std::string& source, const char* key, const json& value,
                         const char* why) {
  throw InputError(source + ": unet config field \"" + key + "\" = " + value.dump() + " " + why);
}

template <typename T>
T get(const std::string& source, const char* key, const json& value) {
  try {
    return value.get<T>();
  } catch (const json::exception&) {
    refuse(source, key, value, "has the wrong type");
  }
}

// An int or a per-block list of ints; a single int is repeated for each of `blocks` blocks.
std::vector<int64_t> per_block(const json& config, const char* key, int64_t fallback, size_t blocks,
                               const std::string& source) {
  const json* value = field(config, key);
  if (value == nullptr) return std::vector<int64_t>(blocks, fallback);
  if (value->is_number_integer()) return std::vector<int64_t>(blocks, value->get<int64_t>());
  auto list = get<std::vector<int64_t>>(source, key, *value);
  if (list.size() != blocks) {
    refuse(source, key, *value, "does not have one entry per down block");
  }
  return list;
}

// Fields that would make diffusers build a different network than this one. Each is refused
// unless it holds diffusers' default (the value every SD1.x/SD2.x config has).
void refuse_unsupported(const json& config, const std::string& source) {
  auto must_be = [&](const char* key, const json& expected, const char* why) {
    const json* value = field(config, key);
    if (value != nullptr && *value != expected) refuse(source, key, *value, why);
  };
  auto must_be_null = [&](const char* key, const char* why) {
    const json* value = field(config, key);
    if (value != nullptr) refuse(source, key, *value, why);
  };
  constexpr const char* kNotYet = "is not supported yet";
  must_be_null("class_embed_type", kNotYet);
  must_be_null("num_class_embeds", kNotYet);
  must_be_null("encoder_hid_dim_type", kNotYet);
  must_be_null("encoder_hid_dim", kNotYet);
  must_be_null("time_cond_proj_dim", kNotYet);
  must_be_null("time_embedding_dim", kNotYet);
  must_be_null("time_embedding_act_fn", kNotYet);
  must_be_null("timestep_post_act", kNotYet);
  must_be_null("cross_attention_norm", kNotYet);
  must_be_null("reverse_transformer_layers_per_block", kNotYet);
  // diffusers itself raises on it (issue #2011): attention_head_dim carries the head count.
  must_be_null("num_attention_heads", "is refused by diffusers too; use attention_head_dim");
  must_be("center_input_sample", false, kNotYet);
  must_be("dual_cross_attention", false, kNotYet);
  must_be("only_cross_attention", false, kNotYet);
  must_be("mid_block_only_cross_attention", false, kNotYet);
  must_be("class_embeddings_concat", false, kNotYet);
  must_be("resnet_skip_time_act", false, kNotYet);
  must_be("act_fn", "silu", kNotYet);
  must_be("time_embedding_type", "positional", kNotYet);
  must_be("resnet_time_scale_shift", "default", kNotYet);
  must_be("attention_type", "default", kNotYet);
  must_be("conv_in_kernel", 3, kNotYet);
  must_be("conv_out_kernel", 3, kNotYet);
  must_be("downsample_padding", 1, kNotYet);
  must_be("mid_block_scale_factor", 1, kNotYet);
  must_be("resnet_out_scale_factor", 1, kNotYet);
  must_be("dropout", 0, "is not supported yet (only dropout 0)");
  // upcast_attention (SD2.1) is accepted: it changes only diffusers' legacy AttnProcessor, not
  // the scaled_dot_product_attention path this UNet and diffusers' default processor take.
}

Conv2d conv3x3(int64_t in, int64_t out, int64_t stride = 1) {
  return Conv2d(torch::nn::Conv2dOptions(in, out, 3).stride(stride).padding(1));
}

Conv2d conv1x1(int64_t in, int64_t out) { return Conv2d(torch::nn::Conv2dOptions(in, out, 1)); }

torch::nn::GroupNorm group_norm(int64_t groups, int64_t channels, double eps) {
  return torch::nn::GroupNorm(torch::nn::GroupNormOptions(groups, channels).eps(eps));
}

Linear linear(int64_t in, int64_t out, bool bias = true) {
  return Linear(torch::nn::LinearOptions(in, out).bias(bias));
}

}  // namespace

// ---- config ----------------------------------------------------------------------------------

UNetConfig UNetConfig::sd15() {
  UNetConfig config;  // diffusers' defaults are SD1.x's, except the text width
  config.cross_attention_dim = 768;
  config.sample_size = 64;
  return config;
}

UNetConfig UNetConfig::sdxl() {
  UNetConfig config;
  config.block_out_channels = {320, 640, 1280};
  config.layers_per_block = {2, 2, 2};
  config.down_block_types = {kDown, kCrossAttnDown, kCrossAttnDown};
  config.up_block_types = {kCrossAttnUp, kCrossAttnUp, kUp};
  config.cross_attention_dim = 2048;
  config.attention_head_dim = {5, 10, 20};
  config.transformer_layers_per_block = {1, 2, 10};
  config.use_linear_projection = true;
  config.sample_size = 128;
  config.addition_embed_type = "text_time";
  config.addition_time_embed_dim = 256;
  config.projection_class_embeddings_input_dim = 2816;
  return config;
}

UNetConfig UNetConfig::from_json(const std::string& text, const std::string& source) {
  json config;
  try {
    config = json::parse(text);
  } catch (const json::exception& e) {
    throw InputError(source + ": unet config is not JSON: " + e.what());
  }
  if (!config.is_object()) throw InputError(source + ": unet config is not a JSON object");
  refuse_unsupported(config, source);

  UNetConfig out;
  auto read = [&](const char* key, auto& target) {
    if (const json* value = field(config, key)) {
      target = get<std::remove_reference_t<decltype(target)>>(source, key, *value);
    }
  };
  read("in_channels", out.in_channels);
  read("out_channels", out.out_channels);
  read("block_out_channels", out.block_out_channels);
  read("down_block_types", out.down_block_types);
  read("up_block_types", out.up_block_types);
  read("mid_block_type", out.mid_block_type);
  read("norm_num_groups", out.norm_num_groups);
  read("norm_eps", out.norm_eps);
  read("use_linear_projection", out.use_linear_projection);
  read("flip_sin_to_cos", out.flip_sin_to_cos);
  read("freq_shift", out.freq_shift);
  if (const json* value = field(config, "addition_embed_type")) {
    if (*value != "text_time") {
      refuse(source, "addition_embed_type", *value, "is not supported yet (only SDXL's text_time)");
    }
    out.addition_embed_type = "text_time";
    read("addition_time_embed_dim", out.addition_time_embed_dim);
    read("projection_class_embeddings_input_dim", out.projection_class_embeddings_input_dim);
  }
  if (const json* value = field(config, "cross_attention_dim")) {
    if (!value->is_number_integer()) {
      refuse(source, "cross_attention_dim", *value, "is not supported yet (only one width)");
    }
    out.cross_attention_dim = value->get<int64_t>();
  }
  if (const json* value = field(config, "sample_size")) {
    if (value->is_array() && !value->empty()) {
      out.sample_size = get<int64_t>(source, "sample_size", (*value)[0]);
    } else {
      out.sample_size = get<int64_t>(source, "sample_size", *value);
    }
  }
  const size_t blocks = out.down_block_types.size();
  out.layers_per_block = per_block(config, "layers_per_block", 2, blocks, source);
  out.attention_head_dim = per_block(config, "attention_head_dim", 8, blocks, source);
  out.transformer_layers_per_block =
      per_block(config, "transformer_layers_per_block", 1, blocks, source);
  try {
    out.validate();
  } catch (const InputError& e) {
    throw InputError(source + ": " + e.what());
  }
  return out;
}

void UNetConfig::validate() const {
  const size_t n = block_out_channels.size();
  auto fail = [](const std::string& why) { throw InputError("unet config: " + why); };
  if (n == 0) fail("block_out_channels is empty");
  auto same_length = [&](const char* name, size_t size) {
    if (size != n) {
      fail(std::string(name) + " has " + std::to_string(size) + " entries, block_out_channels " +
           std::to_string(n));
    }
  };
  same_length("down_block_types", down_block_types.size());
  same_length("up_block_types", up_block_types.size());
  same_length("layers_per_block", layers_per_block.size());
  same_length("attention_head_dim", attention_head_dim.size());
  same_length("transformer_layers_per_block", transformer_layers_per_block.size());
  if (mid_block_type != kMidCrossAttn) {
    fail("mid_block_type \"" + mid_block_type + "\" is not supported yet");
  }
  if (in_channels <= 0 || out_channels <= 0 || cross_attention_dim <= 0 || norm_num_groups <= 0) {
    fail("in_channels, out_channels, cross_attention_dim and norm_num_groups must be positive");
  }
  if (!addition_embed_type.empty() &&
      (addition_embed_type != "text_time" || addition_time_embed_dim <= 0 ||
       projection_class_embeddings_input_dim <= 0)) {
    fail("addition_embed_type \"" + addition_embed_type +
         "\" needs \"text_time\" with positive addition_time_embed_dim and "
         "projection_class_embeddings_input_dim");
  }
  for (size_t i = 0; i < n; ++i) {
    const std::string block = " (block " + std::to_string(i) + ")";
    if (down_block_types[i] != kCrossAttnDown && down_block_types[i] != kDown) {
      fail("down block type \"" + down_block_types[i] + "\" is not supported yet");
    }
    if (up_block_types[i] != kCrossAttnUp && up_block_types[i] != kUp) {
      fail("up block type \"" + up_block_types[i] + "\" is not supported yet");
    }
    if (block_out_channels[i] <= 0 || block_out_channels[i] % norm_num_groups != 0) {
      fail("block_out_channels " + std::to_string(block_out_channels[i]) +
           " is not a positive multiple of norm_num_groups " + std::to_string(norm_num_groups) +
           block);
    }
    if (layers_per_block[i] <= 0 || transformer_layers_per_block[i] <= 0 ||
        attention_head_dim[i] <= 0) {
      fail(
          "layers_per_block, transformer_layers_per_block and attention_head_dim must be "
          "positive" +
          block);
    }
  }
  // Heads per attention: down block i and the mid block (the last entry) use attention_head_dim
  // in order, up block i uses it reversed (diffusers' reversed_num_attention_heads).
  auto check_heads = [&](int64_t channels, int64_t heads, const std::string& where) {
    if (channels % heads != 0) {
      fail(std::to_string(channels) + " channels do not split into " + std::to_string(heads) +
           " heads (attention_head_dim) in " + where);
    }
  };
  for (size_t i = 0; i < n; ++i) {
    if (down_block_types[i] == kCrossAttnDown) {
      check_heads(block_out_channels[i], attention_head_dim[i], "down block " + std::to_string(i));
    }
    if (up_block_types[i] == kCrossAttnUp) {
      check_heads(block_out_channels[n - 1 - i], attention_head_dim[n - 1 - i],
                  "up block " + std::to_string(i));
    }
  }
  check_heads(block_out_channels.back(), attention_head_dim.back(), "the mid block");
}

namespace unet_blocks {

// ---- attention -------------------------------------------------------------------------------

AttentionImpl::AttentionImpl(int64_t query_dim, int64_t context_dim, int64_t num_heads,
                             int64_t dim_per_head)
    : heads(num_heads), head_dim(dim_per_head) {
  const int64_t inner = heads * head_dim;
  to_q = register_module("to_q", linear(query_dim, inner, /*bias=*/false));
  to_k = register_module("to_k", linear(context_dim, inner, /*bias=*/false));
  to_v = register_module("to_v", linear(context_dim, inner, /*bias=*/false));
  out_proj = linear(inner, query_dim);
  to_out->push_back(out_proj);
  register_module("to_out", to_out);
}

torch::Tensor AttentionImpl::forward(const torch::Tensor& x, const torch::Tensor& context) {
  const torch::Tensor& source = context.defined() ? context : x;
  const int64_t batch = x.size(0);
  // (B, L, heads * head_dim) -> (B, heads, L, head_dim), as AttnProcessor2_0 does.
  auto split = [&](const torch::Tensor& t) {
    return t.view({batch, -1, heads, head_dim}).transpose(1, 2);
  };
  const torch::Tensor q = split(to_q(x));
  const torch::Tensor k = split(to_k(source));
  const torch::Tensor v = split(to_v(source));
  const torch::Tensor out = attention(q, k, v).transpose(1, 2);
  return out_proj(out.reshape({batch, -1, heads * head_dim}));
}

GEGLUImpl::GEGLUImpl(int64_t dim_in, int64_t dim_out) {
  proj = register_module("proj", linear(dim_in, dim_out * 2));
}

torch::Tensor GEGLUImpl::forward(const torch::Tensor& x) {
  auto halves = proj(x).chunk(2, /*dim=*/-1);
  return halves[0] * torch::gelu(halves[1]);
}

FeedForwardImpl::FeedForwardImpl(int64_t dim) {
  const int64_t inner = dim * 4;
  geglu = GEGLU(dim, inner);
  out = linear(inner, dim);
  net->push_back(geglu);
  net->push_back(torch::nn::Identity());  // diffusers' Dropout: keeps the Linear at net.2
  net->push_back(out);
  register_module("net", net);
}

torch::Tensor FeedForwardImpl::forward(const torch::Tensor& x) { return out(geglu(x)); }

BasicTransformerBlockImpl::BasicTransformerBlockImpl(int64_t dim, int64_t heads, int64_t head_dim,
                                                     int64_t context_dim) {
  auto layer_norm = [&] {
    return torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim}).eps(kTransformerLayerNormEps));
  };
  norm1 = register_module("norm1", layer_norm());
  attn1 = register_module("attn1", Attention(dim, dim, heads, head_dim));
  norm2 = register_module("norm2", layer_norm());
  attn2 = register_module("attn2", Attention(dim, context_dim, heads, head_dim));
  norm3 = register_module("norm3", layer_norm());
  ff = register_module("ff", FeedForward(dim));
}

torch::Tensor BasicTransformerBlockImpl::forward(torch::Tensor x, const torch::Tensor& context) {
  x = attn1(norm1(x)) + x;
  x = attn2(norm2(x), context) + x;
  return ff(norm3(x)) + x;
}

Transformer2DImpl::Transformer2DImpl(int64_t channels, int64_t heads, int64_t layers,
                                     int64_t context_dim, int64_t groups, bool linear_projection) {
  // diffusers: Transformer2DModel(heads, channels // heads, in_channels=channels); inner_dim is
  // heads * head_dim, which validate() makes equal to channels.
  const int64_t head_dim = channels / heads;
  norm = register_module("norm", group_norm(groups, channels, kTransformerGroupNormEps));
  if (linear_projection) {
    proj_in_linear = register_module("proj_in", linear(channels, channels));
  } else {
    proj_in_conv = register_module("proj_in", conv1x1(channels, channels));
  }
  for (int64_t i = 0; i < layers; ++i) {
    blocks.push_back(BasicTransformerBlock(channels, heads, head_dim, context_dim));
    transformer_blocks->push_back(blocks.back());
  }
  register_module("transformer_blocks", transformer_blocks);
  if (linear_projection) {
    proj_out_linear = register_module("proj_out", linear(channels, channels));
  } else {
    proj_out_conv = register_module("proj_out", conv1x1(channels, channels));
  }
}

torch::Tensor Transformer2DImpl::forward(const torch::Tensor& x, const torch::Tensor& context,
                                         bool checkpointed) {
  const int64_t batch = x.size(0), height = x.size(2), width = x.size(3);
  // (B, C, H, W) <-> (B, H*W, C); diffusers projects before flattening with the convolution and
  // after it with the Linear (Transformer2DModel._operate_on_continuous_inputs). By value: a
  // checkpoint runs them again in backward.
  auto to_tokens = [=](const torch::Tensor& t) {
    return t.permute({0, 2, 3, 1}).reshape({batch, height * width, t.size(1)});
  };
  auto to_image = [=](const torch::Tensor& t) {
    return t.reshape({batch, height, width, t.size(2)}).permute({0, 3, 1, 2}).contiguous();
  };
  auto head = [this, to_tokens](const torch::Tensor& in) {
    const torch::Tensor h = norm(in);
    return proj_in_linear ? proj_in_linear(to_tokens(h)) : to_tokens(proj_in_conv(h));
  };
  auto tail = [this, to_image](const torch::Tensor& h, const torch::Tensor& residual) {
    return (proj_out_linear ? to_image(proj_out_linear(h)) : proj_out_conv(to_image(h))) + residual;
  };
  // Block swap's calls around block i (none where the block does not swap).
  auto calls = [this](size_t i) {
    BlockCalls c;
    BlockSwap* s = swap.get();
    const size_t k = swap_first + i;
    if (s == nullptr || !s->swaps(k)) return c;
    c.enter = [s, k](bool backward) { s->enter(k, backward); };
    c.leave = [s, k](bool backward) { s->leave(k, backward); };
    return c;
  };
  if (!checkpointed) {
    torch::Tensor h = head(x);
    for (size_t i = 0; i < blocks.size(); ++i) {
      BlockCalls c = calls(i);
      if (!c.enter) {
        h = blocks[i](h, context);
        continue;
      }
      BasicTransformerBlock block = blocks[i];
      h = run_block(
          [block](const std::vector<torch::Tensor>& in) mutable {
            return std::vector<torch::Tensor>{block(in[0], in[1])};
          },
          {h, context}, trainable_adapter_tensors(*block), /*checkpointed=*/false, std::move(c))[0];
    }
    return tail(h, x);
  }
  // One checkpoint per transformer block, the first holding the norm and proj_in too and the last
  // proj_out and the residual, so between blocks only the tokens stay alive (a single block is
  // the whole module under one checkpoint).
  const size_t n = blocks.size();
  torch::Tensor h = x;
  for (size_t i = 0; i < n; ++i) {
    const bool first = i == 0, last = i + 1 == n;
    std::vector<torch::Tensor> inputs{h, context};
    if (last && !first) inputs.push_back(x);
    std::vector<torch::Tensor> trainable = trainable_adapter_tensors(*blocks[i]);
    auto add_trainable = [&trainable](const torch::nn::Module& m) {
      for (const at::Tensor& t : trainable_adapter_tensors(m)) trainable.push_back(t);
    };
    if (first) add_trainable(proj_in_linear ? *proj_in_linear : static_cast<torch::nn::Module&>(*proj_in_conv));
    if (last) add_trainable(proj_out_linear ? *proj_out_linear : static_cast<torch::nn::Module&>(*proj_out_conv));
    h = checkpoint(
        [this, i, first, last, head, tail](const std::vector<torch::Tensor>& in) {
          torch::Tensor t = first ? head(in[0]) : in[0];
          t = blocks[i](t, in[1]);
          if (last) t = tail(t, first ? in[0] : in[2]);
          return std::vector<torch::Tensor>{t};
        },
        inputs, trainable, calls(i))[0];
  }
  return h;
}

// ---- resnets and resampling ------------------------------------------------------------------

ResnetBlock2DImpl::ResnetBlock2DImpl(int64_t in_channels, int64_t out_channels,
                                     int64_t temb_channels, int64_t groups, double eps) {
  norm1 = register_module("norm1", group_norm(groups, in_channels, eps));
  conv1 = register_module("conv1", conv3x3(in_channels, out_channels));
  time_emb_proj = register_module("time_emb_proj", linear(temb_channels, out_channels));
  norm2 = register_module("norm2", group_norm(groups, out_channels, eps));
  conv2 = register_module("conv2", conv3x3(out_channels, out_channels));
  if (in_channels != out_channels) {
    conv_shortcut = register_module("conv_shortcut", conv1x1(in_channels, out_channels));
  }
}

torch::Tensor ResnetBlock2DImpl::forward(const torch::Tensor& x, const torch::Tensor& temb) {
  torch::Tensor h = conv1(torch::silu(norm1(x)));
  h = h + time_emb_proj(torch::silu(temb)).unsqueeze(-1).unsqueeze(-1);
  h = conv2(torch::silu(norm2(h)));
  return (conv_shortcut ? conv_shortcut(x) : x) + h;
}

Downsample2DImpl::Downsample2DImpl(int64_t channels) {
  conv = register_module("conv", conv3x3(channels, channels, /*stride=*/2));
}

torch::Tensor Downsample2DImpl::forward(const torch::Tensor& x) { return conv(x); }

Upsample2DImpl::Upsample2DImpl(int64_t channels) {
  conv = register_module("conv", conv3x3(channels, channels));
}

torch::Tensor Upsample2DImpl::forward(const torch::Tensor& x, c10::IntArrayRef size) {
  TORCH_CHECK(size.size() == 2, "Upsample2D needs the skip connection's height and width");
  // Nearest to an explicit size picks source index floor(i * in / out); for out = 2 * in that is
  // i / 2, exactly what scale_factor=2 picks (ATen nearest_idx), so even sizes match diffusers.
  return conv(at::upsample_nearest2d(x, size));
}

// ---- blocks ----------------------------------------------------------------------------------

namespace {

// One resnet on x (concatenated with `skip` along channels when given, as the up path does),
// under models::checkpoint when `checkpointed`. The concatenation happens inside, so its double
// width copy is not kept for backward either.
torch::Tensor run_resnet(ResnetBlock2D& resnet, const torch::Tensor& x, const torch::Tensor& skip,
                         const torch::Tensor& temb, bool checkpointed) {
  auto run = [r = resnet.ptr()](const torch::Tensor& in, const torch::Tensor& skip_in,
                                const torch::Tensor& t) {
    return r->forward(skip_in.defined() ? torch::cat({in, skip_in}, /*dim=*/1) : in, t);
  };
  if (!checkpointed) return run(x, skip, temb);
  // Inputs: x, temb[, skip] (an undefined tensor is not passed through autograd).
  std::vector<torch::Tensor> inputs{x, temb};
  if (skip.defined()) inputs.push_back(skip);
  return checkpoint(
      [run](const std::vector<torch::Tensor>& in) {
        return std::vector<torch::Tensor>{
            run(in[0], in.size() > 2 ? in[2] : torch::Tensor(), in[1])};
      },
      inputs, trainable_adapter_tensors(*resnet))[0];
}

torch::Tensor run_attention(Transformer2D& attention, const torch::Tensor& x,
                            const torch::Tensor& context, bool checkpointed) {
  return attention->forward(x, context, checkpointed);
}

}  // namespace

DownBlockImpl::DownBlockImpl(int64_t in_channels, int64_t out_channels, int64_t temb_channels,
                             int64_t layers, bool with_attention, int64_t heads,
                             int64_t transformer_layers, int64_t context_dim,
                             const UNetConfig& config, bool add_downsample) {
  for (int64_t i = 0; i < layers; ++i) {
    resnet_list.push_back(ResnetBlock2D(i == 0 ? in_channels : out_channels, out_channels,
                                        temb_channels, config.norm_num_groups, config.norm_eps));
    resnets->push_back(resnet_list.back());
    if (with_attention) {
      attention_list.push_back(Transformer2D(out_channels, heads, transformer_layers, context_dim,
                                             config.norm_num_groups, config.use_linear_projection));
      attentions->push_back(attention_list.back());
    }
  }
  register_module("resnets", resnets);
  if (with_attention) register_module("attentions", attentions);
  if (add_downsample) {
    downsampler = Downsample2D(out_channels);
    downsamplers->push_back(downsampler);
    register_module("downsamplers", downsamplers);
  }
}

torch::Tensor DownBlockImpl::forward(torch::Tensor x, const torch::Tensor& temb,
                                     const torch::Tensor& context,
                                     std::vector<torch::Tensor>& skips, bool checkpointed) {
  for (size_t i = 0; i < resnet_list.size(); ++i) {
    x = run_resnet(resnet_list[i], x, /*skip=*/{}, temb, checkpointed);
    if (!attention_list.empty()) x = run_attention(attention_list[i], x, context, checkpointed);
    skips.push_back(x);
  }
  if (downsampler) {
    x = downsampler(x);
    skips.push_back(x);
  }
  return x;
}

MidBlockImpl::MidBlockImpl(int64_t channels, int64_t temb_channels, int64_t heads,
                           int64_t transformer_layers, int64_t context_dim,
                           const UNetConfig& config) {
  for (int i = 0; i < 2; ++i) {
    resnet_list.push_back(
        ResnetBlock2D(channels, channels, temb_channels, config.norm_num_groups, config.norm_eps));
    resnets->push_back(resnet_list.back());
  }
  attention_list.push_back(Transformer2D(channels, heads, transformer_layers, context_dim,
                                         config.norm_num_groups, config.use_linear_projection));
  attentions->push_back(attention_list.back());
  register_module("attentions", attentions);
  register_module("resnets", resnets);
}

torch::Tensor MidBlockImpl::forward(torch::Tensor x, const torch::Tensor& temb,
                                    const torch::Tensor& context, bool checkpointed) {
  x = run_resnet(resnet_list[0], x, /*skip=*/{}, temb, checkpointed);
  x = run_attention(attention_list[0], x, context, checkpointed);
  return run_resnet(resnet_list[1], x, /*skip=*/{}, temb, checkpointed);
}

UpBlockImpl::UpBlockImpl(int64_t in_channels, int64_t prev_output_channels, int64_t out_channels,
                         int64_t temb_channels, int64_t layers, bool with_attention, int64_t heads,
                         int64_t transformer_layers, int64_t context_dim, const UNetConfig& config,
                         bool add_upsample) {
  for (int64_t i = 0; i < layers; ++i) {
    // diffusers: the last resnet takes the skip from the level above (in_channels wide), the
    // others skips of this level; the first one takes the previous up block's output.
    const int64_t skip_channels = i == layers - 1 ? in_channels : out_channels;
    const int64_t resnet_in = i == 0 ? prev_output_channels : out_channels;
    resnet_list.push_back(ResnetBlock2D(resnet_in + skip_channels, out_channels, temb_channels,
                                        config.norm_num_groups, config.norm_eps));
    resnets->push_back(resnet_list.back());
    if (with_attention) {
      attention_list.push_back(Transformer2D(out_channels, heads, transformer_layers, context_dim,
                                             config.norm_num_groups, config.use_linear_projection));
      attentions->push_back(attention_list.back());
    }
  }
  register_module("resnets", resnets);
  if (with_attention) register_module("attentions", attentions);
  if (add_upsample) {
    upsampler = Upsample2D(out_channels);
    upsamplers->push_back(upsampler);
    register_module("upsamplers", upsamplers);
  }
}

torch::Tensor UpBlockImpl::forward(torch::Tensor x, const std::vector<torch::Tensor>& skips,
                                   const torch::Tensor& temb, const torch::Tensor& context,
                                   c10::IntArrayRef upsample_size, bool checkpointed) {
  TORCH_CHECK(skips.size() == resnet_list.size(), "up block has ", resnet_list.size(),
              " resnets but got ", skips.size(), " skip tensors");
  for (size_t i = 0; i < resnet_list.size(); ++i) {
    x = run_resnet(resnet_list[i], x, skips[skips.size() - 1 - i], temb, checkpointed);
    if (!attention_list.empty()) x = run_attention(attention_list[i], x, context, checkpointed);
  }
  if (upsampler) x = upsampler(x, upsample_size);
  return x;
}

// ---- time embedding --------------------------------------------------------------------------

TimestepEmbeddingImpl::TimestepEmbeddingImpl(int64_t in_dim, int64_t time_embed_dim) {
  linear_1 = register_module("linear_1", linear(in_dim, time_embed_dim));
  linear_2 = register_module("linear_2", linear(time_embed_dim, time_embed_dim));
}

torch::Tensor TimestepEmbeddingImpl::forward(const torch::Tensor& x) {
  return linear_2(torch::silu(linear_1(x)));
}

}  // namespace unet_blocks

torch::Tensor timestep_embedding(const torch::Tensor& timesteps, int64_t dim, bool flip_sin_to_cos,
                                 double freq_shift) {
  TORCH_CHECK(timesteps.dim() == 1, "timestep_embedding wants 1-d timesteps, got ",
              timesteps.sizes());
  constexpr double kMaxPeriod = 10000;
  const int64_t half = dim / 2;
  const auto f32 = torch::TensorOptions().dtype(torch::kFloat32).device(timesteps.device());
  torch::Tensor exponent = torch::arange(0, half, f32) * -std::log(kMaxPeriod);
  exponent = exponent / (static_cast<double>(half) - freq_shift);
  torch::Tensor angles = timesteps.unsqueeze(1).to(torch::kFloat32) * exponent.exp().unsqueeze(0);
  torch::Tensor emb = torch::cat({angles.sin(), angles.cos()}, /*dim=*/-1);
  if (flip_sin_to_cos) emb = torch::cat({emb.slice(1, half), emb.slice(1, 0, half)}, /*dim=*/-1);
  if (dim % 2 == 1) emb = torch::constant_pad_nd(emb, {0, 1, 0, 0});
  return emb;
}

// ---- the UNet --------------------------------------------------------------------------------

UNetImpl::UNetImpl(const UNetConfig& config) : config_(config) {
  config_.validate();
  const UNetConfig& c = config_;
  const size_t n = c.block_out_channels.size();
  const int64_t time_embed_dim = c.block_out_channels[0] * 4;
  conv_in = register_module("conv_in", conv3x3(c.in_channels, c.block_out_channels[0]));
  time_embedding = register_module(
      "time_embedding", unet_blocks::TimestepEmbedding(c.block_out_channels[0], time_embed_dim));
  if (!c.addition_embed_type.empty()) {
    add_embedding = register_module(
        "add_embedding",
        unet_blocks::TimestepEmbedding(c.projection_class_embeddings_input_dim, time_embed_dim));
  }

  int64_t output_channels = c.block_out_channels[0];
  for (size_t i = 0; i < n; ++i) {
    const int64_t input_channels = output_channels;
    output_channels = c.block_out_channels[i];
    down_list.push_back(unet_blocks::DownBlock(
        input_channels, output_channels, time_embed_dim, c.layers_per_block[i],
        c.down_block_types[i] == kCrossAttnDown, c.attention_head_dim[i],
        c.transformer_layers_per_block[i], c.cross_attention_dim, c, /*add_downsample=*/i + 1 < n));
    down_blocks->push_back(down_list.back());
  }
  register_module("down_blocks", down_blocks);

  mid_block = register_module(
      "mid_block", unet_blocks::MidBlock(
                       c.block_out_channels.back(), time_embed_dim, c.attention_head_dim.back(),
                       c.transformer_layers_per_block.back(), c.cross_attention_dim, c));

  // Up block i mirrors down block n-1-i (diffusers reverses channels, heads, layers and
  // transformer layers), with one resnet more than its down block to take the downsampler's skip.
  output_channels = c.block_out_channels[n - 1];
  for (size_t i = 0; i < n; ++i) {
    const size_t mirror = n - 1 - i;
    const int64_t prev_output_channels = output_channels;
    output_channels = c.block_out_channels[mirror];
    const int64_t input_channels = c.block_out_channels[mirror == 0 ? 0 : mirror - 1];
    up_list.push_back(
        unet_blocks::UpBlock(input_channels, prev_output_channels, output_channels, time_embed_dim,
                             c.layers_per_block[mirror] + 1, c.up_block_types[i] == kCrossAttnUp,
                             c.attention_head_dim[mirror], c.transformer_layers_per_block[mirror],
                             c.cross_attention_dim, c,
                             /*add_upsample=*/i + 1 < n));
    up_blocks->push_back(up_list.back());
  }
  register_module("up_blocks", up_blocks);

  conv_norm_out = register_module(
      "conv_norm_out", group_norm(c.norm_num_groups, c.block_out_channels[0], c.norm_eps));
  conv_out = register_module("conv_out", conv3x3(c.block_out_channels[0], c.out_channels));
}

torch::Tensor UNetImpl::time_embed(const torch::Tensor& timesteps, int64_t batch,
                                   const torch::Tensor& like, const torch::Tensor& text_embeds,
                                   const torch::Tensor& time_ids) {
  TORCH_CHECK(timesteps.dim() <= 1, "timesteps must be 0-d or 1-d, got ", timesteps.sizes());
  torch::Tensor t = timesteps.reshape({-1}).to(like.device());
  TORCH_CHECK(t.size(0) == 1 || t.size(0) == batch, "got ", t.size(0), " timesteps for a batch of ",
              batch);
  t = t.expand({batch});
  const torch::Tensor t_emb = timestep_embedding(t, config_.block_out_channels[0],
                                                 config_.flip_sin_to_cos, config_.freq_shift);
  torch::Tensor emb = time_embedding(t_emb.to(like.scalar_type()));
  if (!add_embedding) {
    TORCH_CHECK(!text_embeds.defined() && !time_ids.defined(),
                "this UNet takes no added conditions (text_embeds, time_ids)");
    return emb;
  }
  // diffusers' get_aug_embed for "text_time": each time id's sinusoidal embedding, joined after
  // the pooled text embedding, through add_embedding, added to the timestep's.
  TORCH_CHECK(text_embeds.defined() && time_ids.defined(),
              "an SDXL UNet needs text_embeds and time_ids (the pooled text and the six time ids)");
  TORCH_CHECK(text_embeds.dim() == 2 && text_embeds.size(0) == batch && time_ids.dim() == 2 &&
                  time_ids.size(0) == batch,
              "text_embeds and time_ids must be (", batch, ", n), got ", text_embeds.sizes(),
              " and ", time_ids.sizes());
  const torch::Tensor time_embeds =
      timestep_embedding(time_ids.to(like.device()).flatten(), config_.addition_time_embed_dim,
                         config_.flip_sin_to_cos, config_.freq_shift)
          .reshape({batch, -1});
  const torch::Tensor add_embeds =
      torch::cat({text_embeds.to(like.device(), torch::kFloat32), time_embeds}, /*dim=*/-1);
  TORCH_CHECK(add_embeds.size(1) == config_.projection_class_embeddings_input_dim,
              "text_embeds and time_ids give ", add_embeds.size(1),
              " values, the config's projection_class_embeddings_input_dim is ",
              config_.projection_class_embeddings_input_dim);
  return emb + add_embedding(add_embeds.to(emb.scalar_type()));
}

std::vector<unet_blocks::Transformer2D> UNetImpl::transformers() const {
  std::vector<unet_blocks::Transformer2D> out;
  for (const auto& down : down_list) {
    for (const auto& t : down->attention_list) out.push_back(t);
  }
  if (mid_block) {
    for (const auto& t : mid_block->attention_list) out.push_back(t);
  }
  for (const auto& up : up_list) {
    for (const auto& t : up->attention_list) out.push_back(t);
  }
  return out;
}

torch::Tensor UNetImpl::forward(const torch::Tensor& sample, const torch::Tensor& timesteps,
                                const torch::Tensor& encoder_hidden_states,
                                const torch::Tensor& text_embeds, const torch::Tensor& time_ids) {
  TORCH_CHECK(sample.dim() == 4 && sample.size(1) == config_.in_channels,
              "UNet sample must be (B, ", config_.in_channels, ", H, W), got ", sample.sizes());
  TORCH_CHECK(encoder_hidden_states.dim() == 3 && encoder_hidden_states.size(0) == sample.size(0) &&
                  encoder_hidden_states.size(2) == config_.cross_attention_dim,
              "encoder_hidden_states must be (", sample.size(0), ", tokens, ",
              config_.cross_attention_dim, "), got ", encoder_hidden_states.sizes());
  const torch::Tensor emb = time_embed(timesteps, sample.size(0), sample, text_embeds, time_ids);
  torch::Tensor x = conv_in(sample);
  std::vector<torch::Tensor> skips{x};
  const bool checkpointed = gradient_checkpointing && torch::GradMode::is_enabled();
  for (auto& block : down_list) {
    x = block->forward(x, emb, encoder_hidden_states, skips, checkpointed);
  }
  x = mid_block->forward(x, emb, encoder_hidden_states, checkpointed);
  for (auto& block : up_list) {
    const size_t take = block->resnet_list.size();
    std::vector<torch::Tensor> own(skips.end() - static_cast<std::ptrdiff_t>(take), skips.end());
    skips.resize(skips.size() - take);
    // diffusers' upsample_size: the size of the skip the next up block concatenates first.
    std::vector<int64_t> upsample_size;
    if (block->upsampler) {
      upsample_size.assign(skips.back().sizes().begin() + 2, skips.back().sizes().end());
    }
    x = block->forward(x, own, emb, encoder_hidden_states, upsample_size, checkpointed);
  }
  return conv_out(torch::silu(conv_norm_out(x)));
}

// ---- loading ---------------------------------------------------------------------------------

void load_unet_diffusers(UNet& unet, const fs::path& folder_or_file) {
  fs::path file = folder_or_file;
  if (fs::is_directory(file)) {
    file = folder_or_file / "diffusion_pytorch_model.safetensors";
    const fs::path fp16 = folder_or_file / "diffusion_pytorch_model.fp16.safetensors";
    if (!fs::exists(file) && fs::exists(fp16)) file = fp16;
  }
  if (!fs::exists(file)) throw InputError(file.string() + ": no such file");
  const SafetensorsFile weights = SafetensorsFile::open(file);
  load_into(*unet, weights, file.string());
}

double unet_forward_flops(const UNetConfig& config, int64_t batch, int64_t height, int64_t width,
                          int64_t tokens) {
  config.validate();
  const UNetConfig& c = config;
  const double b = static_cast<double>(batch);
  double flops = 0;
  struct Size {
    int64_t channels, height, width;
  };
  auto conv = [&](int64_t in, int64_t out, int64_t kernel, int64_t h, int64_t w) {
    flops += 2 * b * static_cast<double>(h * w * out * in * kernel * kernel);
  };
  auto linear = [&](double rows, int64_t in, int64_t out) {
    flops += 2 * rows * static_cast<double>(in * out);
  };
  const int64_t temb = c.block_out_channels[0] * 4;
  linear(b, c.block_out_channels[0], temb);  // time_embedding.linear_1, linear_2
  linear(b, temb, temb);
  if (!c.addition_embed_type.empty()) {  // add_embedding.linear_1, linear_2
    linear(b, c.projection_class_embeddings_input_dim, temb);
    linear(b, temb, temb);
  }
  auto resnet = [&](int64_t in, int64_t out, int64_t h, int64_t w) {
    conv(in, out, 3, h, w);
    linear(b, temb, out);  // time_emb_proj
    conv(out, out, 3, h, w);
    if (in != out) conv(in, out, 1, h, w);  // conv_shortcut
  };
  auto transformer = [&](int64_t channels, int64_t layers, int64_t h, int64_t w) {
    const double pixels = b * static_cast<double>(h * w);
    const double q = static_cast<double>(h * w), kv = static_cast<double>(tokens);
    linear(pixels, channels, channels);  // proj_in (a 1x1 conv or a Linear: the same count)
    for (int64_t l = 0; l < layers; ++l) {
      linear(pixels, channels, channels * 3);                  // attn1 to_q, to_k, to_v
      flops += 4 * b * q * q * static_cast<double>(channels);  // attn1 Q K^T, weights x V
      linear(pixels, channels, channels);                      // attn1 to_out
      linear(pixels, channels, channels);                      // attn2 to_q
      linear(b * kv, c.cross_attention_dim, channels * 2);     // attn2 to_k, to_v on the text
      flops += 4 * b * q * kv * static_cast<double>(channels);
      linear(pixels, channels, channels);                      // attn2 to_out
      linear(pixels, channels, channels * 8);                  // ff GEGLU proj (two halves)
      linear(pixels, channels * 4, channels);                  // ff out
    }
    linear(pixels, channels, channels);  // proj_out
  };

  int64_t h = height, w = width;
  conv(c.in_channels, c.block_out_channels[0], 3, h, w);
  std::vector<Size> skips{{c.block_out_channels[0], h, w}};
  const size_t n = c.block_out_channels.size();
  int64_t channels = c.block_out_channels[0];
  for (size_t i = 0; i < n; ++i) {
    const int64_t out = c.block_out_channels[i];
    for (int64_t r = 0; r < c.layers_per_block[i]; ++r) {
      resnet(r == 0 ? channels : out, out, h, w);
      if (c.down_block_types[i] == kCrossAttnDown) {
        transformer(out, c.transformer_layers_per_block[i], h, w);
      }
      skips.push_back({out, h, w});
    }
    channels = out;
    if (i + 1 < n) {  // a 3x3 convolution with stride 2 and padding 1
      h = (h + 1) / 2;
      w = (w + 1) / 2;
      conv(out, out, 3, h, w);
      skips.push_back({out, h, w});
    }
  }
  resnet(channels, channels, h, w);
  transformer(channels, c.transformer_layers_per_block.back(), h, w);
  resnet(channels, channels, h, w);
  for (size_t i = 0; i < n; ++i) {
    const size_t mirror = n - 1 - i;
    const int64_t out = c.block_out_channels[mirror];
    for (int64_t r = 0; r < c.layers_per_block[mirror] + 1; ++r) {
      const Size skip = skips.back();
      skips.pop_back();
      resnet(channels + skip.channels, out, h, w);
      channels = out;
      if (c.up_block_types[i] == kCrossAttnUp) {
        transformer(out, c.transformer_layers_per_block[mirror], h, w);
      }
    }
    if (i + 1 < n) {  // nearest to the next skip's size, then a 3x3 convolution
      h = skips.back().height;
      w = skips.back().width;
      conv(out, out, 3, h, w);
    }
  }
  conv(c.block_out_channels[0], c.out_channels, 3, h, w);
  return flops;
}

}  // namespace lorapipe::models
