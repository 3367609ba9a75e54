#!/usr/bin/env python3
"""Reference for sampler/render_test.cpp: diffusers' StableDiffusionPipeline renders on lorapipe's
tiny SD1.5 folder, one per sampler, with the schedulers kohya builds.

    $LORAPIPE_PYTHON sampler/reference/render_reference.py MODEL_DIR OUT_DIR

Per sampler, OUT_DIR/<sampler>.safetensors: the initial latents handed to the pipeline (seeded),
the final latents (output_type="latent"), the largest |latent| after any step (trajectory_scale)
and the decoded image as uint8 [H, W, 3] (the pipeline's own PIL output). The prompt, negative prompt, size, steps and CFG scale are in REQUEST below; the
generator (Euler ancestral's noise) is torch.Generator().manual_seed(SEED). Attention runs on
the math path, as the C++ side's forced math attention does: diffusers' AttnProcessor in the UNet
and VAE, transformers' eager attention in the text encoder. OUT_DIR/lora.safetensors is the
random kohya LoRA the *_lora renders load; lora_peft.safetensors the same LoRA as diffusers saves it.
"""
import json
import os
import sys
import warnings

import numpy as np
import torch
from safetensors.torch import save_file

warnings.filterwarnings("ignore")
from diffusers import (DDIMScheduler, DDPMScheduler, DPMSolverMultistepScheduler,  # noqa: E402
                       DPMSolverSinglestepScheduler, EulerAncestralDiscreteScheduler,
                       EulerDiscreteScheduler, HeunDiscreteScheduler,
                       KDPM2AncestralDiscreteScheduler, KDPM2DiscreteScheduler,
                       LMSDiscreteScheduler, PNDMScheduler, StableDiffusionPipeline)
from diffusers.models.attention_processor import AttnProcessor  # noqa: E402
from peft import get_peft_model_state_dict  # noqa: E402
from transformers import CLIPTextModel  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "models",
                                "reference"))
from prompt_attention import prompt_attention  # noqa: E402  (kohya's parse, shared)

SEED = 77
REQUEST = {"prompt": "a red circle on a blue background", "negative_prompt": "blurry",
           "width": 64, "height": 48, "steps": 20, "cfg_scale": 7.5}
# Over 75 tokens (108 with the tiny model's tokenizer), and with attention weights: conditioned as
# kohya's sample images are (kohya_sample_embeds), which the pipeline takes as prompt_embeds.
LONG_PROMPT = ("a detailed photo of a red circle, a blue square, a green triangle, a yellow star, "
               "a purple hexagon, an orange moon, a white cloud, in soft morning light")
WEIGHTED_PROMPT = "a (red:1.3) circle on a [blue] background, ((shiny)), \\(flat\\)"
SAMPLERS = {"ddim": (DDIMScheduler, {}), "euler": (EulerDiscreteScheduler, {}),
            "euler_a": (EulerAncestralDiscreteScheduler, {}),
            "dpmsolver++": (DPMSolverMultistepScheduler, {"algorithm_type": "dpmsolver++"}),
            # lorapipe's --karras (--ss euler_karras / dpmsolver++_karras): diffusers' Karras sigmas.
            "dpmsolver++_karras": (DPMSolverMultistepScheduler, {"algorithm_type": "dpmsolver++",
                                                                 "use_karras_sigmas": True}),
            "euler_karras": (EulerDiscreteScheduler, {"use_karras_sigmas": True}),
            # kohya's "dpmsolver" ends at sigma_min: diffusers 0.36 refuses it with a final 0.
            "dpmsolver": (DPMSolverMultistepScheduler, {"algorithm_type": "dpmsolver",
                                                        "final_sigmas_type": "sigma_min"}),
            "dpmsingle": (DPMSolverSinglestepScheduler, {}), "heun": (HeunDiscreteScheduler, {}),
            "dpm_2": (KDPM2DiscreteScheduler, {}), "dpm_2_a": (KDPM2AncestralDiscreteScheduler, {}),
            "lms": (LMSDiscreteScheduler, {}), "pndm": (PNDMScheduler, {}),
            "ddpm": (DDPMScheduler, {})}


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


def kohya_sample_embeds(pipe, texts):
    """kohya's sample-image conditioning (lpw_stable_diffusion.get_weighted_text_embeddings with
    its defaults, as train_util.sample_images calls it): every piece of each prompt tokenized on
    its own, at most 225 tokens; all prompts at the chunk count of the longest (1 to 3); each
    chunk BOS + 75 ids + EOS encoded on its own and kept whole; every state times its token's
    weight, then rescaled to the prompt's mean before weighting. One tensor per text."""
    tok, chunk = pipe.tokenizer, pipe.tokenizer.model_max_length
    per_chunk = chunk - 2
    ids, weights = [], []
    for text in texts:
        t, w = [], []
        for piece, weight in prompt_attention(text):
            piece_ids = tok(piece).input_ids[1:-1]
            t += piece_ids
            w += [weight] * len(piece_ids)
            if len(t) > 3 * per_chunk:
                break
        ids.append(t[:3 * per_chunk])
        weights.append(w[:3 * per_chunk])
    longest = max(len(t) for t in ids)
    chunks = max(1, min(3, (longest - 1) // per_chunk + 1))
    out = []
    for t, w in zip(ids, weights):
        full = [tok.bos_token_id] + t + [tok.eos_token_id] * (per_chunk * chunks + 1 - len(t))
        rows, row_weights = [], []
        for c in range(chunks):
            rows.append([tok.bos_token_id] + full[c * per_chunk + 1:(c + 1) * per_chunk + 1] +
                        [tok.eos_token_id])
            part = w[c * per_chunk:(c + 1) * per_chunk]
            row_weights += [1.0] + part + [1.0] * (per_chunk - len(part)) + [1.0]
        with torch.no_grad():
            states = pipe.text_encoder(torch.tensor(rows))[0].reshape(1, chunks * chunk, -1)
        before = states.float().mean(dim=[-2, -1])
        states = states * torch.tensor(row_weights, dtype=states.dtype).reshape(1, -1, 1)
        after = states.float().mean(dim=[-2, -1])
        out.append(states * (before / after).reshape(-1, 1, 1))
    return out


def render(pipe, sampler, initial, path, prompt=None):
    """One render with `sampler` from `initial`: the final latents, each step's latents and their
    largest magnitude (callback_on_step_end), and the pipeline's own PIL image, saved to `path`.
    With `prompt` (long or weighted), it is conditioned as kohya's sample images are."""
    cls, kwargs = SAMPLERS[sampler]
    pipe.scheduler = kohya_scheduler(cls, kwargs)
    r = REQUEST
    common = dict(prompt=r["prompt"], negative_prompt=r["negative_prompt"], height=r["height"],
                  width=r["width"], num_inference_steps=r["steps"], guidance_scale=r["cfg_scale"])
    if prompt is not None:
        del common["prompt"], common["negative_prompt"]
        positive, negative = kohya_sample_embeds(pipe, [prompt, r["negative_prompt"]])
        common["prompt_embeds"], common["negative_prompt_embeds"] = positive, negative
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
    # The text encoder on transformers' eager attention, as the UNet and VAE on diffusers' math
    # AttnProcessor: the formulations lorapipe's forced math path follows op for op.
    text_encoder = CLIPTextModel.from_pretrained(model, subfolder="text_encoder",
                                                 torch_dtype=torch.float32,
                                                 attn_implementation="eager")
    pipe = StableDiffusionPipeline.from_pretrained(
        model, torch_dtype=torch.float32, scheduler=kohya_scheduler(DDIMScheduler, {}),
        text_encoder=text_encoder, safety_checker=None, feature_extractor=None,
        requires_safety_checker=False).to("cpu")
    pipe.unet.set_attn_processor(AttnProcessor())
    pipe.vae.set_attn_processor(AttnProcessor())
    pipe.set_progress_bar_config(disable=True)
    r = REQUEST
    shape = (1, pipe.unet.config.in_channels, r["height"] // pipe.vae_scale_factor,
             r["width"] // pipe.vae_scale_factor)
    initial = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    for name in SAMPLERS:
        render(pipe, name, initial, f"{out}/{name}.safetensors")
    tokens = len(pipe.tokenizer(LONG_PROMPT).input_ids) - 2
    assert 75 < tokens <= 150, tokens
    render(pipe, "ddim", initial, f"{out}/ddim_long.safetensors", prompt=LONG_PROMPT)
    assert len(prompt_attention(WEIGHTED_PROMPT)) > 3, prompt_attention(WEIGHTED_PROMPT)
    render(pipe, "ddim", initial, f"{out}/ddim_weighted.safetensors", prompt=WEIGHTED_PROMPT)
    # With a LoRA: diffusers loads the kohya file (load_lora_weights, scale 1) and peft computes it
    # beside the frozen weights, base(x) + lora_B(lora_A(x)) * scale, unfused: what lorapipe's
    # sampler computes with the LoRA in the layers' slots.
    kohya_lora(pipe, f"{out}/lora.safetensors")
    pipe.load_lora_weights(f"{out}/lora.safetensors", adapter_name="check")
    # The same LoRA as diffusers saves it (PEFT's naming, lora_A / lora_B under unet. and
    # text_encoder., its alpha in lora_adapter_metadata), for lorapipe's reading of that naming.
    config_keys = ("r", "lora_alpha", "rank_pattern", "alpha_pattern", "target_modules")
    meta = {part: {k: v for k, v in getattr(pipe, part).peft_config["check"].to_dict().items()
                   if k in config_keys} for part in ("unet", "text_encoder")}
    StableDiffusionPipeline.save_lora_weights(
        out, weight_name="lora_peft.safetensors",
        unet_lora_layers=get_peft_model_state_dict(pipe.unet, adapter_name="check"),
        text_encoder_lora_layers=get_peft_model_state_dict(pipe.text_encoder, adapter_name="check"),
        unet_lora_adapter_metadata=meta["unet"], text_encoder_lora_adapter_metadata=meta["text_encoder"])
    for name in ("ddim", "euler", "euler_a", "dpmsolver++", "dpmsolver++_karras"):
        render(pipe, name, initial, f"{out}/{name}_lora.safetensors")
    # --fp8_base: every base Linear and Conv2d weight of the U-Net and text encoder rounded to
    # float8_e4m3fn (lorapipe stores them so and widens them per call; the VAE is not touched),
    # the LoRA computed beside them, unfused, as peft computes it (lorapipe puts it in the layers'
    # slots).
    for module in (pipe.unet, pipe.text_encoder):
        for name, layer in module.named_modules():
            if isinstance(layer, (torch.nn.Linear, torch.nn.Conv2d)) and "lora_" not in name:
                layer.weight.data = layer.weight.data.to(torch.float8_e4m3fn).to(torch.float32)
    render(pipe, "ddim", initial, f"{out}/ddim_lora_fp8.safetensors")
    with open(f"{out}/request.json", "w") as f:
        json.dump({**r, "seed": SEED, "vae_scale_factor": pipe.vae_scale_factor,
                   "long_prompt": LONG_PROMPT, "weighted_prompt": WEIGHTED_PROMPT}, f)


if __name__ == "__main__":
    main()
