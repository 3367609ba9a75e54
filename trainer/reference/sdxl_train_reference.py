"""Reference SDXL LoRA training for lorapipe's SdxlTrainParity tests (CPU, float64).

diffusers' UNet2DConditionModel with text_time added conditions, transformers' CLIPTextModel and
CLIPTextModelWithProjection, peft LoRA and torch's AdamW doing what kohya sd-scripts'
sdxl_train_network.py does per micro-batch, with every random draw supplied by the caller:
both encoders' penultimate hidden states (hidden_states[-2], no final norm) side by side, bigG's
projected pooled output and each sample's six time ids as the U-Net's added conditions, the DDPM
noising, the L2 loss against the noise (or v), times the samples' loss weights.

    python sdxl_train_reference.py --model DIR --lora INIT.safetensors --names NAMES.json \
        --inputs INPUTS.safetensors --config CONFIG.json --out OUT.safetensors

DIR     diffusers SDXL folder: unet/, text_encoder/, text_encoder_2/ are loaded.
INIT    kohya-named LoRA (<name>.lora_down.weight, .lora_up.weight, .alpha).
NAMES   {kohya name: [component, module path]}, component unet | text_encoder | text_encoder_2:
        where lorapipe puts each of its modules. The names themselves (Stability AI paths under
        lora_unet_, lora_te1_, lora_te2_) are checked against diffusers' own kohya loader by
        models/sdxl_test.cpp; here every path must be a Linear or Conv2d and every module of the
        file must be placed exactly once.
INPUTS  latents, noise [S,B,4,h,w]; timesteps [S,B] int64; input_ids, input_ids_2 [S,B,77]
        int64; time_ids [S,B,6]; loss_weights [S,B].
CONFIG  steps, learning_rate, prediction_type (epsilon | v_prediction), train_text_encoder,
        max_grad_norm, adam_eps, weight_decay.
OUT     loss [S]; per module <name>.lora_{down,up}.grad (first step, before clipping) and
        <name>.lora_{down,up}.weight (final); alphas_cumprod.
"""
import argparse
import json
import os
import re
import sys

import torch
import torch.nn.functional as F
from diffusers import DDPMScheduler, UNet2DConditionModel
from peft import LoraConfig, inject_adapter_in_model
from safetensors.torch import load_file, save_file
from transformers import CLIPTextModel, CLIPTextModelWithProjection

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_reference import optimizer_step, read_lora  # noqa: E402  (shared with SD1.5's)


def fail(message):
    sys.exit(f"sdxl_train_reference: {message}")


def attach(model, placed, groups):
    """peft LoRA on `placed` ({kohya name: module path} of this model), initialised from the file;
    returns {kohya name: peft layer}."""
    if not placed:
        return {}
    for name, path in placed.items():
        layer = model.get_submodule(path)
        if not isinstance(layer, (torch.nn.Linear, torch.nn.Conv2d)):
            fail(f"{name}: {path} is a {type(layer).__name__}, not a Linear or Conv2d")
    rank = {p: groups[n]["lora_down.weight"].shape[0] for n, p in placed.items()}
    alpha = {p: groups[n]["alpha"].item() for n, p in placed.items()}
    first = next(iter(rank))
    config = LoraConfig(r=rank[first], lora_alpha=alpha[first], lora_dropout=0.0,
                        target_modules=list(rank),
                        rank_pattern={re.escape(p): r for p, r in rank.items()},
                        alpha_pattern={re.escape(p): a for p, a in alpha.items()})
    inject_adapter_in_model(config, model)
    layers = {}
    for name, path in placed.items():
        layer = model.get_submodule(path)
        for param, part in ((layer.lora_A["default"].weight, "lora_down.weight"),
                            (layer.lora_B["default"].weight, "lora_up.weight")):
            if param.shape != groups[name][part].shape:
                fail(f"{name}.{part}: shape {list(groups[name][part].shape)}, module needs "
                     f"{list(param.shape)}")
            with torch.no_grad():
                param.copy_(groups[name][part])
        layers[name] = layer
    attached = {p for p, m in model.named_modules() if hasattr(m, "lora_A")}
    if attached != set(placed.values()):
        fail(f"peft adapted {sorted(attached ^ set(placed.values()))[:5]} beyond/short of the file")
    return layers


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag in ("--model", "--lora", "--names", "--inputs", "--config", "--out"):
        parser.add_argument(flag, required=True)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    dtype = torch.float64
    torch.set_default_dtype(dtype)
    with open(args.config) as f:
        cfg = {"prediction_type": "epsilon", "train_text_encoder": False, "max_grad_norm": 0.0,
               "adam_eps": 1e-8, "weight_decay": 0.01, **json.load(f)}
    with open(args.names) as f:
        names = json.load(f)
    groups = read_lora(args.lora)
    if set(groups) != set(names):
        fail(f"names and LoRA file disagree: {sorted(set(groups) ^ set(names))[:5]}")
    inputs = {k: v.to(dtype) if v.is_floating_point() else v
              for k, v in load_file(args.inputs).items()}

    unet = UNet2DConditionModel.from_pretrained(f"{args.model}/unet", torch_dtype=dtype)
    te1 = CLIPTextModel.from_pretrained(f"{args.model}/text_encoder", dtype=dtype)
    te2 = CLIPTextModelWithProjection.from_pretrained(f"{args.model}/text_encoder_2", dtype=dtype)
    models = {"unet": unet, "text_encoder": te1, "text_encoder_2": te2}
    for m in models.values():
        m.requires_grad_(False).eval()
    layers = {}
    for component, model in models.items():
        placed = {n: p for n, (c, p) in names.items() if c == component}
        layers.update(attach(model, placed, groups))
    trains_te = any(names[n][0] != "unet" for n in layers)
    if cfg["train_text_encoder"] != trains_te:
        fail("train_text_encoder must be true exactly when the file has text-encoder modules")
    params = {}
    for name, layer in layers.items():
        params[f"{name}.lora_down"] = layer.lora_A["default"].weight
        params[f"{name}.lora_up"] = layer.lora_B["default"].weight
    for p in params.values():
        p.requires_grad_(True)

    scheduler = DDPMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                              num_train_timesteps=1000, clip_sample=False)
    optimizer = torch.optim.AdamW(list(params.values()), lr=cfg["learning_rate"],
                                  eps=cfg["adam_eps"], weight_decay=cfg["weight_decay"])
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)  # constant
    steps = cfg["steps"]
    losses, grad_norms, lrs, first_grads = [], [], [], {}
    for step in range(steps):
        b = {k: v[step] for k, v in inputs.items()}
        with torch.set_grad_enabled(cfg["train_text_encoder"]):
            one = te1(b["input_ids"], output_hidden_states=True).hidden_states[-2]
            out2 = te2(b["input_ids_2"], output_hidden_states=True)
            two, pooled = out2.hidden_states[-2], out2.text_embeds
            hidden = torch.cat([one, two], dim=-1)
        noisy = scheduler.add_noise(b["latents"], b["noise"], b["timesteps"])
        pred = unet(noisy, b["timesteps"], hidden,
                    added_cond_kwargs={"text_embeds": pooled, "time_ids": b["time_ids"]}).sample
        v_pred = cfg["prediction_type"] == "v_prediction"
        target = scheduler.get_velocity(b["latents"], b["noise"], b["timesteps"]) if v_pred else b["noise"]
        loss = (F.mse_loss(pred, target, reduction="none").mean([1, 2, 3]) * b["loss_weights"]).mean()
        loss.backward()
        losses.append(loss.item())
        optimizer_step(cfg, params, optimizer, lr_scheduler, first_grads, grad_norms, lrs)

    out = {"loss": losses, "grad_norm": grad_norms, "alphas_cumprod": scheduler.alphas_cumprod,
           **first_grads}
    out.update({f"{key}.weight": p.detach() for key, p in params.items()})
    save_file({k: torch.as_tensor(v, dtype=dtype).contiguous() for k, v in out.items()}, args.out)


if __name__ == "__main__":
    main()
