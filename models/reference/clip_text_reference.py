#!/usr/bin/env python3
"""Parity fixture for the CLIP text encoder: a tiny transformers CLIPTextModel with seeded random
weights, saved as transformers saves it, and its outputs on fixed token ids.

    clip_text_reference.py OUT_DIR
writes OUT_DIR/text_encoder/{config.json,model.safetensors} and OUT_DIR/clip_text_io.safetensors
with input_ids, last_hidden_state, pooled, penultimate (hidden_states[-2]) and clip_skip2
(final_layer_norm(hidden_states[-2]), the conditioning kohya/A1111 use for clip skip 2).
"""
import os
import sys

import torch
from safetensors.torch import save_file
from transformers import CLIPTextConfig, CLIPTextModel


def main() -> None:
    out = sys.argv[1]
    torch.manual_seed(0)
    config = CLIPTextConfig(vocab_size=1000, hidden_size=32, intermediate_size=37,
                            num_hidden_layers=5, num_attention_heads=4,
                            max_position_embeddings=77, hidden_act="quick_gelu",
                            layer_norm_eps=1e-5, eos_token_id=2, bos_token_id=0,
                            pad_token_id=1, attn_implementation="eager")
    model = CLIPTextModel(config).eval()
    with torch.no_grad():
        for p in model.parameters():  # every weight random and non-trivial, layer norms too
            p.copy_(torch.randn_like(p) * 0.2)
    model.save_pretrained(os.path.join(out, "text_encoder"), safe_serialization=True)

    # Two prompts as SD tokenizes them: BOS, tokens, EOS (the largest id), then EOS padding.
    bos, eos = 998, 999
    ids = torch.full((2, 77), eos, dtype=torch.long)
    g = torch.Generator().manual_seed(1)
    for row, length in enumerate((12, 40)):
        ids[row, 0] = bos
        ids[row, 1:1 + length] = torch.randint(2, 998, (length,), generator=g)
    with torch.no_grad():
        result = model(ids, output_hidden_states=True)
        penultimate = result.hidden_states[-2]
        clip_skip2 = model.text_model.final_layer_norm(penultimate)
    save_file({"input_ids": ids, "last_hidden_state": result.last_hidden_state.contiguous(),
               "pooled": result.pooler_output.contiguous(), "penultimate": penultimate.contiguous(),
               "clip_skip2": clip_skip2.contiguous()},
              os.path.join(out, "clip_text_io.safetensors"))


if __name__ == "__main__":
    main()
