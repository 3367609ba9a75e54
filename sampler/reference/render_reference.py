#!/usr/bin/env python3
"""Reference for sampler/render_test.cpp: diffusers' StableDiffusionPipeline renders on lorapipe's
tiny SD1.5 folder, one per sampler, with the schedulers kohya builds.

    $LORAPIPE_PYTHON sampler/reference/render_reference.py MODEL_DIR OUT_DIR

Per sampler, OUT_DIR/<sampler>.safetensors: the initial latents handed to the pipeline (seeded),
the final latents (output_type="latent"), the largest |latent| after any step (trajectory_scale)
and the decoded image as uint8 [H, W, 3] (the pipeline's own PIL output). The prompt, negative prompt, size, steps and CFG scale are in REQUEST below; the
generator (Euler ancestral's noise) is torch.Generator().manual_seed(SEED). Attention runs on
PyTorch's math path (AttnProcessor), as the C++ side's forced math attention does.
"""
import json
import sys
import warnings

import numpy as np
import torch
from safetensors.torch import save_file

warnings.filterwarnings("ignore")
from diffusers import (DDIMScheduler, DPMSolverMultistepScheduler,  # noqa: E402
                       EulerAncestralDiscreteScheduler, EulerDiscreteScheduler,
                       StableDiffusionPipeline)
from diffusers.models.attention_processor import AttnProcessor  # noqa: E402

SEED = 77
REQUEST = {"prompt": "a red circle on a blue background", "negative_prompt": "blurry",
           "width": 64, "height": 48, "steps": 20, "cfg_scale": 7.5}
# Over 75 tokens (108 with the tiny model's tokenizer): rendered with kohya's chunked long-prompt
# conditioning (two chunks, --max_token_length 150), which the pipeline takes as prompt_embeds.
LONG_PROMPT = ("a detailed photo of a red circle, a blue square, a green triangle, a yellow star, "
               "a purple hexagon, an orange moon, a white cloud, in soft morning light")
SAMPLERS = {"ddim": (DDIMScheduler, {}), "euler": (EulerDiscreteScheduler, {}),
            "euler_a": (EulerAncestralDiscreteScheduler, {}),
            "dpmsolver++": (DPMSolverMultistepScheduler, {"algorithm_type": "dpmsolver++"})}


def kohya_scheduler(cls, kwargs):
    """train_util.get_my_scheduler."""
    scheduler = cls(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.0120,
                    beta_schedule="scaled_linear", **kwargs)
    if hasattr(scheduler.config, "clip_sample") and scheduler.config.clip_sample is False:
        scheduler.config.clip_sample = True
    return scheduler


def kohya_lora(pipe, path, rank=4):
    """A random LoRA in kohya's format (networks/lora.py names) over the UNet's Transformer2D
    layers and the text encoder's attention and MLP, written to `path` for both sides."""
    g = torch.Generator().manual_seed(11)
    tensors = {}

    def add(prefix, path_name, layer):
        name = f"{prefix}_{path_name}".replace(".", "_")
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
                    add("lora_unet", f"{name}.{child}", layer)
    for name, module in pipe.text_encoder.named_modules():
        if type(module).__name__ in ("CLIPAttention", "CLIPMLP"):
            for child, layer in module.named_modules():
                if isinstance(layer, torch.nn.Linear):
                    add("lora_te", f"{name}.{child}", layer)
    save_file(tensors, path)


def kohya_long_embeds(pipe, text, max_token_length):
    """kohya's long-prompt conditioning (train_util: get_input_ids, then get_hidden_states, SD1
    branch): ids padded to max_token_length + 2, cut into chunks of BOS + 75 + the last id, each
    chunk encoded on its own, joined as the first BOS state, each chunk's 75, the last state."""
    tok, chunk = pipe.tokenizer, pipe.tokenizer.model_max_length
    ids = tok(text, padding="max_length", truncation=True, max_length=max_token_length + 2,
              return_tensors="pt").input_ids[0]
    chunks = [torch.cat((ids[:1], ids[i:i + chunk - 2], ids[-1:]))
              for i in range(1, max_token_length + 2 - chunk + 2, chunk - 2)]
    with torch.no_grad():
        states = pipe.text_encoder(torch.stack(chunks))[0]
    states = states.reshape(1, -1, states.shape[-1])
    parts = [states[:, 0].unsqueeze(1)]
    for i in range(1, max_token_length, chunk):
        parts.append(states[:, i:i + chunk - 2])
    parts.append(states[:, -1].unsqueeze(1))
    return torch.cat(parts, dim=1)


def render(pipe, sampler, initial, path, long_prompt=False):
    """One render with `sampler` from `initial`: the final latents, each step's latents and their
    largest magnitude (callback_on_step_end), and the pipeline's own PIL image, saved to `path`.
    With `long_prompt`, LONG_PROMPT conditioned as kohya does past 75 tokens."""
    cls, kwargs = SAMPLERS[sampler]
    pipe.scheduler = kohya_scheduler(cls, kwargs)
    r = REQUEST
    common = dict(prompt=r["prompt"], negative_prompt=r["negative_prompt"], height=r["height"],
                  width=r["width"], num_inference_steps=r["steps"], guidance_scale=r["cfg_scale"])
    if long_prompt:
        tokens = len(pipe.tokenizer(LONG_PROMPT).input_ids) - 2
        assert 75 < tokens <= 150, tokens
        del common["prompt"], common["negative_prompt"]
        common["prompt_embeds"] = kohya_long_embeds(pipe, LONG_PROMPT, 150)
        common["negative_prompt_embeds"] = kohya_long_embeds(pipe, r["negative_prompt"], 150)
    scale = [0.0]
    steps = {}

    def track(pipeline, step, timestep, kwargs):
        scale[0] = max(scale[0], kwargs["latents"].abs().max().item())
        steps[f"step.{step}"] = kwargs["latents"].clone()
        return kwargs

    with torch.no_grad():
        latents = pipe(**common, latents=initial.clone(), output_type="latent",
                       generator=torch.Generator().manual_seed(SEED),
                       callback_on_step_end=track).images
        image = pipe(**common, latents=initial.clone(), output_type="pil",
                     generator=torch.Generator().manual_seed(SEED)).images[0]
    save_file({"initial": initial.contiguous(), "latents": latents.contiguous(),
               "trajectory_scale": torch.tensor(scale[0], dtype=torch.float64), **steps,
               "image": torch.from_numpy(np.array(image)).contiguous()}, path)


def main():
    model, out = sys.argv[1], sys.argv[2]
    pipe = StableDiffusionPipeline.from_pretrained(
        model, torch_dtype=torch.float32, scheduler=kohya_scheduler(DDIMScheduler, {}),
        safety_checker=None, feature_extractor=None, requires_safety_checker=False).to("cpu")
    pipe.unet.set_attn_processor(AttnProcessor())
    pipe.vae.set_attn_processor(AttnProcessor())
    pipe.set_progress_bar_config(disable=True)
    r = REQUEST
    shape = (1, pipe.unet.config.in_channels, r["height"] // pipe.vae_scale_factor,
             r["width"] // pipe.vae_scale_factor)
    initial = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    for name in SAMPLERS:
        render(pipe, name, initial, f"{out}/{name}.safetensors")
    render(pipe, "ddim", initial, f"{out}/ddim_long.safetensors", long_prompt=True)
    # With a LoRA: diffusers loads the kohya file (load_lora_weights, scale 1); lorapipe merges it.
    kohya_lora(pipe, f"{out}/lora.safetensors")
    pipe.load_lora_weights(f"{out}/lora.safetensors", adapter_name="check")
    for name in ("ddim", "euler_a"):
        render(pipe, name, initial, f"{out}/{name}_lora.safetensors")
    with open(f"{out}/request.json", "w") as f:
        json.dump({**r, "seed": SEED, "vae_scale_factor": pipe.vae_scale_factor,
                   "long_prompt": LONG_PROMPT}, f)


if __name__ == "__main__":
    main()
