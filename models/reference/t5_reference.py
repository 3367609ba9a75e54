#!/usr/bin/env python3
"""Reference outputs of transformers' T5EncoderModel (T5 v1.1: gated-GELU) for models/t5_test.cpp.

    t5_reference.py OUT_DIR

A tiny encoder from config alone (no network): 3 blocks, 4 heads of 8, d_model 32, d_ff 48,
vocabulary 64, 8 relative position buckets up to distance 16 (so that 20 tokens reach the
logarithmic buckets and the clamp at the last). Every parameter re-drawn at random (seeded).

  OUT_DIR/t5/                 config.json and model.safetensors (save_pretrained: the tied
                              embeddings once)
  OUT_DIR/t5_both.safetensors the same weights with shared.weight and encoder.embed_tokens.weight
                              both present, as some single files hold them
  OUT_DIR/io.safetensors
      ids [2, 20] (the second sample: 12 tokens, end-of-text 1, then padding 0), mask
      out, masked_out                   fp32 last hidden state, without and with attention_mask
      bf16_out, bf16_masked_out         the model loaded with dtype=bfloat16, outputs as fp32
      fp16_out, fp16_masked_out         and with dtype=float16 (wo kept in fp32 by transformers)
      buckets_32_128, buckets_8_16      _relative_position_bucket of key - query in [-300, 300]
                                        (bidirectional), for T5-XXL's (32, 128) and the tiny one's
  OUT_DIR/full_xxl.json       {key: shape} of google/t5-v1_1-xxl's encoder built on the meta device
                              (the tied encoder.embed_tokens.weight left out: it is shared.weight)
"""
import json
import os
import sys

import torch
from safetensors.torch import save_file
from transformers import T5Config, T5EncoderModel
from transformers.models.t5.modeling_t5 import T5Attention


def main() -> None:
    out = sys.argv[1]
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(5)
    config = T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=48, num_layers=3, num_heads=4,
                      relative_attention_num_buckets=8, relative_attention_max_distance=16,
                      feed_forward_proj="gated-gelu", layer_norm_epsilon=1e-6, dropout_rate=0.0)
    model = T5EncoderModel(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 1.0 if "layer_norm" in name or "relative_attention_bias" in name else 0.3
            p.copy_(torch.randn(p.shape, generator=gen) * scale + (1.0 if "layer_norm" in name else 0.0))
    folder = os.path.join(out, "t5")
    model.save_pretrained(folder, safe_serialization=True)
    both = {k: v.clone().contiguous() for k, v in model.state_dict().items()}
    both["encoder.embed_tokens.weight"] = both["shared.weight"].clone()
    save_file(both, os.path.join(out, "t5_both.safetensors"))

    ids = torch.randint(2, 64, (2, 20), generator=gen)
    ids[1, 12] = 1
    ids[1, 13:] = 0
    mask = torch.ones(2, 20, dtype=torch.int64)
    mask[1, 13:] = 0
    results = {"ids": ids, "mask": mask}
    with torch.no_grad():
        results["out"] = model(input_ids=ids).last_hidden_state
        results["masked_out"] = model(input_ids=ids, attention_mask=mask).last_hidden_state
        for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
            half = T5EncoderModel.from_pretrained(folder, dtype=dtype).eval()
            wo = half.encoder.block[0].layer[1].DenseReluDense.wo.weight.dtype
            assert wo == (torch.float32 if dtype == torch.float16 else dtype), wo
            results[f"{name}_out"] = half(input_ids=ids).last_hidden_state.float()
            results[f"{name}_masked_out"] = half(input_ids=ids, attention_mask=mask).last_hidden_state.float()
    relative = torch.arange(-300, 301)
    results["buckets_32_128"] = T5Attention._relative_position_bucket(relative, True, 32, 128)
    results["buckets_8_16"] = T5Attention._relative_position_bucket(relative, True, 8, 16)
    save_file({k: v.contiguous() for k, v in results.items()}, os.path.join(out, "io.safetensors"))

    # google/t5-v1_1-xxl's encoder (Flux.1's text_encoder_2), on the meta device.
    xxl = T5Config(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24,
                   num_heads=64, relative_attention_num_buckets=32,
                   relative_attention_max_distance=128, feed_forward_proj="gated-gelu")
    with torch.device("meta"):
        full = T5EncoderModel(xxl)
    shapes = {k: list(v.shape) for k, v in full.state_dict().items() if k != "encoder.embed_tokens.weight"}
    with open(os.path.join(out, "full_xxl.json"), "w") as f:
        json.dump(shapes, f, indent=0, sort_keys=True)


if __name__ == "__main__":
    main()
