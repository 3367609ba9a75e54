#!/usr/bin/env python3
"""Reference for models/sdxl_test.cpp: diffusers' StableDiffusionXLPipeline on lorapipe's tiny
SDXL (models/tiny.h, write_tiny_sdxl_checkpoint), fp32 on the CPU.

    $LORAPIPE_PYTHON models/reference/sdxl_reference.py MODEL_DIR SINGLE_FILE OUT_DIR

Writes OUT_DIR/reference.safetensors:
  prompt_embeds, pooled     encode_prompt(PROMPTS) without guidance: both encoders' penultimate
                            states side by side, and bigG's projected pooled output
  long_prompt_embeds,       LONG_PROMPTS as kohya's SDXL training encodes them with
  long_pooled               --max_token_length 150: each tokenizer's ids cut into chunks of 77
                            (kohya's get_input_ids; the second pads with "!" and takes the
                            pad != eos fixes), every chunk through both encoders, their
                            penultimate states joined back (BOS, 75 per chunk, the last), and the
                            pooled output of the first chunk (kohya's pool_workaround: bigG's
                            final-norm state at the first EOS, projected)
  unet_*                    one U-Net call on seeded latents at two timesteps with GEOMETRY's
                            time ids (diffusers' added_cond_kwargs), its output, and the gradient
                            of sum(output * unet_w) with respect to the latents
and OUT_DIR/<sampler>[_lora].safetensors per sampler: the initial latents, the final latents
(output_type="latent"), the largest |latent| after any step, and the image the pipeline decodes
(uint8 [H, W, 3]). The "_lora" renders load OUT_DIR/lora.safetensors (a random LoRA in kohya's
SDXL format: Stability AI's module names under lora_unet_, lora_te1_, lora_te2_) with
load_lora_weights; every module of the file must become an adapter (none left over).

Before anything, the single file is loaded with diffusers' own single-file converters
(convert_ldm_unet_checkpoint, convert_ldm_vae_checkpoint, convert_ldm_clip_checkpoint,
convert_open_clip_checkpoint) and must give exactly the folder's weights: the single file
lorapipe writes is the layout diffusers reads. Attention runs on the math path, as lorapipe's
forced math attention (diffusers' AttnProcessor, transformers' eager attention).
"""
import json
import os
import sys
import warnings

import numpy as np
import torch
from safetensors.torch import load_file, save_file

warnings.filterwarnings("ignore")
from diffusers import (DDIMScheduler, DPMSolverMultistepScheduler,  # noqa: E402
                       EulerAncestralDiscreteScheduler, EulerDiscreteScheduler,
                       StableDiffusionXLPipeline)
from diffusers.loaders import single_file_utils as sfu  # noqa: E402
from diffusers.models.attention_processor import AttnProcessor  # noqa: E402
from transformers import CLIPTextModel, CLIPTextModelWithProjection  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from clip_tokenizer_reference import kohya_get_input_ids  # noqa: E402

SEED = 77
PROMPTS = ["a red circle", "a square on a ring, red"]
# One caption past 150 tokens (truncated, both chunks full) and one short (its second chunk all
# padding): both of kohya's chunk fixes.
LONG_PROMPTS = [" ".join(["a red circle on a ring,"] * 30), "a square"]
MAX_TOKEN_LENGTH = 150
# Per sample: original height, width; crop top, left; target height, width.
GEOMETRY = [(64, 48, 3, 5, 64, 64), (96, 80, 0, 8, 64, 64)]
REQUEST = {"prompt": "a red circle on a ring", "negative_prompt": "blurry", "width": 64,
           "height": 48, "steps": 10, "cfg_scale": 5.0}
SAMPLERS = {"ddim": (DDIMScheduler, {}), "euler": (EulerDiscreteScheduler, {}),
            "euler_a": (EulerAncestralDiscreteScheduler, {}),
            "dpmsolver++": (DPMSolverMultistepScheduler, {"algorithm_type": "dpmsolver++"})}


def kohya_scheduler(cls, kwargs):
    """train_util.get_my_scheduler, as kohya's SDXL sampling builds it."""
    scheduler = cls(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.0120,
                    beta_schedule="scaled_linear", **kwargs)
    if hasattr(scheduler.config, "clip_sample") and scheduler.config.clip_sample is False:
        scheduler.config.clip_sample = True
    return scheduler


def check_single_file(pipe, single_file):
    """diffusers' converters on the single file must give the folder's weights exactly."""
    checkpoint = load_file(single_file)
    unet = sfu.convert_ldm_unet_checkpoint(checkpoint, dict(pipe.unet.config))
    vae = sfu.convert_ldm_vae_checkpoint(checkpoint, dict(pipe.vae.config))
    clip = sfu.convert_ldm_clip_checkpoint(checkpoint, remove_prefix="conditioner.embedders.0.transformer.")
    open_clip = sfu.convert_open_clip_checkpoint(
        pipe.text_encoder_2, checkpoint, prefix="conditioner.embedders.1.model.")
    for name, module, converted in (("unet", pipe.unet, unet), ("vae", pipe.vae, vae),
                                    ("text_encoder", pipe.text_encoder, clip),
                                    ("text_encoder_2", pipe.text_encoder_2, open_clip)):
        want = module.state_dict()
        got = {k: v for k, v in converted.items() if k in want or "position_ids" not in k}
        missing = sorted(set(want) - set(got) - {"text_model.embeddings.position_ids"})
        extra = sorted(set(got) - set(want))
        if missing or extra:
            sys.exit(f"single file, {name}: missing {missing[:5]}, extra {extra[:5]}")
        for key, value in want.items():
            if key in got and not torch.equal(got[key].to(value.dtype).reshape(value.shape), value):
                sys.exit(f"single file, {name}: {key} differs from the folder's")
    return checkpoint


def sai_names(pipe, checkpoint):
    """Each U-Net module's Stability AI path, found by matching the single file's tensors
    (unique random values) to the folder's through diffusers' converter."""
    converted = sfu.convert_ldm_unet_checkpoint(checkpoint, dict(pipe.unet.config))
    by_value = {}
    prefix = "model.diffusion_model."
    for key, value in checkpoint.items():
        if key.startswith(prefix) and key.endswith(".weight"):
            by_value[key[len(prefix):-len(".weight")]] = value
    names = {}
    for key, value in converted.items():
        if not key.endswith(".weight"):
            continue
        for sai, candidate in by_value.items():
            if candidate.shape == value.shape and torch.equal(candidate, value):
                names[key[:-len(".weight")]] = sai
                break
    return names


def kohya_sdxl_lora(pipe, checkpoint, path, rank=4):
    """A random LoRA in kohya's SDXL format over the U-Net's Transformer2D layers (SAI names)
    and both text encoders' attention and MLP layers."""
    g = torch.Generator().manual_seed(11)
    tensors = {}
    sai = sai_names(pipe, checkpoint)

    def add(name, layer):
        name = name.replace(".", "_")
        if isinstance(layer, torch.nn.Conv2d):
            down = torch.randn(rank, layer.in_channels, *layer.kernel_size, generator=g) * 0.2
            up = torch.randn(layer.out_channels, rank, 1, 1, generator=g) * 0.2
        else:
            down = torch.randn(rank, layer.in_features, generator=g) * 0.2
            up = torch.randn(layer.out_features, rank, generator=g) * 0.2
        tensors[f"{name}.lora_down.weight"] = down
        tensors[f"{name}.lora_up.weight"] = up
        tensors[f"{name}.alpha"] = torch.tensor(rank / 2.0)

    for name, module in pipe.unet.named_modules():
        if type(module).__name__ == "Transformer2DModel":
            for child, layer in module.named_modules():
                if isinstance(layer, (torch.nn.Linear, torch.nn.Conv2d)):
                    add("lora_unet_" + sai[f"{name}.{child}"], layer)
    for prefix, encoder in (("lora_te1", pipe.text_encoder), ("lora_te2", pipe.text_encoder_2)):
        for name, module in encoder.named_modules():
            if type(module).__name__ in ("CLIPAttention", "CLIPMLP", "CLIPSdpaAttention"):
                for child, layer in module.named_modules():
                    if isinstance(layer, torch.nn.Linear):
                        add(f"{prefix}_{name}.{child}", layer)
    save_file(tensors, path)
    return len(tensors) // 3


def kohya_long_conditioning(pipe, prompts, max_token_length):
    """kohya's SDXL text encoding of long captions (strategy_sdxl's encode_tokens with
    max_token_length), written from its description: ids per chunk, both encoders on every chunk,
    penultimate states, the chunks' states joined back, the first chunk's pooled output."""
    chunk = pipe.tokenizer.model_max_length  # 77
    states = []
    for tokenizer, encoder in ((pipe.tokenizer, pipe.text_encoder),
                               (pipe.tokenizer_2, pipe.text_encoder_2)):
        ids = torch.tensor([kohya_get_input_ids(tokenizer, p, max_token_length) for p in prompts])
        batch, chunks = ids.shape[0], ids.shape[1] // chunk
        flat = ids.reshape(batch * chunks, chunk)
        out = encoder(flat, output_hidden_states=True)
        hidden = out.hidden_states[-2].reshape(batch, chunks * chunk, -1)
        parts = [hidden[:, :1]]
        for i in range(1, max_token_length, chunk):
            parts.append(hidden[:, i:i + chunk - 2])
        parts.append(hidden[:, -1:])
        states.append(torch.cat(parts, dim=1))
        if encoder is pipe.text_encoder_2:
            # pool_workaround: the final-norm state at each chunk's first EOS, projected.
            final = encoder.text_model.final_layer_norm(out.hidden_states[-1])
            eos = (flat == tokenizer.eos_token_id).int().argmax(dim=-1)
            pooled = encoder.text_projection(final[torch.arange(flat.shape[0]), eos])
            pooled = pooled.reshape(batch, chunks, -1)[:, 0]
    return torch.cat(states, dim=-1), pooled


def render(pipe, sampler, initial, path):
    cls, kwargs = SAMPLERS[sampler]
    pipe.scheduler = kohya_scheduler(cls, kwargs)
    r = REQUEST
    common = dict(prompt=r["prompt"], negative_prompt=r["negative_prompt"], height=r["height"],
                  width=r["width"], num_inference_steps=r["steps"], guidance_scale=r["cfg_scale"])
    scale = [0.0]

    def track(pipeline, step, timestep, kwargs):
        scale[0] = max(scale[0], kwargs["latents"].abs().max().item())
        return kwargs

    with torch.no_grad():
        latents = pipe(**common, latents=initial.clone(), output_type="latent",
                       generator=torch.Generator().manual_seed(SEED),
                       callback_on_step_end=track).images
        image = pipe(**common, latents=initial.clone(), output_type="pil",
                     generator=torch.Generator().manual_seed(SEED)).images[0]
    save_file({"initial": initial.contiguous(), "latents": latents.contiguous(),
               "trajectory_scale": torch.tensor(scale[0], dtype=torch.float64),
               "image": torch.from_numpy(np.array(image)).contiguous()}, path)


def main():
    model, single_file, out = sys.argv[1], sys.argv[2], sys.argv[3]
    text_encoder = CLIPTextModel.from_pretrained(model, subfolder="text_encoder",
                                                 attn_implementation="eager")
    text_encoder_2 = CLIPTextModelWithProjection.from_pretrained(
        model, subfolder="text_encoder_2", attn_implementation="eager")
    pipe = StableDiffusionXLPipeline.from_pretrained(
        model, torch_dtype=torch.float32, scheduler=kohya_scheduler(DDIMScheduler, {}),
        text_encoder=text_encoder, text_encoder_2=text_encoder_2, add_watermarker=False)
    pipe.unet.set_attn_processor(AttnProcessor())
    pipe.vae.set_attn_processor(AttnProcessor())
    pipe.set_progress_bar_config(disable=True)
    assert pipe.tokenizer_2.pad_token_id == 0, pipe.tokenizer_2.pad_token_id
    assert pipe.tokenizer.pad_token_id == pipe.tokenizer.eos_token_id
    checkpoint = check_single_file(pipe, single_file)

    with torch.no_grad():
        prompt_embeds, _, pooled, _ = pipe.encode_prompt(
            PROMPTS, device="cpu", num_images_per_prompt=1, do_classifier_free_guidance=False)
        long_embeds, long_pooled = kohya_long_conditioning(pipe, LONG_PROMPTS, MAX_TOKEN_LENGTH)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 4, 8, 8, generator=g).requires_grad_(True)
    t = torch.tensor([500, 21])
    time_ids = torch.tensor(GEOMETRY, dtype=torch.float32)
    y = pipe.unet(x, t, encoder_hidden_states=prompt_embeds,
                  added_cond_kwargs={"text_embeds": pooled, "time_ids": time_ids}).sample
    w = torch.randn(y.shape, generator=g)
    (y * w).sum().backward()
    save_file({"prompt_embeds": prompt_embeds.contiguous(), "pooled": pooled.contiguous(),
               "long_prompt_embeds": long_embeds.contiguous(),
               "long_pooled": long_pooled.contiguous(),
               "unet_in": x.detach().contiguous(), "unet_t": t, "unet_time_ids": time_ids,
               "unet_out": y.detach().contiguous(), "unet_w": w,
               "unet_grad": x.grad.contiguous()}, os.path.join(out, "reference.safetensors"))

    r = REQUEST
    shape = (1, 4, r["height"] // pipe.vae_scale_factor, r["width"] // pipe.vae_scale_factor)
    initial = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    for name in SAMPLERS:
        render(pipe, name, initial, os.path.join(out, f"{name}.safetensors"))
    modules = kohya_sdxl_lora(pipe, checkpoint, os.path.join(out, "lora.safetensors"))
    pipe.load_lora_weights(os.path.join(out, "lora.safetensors"), adapter_name="check")
    adapted = sum(1 for part in (pipe.unet, pipe.text_encoder, pipe.text_encoder_2)
                  for _, m in part.named_modules() if hasattr(m, "lora_A") and "check" in m.lora_A)
    if adapted != modules:
        sys.exit(f"load_lora_weights made {adapted} adapters of the file's {modules} modules")
    for name in ("ddim", "euler"):
        render(pipe, name, initial, os.path.join(out, f"{name}_lora.safetensors"))
    with open(os.path.join(out, "request.json"), "w") as f:
        json.dump({**r, "seed": SEED, "prompts": PROMPTS, "long_prompts": LONG_PROMPTS,
                   "max_token_length": MAX_TOKEN_LENGTH, "geometry": GEOMETRY,
                   "lora_modules": modules}, f)


if __name__ == "__main__":
    main()
