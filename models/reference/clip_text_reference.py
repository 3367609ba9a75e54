#!/usr/bin/env python3
"""Parity fixture for the CLIP text encoder: a tiny transformers CLIPTextModel with seeded random
weights, saved as transformers saves it, and its outputs on fixed token ids.

    clip_text_reference.py OUT_DIR
writes OUT_DIR/text_encoder/{config.json,model.safetensors} and OUT_DIR/clip_text_io.safetensors
with input_ids, last_hidden_state, pooled, penultimate (hidden_states[-2]) and clip_skip2
(final_layer_norm(hidden_states[-2]), the conditioning kohya/A1111 use for clip skip 2), and the
same for kohya's chunked long prompts (long_*: 225 tokens in three chunks of 77).

Also SDXL's second encoder, a tiny CLIPTextModelWithProjection (gelu, as OpenCLIP ViT-bigG):
OUT_DIR/text_encoder_2/{config.json,model.safetensors}, and in the same io file g_input_ids
(padded with 0 after the end-of-text token, as SDXL's second tokenizer pads), g_last_hidden_state,
g_penultimate (hidden_states[-2], SDXL's conditioning, no final layer norm), g_pooled and
g_text_embeds (text_projection of the pooled state).

And the same tiny encoder's tensors in OpenCLIP's own layout as SDXL single files hold them
(OUT_DIR/openclip_single_file.safetensors, under conditioner.embedders.1.model., with a
logit_scale), and what diffusers' convert_open_clip_checkpoint makes of that file
(OUT_DIR/openclip_converted.safetensors).
"""
import os
import sys

import torch
from diffusers.loaders.single_file_utils import convert_open_clip_checkpoint
from safetensors.torch import save_file
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection


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

    g_config = CLIPTextConfig(vocab_size=1000, hidden_size=40, intermediate_size=53,
                              num_hidden_layers=4, num_attention_heads=5,
                              max_position_embeddings=77, hidden_act="gelu", projection_dim=24,
                              layer_norm_eps=1e-5, eos_token_id=2, bos_token_id=0,
                              pad_token_id=1, attn_implementation="eager")
    g_model = CLIPTextModelWithProjection(g_config).eval()
    with torch.no_grad():
        for p in g_model.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    g_model.save_pretrained(os.path.join(out, "text_encoder_2"), safe_serialization=True)
    g_ids = torch.zeros((2, 77), dtype=torch.long)
    for row, length in enumerate((9, 30)):
        g_ids[row, 0] = bos
        g_ids[row, 1:1 + length] = torch.randint(2, 998, (length,), generator=g)
        g_ids[row, 1 + length] = eos
    with torch.no_grad():
        g_result = g_model(g_ids, output_hidden_states=True)
        g_pooled = g_model.text_model(g_ids).pooler_output

    # OpenCLIP's layout of the same weights: fused q/k/v, text_projection [hidden, projection].
    sd = g_model.state_dict()
    prefix = "conditioner.embedders.1.model."
    open_clip = {prefix + "token_embedding.weight": sd["text_model.embeddings.token_embedding.weight"],
                 prefix + "positional_embedding":
                     sd["text_model.embeddings.position_embedding.weight"],
                 prefix + "ln_final.weight": sd["text_model.final_layer_norm.weight"],
                 prefix + "ln_final.bias": sd["text_model.final_layer_norm.bias"],
                 prefix + "text_projection": sd["text_projection.weight"].T,
                 prefix + "logit_scale": torch.tensor(4.6052)}
    names = {"layer_norm1": "ln_1", "layer_norm2": "ln_2", "self_attn.out_proj": "attn.out_proj",
             "mlp.fc1": "mlp.c_fc", "mlp.fc2": "mlp.c_proj"}
    for i in range(g_config.num_hidden_layers):
        ours, theirs = f"text_model.encoder.layers.{i}.", f"{prefix}transformer.resblocks.{i}."
        for kind in ("weight", "bias"):
            open_clip[theirs + "attn.in_proj_" + kind] = torch.cat(
                [sd[ours + f"self_attn.{p}_proj.{kind}"] for p in "qkv"])
            for a, b in names.items():
                open_clip[theirs + f"{b}.{kind}"] = sd[ours + f"{a}.{kind}"]
    open_clip = {k: v.contiguous() for k, v in open_clip.items()}
    save_file(open_clip, os.path.join(out, "openclip_single_file.safetensors"))
    converted = convert_open_clip_checkpoint(g_model, open_clip, prefix=prefix)
    save_file({k: v.contiguous() for k, v in converted.items()},
              os.path.join(out, "openclip_converted.safetensors"))

    save_file({"g_input_ids": g_ids,
               "g_last_hidden_state": g_result.last_hidden_state.contiguous(),
               "g_penultimate": g_result.hidden_states[-2].contiguous(),
               "g_pooled": g_pooled.contiguous(),
               "g_text_embeds": g_result.text_embeds.contiguous(),
               "input_ids": ids, "last_hidden_state": result.last_hidden_state.contiguous(),
               "pooled": result.pooler_output.contiguous(), "penultimate": penultimate.contiguous(),
               "clip_skip2": clip_skip2.contiguous(), "long_input_ids": long_ids,
               "long_last_hidden_state": long_last.contiguous(),
               "long_clip_skip2": long_skip2.contiguous(), "long_pooled": long_pooled.contiguous()},
              os.path.join(out, "clip_text_io.safetensors"))


if __name__ == "__main__":
    main()
