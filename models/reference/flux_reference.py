#!/usr/bin/env python3
"""Reference outputs of diffusers' FluxTransformer2DModel for models/flux_test.cpp.

    flux_reference.py OUT_DIR

Builds two tiny Flux transformers from config alone (no network): `dev` (guidance embedding) and
`schnell` (none), each 2 double-stream and 2 single-stream blocks, 2 heads 16 wide (rotary axes
4/6/6), 16 packed input channels, T5 states 32 wide, a pooled vector 24 wide. Every parameter is
re-drawn at random (seeded) first: diffusers' default init leaves the norms at exactly 1, which
would hide a q/k norm wired to the wrong stream.

For each <v> in dev, schnell:
  OUT_DIR/<v>/transformer/   config.json and diffusion_pytorch_model.safetensors (save_pretrained)
  OUT_DIR/<v>/original.safetensors
      the same weights in Black Forest Labs' single-file layout under model.diffusion_model.,
      mapped here from the config (diffusers' own single-file conversion hard-codes the full
      width): q, k, v (and the single blocks' proj_mlp) joined into qkv / linear1, the final
      layer's (scale, shift) stored as (shift, scale); metadata lorapipe.flux.axes_dim = "4,6,6"
  OUT_DIR/<v>/io.safetensors (batch 2, fp32):
      img, img_ids, txt, txt_ids, timesteps, y, guidance (dev), txt_mask   the inputs
      latents                        the [2, 4, 8, 6] latents img packs
      (latents 8x6 packed 2x2: 12 tokens; 7 text tokens, the second sample's last 3 masked)
      w                              fixed random weights of the output
      out, grad_img, grad_txt        output, d(sum(out * w)) / d img, / d txt
      masked_out, masked_grad_img, masked_grad_txt   the same with the text mask as diffusers'
                                     attention_mask (kohya's --apply_t5_attn_mask)

And the full-size layouts, built on the meta device (no memory, no weights):
  OUT_DIR/full_dev.json, OUT_DIR/full_schnell.json   {original key: shape}, mapped as above
  OUT_DIR/lora_dev.json, OUT_DIR/lora_schnell.json   kohya's lora_flux names of the full model
"""
import json
import os
import sys

import torch
from diffusers import FluxTransformer2DModel
from safetensors.torch import save_file

TINY = dict(
    patch_size=1,
    in_channels=16,
    num_layers=2,
    num_single_layers=2,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=32,
    pooled_projection_dim=24,
    axes_dims_rope=(4, 6, 6),
)


def to_original(sd: dict, num_layers: int, num_single_layers: int) -> dict:
    """diffusers' FluxTransformer2DModel state dict -> the BFL single-file names."""
    out = {}

    def layer(ours, theirs, swap=False):
        for kind in ("weight", "bias"):
            parts = [sd.pop(f"{t}.{kind}") for t in theirs if f"{t}.{kind}" in sd]
            if not parts:
                continue
            t = torch.cat(parts, 0)
            if swap:
                scale, shift = t.chunk(2, 0)
                t = torch.cat([shift, scale], 0)
            out[f"{ours}.{kind}"] = t

    def tensor(ours, theirs):
        out[ours] = sd.pop(theirs)

    layer("img_in", ["x_embedder"])
    layer("txt_in", ["context_embedder"])
    for ours, theirs in (("time_in", "timestep_embedder"), ("vector_in", "text_embedder"),
                         ("guidance_in", "guidance_embedder")):
        layer(f"{ours}.in_layer", [f"time_text_embed.{theirs}.linear_1"])
        layer(f"{ours}.out_layer", [f"time_text_embed.{theirs}.linear_2"])
    for i in range(num_layers):
        o, d = f"double_blocks.{i}.", f"transformer_blocks.{i}."
        layer(o + "img_mod.lin", [d + "norm1.linear"])
        layer(o + "txt_mod.lin", [d + "norm1_context.linear"])
        layer(o + "img_attn.qkv", [d + "attn.to_q", d + "attn.to_k", d + "attn.to_v"])
        layer(o + "txt_attn.qkv", [d + "attn.add_q_proj", d + "attn.add_k_proj", d + "attn.add_v_proj"])
        tensor(o + "img_attn.norm.query_norm.scale", d + "attn.norm_q.weight")
        tensor(o + "img_attn.norm.key_norm.scale", d + "attn.norm_k.weight")
        tensor(o + "txt_attn.norm.query_norm.scale", d + "attn.norm_added_q.weight")
        tensor(o + "txt_attn.norm.key_norm.scale", d + "attn.norm_added_k.weight")
        layer(o + "img_attn.proj", [d + "attn.to_out.0"])
        layer(o + "txt_attn.proj", [d + "attn.to_add_out"])
        layer(o + "img_mlp.0", [d + "ff.net.0.proj"])
        layer(o + "img_mlp.2", [d + "ff.net.2"])
        layer(o + "txt_mlp.0", [d + "ff_context.net.0.proj"])
        layer(o + "txt_mlp.2", [d + "ff_context.net.2"])
    for i in range(num_single_layers):
        o, d = f"single_blocks.{i}.", f"single_transformer_blocks.{i}."
        layer(o + "linear1", [d + "attn.to_q", d + "attn.to_k", d + "attn.to_v", d + "proj_mlp"])
        layer(o + "linear2", [d + "proj_out"])
        tensor(o + "norm.query_norm.scale", d + "attn.norm_q.weight")
        tensor(o + "norm.key_norm.scale", d + "attn.norm_k.weight")
        layer(o + "modulation.lin", [d + "norm.linear"])
    layer("final_layer.linear", ["proj_out"])
    layer("final_layer.adaLN_modulation.1", ["norm_out.linear"], swap=True)
    if sd:
        raise SystemExit(f"diffusers keys left unmapped: {sorted(sd)[:8]}")
    return out


def pack(latents):
    b, c, h, w = latents.shape
    return latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, h * w // 4, c * 4)


def run(model, inputs, mask=None):
    img = inputs["img"].clone().requires_grad_(True)
    txt = inputs["txt"].clone().requires_grad_(True)
    kwargs = None
    if mask is not None:
        tokens = img.shape[1]
        full = torch.cat([mask.bool(), torch.ones(mask.shape[0], tokens, dtype=torch.bool)], 1)
        kwargs = {"attention_mask": full[:, None, None, :]}
    out = model(
        hidden_states=img,
        encoder_hidden_states=txt,
        pooled_projections=inputs["y"],
        timestep=inputs["timesteps"],
        img_ids=inputs["img_ids"],
        txt_ids=inputs["txt_ids"],
        guidance=inputs.get("guidance"),
        joint_attention_kwargs=kwargs,
        return_dict=False,
    )[0]
    (out * inputs["w"]).sum().backward()
    return out.detach(), img.grad, txt.grad


def tiny_case(out_dir: str, name: str, guidance: bool, gen: torch.Generator) -> None:
    folder = os.path.join(out_dir, name)
    model = FluxTransformer2DModel(guidance_embeds=guidance, **TINY).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    model.save_pretrained(os.path.join(folder, "transformer"), safe_serialization=True)
    sd = {k: v.clone().contiguous() for k, v in model.state_dict().items()}
    original = to_original(sd, TINY["num_layers"], TINY["num_single_layers"])
    save_file({f"model.diffusion_model.{k}": v.contiguous() for k, v in original.items()},
              os.path.join(folder, "original.safetensors"),
              metadata={"lorapipe.flux.axes_dim": "4,6,6"})

    h, w = 8, 6
    latents = torch.randn(2, 4, h, w, generator=gen)
    ids = torch.zeros(h // 2, w // 2, 3)
    ids[..., 1] = torch.arange(h // 2)[:, None]
    ids[..., 2] = torch.arange(w // 2)[None, :]
    inputs = {
        "img": pack(latents),
        "img_ids": ids.reshape(-1, 3),
        "txt": torch.randn(2, 7, TINY["joint_attention_dim"], generator=gen),
        "txt_ids": torch.zeros(7, 3),
        "timesteps": torch.tensor([0.3, 0.85]),
        "y": torch.randn(2, TINY["pooled_projection_dim"], generator=gen),
        "txt_mask": torch.tensor([[1] * 7, [1] * 4 + [0] * 3], dtype=torch.int64),
    }
    if guidance:
        inputs["guidance"] = torch.tensor([3.5, 1.0])
    inputs["w"] = torch.randn(2, inputs["img"].shape[1], TINY["in_channels"], generator=gen)
    results = dict(inputs)
    results["latents"] = latents
    results["out"], results["grad_img"], results["grad_txt"] = run(model, inputs)
    m = run(model, inputs, inputs["txt_mask"])
    results["masked_out"], results["masked_grad_img"], results["masked_grad_txt"] = m
    save_file({k: v.contiguous() for k, v in results.items()}, os.path.join(folder, "io.safetensors"))


def full_layout(out_dir: str, name: str, guidance: bool) -> None:
    with torch.device("meta"):
        model = FluxTransformer2DModel(guidance_embeds=guidance)
    config = model.config
    sd = {k: torch.empty(v.shape, device="meta") for k, v in model.state_dict().items()}
    # torch.cat on the meta device gives the joined shapes without any memory.
    original = to_original(sd, config.num_layers, config.num_single_layers)
    with open(os.path.join(out_dir, f"full_{name}.json"), "w") as f:
        json.dump({k: list(v.shape) for k, v in original.items()}, f, indent=0, sort_keys=True)
    # kohya's lora_flux targets every nn.Linear inside a DoubleStreamBlock / SingleStreamBlock: in
    # the original layout, the 2-D weights under double_blocks.N / single_blocks.N.
    names = sorted("lora_unet_" + k[: -len(".weight")].replace(".", "_") for k, v in original.items()
                   if k.startswith(("double_blocks.", "single_blocks.")) and k.endswith(".weight")
                   and v.dim() == 2)
    with open(os.path.join(out_dir, f"lora_{name}.json"), "w") as f:
        json.dump(names, f, indent=0)


def main() -> None:
    out_dir = sys.argv[1]
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(20261204)
    tiny_case(out_dir, "dev", True, gen)
    tiny_case(out_dir, "schnell", False, gen)
    full_layout(out_dir, "dev", True)
    full_layout(out_dir, "schnell", False)


if __name__ == "__main__":
    main()
