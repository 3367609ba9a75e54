#include "models/open_clip_keys.h"

#include <torch/torch.h>

#include <utility>
#include <vector>

#include "common/error.h"

namespace lorapipe::models {
namespace {

// OpenCLIP's names inside a residual block, and transformers'.
const std::vector<std::pair<std::string, std::string>>& block_names() {
  static const std::vector<std::pair<std::string, std::string>> names = {
      {"ln_1.", "layer_norm1."},          {"ln_2.", "layer_norm2."},
      {"attn.out_proj.", "self_attn.out_proj."}, {"mlp.c_fc.", "mlp.fc1."},
      {"mlp.c_proj.", "mlp.fc2."}};
  return names;
}

}  // namespace

std::map<std::string, at::Tensor> open_clip_to_transformers(
    const std::map<std::string, at::Tensor>& tensors, std::string_view prefix,
    const std::string& source) {
  std::map<std::string, at::Tensor> out;
  auto refuse = [&](const std::string& key, const std::string& why) {
    throw InputError(source + ": " + key + " " + why);
  };
  const std::string blocks = "transformer.resblocks.";
  for (const auto& [key, tensor] : tensors) {
    if (key.rfind(prefix, 0) != 0) continue;
    const std::string name = key.substr(prefix.size());
    if (name == "logit_scale" || name == "attn_mask") continue;
    if (name == "token_embedding.weight") {
      out["text_model.embeddings.token_embedding.weight"] = tensor;
    } else if (name == "positional_embedding") {
      out["text_model.embeddings.position_embedding.weight"] = tensor;
    } else if (name == "ln_final.weight" || name == "ln_final.bias") {
      out["text_model.final_layer_norm." + name.substr(9)] = tensor;
    } else if (name == "text_projection") {
      if (tensor.dim() != 2) refuse(key, "is " + std::to_string(tensor.dim()) + "-D, not a 2-D projection");
      out["text_projection.weight"] = tensor.t().contiguous();  // stored [hidden, projection]
    } else if (name.rfind(blocks, 0) == 0) {
      const size_t dot = name.find('.', blocks.size());
      if (dot == std::string::npos) refuse(key, "is not an OpenCLIP text encoder key");
      const std::string layer =
          "text_model.encoder.layers." + name.substr(blocks.size(), dot - blocks.size()) + ".";
      const std::string rest = name.substr(dot + 1);
      if (rest == "attn.in_proj_weight" || rest == "attn.in_proj_bias") {
        if (tensor.dim() != (rest == "attn.in_proj_weight" ? 2 : 1)) {
          refuse(key, "is " + std::to_string(tensor.dim()) + "-D, not an attention " +
                          (rest == "attn.in_proj_weight" ? "weight (2-D)" : "bias (1-D)"));
        }
        if (tensor.size(0) % 3 != 0) {
          refuse(key, "has " + std::to_string(tensor.size(0)) +
                          " rows, not three projections (q, k, v) of one width");
        }
        const std::string kind = rest == "attn.in_proj_weight" ? "weight" : "bias";
        const std::vector<at::Tensor> qkv = tensor.chunk(3, /*dim=*/0);
        out[layer + "self_attn.q_proj." + kind] = qkv[0].contiguous();
        out[layer + "self_attn.k_proj." + kind] = qkv[1].contiguous();
        out[layer + "self_attn.v_proj." + kind] = qkv[2].contiguous();
        continue;
      }
      bool mapped = false;
      for (const auto& [from, to] : block_names()) {
        if (rest.rfind(from, 0) == 0) {
          out[layer + to + rest.substr(from.size())] = tensor;
          mapped = true;
          break;
        }
      }
      if (!mapped) refuse(key, "is not an OpenCLIP text encoder key");
    } else {
      refuse(key, "is not an OpenCLIP text encoder key");
    }
  }
  return out;
}

std::map<std::string, at::Tensor> transformers_to_open_clip(
    const std::map<std::string, at::Tensor>& tensors, std::string_view prefix) {
  std::map<std::string, at::Tensor> out;
  const std::string p(prefix);
  const std::string layers = "text_model.encoder.layers.";
  for (const auto& [name, tensor] : tensors) {
    if (name == "text_model.embeddings.token_embedding.weight") {
      out[p + "token_embedding.weight"] = tensor;
    } else if (name == "text_model.embeddings.position_embedding.weight") {
      out[p + "positional_embedding"] = tensor;
    } else if (name.rfind("text_model.final_layer_norm.", 0) == 0) {
      out[p + "ln_final." + name.substr(28)] = tensor;
    } else if (name == "text_projection.weight") {
      out[p + "text_projection"] = tensor.t().contiguous();
    } else if (name == "text_model.embeddings.position_ids") {
      continue;
    } else if (name.rfind(layers, 0) == 0) {
      const size_t dot = name.find('.', layers.size());
      const std::string block =
          p + "transformer.resblocks." + name.substr(layers.size(), dot - layers.size()) + ".";
      const std::string rest = name.substr(dot + 1);
      if (rest.rfind("self_attn.q_proj.", 0) == 0) {
        const std::string kind = rest.substr(17);  // weight or bias
        const std::string head = name.substr(0, dot + 1) + "self_attn.";
        out[block + "attn.in_proj_" + kind] =
            torch::cat({tensors.at(head + "q_proj." + kind), tensors.at(head + "k_proj." + kind),
                        tensors.at(head + "v_proj." + kind)});
        continue;
      }
      if (rest.rfind("self_attn.k_proj.", 0) == 0 || rest.rfind("self_attn.v_proj.", 0) == 0) {
        continue;  // fused with q above
      }
      bool mapped = false;
      for (const auto& [from, to] : block_names()) {
        if (rest.rfind(to, 0) == 0) {
          out[block + from + rest.substr(to.size())] = tensor;
          mapped = true;
          break;
        }
      }
      if (!mapped) throw Error("transformers_to_open_clip: no OpenCLIP name for " + name);
    } else {
      throw Error("transformers_to_open_clip: no OpenCLIP name for " + name);
    }
  }
  return out;
}

}  // namespace lorapipe::models
