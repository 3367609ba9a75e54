"""Check a LoRA lorapipe trained on a FLUX.1 model against diffusers' FluxPipeline (fp32, CPU).

    python flux_diffusers_lora_check.py --model DIR --lora FILE --out RESULT.json
        [--png SAMPLE.png --prompt TEXT --seed N --steps N --width W --height H --t5_length N]

DIR   a diffusers FLUX.1 folder (FluxPipeline).
FILE  the LoRA in kohya's networks.lora_flux format: lora_unet_double_blocks_N_img_attn_qkv, ...
      in Black Forest Labs' module names (q, k and v fused; linear1 fusing them with the MLP's
      input), lora_te1_* for CLIP-L. diffusers' own kohya-Flux converter assumes the full width,
      so the file is merged here through an explicit table from BFL's modules to diffusers' split
      ones: each fused up matrix is cut along its rows, and every part shares the down matrix.

RESULT.json: file_modules; merged_modules (every one the table placed, each weight changed by
scale * up @ down); leftover (file modules the table has no place for); transformer_change =
max|lora - base| / max|base| of the transformer's output on seeded inputs; text_change the same
for CLIP-L's pooled output. With --png, the pipeline renders PROMPT from SEED (its own noise
draw, FluxPipeline's default guidance 3.5) with the LoRA merged: pixel_difference is the largest
difference from SAMPLE.png, in 1/255ths.
"""
import argparse
import json
import warnings

import numpy as np
import torch
from diffusers import FluxPipeline
from PIL import Image
from safetensors.torch import load_file

warnings.filterwarnings("ignore")


def flux_table(transformer):
    """kohya module name -> [(diffusers Linear, rows of the fused up matrix)]."""
    table = {}
    for i, block in enumerate(transformer.transformer_blocks):
        a = block.attn
        h = a.to_q.out_features
        base = f"lora_unet_double_blocks_{i}_"
        table[base + "img_attn_qkv"] = [(a.to_q, (0, h)), (a.to_k, (h, 2 * h)), (a.to_v, (2 * h, 3 * h))]
        table[base + "txt_attn_qkv"] = [(a.add_q_proj, (0, h)), (a.add_k_proj, (h, 2 * h)),
                                        (a.add_v_proj, (2 * h, 3 * h))]
        table[base + "img_attn_proj"] = [(a.to_out[0], None)]
        table[base + "txt_attn_proj"] = [(a.to_add_out, None)]
        table[base + "img_mlp_0"] = [(block.ff.net[0].proj, None)]
        table[base + "img_mlp_2"] = [(block.ff.net[2], None)]
        table[base + "txt_mlp_0"] = [(block.ff_context.net[0].proj, None)]
        table[base + "txt_mlp_2"] = [(block.ff_context.net[2], None)]
        table[base + "img_mod_lin"] = [(block.norm1.linear, None)]
        table[base + "txt_mod_lin"] = [(block.norm1_context.linear, None)]
    for i, block in enumerate(transformer.single_transformer_blocks):
        a = block.attn
        h = a.to_q.out_features
        m = block.proj_mlp.out_features
        base = f"lora_unet_single_blocks_{i}_"
        table[base + "linear1"] = [(a.to_q, (0, h)), (a.to_k, (h, 2 * h)), (a.to_v, (2 * h, 3 * h)),
                                   (block.proj_mlp, (3 * h, 3 * h + m))]
        table[base + "linear2"] = [(block.proj_out, None)]
        table[base + "modulation_lin"] = [(block.norm.linear, None)]
    # kohya's network_args in_dims: the input layers (schnell has no guidance embedder).
    table["lora_unet_img_in"] = [(transformer.x_embedder, None)]
    table["lora_unet_txt_in"] = [(transformer.context_embedder, None)]
    embed = transformer.time_text_embed
    for ours, theirs in (("time_in", "timestep_embedder"), ("vector_in", "text_embedder"),
                         ("guidance_in", "guidance_embedder")):
        mlp = getattr(embed, theirs, None)
        if mlp is not None:
            table[f"lora_unet_{ours}_in_layer"] = [(mlp.linear_1, None)]
            table[f"lora_unet_{ours}_out_layer"] = [(mlp.linear_2, None)]
    return table


def clip_table(text_encoder):
    return {"lora_te1_" + name.replace(".", "_"): [(module, None)]
            for name, module in text_encoder.named_modules() if isinstance(module, torch.nn.Linear)}


def outputs(pipe, t5_length):
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        embeds, pooled, text_ids = pipe.encode_prompt(prompt=["a red circle", "a blue square"],
                                                      prompt_2=None, max_sequence_length=t5_length)
        latents = torch.randn(2, 16, 8, 8, generator=g)
        packed = pipe._pack_latents(latents, 2, 16, 8, 8)
        ids = pipe._prepare_latent_image_ids(2, 4, 4, latents.device, latents.dtype)
        guidance = torch.full((2,), 3.5) if pipe.transformer.config.guidance_embeds else None
        y = pipe.transformer(hidden_states=packed, timestep=torch.tensor([0.3, 0.7]),
                             guidance=guidance, pooled_projections=pooled,
                             encoder_hidden_states=embeds, txt_ids=text_ids, img_ids=ids,
                             return_dict=False)[0]
    return pooled, y


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag in ("--model", "--lora", "--out"):
        parser.add_argument(flag, required=True)
    parser.add_argument("--png")
    parser.add_argument("--prompt")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--height", type=int, default=64)
    parser.add_argument("--t5_length", type=int, default=512)
    args = parser.parse_args()
    pipe = FluxPipeline.from_pretrained(args.model, torch_dtype=torch.float32)
    base_text, base_out = outputs(pipe, args.t5_length)
    file = load_file(args.lora)
    modules = sorted({k.split(".")[0] for k in file})
    table = flux_table(pipe.transformer)
    table.update(clip_table(pipe.text_encoder))
    merged, leftover = 0, []
    with torch.no_grad():
        for name in modules:
            if name not in table:
                leftover.append(name)
                continue
            down = file[f"{name}.lora_down.weight"].float()
            up = file[f"{name}.lora_up.weight"].float()
            alpha = file[f"{name}.alpha"].float().item() if f"{name}.alpha" in file else down.shape[0]
            scale = alpha / down.shape[0]
            for linear, rows in table[name]:
                part = up if rows is None else up[rows[0]:rows[1]]
                linear.weight += scale * (part @ down)
            merged += 1
    lora_text, lora_out = outputs(pipe, args.t5_length)
    result = {
        "file_modules": len(modules),
        "merged_modules": merged,
        "leftover": leftover,
        "transformer_change": ((lora_out - base_out).abs().max() / base_out.abs().max()).item(),
        "text_change": ((lora_text - base_text).abs().max() / base_text.abs().max()).item(),
    }
    if args.png:
        with torch.no_grad():
            image = pipe(prompt=args.prompt, width=args.width, height=args.height,
                         num_inference_steps=args.steps, guidance_scale=3.5,
                         generator=torch.Generator().manual_seed(args.seed),
                         max_sequence_length=args.t5_length, output_type="np").images[0]
        ours = np.asarray(Image.open(args.png).convert("RGB")).astype(np.int32)
        theirs = (image * 255).round().astype(np.int32)
        result["pixel_difference"] = int(np.abs(ours - theirs).max()) if ours.shape == theirs.shape else -1
        result["image_shape"] = list(theirs.shape)
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
