#!/usr/bin/env python3
"""A tiny FLUX.1 [dev] pipeline and diffusers' FluxPipeline on it, for models/flux_model_test.cpp.

    flux_pipeline_reference.py TINY_SD_FOLDER OUT_DIR

Builds tiny_flux.py's dev pipeline (its AE with two levels: 2x downsampling) and saves it to
OUT_DIR/flux. Then OUT_DIR/reference.safetensors holds, for the
prompts in OUT_DIR/request.json (T5 at max_sequence_length 16):
  prompt_embeds, pooled            FluxPipeline.encode_prompt
  latents [2, 16, 8, 6], sigma     a denoiser call's inputs (guidance 3.5)
  velocity                         the transformer's output on them, unpacked as the pipeline does
  image                            the AE's decode of latents / 0.3611 + 0.1159
  render_initial, render_latents, render_image   FluxPipeline(PROMPTS[0], 4 steps, guidance
                                   3.5, 16x16) from the given initial latents: the final latents
                                   and the uint8 image
  render_cfg_latents               the same with the negative prompt NEGATIVE and
                                   true_cfg_scale 2: true classifier-free guidance
"""
import json
import os
import sys

import torch
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tiny_flux import build_pipeline  # noqa: E402

PROMPTS = ["a photo of a cat sitting on a red chair", "anime style, 1girl, long hair, sunset"]
T5_LENGTH = 16
RENDER_STEPS = 4
NEGATIVE = "blurry, low quality"


def main() -> None:
    tiny_sd, out = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(11)
    pipe = build_pipeline(tiny_sd, os.path.join(out, "spm"), gen, dev=True, ae_levels=2)
    transformer, vae = pipe.transformer, pipe.vae
    pipe.save_pretrained(os.path.join(out, "flux"), safe_serialization=True)

    with torch.no_grad():
        prompt_embeds, pooled, text_ids = pipe.encode_prompt(
            prompt=PROMPTS, prompt_2=None, max_sequence_length=T5_LENGTH)
        latents = torch.randn(2, 16, 8, 6, generator=gen)
        sigma = torch.tensor([0.35, 0.8])
        packed = pipe._pack_latents(latents, 2, 16, 8, 6)
        image_ids = pipe._prepare_latent_image_ids(2, 4, 3, latents.device, latents.dtype)
        velocity = transformer(hidden_states=packed, timestep=sigma, guidance=torch.full((2,), 3.5),
                               pooled_projections=pooled, encoder_hidden_states=prompt_embeds,
                               txt_ids=text_ids, img_ids=image_ids, return_dict=False)[0]
        # _unpack_latents takes the pixel size: latents times the AE's factor.
        velocity = pipe._unpack_latents(velocity, 8 * pipe.vae_scale_factor, 6 * pipe.vae_scale_factor,
                                        pipe.vae_scale_factor)
        image = vae.decode(latents / vae.config.scaling_factor + vae.config.shift_factor).sample
        # A whole preview: FluxPipeline's Euler steps from given initial latents (16x16 pixels,
        # 8x8 latents), its final latents and its image as uint8, as diffusers' numpy_to_pil.
        initial = torch.randn(1, 16, 8, 8, generator=gen)
        final = pipe(prompt=PROMPTS[0], height=16, width=16, num_inference_steps=RENDER_STEPS,
                     guidance_scale=3.5, latents=pipe._pack_latents(initial, 1, 16, 8, 8),
                     max_sequence_length=T5_LENGTH, output_type="latent").images
        final = pipe._unpack_latents(final, 16, 16, pipe.vae_scale_factor)
        pixels = pipe(prompt=PROMPTS[0], height=16, width=16, num_inference_steps=RENDER_STEPS,
                      guidance_scale=3.5, latents=pipe._pack_latents(initial, 1, 16, 8, 8),
                      max_sequence_length=T5_LENGTH, output_type="np").images[0]
        # True classifier-free guidance: a negative prompt and true_cfg_scale 2 (kohya's --l 2).
        cfg_final = pipe(prompt=PROMPTS[0], negative_prompt=NEGATIVE, true_cfg_scale=2.0,
                         height=16, width=16, num_inference_steps=RENDER_STEPS, guidance_scale=3.5,
                         latents=pipe._pack_latents(initial, 1, 16, 8, 8),
                         max_sequence_length=T5_LENGTH, output_type="latent").images
        cfg_final = pipe._unpack_latents(cfg_final, 16, 16, pipe.vae_scale_factor)
        # kohya's --l 2 without --n: true CFG against the empty prompt.
        cfg_empty = pipe(prompt=PROMPTS[0], negative_prompt="", true_cfg_scale=2.0,
                         height=16, width=16, num_inference_steps=RENDER_STEPS, guidance_scale=3.5,
                         latents=pipe._pack_latents(initial, 1, 16, 8, 8),
                         max_sequence_length=T5_LENGTH, output_type="latent").images
        cfg_empty = pipe._unpack_latents(cfg_empty, 16, 16, pipe.vae_scale_factor)
    save_file({"prompt_embeds": prompt_embeds.contiguous(), "pooled": pooled.contiguous(),
               "render_cfg_latents": cfg_final.contiguous(),
               "render_cfg_empty_latents": cfg_empty.contiguous(),
               "latents": latents, "sigma": sigma, "velocity": velocity.contiguous(),
               "image": image.contiguous(), "render_initial": initial,
               "render_latents": final.contiguous(),
               "render_image": torch.from_numpy((pixels * 255).round().astype("uint8")).contiguous()},
              os.path.join(out, "reference.safetensors"))
    with open(os.path.join(out, "request.json"), "w") as f:
        json.dump({"prompts": PROMPTS, "negative": NEGATIVE, "t5_length": T5_LENGTH, "guidance": 3.5,
                   "render_steps": RENDER_STEPS}, f)


if __name__ == "__main__":
    main()
