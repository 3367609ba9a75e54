#!/usr/bin/env python3
"""A tiny FLUX.1 [dev] pipeline and diffusers' FluxPipeline on it, for models/flux_model_test.cpp.

    flux_pipeline_reference.py TINY_SD_FOLDER OUT_DIR

Builds from config alone (no network), every weight re-drawn at random (seeded):
  - CLIP-L's place: the tiny SD1.5 checkpoint's text_encoder/ and tokenizer/ (TINY_SD_FOLDER,
    written by lorapipe's write_tiny_checkpoint);
  - T5: a 2-block T5 v1.1 encoder (d_model 32) and a T5TokenizerFast over a unigram model trained
    as t5_tokenizer_reference.py trains it, with the backend T5's tokenizer.json configures;
  - the transformer: FluxTransformer2DModel with guidance, 1 double and 2 single blocks, 2 heads
    of 16 (rotary 4/6/6), 64 packed channels (16 latent channels), T5 and CLIP widths;
  - the AE: AutoencoderKL with Flux's settings (16 channels, no quant convs, 0.3611 / 0.1159),
    two levels (2x downsampling);
and saves FluxPipeline(...) to OUT_DIR/flux. Then OUT_DIR/reference.safetensors holds, for the
prompts in OUT_DIR/request.json (T5 at max_sequence_length 16):
  prompt_embeds, pooled            FluxPipeline.encode_prompt
  latents [2, 16, 8, 6], sigma     a denoiser call's inputs (guidance 3.5)
  velocity                         the transformer's output on them, unpacked as the pipeline does
  image                            the AE's decode of latents / 0.3611 + 0.1159
  render_initial, render_latents, render_image   FluxPipeline(PROMPTS[0], 4 steps, guidance
                                   3.5, 16x16) from the given initial latents: the final latents
                                   and the uint8 image
"""
import json
import os
import sys

import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
from safetensors.torch import save_file
from transformers import CLIPTextModel, CLIPTokenizer, T5Config, T5EncoderModel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from t5_tokenizer_reference import t5_tokenizer_fast, train_spiece  # noqa: E402

PROMPTS = ["a photo of a cat sitting on a red chair", "anime style, 1girl, long hair, sunset"]
T5_LENGTH = 16
RENDER_STEPS = 4


def randomize(model, gen, scale=0.3):
    with torch.no_grad():
        for name, p in model.named_parameters():
            norm = "norm" in name and p.dim() == 1
            p.copy_(torch.randn(p.shape, generator=gen) * scale + (1.0 if norm else 0.0))


def main() -> None:
    tiny_sd, out = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(11)
    work = os.path.join(out, "spm")
    os.makedirs(work)
    t5_tokenizer = t5_tokenizer_fast(train_spiece(work))

    clip = CLIPTextModel.from_pretrained(os.path.join(tiny_sd, "text_encoder")).eval()
    tokenizer = CLIPTokenizer.from_pretrained(os.path.join(tiny_sd, "tokenizer"))
    t5 = T5EncoderModel(T5Config(vocab_size=len(t5_tokenizer), d_model=32, d_kv=8, d_ff=48,
                                 num_layers=2, num_heads=4, relative_attention_num_buckets=8,
                                 relative_attention_max_distance=16,
                                 feed_forward_proj="gated-gelu", dropout_rate=0.0)).eval()
    randomize(t5, gen)
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=64, num_layers=1, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=clip.config.hidden_size,
        guidance_embeds=True, axes_dims_rope=(4, 6, 6)).eval()
    randomize(transformer, gen)
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(32, 32),
                        layers_per_block=1, latent_channels=16, norm_num_groups=32,
                        use_quant_conv=False, use_post_quant_conv=False, scaling_factor=0.3611,
                        shift_factor=0.1159).eval()
    randomize(vae, gen, 0.1)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True)
    pipe = FluxPipeline(scheduler=scheduler, vae=vae, text_encoder=clip, tokenizer=tokenizer,
                        text_encoder_2=t5, tokenizer_2=t5_tokenizer, transformer=transformer)
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
    save_file({"prompt_embeds": prompt_embeds.contiguous(), "pooled": pooled.contiguous(),
               "latents": latents, "sigma": sigma, "velocity": velocity.contiguous(),
               "image": image.contiguous(), "render_initial": initial,
               "render_latents": final.contiguous(),
               "render_image": torch.from_numpy((pixels * 255).round().astype("uint8")).contiguous()},
              os.path.join(out, "reference.safetensors"))
    with open(os.path.join(out, "request.json"), "w") as f:
        json.dump({"prompts": PROMPTS, "t5_length": T5_LENGTH, "guidance": 3.5,
                   "render_steps": RENDER_STEPS}, f)


if __name__ == "__main__":
    main()
