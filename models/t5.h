#pragma once
// The T5 v1.1 encoder (transformers' T5EncoderModel), Flux.1's large text encoder and the pattern
// of the encoders the flow-matching transformers after it use: token embeddings, then blocks of
// self-attention with a learned relative position bias (bucketed, computed once by the first
// block and shared by all) and a gated-GELU feed-forward, each behind T5's RMS norm (scale only,
// no mean, accumulated in fp32), and a final RMS norm. Parameters carry transformers' names
// ("encoder.block.0.layer.0.SelfAttention.q.weight", "shared.weight"), so a transformers
// text_encoder_2/ folder and kohya's t5xxl_fp16.safetensors load by name.
//
// Like transformers, the feed-forward's `wo` stays in fp32 when the rest is stored in fp16
// (T5EncoderModel._keep_in_fp32_modules, which transformers applies to fp16 loads only: XXL's
// activations pass fp16's range there), and the residual stream follows PyTorch's type promotion
// from then on, as in transformers. In bf16 everything is bf16.
//
// Built with uninitialised weights in their storage dtype (models/empty_linear.h): XXL's 4.8 B
// parameters never exist in fp32 unless asked for.

#include <ATen/core/Tensor.h>
#include <c10/core/TensorOptions.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/pimpl.h>

#include <filesystem>
#include <string>
#include <vector>

#include "models/linear.h"

namespace lorapipe::models {

class SafetensorsFile;

// The fields of transformers' T5Config that decide the encoder. Defaults: google/t5-v1_1-xxl.
struct T5Config {
  int64_t vocab_size = 32128;
  int64_t d_model = 4096;
  int64_t d_kv = 64;
  int64_t d_ff = 10240;
  int64_t num_layers = 24;
  int64_t num_heads = 64;
  int64_t relative_attention_num_buckets = 32;
  int64_t relative_attention_max_distance = 128;
  double layer_norm_epsilon = 1e-6;

  static T5Config xxl() { return {}; }
  // A transformers config.json. Only the gated-GELU (v1.1) feed-forward is built; another
  // feed_forward_proj is refused by name (InputError naming `source`).
  static T5Config from_json(const std::string& json, const std::string& source);
};

// T5's RMS norm: x / rms(x) (the mean of squares in fp32), cast to the weight's dtype when that
// is 16-bit, times the weight.
struct T5LayerNormImpl : torch::nn::Module {
  T5LayerNormImpl(int64_t dim, double eps, const at::TensorOptions& options);
  at::Tensor forward(const at::Tensor& x);
  at::Tensor weight;
  double eps;
};
TORCH_MODULE(T5LayerNorm);

struct T5BlockImpl : torch::nn::Module {
  T5BlockImpl(const T5Config& config, bool relative_bias, const at::TensorOptions& options);
  // `bias`: the position bias plus the padding mask, [B or 1, heads, T, T].
  at::Tensor forward(const at::Tensor& x, const at::Tensor& bias);
  // The first block's relative position bias for `length` tokens, [1, heads, T, T].
  at::Tensor position_bias(int64_t length) const;
  // A conversion to fp16 keeps `wo` in fp32, as the constructor and transformers do (the stages
  // convert loaded models with Module::to: an fp16 cache of T5 XXL would overflow otherwise).
  using torch::nn::Module::to;
  void to(torch::Dtype dtype, bool non_blocking = false) override;
  void to(torch::Device device, torch::Dtype dtype, bool non_blocking = false) override;

  T5Config config;
  Linear q{nullptr}, k{nullptr}, v{nullptr}, o{nullptr};
  at::Tensor relative_attention_bias;  // [buckets, heads], the first block only
  T5LayerNorm attention_norm{nullptr}, ff_norm{nullptr};
  Linear wi_0{nullptr}, wi_1{nullptr}, wo{nullptr};
};
TORCH_MODULE(T5Block);

struct T5EncoderImpl : torch::nn::Module {
  // Parameters made with `options`, uninitialised; `wo` made in fp32 where `options` is fp16.
  T5EncoderImpl(const T5Config& config, const at::TensorOptions& options);
  // The last hidden state (after the final norm) of `ids` [B, T] int64; `mask` [B, T] (1: a
  // token, 0: padding) or undefined: every token attends to every token, as diffusers' Flux
  // pipeline and kohya without --apply_t5_attn_mask encode.
  at::Tensor forward(const at::Tensor& ids, const at::Tensor& mask = {});

  T5Config config;
  at::Tensor shared;  // [vocab, d_model], the token embeddings ("shared.weight")
  torch::nn::ModuleList blocks;
  T5LayerNorm final_layer_norm{nullptr};
};
TORCH_MODULE(T5Encoder);

// transformers' relative position buckets (bidirectional) of `relative` = key - query positions.
at::Tensor t5_relative_position_bucket(const at::Tensor& relative, int64_t num_buckets,
                                       int64_t max_distance);

// Fills `encoder` from a transformers-layout file (a text_encoder_2/ model.safetensors, kohya's
// t5xxl file): the embeddings under shared.weight or encoder.embed_tokens.weight (both, tied, in
// some files). One tensor at a time; throws InputError naming the file and the missing,
// unexpected or mis-shaped keys.
void load_t5_encoder(T5EncoderImpl& encoder, const SafetensorsFile& file);
// The same from several files (a transformers folder's shards), named `source` in errors; with
// `prefix`, only the tensors under it, by their names without it (ComfyUI's all-in-one FLUX.1
// file: text_encoders.t5xxl.transformer.).
void load_t5_encoder(T5EncoderImpl& encoder, const std::vector<const SafetensorsFile*>& files,
                     const std::string& source, const std::string& prefix = "");

}  // namespace lorapipe::models
