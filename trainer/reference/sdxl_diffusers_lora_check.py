"""Check that diffusers loads a LoRA lorapipe trained on an SDXL model (fp32, CPU).

    python sdxl_diffusers_lora_check.py --model DIR --lora FILE --out RESULT.json

DIR   a diffusers SDXL folder (StableDiffusionXLPipeline).
FILE  the LoRA in kohya's SDXL format (lora_unet_* in Stability AI's module names, lora_te1_*,
      lora_te2_*), as users load it with `pipe.load_lora_weights`: diffusers maps the SAI names
      to its own (_maybe_map_sgm_blocks_to_diffusers) and injects peft adapters.

RESULT.json: file_modules; adapted_modules (layers holding the adapter after loading);
leftover (file modules whose down/up did not land in any adapter unchanged, found by value);
unet_change = max|lora - base| / max|base| of the U-Net's output on seeded inputs, and
text_change the same for both encoders' penultimate states. Exits non-zero if
load_lora_weights raises.
"""
import argparse
import json
import warnings

import torch
from diffusers import DDIMScheduler, StableDiffusionXLPipeline
from safetensors.torch import load_file

warnings.filterwarnings("ignore")


def outputs(pipe):
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        embeds, _, pooled, _ = pipe.encode_prompt(["a red circle", "a square"], device="cpu",
                                                  do_classifier_free_guidance=False)
        x = torch.randn(2, 4, 8, 8, generator=g)
        time_ids = torch.tensor([[64, 64, 0, 0, 64, 64], [96, 80, 3, 8, 64, 64]],
                                dtype=torch.float32)
        y = pipe.unet(x, torch.tensor([10, 500]), encoder_hidden_states=embeds,
                      added_cond_kwargs={"text_embeds": pooled, "time_ids": time_ids}).sample
    return embeds, y


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag in ("--model", "--lora", "--out"):
        parser.add_argument(flag, required=True)
    args = parser.parse_args()
    pipe = StableDiffusionXLPipeline.from_pretrained(
        args.model, torch_dtype=torch.float32, add_watermarker=False,
        scheduler=DDIMScheduler(beta_start=0.00085, beta_end=0.012,
                                beta_schedule="scaled_linear"))
    base_text, base_unet = outputs(pipe)
    file = load_file(args.lora)
    modules = sorted({k.split(".")[0] for k in file})
    pipe.load_lora_weights(args.lora, adapter_name="check")
    adapters = []
    for part in (pipe.unet, pipe.text_encoder, pipe.text_encoder_2):
        for _, m in part.named_modules():
            if hasattr(m, "lora_A") and "check" in m.lora_A:
                adapters.append((m.lora_A["check"].weight.detach(), m.lora_B["check"].weight.detach()))
    leftover = []
    for name in modules:
        down, up = file[f"{name}.lora_down.weight"], file[f"{name}.lora_up.weight"]
        found = any(a.shape == down.shape and b.shape == up.shape and
                    torch.equal(a, down.to(a.dtype)) and torch.equal(b, up.to(b.dtype))
                    for a, b in adapters)
        if not found:
            leftover.append(name)
    lora_text, lora_unet = outputs(pipe)
    result = {
        "file_modules": len(modules),
        "adapted_modules": len(adapters),
        "leftover": leftover,
        "unet_change": ((lora_unet - base_unet).abs().max() / base_unet.abs().max()).item(),
        "text_change": ((lora_text - base_text).abs().max() / base_text.abs().max()).item(),
    }
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
