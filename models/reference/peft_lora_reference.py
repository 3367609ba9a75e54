#!/usr/bin/env python3
"""LoRA files in diffusers' PEFT naming on the tiny FLUX.1 [dev] pipeline, and what FluxPipeline
computes with each loaded by load_lora_weights, for models/flux_model_test.cpp.

    peft_lora_reference.py FLUX_FOLDER OUT_DIR

FLUX_FOLDER: the pipeline flux_pipeline_reference.py saved. peft adapters with seeded random A
and B on layers chosen to leave parts of lorapipe's fused layers out: in the double block the
image attention's to_q and to_k (not to_v), the text attention's add_v_proj alone, to_out.0,
ff.net.2 and norm1.linear; in the single blocks to_q and proj_mlp (of linear1's four parts, at
rank 2) and proj_out; on CLIP-L, q_proj and fc1. Saved by FluxPipeline.save_lora_weights as
  with_metadata.safetensors  rank 4 (proj_mlp 2), lora_alpha 8, in lora_adapter_metadata
  plain.safetensors          the same tensors without it (diffusers: alpha = the first rank)
  alphas.safetensors         the same tensors with a `.alpha` of 2 on each module but proj_mlp's
                             (diffusers gives those the most common alpha)
  rslora.safetensors         with_metadata's, the transformer's with use_rslora (alpha / sqrt(r))
  comfy.safetensors          a LoRA in ComfyUI's naming (diffusion_model.double_blocks.0.img_attn.qkv
                             .lora_down.weight, text_encoders.clip_l.transformer.text_model....):
                             qkv, proj, txt_mlp.0, img_mod.lin, linear2, modulation.lin and CLIP-L's
                             fc1 and fc2, rank 4, an `.alpha` of 2 on the double blocks' and
                             none (alpha = rank) on the others. Not linear1: diffusers' reader
                             splits it at FLUX.1's full widths alone. Not CLIP-L's attention:
                             diffusers 0.36 drops those modules of this naming ("unexpected
                             keys ... self_attn.to_q_lora"), so it is no reference for them.
OUT_DIR/reference.safetensors: latents, sigma and the T5 states (prompt_embeds) of a denoiser
call; for each file NAME, pooled_NAME (CLIP-L's pooled output of PROMPTS) and velocity_NAME (the
transformer's unpacked output on those inputs, guidance 3.5) with the file loaded; pooled_base
and velocity_base without a LoRA.
"""
import os
import sys

import torch
from diffusers import FluxPipeline
from peft import LoraConfig, get_peft_model_state_dict
from safetensors.torch import load_file, save_file

PROMPTS = ["a photo of a cat sitting on a red chair", "anime style, 1girl, long hair, sunset"]
T5_LENGTH = 16
DENOISER = (r"(transformer_blocks\.\d+\.(attn\.(to_q|to_k|add_v_proj|to_out\.0)|ff\.net\.2"
            r"|norm1\.linear)|single_transformer_blocks\.\d+\.(attn\.to_q|proj_mlp|proj_out))")
TEXT = r".*layers\.\d+\.(self_attn\.q_proj|mlp\.fc1)"
CONFIG_KEYS = ("r", "lora_alpha", "rank_pattern", "alpha_pattern", "target_modules")


def adapt(model, targets, gen, rank_pattern):
    config = LoraConfig(r=4, lora_alpha=8, target_modules=targets, rank_pattern=rank_pattern,
                        init_lora_weights=False)
    model.add_adapter(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    state = get_peft_model_state_dict(model)
    metadata = {k: v for k, v in config.to_dict().items() if k in CONFIG_KEYS}
    return state, metadata


def comfy_lora(pipe, gen):
    """Seeded LoRA weights under ComfyUI's names: the original FLUX.1 layout's paths."""
    config = pipe.transformer.config
    inner = config.num_attention_heads * config.attention_head_dim
    mlp = inner * 4
    text = pipe.text_encoder.config
    layers = {}
    for i in range(config.num_layers):
        for path, rows, cols in (("img_attn.qkv", 3 * inner, inner), ("img_attn.proj", inner, inner),
                                 ("txt_mlp.0", mlp, inner), ("img_mod.lin", 6 * inner, inner)):
            layers[f"diffusion_model.double_blocks.{i}.{path}"] = (rows, cols, 2.0)
    for i in range(config.num_single_layers):
        for path, rows, cols in (("linear2", inner, inner + mlp), ("modulation.lin", 3 * inner, inner)):
            layers[f"diffusion_model.single_blocks.{i}.{path}"] = (rows, cols, None)
    for i in range(text.num_hidden_layers):
        prefix = f"text_encoders.clip_l.transformer.text_model.encoder.layers.{i}"
        layers[prefix + ".mlp.fc1"] = (text.intermediate_size, text.hidden_size, None)
        layers[prefix + ".mlp.fc2"] = (text.hidden_size, text.intermediate_size, None)
    tensors = {}
    for path, (rows, cols, alpha) in layers.items():
        tensors[path + ".lora_down.weight"] = torch.randn(4, cols, generator=gen) * 0.3
        tensors[path + ".lora_up.weight"] = torch.randn(rows, 4, generator=gen) * 0.3
        if alpha is not None:
            tensors[path + ".alpha"] = torch.tensor(alpha)
    return tensors


def outputs(pipe, latents, sigma):
    with torch.no_grad():
        prompt_embeds, pooled, text_ids = pipe.encode_prompt(
            prompt=PROMPTS, prompt_2=None, max_sequence_length=T5_LENGTH)
        b, c, h, w = latents.shape
        packed = pipe._pack_latents(latents, b, c, h, w)
        image_ids = pipe._prepare_latent_image_ids(b, h // 2, w // 2, latents.device, latents.dtype)
        velocity = pipe.transformer(hidden_states=packed, timestep=sigma, guidance=torch.full((b,), 3.5),
                                    pooled_projections=pooled, encoder_hidden_states=prompt_embeds,
                                    txt_ids=text_ids, img_ids=image_ids, return_dict=False)[0]
        velocity = pipe._unpack_latents(velocity, h * pipe.vae_scale_factor, w * pipe.vae_scale_factor,
                                        pipe.vae_scale_factor)
    return prompt_embeds, pooled, velocity


def main() -> None:
    folder, out = sys.argv[1], sys.argv[2]
    gen = torch.Generator().manual_seed(5)
    latents = torch.randn(2, 16, 8, 6, generator=gen)
    sigma = torch.tensor([0.35, 0.8])
    pipe = FluxPipeline.from_pretrained(folder)
    prompt_embeds, pooled, velocity = outputs(pipe, latents, sigma)
    result = {"latents": latents, "sigma": sigma, "prompt_embeds": prompt_embeds.contiguous(),
              "pooled_base": pooled.contiguous(), "velocity_base": velocity.contiguous()}

    transformer_state, transformer_meta = adapt(pipe.transformer, DENOISER, gen, {"proj_mlp": 2})
    text_state, text_meta = adapt(pipe.text_encoder, TEXT, gen, {})
    FluxPipeline.save_lora_weights(out, transformer_lora_layers=transformer_state,
                                   text_encoder_lora_layers=text_state,
                                   weight_name="with_metadata.safetensors",
                                   transformer_lora_adapter_metadata=transformer_meta,
                                   text_encoder_lora_adapter_metadata=text_meta)
    FluxPipeline.save_lora_weights(out, transformer_lora_layers=transformer_state,
                                   text_encoder_lora_layers=text_state, weight_name="plain.safetensors")
    FluxPipeline.save_lora_weights(out, transformer_lora_layers=transformer_state,
                                   text_encoder_lora_layers=text_state, weight_name="rslora.safetensors",
                                   transformer_lora_adapter_metadata={**transformer_meta, "use_rslora": True},
                                   text_encoder_lora_adapter_metadata=text_meta)
    tensors = load_file(os.path.join(out, "plain.safetensors"))
    for key in list(tensors):
        if key.endswith(".lora_A.weight") and "proj_mlp" not in key:
            tensors[key.replace(".lora_A.weight", ".alpha")] = torch.tensor(2.0)
    save_file(tensors, os.path.join(out, "alphas.safetensors"))

    save_file(comfy_lora(pipe, gen), os.path.join(out, "comfy.safetensors"))

    for name in ("with_metadata", "plain", "alphas", "rslora", "comfy"):
        fresh = FluxPipeline.from_pretrained(folder)
        fresh.load_lora_weights(os.path.join(out, name + ".safetensors"))
        embeds, pooled, velocity = outputs(fresh, latents, sigma)
        assert torch.equal(embeds, prompt_embeds), "the LoRA changed T5"
        result["pooled_" + name] = pooled.contiguous()
        result["velocity_" + name] = velocity.contiguous()
    save_file(result, os.path.join(out, "reference.safetensors"))


if __name__ == "__main__":
    main()
