#!/usr/bin/env python3
"""Reference outputs of diffusers' UNet2DConditionModel for models/unet_test.cpp.

    unet_reference.py OUT_DIR

Builds two tiny UNets from config alone (no network), in the two layouts lorapipe must load:

  OUT_DIR/unet/          SD1.x-shaped: 1x1-conv proj_in/proj_out, one head count for all blocks
                         (attention_head_dim=8, i.e. 8 heads: diffusers' misnomer), 2 layers
  OUT_DIR/unet_linear/   SD2.x-shaped: Linear proj_in/proj_out, heads per block (2, 4, 8), two
                         transformer layers per block, flip_sin_to_cos=False, freq_shift=1,
                         16 groups, cross_attention_dim 24
  OUT_DIR/unet_sdxl/     SDXL-shaped: no attention in the first level, depth (1, 2), Linear
                         projections, addition_embed_type text_time (pooled text 32 wide, six
                         time ids of 8 each)

Each holds config.json and diffusion_pytorch_model.safetensors from save_pretrained. Every
parameter is re-drawn at random (seeded) first: diffusers' default init leaves some at exactly 0
or 1 (conv_out, norms), which would hide a wrong wiring.

OUT_DIR/<name>_io.safetensors holds, per case <c> (batch 2, fp32, the SDPA math backend):
  <c>.sample, <c>.timesteps, <c>.encoder_hidden_states   the inputs
  <c>.out                                                 the UNet output
  <c>.loss_weights                                        w, fixed random, shaped like out
  <c>.grad_sample                                         d(sum(out * w)) / d sample
  <c>.grad_encoder_hidden_states                          the same w.r.t. encoder_hidden_states,
      which is the input of every attn2.to_k and attn2.to_v projection
  <c>.grad_to_k_weight                                    the same w.r.t. the first
      attn2.to_k.weight parameter (down_blocks.0.attentions.0..., SDXL's down_blocks.1...)
  <c>.text_embeds, <c>.time_ids, <c>.grad_text_embeds     SDXL-shaped only: the added
      conditions and the gradient through add_embedding
Cases: a = 16x16 latents, 0-d int timestep 10; b = 16x24, per-sample int timesteps (10, 900);
c = 9x13 (odd: upsamplers must follow the skip sizes), float timesteps of length 1 (900.0).

Also the full-size key layouts, built on the meta device (no memory, no weights):
  OUT_DIR/{sd15,sd21,sdxl}/config.json   the published unet/config.json files
  OUT_DIR/{sd15,sd21,sdxl}/shapes.json   {state-dict key: shape}
"""
import json
import os
import sys

import torch
from diffusers import UNet2DConditionModel
from diffusers.models.attention_processor import AttnProcessor2_0
from safetensors.torch import save_file
from torch.nn.attention import SDPBackend, sdpa_kernel

TINY = {
    "unet": dict(
        sample_size=16, in_channels=4, out_channels=4, layers_per_block=2,
        block_out_channels=(32, 64, 64),
        down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32, attention_head_dim=8, norm_num_groups=32),
    "unet_linear": dict(
        sample_size=16, in_channels=4, out_channels=4, layers_per_block=1,
        block_out_channels=(32, 64, 64),
        down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=24, attention_head_dim=(2, 4, 8), norm_num_groups=16,
        use_linear_projection=True, transformer_layers_per_block=2,
        flip_sin_to_cos=False, freq_shift=1),
    # SDXL-shaped, after diffusers' own SDXL test config: no attention in the first level,
    # transformer depth per level, Linear projections, and the text_time added conditions (a
    # 32-wide pooled text embedding and six time ids of 8 each: 80 into add_embedding).
    "unet_sdxl": dict(
        sample_size=16, in_channels=4, out_channels=4, layers_per_block=2,
        block_out_channels=(32, 64),
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=64, attention_head_dim=(2, 4), norm_num_groups=32,
        use_linear_projection=True, transformer_layers_per_block=(1, 2),
        addition_embed_type="text_time", addition_time_embed_dim=8,
        projection_class_embeddings_input_dim=80),
}
SDXL_POOLED_WIDTH = 32

# runwayml/stable-diffusion-v1-5 and stabilityai/stable-diffusion-2-1 unet/config.json.
SD15_CONFIG = {
    "_class_name": "UNet2DConditionModel", "_diffusers_version": "0.6.0", "act_fn": "silu",
    "attention_head_dim": 8, "block_out_channels": [320, 640, 1280, 1280],
    "center_input_sample": False, "cross_attention_dim": 768,
    "down_block_types": ["CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D",
                         "DownBlock2D"],
    "downsample_padding": 1, "flip_sin_to_cos": True, "freq_shift": 0, "in_channels": 4,
    "layers_per_block": 2, "mid_block_scale_factor": 1, "norm_eps": 1e-05,
    "norm_num_groups": 32, "out_channels": 4, "sample_size": 64,
    "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D",
                       "CrossAttnUpBlock2D"],
}
SD21_CONFIG = {
    "_class_name": "UNet2DConditionModel", "_diffusers_version": "0.10.0.dev0",
    "act_fn": "silu", "attention_head_dim": [5, 10, 20, 20],
    "block_out_channels": [320, 640, 1280, 1280], "center_input_sample": False,
    "cross_attention_dim": 1024,
    "down_block_types": ["CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D",
                         "DownBlock2D"],
    "downsample_padding": 1, "dual_cross_attention": False, "flip_sin_to_cos": True,
    "freq_shift": 0, "in_channels": 4, "layers_per_block": 2, "mid_block_scale_factor": 1,
    "norm_eps": 1e-05, "norm_num_groups": 32, "num_class_embeds": None,
    "only_cross_attention": False, "out_channels": 4, "sample_size": 96,
    "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D",
                       "CrossAttnUpBlock2D"],
    "upcast_attention": True, "use_linear_projection": True,
}

# stabilityai/stable-diffusion-xl-base-1.0 unet/config.json.
SDXL_CONFIG = {
    "_class_name": "UNet2DConditionModel", "_diffusers_version": "0.19.0.dev0",
    "act_fn": "silu", "addition_embed_type": "text_time", "addition_embed_type_num_heads": 64,
    "addition_time_embed_dim": 256, "attention_head_dim": [5, 10, 20],
    "block_out_channels": [320, 640, 1280], "center_input_sample": False,
    "class_embed_type": None, "class_embeddings_concat": False, "conv_in_kernel": 3,
    "conv_out_kernel": 3, "cross_attention_dim": 2048, "cross_attention_norm": None,
    "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
    "downsample_padding": 1, "dual_cross_attention": False, "encoder_hid_dim": None,
    "encoder_hid_dim_type": None, "flip_sin_to_cos": True, "freq_shift": 0, "in_channels": 4,
    "layers_per_block": 2, "mid_block_only_cross_attention": None, "mid_block_scale_factor": 1,
    "mid_block_type": "UNetMidBlock2DCrossAttn", "norm_eps": 1e-05, "norm_num_groups": 32,
    "num_attention_heads": None, "num_class_embeds": None, "only_cross_attention": False,
    "out_channels": 4, "projection_class_embeddings_input_dim": 2816,
    "resnet_out_scale_factor": 1.0, "resnet_skip_time_act": False,
    "resnet_time_scale_shift": "default", "sample_size": 128, "time_cond_proj_dim": None,
    "time_embedding_act_fn": None, "time_embedding_dim": None,
    "time_embedding_type": "positional", "timestep_post_act": None,
    "transformer_layers_per_block": [1, 2, 10],
    "up_block_types": ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
    "upcast_attention": None, "use_linear_projection": True,
}

# The first cross-attention key projection (SDXL's first level has no attention).
def probe_param(model: torch.nn.Module) -> str:
    return next(n for n, _ in model.named_parameters() if n.endswith("attn2.to_k.weight"))


def randomize(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Every parameter random and O(1)-preserving: weights ~ N(0, 1/fan_in), biases ~ N(0, 0.1^2),
    norm scales ~ 1 + N(0, 0.2^2)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if p.ndim > 1:
                p.copy_(noise / (p[0].numel() ** 0.5))
            elif name.endswith("weight"):
                p.copy_(1 + 0.2 * noise)
            else:
                p.copy_(0.1 * noise)


def run_cases(model: UNet2DConditionModel, gen: torch.Generator) -> dict:
    cfg = model.config
    cases = [("a", (16, 16), torch.tensor(10, dtype=torch.int64)),
             ("b", (16, 24), torch.tensor([10, 900], dtype=torch.int64)),
             ("c", (9, 13), torch.tensor([900.0], dtype=torch.float32))]
    probe = dict(model.named_parameters())[probe_param(model)]
    added = cfg.addition_embed_type == "text_time"
    out = {}
    for name, (h, w), timesteps in cases:
        sample = torch.randn((2, cfg.in_channels, h, w), generator=gen)
        context = torch.randn((2, 7, cfg.cross_attention_dim), generator=gen)
        sample_in = sample.clone().requires_grad_(True)
        context_in = context.clone().requires_grad_(True)
        kwargs = {}
        if added:
            # Original size, crop top-left, target size, as SDXL pipelines make them.
            text_embeds = torch.randn((2, SDXL_POOLED_WIDTH), generator=gen)
            time_ids = torch.tensor([[h * 8.0, w * 8.0, 0.0, 0.0, h * 8.0, w * 8.0],
                                     [1024.0, 768.0, 16.0, 8.0, h * 8.0, w * 8.0]])
            text_embeds_in = text_embeds.clone().requires_grad_(True)
            kwargs["added_cond_kwargs"] = {"text_embeds": text_embeds_in, "time_ids": time_ids}
        model.zero_grad(set_to_none=True)
        with sdpa_kernel(SDPBackend.MATH):
            pred = model(sample_in, timesteps, encoder_hidden_states=context_in, **kwargs).sample
        weights = torch.randn(pred.shape, generator=gen)
        (pred * weights).sum().backward()
        if added:
            out.update({f"{name}.text_embeds": text_embeds, f"{name}.time_ids": time_ids,
                        f"{name}.grad_text_embeds": text_embeds_in.grad})
        out.update({
            f"{name}.sample": sample, f"{name}.timesteps": timesteps,
            f"{name}.encoder_hidden_states": context, f"{name}.out": pred.detach(),
            f"{name}.loss_weights": weights, f"{name}.grad_sample": sample_in.grad,
            f"{name}.grad_encoder_hidden_states": context_in.grad,
            f"{name}.grad_to_k_weight": probe.grad.clone(),
        })
    return {k: v.contiguous() for k, v in out.items()}


def write_full_size(out_dir: str, name: str, config: dict) -> None:
    folder = os.path.join(out_dir, name)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    kwargs = {k: v for k, v in config.items() if not k.startswith("_")}
    with torch.device("meta"):
        model = UNet2DConditionModel(**kwargs)
    shapes = {k: list(v.shape) for k, v in model.state_dict().items()}
    with open(os.path.join(folder, "shapes.json"), "w") as f:
        json.dump(shapes, f)


def main() -> None:
    out_dir = sys.argv[1]
    os.makedirs(out_dir, exist_ok=True)
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    for name, config in TINY.items():
        gen = torch.Generator().manual_seed(0)
        model = UNet2DConditionModel(**config)
        randomize(model, gen)
        model.set_attn_processor(AttnProcessor2_0())
        model.eval()
        model.save_pretrained(os.path.join(out_dir, name), safe_serialization=True)
        save_file(run_cases(model, gen), os.path.join(out_dir, f"{name}_io.safetensors"))
    write_full_size(out_dir, "sd15", SD15_CONFIG)
    write_full_size(out_dir, "sd21", SD21_CONFIG)
    write_full_size(out_dir, "sdxl", SDXL_CONFIG)


if __name__ == "__main__":
    main()
