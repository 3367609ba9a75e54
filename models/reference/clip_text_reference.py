#!/usr/bin/env python3
"""Parity fixture for the CLIP text encoder: a tiny transformers CLIPTextModel with seeded random
weights, saved as transformers saves it, and its outputs on fixed token ids.

    clip_text_reference.py OUT_DIR
writes OUT_DIR/text_encoder/{config.json,model.safetensors} and OUT_DIR/clip_text_io.safetensors
with input_ids, last_hidden_state, pooled, penultimate (hidden_states[-2]) and clip_skip2
(final_layer_norm(hidden_states[-2]), the conditioning kohya/A1111 use for clip skip 2), and the
same for kohya's chunked long prompts (long_*: 225 tokens in three chunks of 77).
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

    # kohya's long prompts (--max_token_length 225): ids padded to 227, cut into chunks of BOS +
    # 75 tokens + the last id (train_util's get_input_ids, the pad == eos branch), each chunk
    # encoded on its own, then joined by get_hidden_states (SD1 branch).
    max_token_length, chunk = 225, 77
    rows = []
    for length in (100, 200):
        full = torch.full((max_token_length + 2,), eos, dtype=torch.long)
        full[0] = bos
        full[1:1 + length] = torch.randint(2, 998, (length,), generator=g)
        pieces = [torch.cat((full[:1], full[i:i + chunk - 2], full[-1:]))
                  for i in range(1, max_token_length + 2 - chunk + 2, chunk - 2)]
        rows.append(torch.cat(pieces))
    long_ids = torch.stack(rows)  # [2, 3 * 77]

    def kohya_hidden_states(clip_skip):
        b = long_ids.size(0)
        with torch.no_grad():
            result = model(long_ids.reshape(-1, chunk), output_hidden_states=True)
            states = result.last_hidden_state if clip_skip == 1 else \
                model.text_model.final_layer_norm(result.hidden_states[-clip_skip])
        states = states.reshape(b, -1, states.shape[-1])
        parts = [states[:, 0].unsqueeze(1)]
        for i in range(1, max_token_length, chunk):
            parts.append(states[:, i:i + chunk - 2])
        parts.append(states[:, -1].unsqueeze(1))
        return torch.cat(parts, dim=1), result.pooler_output.reshape(b, -1, states.shape[-1])[:, 0]

    long_last, long_pooled = kohya_hidden_states(1)
    long_skip2, _ = kohya_hidden_states(2)
    save_file({"input_ids": ids, "last_hidden_state": result.last_hidden_state.contiguous(),
               "pooled": result.pooler_output.contiguous(), "penultimate": penultimate.contiguous(),
               "clip_skip2": clip_skip2.contiguous(), "long_input_ids": long_ids,
               "long_last_hidden_state": long_last.contiguous(),
               "long_clip_skip2": long_skip2.contiguous(), "long_pooled": long_pooled.contiguous()},
              os.path.join(out, "clip_text_io.safetensors"))


if __name__ == "__main__":
    main()
