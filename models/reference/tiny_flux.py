#!/usr/bin/env python3
"""A tiny FLUX.1 pipeline built by diffusers from config alone (no network), every weight drawn
at random from a seeded generator, for lorapipe's Flux tests:

    tiny_flux.py TINY_SD_FOLDER OUT_FOLDER [--schnell] [--ae_levels N]

  - CLIP-L's place: the tiny SD1.5 checkpoint's text_encoder/ and tokenizer/ (TINY_SD_FOLDER,
    written by lorapipe's write_tiny_checkpoint);
  - T5: a 2-block T5 v1.1 encoder (d_model 32) and a T5TokenizerFast over a unigram model trained
    as t5_tokenizer_reference.py trains it (tokenizer_2/spiece.model beside it);
  - the transformer: FluxTransformer2DModel, 1 double and 2 single blocks, 2 heads of 16 (rotary
    4/6/6), 64 packed channels (16 latent channels), with the guidance embedding (dev) or without
    (--schnell);
  - the AE: AutoencoderKL with Flux's settings (16 channels, no quant convs, 0.3611 / 0.1159),
    N levels (2^(N-1) pixels per latent; 4, FLUX.1's 8x, by default).
build_pipeline() is what flux_pipeline_reference.py uses; the command saves the pipeline with
FluxPipeline.save_pretrained, as a user's diffusers folder is laid out.
"""
import argparse
import os
import sys

import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
from transformers import CLIPTextModel, CLIPTokenizer, T5Config, T5EncoderModel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from t5_tokenizer_reference import t5_tokenizer_fast, train_spiece  # noqa: E402


def randomize(model, gen, scale=0.3):
    with torch.no_grad():
        for name, p in model.named_parameters():
            norm = "norm" in name and p.dim() == 1
            p.copy_(torch.randn(p.shape, generator=gen) * scale + (1.0 if norm else 0.0))


def build_pipeline(tiny_sd, work, gen, dev=True, ae_levels=4):
    """The tiny FluxPipeline; `work` receives the SentencePiece model's training files."""
    os.makedirs(work, exist_ok=True)
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
        guidance_embeds=dev, axes_dims_rope=(4, 6, 6)).eval()
    randomize(transformer, gen)
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * ae_levels,
                        up_block_types=("UpDecoderBlock2D",) * ae_levels,
                        block_out_channels=(32,) * ae_levels, layers_per_block=1, latent_channels=16,
                        norm_num_groups=32, use_quant_conv=False, use_post_quant_conv=False,
                        scaling_factor=0.3611, shift_factor=0.1159).eval()
    randomize(vae, gen, 0.1)
    # FLUX.1's scheduler configs: dev shifts by resolution, schnell not at all.
    scheduler = (FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True) if dev
                 else FlowMatchEulerDiscreteScheduler(shift=1.0, use_dynamic_shifting=False))
    return FluxPipeline(scheduler=scheduler, vae=vae, text_encoder=clip, tokenizer=tokenizer,
                        text_encoder_2=t5, tokenizer_2=t5_tokenizer, transformer=transformer)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("tiny_sd")
    parser.add_argument("out")
    parser.add_argument("--schnell", action="store_true")
    parser.add_argument("--ae_levels", type=int, default=4)
    args = parser.parse_args()
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(11)
    pipe = build_pipeline(args.tiny_sd, args.out + ".spm", gen, dev=not args.schnell,
                          ae_levels=args.ae_levels)
    pipe.save_pretrained(args.out, safe_serialization=True)


if __name__ == "__main__":
    main()
