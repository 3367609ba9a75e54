#include "models/clip_text.h"

#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include "common/error.h"
#include "models/attention.h"
#include "models/checkpoint.h"
#include "models/safetensors.h"
#include "models/weights.h"

namespace lorapipe::models {

ClipTextConfig ClipTextConfig::sd15() { return ClipTextConfig{}; }

ClipTextConfig ClipTextConfig::sdxl_clip_g() {
  ClipTextConfig c;
  c.hidden_size = 1280;
  c.intermediate_size = 5120;
  c.num_hidden_layers = 32;
  c.num_attention_heads = 20;
  c.hidden_act = "gelu";
  c.with_projection = true;
  c.projection_dim = 1280;
  return c;
}

ClipTextConfig ClipTextConfig::from_json(const std::string& text, const std::string& source) try {
  const nlohmann::json j = nlohmann::json::parse(text);
  ClipTextConfig c;
  c.vocab_size = j.value("vocab_size", c.vocab_size);
  c.hidden_size = j.value("hidden_size", c.hidden_size);
  c.intermediate_size = j.value("intermediate_size", c.intermediate_size);
  c.num_hidden_layers = j.value("num_hidden_layers", c.num_hidden_layers);
  c.num_attention_heads = j.value("num_attention_heads", c.num_attention_heads);
  c.max_position_embeddings = j.value("max_position_embeddings", c.max_position_embeddings);
  c.hidden_act = j.value("hidden_act", c.hidden_act);
  c.layer_norm_eps = j.value("layer_norm_eps", c.layer_norm_eps);
  c.eos_token_id = j.value("eos_token_id", c.eos_token_id);
  c.projection_dim = j.value("projection_dim", c.projection_dim);
  if (const auto it = j.find("architectures"); it != j.end() && it->is_array()) {
    for (const auto& name : *it) {
      c.with_projection |=
          name.is_string() && name.get<std::string>() == "CLIPTextModelWithProjection";
    }
  }
  if (c.hidden_act != "quick_gelu" && c.hidden_act != "gelu") {
    throw InputError(source + ": text encoder config: hidden_act '" + c.hidden_act +
                     "' is not supported");
  }
  return c;
} catch (const nlohmann::json::exception& e) {
  throw InputError(source + ": text encoder config: " + e.what());
}

ClipAttentionImpl::ClipAttentionImpl(const ClipTextConfig& c) : heads(c.num_attention_heads) {
  q_proj = register_module("q_proj", Linear(c.hidden_size, c.hidden_size));
  k_proj = register_module("k_proj", Linear(c.hidden_size, c.hidden_size));
  v_proj = register_module("v_proj", Linear(c.hidden_size, c.hidden_size));
  out_proj = register_module("out_proj", Linear(c.hidden_size, c.hidden_size));
}

torch::Tensor ClipAttentionImpl::forward(const torch::Tensor& x) {
  const int64_t b = x.size(0), t = x.size(1), c = x.size(2);
  auto split = [&](const torch::Tensor& y) {
    return y.view({b, t, heads, c / heads}).transpose(1, 2);
  };
  torch::Tensor out =
      attention(split(q_proj(x)), split(k_proj(x)), split(v_proj(x)), /*causal=*/true);
  return out_proj(out.transpose(1, 2).reshape({b, t, c}));
}

ClipMlpImpl::ClipMlpImpl(const ClipTextConfig& c) : quick_gelu(c.hidden_act == "quick_gelu") {
  fc1 = register_module("fc1", Linear(c.hidden_size, c.intermediate_size));
  fc2 = register_module("fc2", Linear(c.intermediate_size, c.hidden_size));
}

torch::Tensor ClipMlpImpl::forward(const torch::Tensor& x) {
  torch::Tensor h = fc1(x);
  // quick_gelu (OpenAI CLIP): x * sigmoid(1.702 x).
  h = quick_gelu ? h * torch::sigmoid(1.702 * h) : torch::gelu(h);
  return fc2(h);
}

ClipEncoderLayerImpl::ClipEncoderLayerImpl(const ClipTextConfig& c) {
  auto ln = [&] {
    return torch::nn::LayerNorm(
        torch::nn::LayerNormOptions({c.hidden_size}).eps(c.layer_norm_eps));
  };
  self_attn = register_module("self_attn", ClipAttention(c));
  layer_norm1 = register_module("layer_norm1", ln());
  mlp = register_module("mlp", ClipMlp(c));
  layer_norm2 = register_module("layer_norm2", ln());
}

torch::Tensor ClipEncoderLayerImpl::forward(const torch::Tensor& x) {
  torch::Tensor h = x + self_attn(layer_norm1(x));
  return h + mlp(layer_norm2(h));
}

ClipTextTransformerImpl::ClipTextTransformerImpl(const ClipTextConfig& c) : config(c) {
  embeddings = register_module("embeddings", std::make_shared<torch::nn::Module>());
  token_embedding = embeddings->register_module(
      "token_embedding", torch::nn::Embedding(c.vocab_size, c.hidden_size));
  position_embedding = embeddings->register_module(
      "position_embedding", torch::nn::Embedding(c.max_position_embeddings, c.hidden_size));
  encoder = register_module("encoder", std::make_shared<torch::nn::Module>());
  layers = encoder->register_module("layers", torch::nn::ModuleList());
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) layers->push_back(ClipEncoderLayer(c));
  final_layer_norm = register_module(
      "final_layer_norm",
      torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.hidden_size}).eps(c.layer_norm_eps)));
}

ClipTextModelImpl::ClipTextModelImpl(const ClipTextConfig& config) {
  text_model_ = register_module("text_model", ClipTextTransformer(config));
  if (config.with_projection) {
    text_projection = register_module(
        "text_projection", Linear(torch::nn::LinearOptions(config.hidden_size, config.projection_dim)
                                      .bias(false)));
  }
}

ClipTextOutput ClipTextModelImpl::forward(const torch::Tensor& input_ids) {
  auto& m = *text_model_;
  const int64_t t = input_ids.size(1);
  TORCH_CHECK(t <= m.config.max_position_embeddings, "text encoder: ", t,
              " tokens, more than max_position_embeddings ", m.config.max_position_embeddings);
  const torch::Tensor positions = torch::arange(t, input_ids.options().dtype(torch::kLong));
  torch::Tensor x = m.token_embedding(input_ids) + m.position_embedding(positions).unsqueeze(0);
  ClipTextOutput out;
  out.hidden_states.push_back(x);
  const bool checkpointed = gradient_checkpointing && torch::GradMode::is_enabled();
  for (const auto& layer : *m.layers) {
    auto* encoder_layer = layer->as<ClipEncoderLayer>();
    if (checkpointed) {
      auto shared = std::dynamic_pointer_cast<ClipEncoderLayerImpl>(layer);
      x = checkpoint(
          [shared](const std::vector<torch::Tensor>& in) {
            return std::vector<torch::Tensor>{shared->forward(in[0])};
          },
          {x}, trainable_adapter_tensors(*encoder_layer))[0];
    } else {
      x = encoder_layer->forward(x);
    }
    out.hidden_states.push_back(x);
  }
  out.last_hidden_state = m.final_layer_norm(x);
  // transformers: the legacy config (eos_token_id 2) pools at argmax(input_ids), which is the
  // end-of-text token in CLIP's vocabulary; otherwise at the first end-of-text token.
  const torch::Tensor eos_index =
      m.config.eos_token_id == 2
          ? input_ids.to(torch::kLong).argmax(-1)
          : (input_ids == m.config.eos_token_id).to(torch::kInt).argmax(-1);
  const torch::Tensor batch = torch::arange(input_ids.size(0), eos_index.options());
  out.pooled = out.last_hidden_state.index({batch, eos_index});
  if (text_projection) out.text_embeds = text_projection(out.pooled);
  return out;
}

torch::Tensor ClipTextModelImpl::encode(const torch::Tensor& input_ids, int clip_skip) {
  return conditioning(forward(input_ids), clip_skip);
}

torch::Tensor ClipTextModelImpl::encode_chunked(const torch::Tensor& input_ids, int clip_skip,
                                                torch::Tensor* pooled) {
  return chunked(
      input_ids, [&](const ClipTextOutput& out) { return conditioning(out, clip_skip); }, pooled,
      /*projected=*/false);
}

torch::Tensor ClipTextModelImpl::encode_chunked_penultimate(const torch::Tensor& input_ids,
                                                            torch::Tensor* pooled) {
  TORCH_CHECK(text_model_->config.num_hidden_layers >= 2, "text encoder: no penultimate layer");
  return chunked(
      input_ids,
      [](const ClipTextOutput& out) { return out.hidden_states[out.hidden_states.size() - 2]; },
      pooled, /*projected=*/static_cast<bool>(text_projection));
}

torch::Tensor ClipTextModelImpl::chunked(
    const torch::Tensor& input_ids,
    const std::function<torch::Tensor(const ClipTextOutput&)>& pick, torch::Tensor* pooled,
    bool projected) {
  const int64_t chunk = text_model_->config.max_position_embeddings;
  const int64_t batch = input_ids.size(0), tokens = input_ids.size(1);
  TORCH_CHECK(tokens % chunk == 0, "long-prompt ids must be whole chunks of ", chunk,
              " tokens, got ", tokens);
  const int64_t chunks = tokens / chunk;
  const ClipTextOutput out = forward(input_ids.reshape({batch * chunks, chunk}));
  if (pooled != nullptr) {
    *pooled = (projected ? out.text_embeds : out.pooled).view({batch, chunks, -1}).select(1, 0);
  }
  const torch::Tensor states = pick(out).reshape({batch, tokens, -1});
  if (chunks == 1) return states;
  // kohya: [BOS of chunk 0] + states[:, i : i + 75] for i in 1, 78, 155 ... + [the last state].
  std::vector<torch::Tensor> parts{states.narrow(1, 0, 1)};
  for (int64_t i = 1; i < tokens - 1; i += chunk) parts.push_back(states.narrow(1, i, chunk - 2));
  parts.push_back(states.narrow(1, tokens - 1, 1));
  return torch::cat(parts, /*dim=*/1);
}

torch::Tensor ClipTextModelImpl::conditioning(const ClipTextOutput& out, int clip_skip) {
  const int64_t layers = text_model_->config.num_hidden_layers;
  TORCH_CHECK(clip_skip >= 1 && clip_skip <= layers, "clip_skip must be in 1..", layers, ", got ",
              clip_skip);
  if (clip_skip == 1) return out.last_hidden_state;
  const auto& hidden = out.hidden_states[out.hidden_states.size() - clip_skip];
  return text_model_->final_layer_norm(hidden);
}

void load_clip_text(ClipTextModel& model, const std::filesystem::path& folder_or_file) {
  const std::filesystem::path file = std::filesystem::is_directory(folder_or_file)
                                         ? folder_or_file / "model.safetensors"
                                         : folder_or_file;
  const SafetensorsFile weights = SafetensorsFile::open(file);
  // position_ids is a buffer older transformers versions saved; it carries nothing.
  load_into(*model, weights, file.string(),
            /*optional=*/{"text_model.embeddings.position_ids"});
}

}  // namespace lorapipe::models
