"""Reference LoRA training run for lorapipe's TrainParity tests (SD1.5, CPU, fp32 or fp64).

The truth the C++ trainer is compared against: diffusers + transformers + peft doing
what kohya sd-scripts train_network.py does per micro-batch, with every random draw
supplied by the caller.

    python train_reference.py --model DIR --lora INIT.safetensors \
        --inputs INPUTS.safetensors --config CONFIG.json --out OUT.safetensors

DIR            diffusers layout; unet/ and text_encoder/ are loaded.
INIT           kohya-named LoRA: <name>.lora_down.weight, <name>.lora_up.weight, <name>.alpha
               with <name> = lora_unet_<unet module path> or lora_te_<CLIPTextModel module
               path>, '.' -> '_'. Exactly these modules are adapted; scale = alpha / rank.
INPUTS         latents, noise, ip_noise [S,B,4,H,W]; offset_noise [S,B,4,1,1]; timesteps [S,B]
               int64; input_ids [S,B,77] int64; token_weights [S,B,77] (kohya's
               --weighted_captions: each text state times its token's weight; ones without);
               loss_weights [S,B]; optional alpha_masks [S,B,H*8,W*8] (kohya's alpha_mask,
               alpha / 255 at image size). S = steps (micro-batches).
CONFIG         steps, prediction_type, min_snr_gamma, scale_v_pred_loss_like_noise_pred,
               v_pred_like_loss, debiased_estimation_loss, ip_noise_gamma, noise_offset,
               zero_terminal_snr, scale_weight_norms (kohya's max-norm; 0: off),
               learning_rate,
               lr_scheduler, lr_warmup_steps, lr_scheduler_num_cycles, lr_scheduler_power,
               max_grad_norm, adam_betas, adam_eps, weight_decay, train_text_encoder,
               clip_skip, loss_type (l2|l1|huber|smooth_l1), huber_c, huber_scale,
               huber_schedule (constant|exponential|snr: kohya's
               get_huber_threshold_if_needed), adaptive_noise_scale (kohya's
               apply_noise_offset: the offset grows by scale * |mean of each latent channel|,
               clamped at 0),
               gradient_accumulation_steps (G; each micro-batch loss is divided by G),
               dtype (float32 | float64: models, LoRA, inputs, optimizer and OUT in it),
               fp8_base (kohya's --fp8_base as lorapipe stores it: the weight of every Linear
               and Conv2d of both models rounded to float8_e4m3fn, then widened to dtype, so
               the run computes in dtype with the rounded weights; norms, biases and
               embeddings as loaded).
OUT            loss, keys_scaled [S]; grad_norm, lr [S/G]; alphas_cumprod [1000] (the
               scheduler's, fp32 values); per module <name>.lora_{down,up}.grad (first
               optimizer step, before clipping), <name>.lora_{down,up}.weight (final),
               <name>.alpha. A LoRA the loss never reaches (last TE layer under clip_skip > 1)
               reports zero grads and is skipped by AdamW, as in kohya.
Exits non-zero with a message on any mismatch: unused or stray key, shape, config, inputs.
"""
import argparse
import json
import math
import re
import sys

import torch
import torch.nn.functional as F
from diffusers import DDPMScheduler, UNet2DConditionModel
from diffusers.optimization import get_scheduler
from peft import LoraConfig, inject_adapter_in_model
from safetensors.torch import load_file, save_file
from transformers import CLIPTextModel

CONFIG_DEFAULTS = {
    "prediction_type": "epsilon", "min_snr_gamma": 0.0, "scale_v_pred_loss_like_noise_pred": False,
    "v_pred_like_loss": 0.0, "debiased_estimation_loss": False, "ip_noise_gamma": 0.0, "noise_offset": 0.0,
    "zero_terminal_snr": False, "scale_weight_norms": 0.0, "lr_scheduler": "constant",
    "lr_warmup_steps": 0, "lr_scheduler_num_cycles": 1, "lr_scheduler_power": 1.0, "max_grad_norm": 0.0,
    "adam_betas": [0.9, 0.999], "adam_eps": 1e-8, "weight_decay": 0.01, "train_text_encoder": False,
    "clip_skip": 1, "loss_type": "l2", "huber_c": 0.1, "huber_scale": 1.0, "huber_schedule": "constant",
    "adaptive_noise_scale": 0.0,
    "gradient_accumulation_steps": 1, "dtype": "float32", "fp8_base": False,
}
DTYPES = {"float32": torch.float32, "float64": torch.float64}
LORA_PARTS = ("lora_down.weight", "lora_up.weight", "alpha")
INPUT_NDIMS = {"latents": 5, "noise": 5, "offset_noise": 5, "timesteps": 2, "input_ids": 3, "loss_weights": 2,
               "ip_noise": 5, "token_weights": 3}


def fail(message):
    sys.exit(f"train_reference: {message}")


def read_config(path):
    with open(path) as f:
        given = json.load(f)
    unknown = set(given) - set(CONFIG_DEFAULTS) - {"steps", "learning_rate"}
    if unknown or "steps" not in given or "learning_rate" not in given:
        fail(f"config {path}: unknown keys {sorted(unknown)} or missing steps/learning_rate")
    cfg = {**CONFIG_DEFAULTS, **given}
    if cfg["prediction_type"] not in ("epsilon", "v_prediction"):
        fail(f"prediction_type {cfg['prediction_type']!r}")
    if (cfg["loss_type"] not in ("l2", "l1", "huber", "smooth_l1")
            or cfg["huber_schedule"] not in ("constant", "exponential", "snr")):
        fail(f"loss_type {cfg['loss_type']!r} / huber_schedule {cfg['huber_schedule']!r} unsupported")
    if cfg["steps"] <= 0 or cfg["steps"] % cfg["gradient_accumulation_steps"]:
        fail(f"steps {cfg['steps']} must be a positive multiple of gradient_accumulation_steps")
    if cfg["dtype"] not in DTYPES:
        fail(f"dtype {cfg['dtype']!r}, not one of {list(DTYPES)}")
    if cfg["lr_scheduler"] == "constant" and cfg["lr_warmup_steps"]:
        fail("lr_scheduler constant takes no lr_warmup_steps (kohya get_scheduler_fix rejects it)")
    return cfg


def read_lora(path):
    """{kohya name: {part: tensor}}, every name carrying exactly down, up and alpha."""
    groups = {}
    for key, tensor in load_file(path).items():
        name, _, part = key.partition(".")
        if part not in LORA_PARTS:
            fail(f"{path}: unexpected key {key!r}")
        groups.setdefault(name, {})[part] = tensor.double()
    for name, parts in groups.items():
        if set(parts) != set(LORA_PARTS):
            fail(f"{path}: {name} has {sorted(parts)}, needs {list(LORA_PARTS)}")
        if parts["alpha"].numel() != 1:
            fail(f"{path}: {name}.alpha must hold one value, shape {list(parts['alpha'].shape)}")
    return groups


def attach_lora(model, prefix, groups):
    """Inject peft LoRA into the modules of `model` named in `groups`; returns {kohya name: peft layer}."""
    paths = {}
    for path, module in model.named_modules():
        if isinstance(module, (torch.nn.Linear, torch.nn.Conv2d)):
            paths.setdefault(prefix + path.replace(".", "_"), []).append(path)
    wanted = {name: parts for name, parts in groups.items() if name.startswith(prefix)}
    if not wanted:
        return {}
    for name in wanted:
        if len(paths.get(name, [])) != 1:
            fail(f"LoRA module {name} matches {paths.get(name, [])} in the model, needs exactly one")
    target = {paths[name][0]: parts for name, parts in wanted.items()}
    rank = {path: parts["lora_down.weight"].shape[0] for path, parts in target.items()}
    alpha = {path: parts["alpha"].item() for path, parts in target.items()}
    first = next(iter(target))
    config = LoraConfig(
        r=rank[first], lora_alpha=alpha[first], lora_dropout=0.0, target_modules=list(target),
        rank_pattern={re.escape(p): r for p, r in rank.items()}, alpha_pattern={re.escape(p): a for p, a in alpha.items()})
    inject_adapter_in_model(config, model)
    layers = {}
    for name, parts in wanted.items():
        path = paths[name][0]
        layer = model.get_submodule(path)
        lora_a, lora_b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
        if layer.r["default"] != rank[path] or layer.scaling["default"] != alpha[path] / rank[path]:
            fail(f"peft attached {name} with r={layer.r['default']} scaling={layer.scaling['default']}")
        for param, part in ((lora_a, "lora_down.weight"), (lora_b, "lora_up.weight")):
            if param.shape != parts[part].shape:
                fail(f"{name}.{part}: shape {list(parts[part].shape)}, module needs {list(param.shape)}")
            with torch.no_grad():
                param.copy_(parts[part])
        layers[name] = layer
    attached = {p for p, m in model.named_modules() if hasattr(m, "lora_A")}
    if attached != set(target):
        fail(f"peft adapted {sorted(attached ^ set(target))} beyond/short of the file")
    return layers


def encode_text(text_encoder, input_ids, clip_skip):
    if clip_skip == 1:
        return text_encoder(input_ids).last_hidden_state
    hidden = text_encoder(input_ids, output_hidden_states=True).hidden_states[-clip_skip]
    return text_encoder.text_model.final_layer_norm(hidden)


def huber_threshold(cfg, scheduler, timesteps):
    """kohya's per-sample Huber threshold c: constant huber_c * huber_scale; exponential
    exp(-t * -ln(huber_c) / 1000) * huber_scale; snr (1 - huber_c) / (1 + sigma_t)^2 + huber_c
    with sigma_t = sqrt((1 - a_t) / a_t) of the scheduler's alphas_cumprod (no scale)."""
    schedule, c, scale = cfg["huber_schedule"], cfg["huber_c"], cfg["huber_scale"]
    if schedule == "constant":
        return torch.full(timesteps.shape, c * scale, dtype=torch.float64)
    if schedule == "exponential":
        alpha = -math.log(c) / scheduler.config.num_train_timesteps
        return torch.exp(-alpha * timesteps.to(torch.float64)) * scale
    a = scheduler.alphas_cumprod.to(torch.float64)[timesteps]
    sigmas = ((1.0 - a) / a) ** 0.5
    return (1 - c) / (1 + sigmas) ** 2 + c


def micro_batch_loss(cfg, scheduler, all_snr, unet, text_encoder, batch):
    noise = batch["noise"]
    latents, timesteps = batch["latents"], batch["timesteps"]
    if cfg["noise_offset"]:
        offset = cfg["noise_offset"]
        if cfg["adaptive_noise_scale"]:
            # kohya clamps at 0, for a negative adaptive scale.
            offset = (offset + cfg["adaptive_noise_scale"] * latents.mean(dim=(2, 3), keepdim=True).abs()).clamp(min=0)
        noise = noise + offset * batch["offset_noise"]
    with torch.set_grad_enabled(cfg["train_text_encoder"]):
        hidden = encode_text(text_encoder, batch["input_ids"], cfg["clip_skip"])
        # kohya's encode_tokens_with_weights (one chunk): every state times its token's weight.
        hidden = hidden * batch["token_weights"].unsqueeze(-1)
    # kohya's ip_noise_gamma: the input is noised with extra noise, the target is not.
    input_noise = noise + cfg["ip_noise_gamma"] * batch["ip_noise"] if cfg["ip_noise_gamma"] else noise
    noisy = scheduler.add_noise(latents, input_noise, timesteps)
    pred = unet(noisy, timesteps, hidden).sample
    v_pred = cfg["prediction_type"] == "v_prediction"
    target = scheduler.get_velocity(latents, noise, timesteps) if v_pred else noise
    if cfg["loss_type"] == "l2":
        loss = F.mse_loss(pred, target, reduction="none")
    elif cfg["loss_type"] == "l1":
        loss = F.l1_loss(pred, target, reduction="none")
    else:
        c = huber_threshold(cfg, scheduler, timesteps).to(pred.dtype).view(-1, 1, 1, 1)
        root = torch.sqrt((pred - target) ** 2 + c**2) - c
        loss = 2 * c * root if cfg["loss_type"] == "huber" else 2 * root
    if "alpha_masks" in batch:  # kohya's apply_masked_loss
        mask = F.interpolate(batch["alpha_masks"].unsqueeze(1), size=loss.shape[2:], mode="area")
        loss = loss * mask
    loss = loss.mean([1, 2, 3]) * batch["loss_weights"]
    if cfg["min_snr_gamma"]:
        snr = all_snr[timesteps]
        loss = loss * torch.minimum(snr, torch.full_like(snr, cfg["min_snr_gamma"])) / (snr + 1 if v_pred else snr)
    # kohya's custom_train_functions, in train_network's order, the SNR capped at 1000.
    capped = torch.minimum(all_snr[timesteps], torch.full_like(all_snr[timesteps], 1000.0))
    if cfg["scale_v_pred_loss_like_noise_pred"]:
        loss = loss * (capped / (capped + 1))
    if cfg["v_pred_like_loss"]:
        loss = loss + loss / (capped / (capped + 1)) * cfg["v_pred_like_loss"]
    if cfg["debiased_estimation_loss"]:
        loss = (1 / (capped + 1) if v_pred else 1 / torch.sqrt(capped)) * loss
    return loss.mean()


def max_norm_pass(layers, max_norm):
    """kohya's --scale_weight_norms after a micro-batch: a module whose update (B A scaled by
    peft's alpha / r; a kxk conv's A convolved by B) is longer than max_norm in Frobenius norm
    has A and B shrunk by the same factor, so the update's norm becomes max_norm. Returns how
    many modules were shrunk."""
    shrunk = 0
    with torch.no_grad():
        for layer in layers.values():
            a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
            if a.dim() == 2:
                delta = b @ a
            elif a.shape[2:] == (1, 1):
                delta = (b.flatten(1) @ a.flatten(1))[:, :, None, None]
            else:
                delta = F.conv2d(a.transpose(0, 1), b).transpose(0, 1)
            norm = (delta * layer.scaling["default"]).norm()
            if norm > max_norm:
                factor = (max_norm / norm).sqrt()
                a.mul_(factor)
                b.mul_(factor)
                shrunk += 1
    return shrunk


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag in ("--model", "--lora", "--inputs", "--config", "--out"):
        parser.add_argument(flag, required=True)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    cfg = read_config(args.config)
    groups = read_lora(args.lora)
    dtype = DTYPES[cfg["dtype"]]
    torch.set_default_dtype(dtype)  # CLIP builds its causal mask in the default dtype
    inputs = {k: v.to(dtype) if v.is_floating_point() else v for k, v in load_file(args.inputs).items()}
    steps, accum = cfg["steps"], cfg["gradient_accumulation_steps"]
    for key, ndim in INPUT_NDIMS.items():
        if key not in inputs or inputs[key].dim() != ndim or inputs[key].shape[0] != steps:
            fail(f"inputs: {key} missing or not {ndim}-D with leading dimension steps={steps}")

    unet = UNet2DConditionModel.from_pretrained(f"{args.model}/unet", torch_dtype=dtype)
    text_encoder = CLIPTextModel.from_pretrained(f"{args.model}/text_encoder", dtype=dtype)
    unet.requires_grad_(False).eval()
    text_encoder.requires_grad_(False).eval()
    if cfg["fp8_base"]:  # before peft wraps the layers: the base layers' own weights
        for model in (unet, text_encoder):
            for m in model.modules():
                if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d)):
                    m.weight.data = m.weight.data.to(torch.float8_e4m3fn).to(dtype)
    unknown = [n for n in groups if not n.startswith(("lora_unet_", "lora_te_"))]
    if unknown:
        fail(f"LoRA names without lora_unet_/lora_te_ prefix: {unknown}")
    layers = {**attach_lora(text_encoder, "lora_te_", groups), **attach_lora(unet, "lora_unet_", groups)}
    if cfg["train_text_encoder"] != any(n.startswith("lora_te_") for n in layers):
        fail("train_text_encoder must be true exactly when the LoRA file has lora_te_ modules")
    params = {}
    for name, layer in layers.items():
        params[f"{name}.lora_down"] = layer.lora_A["default"].weight
        params[f"{name}.lora_up"] = layer.lora_B["default"].weight
    for p in params.values():
        if p.dtype != dtype:
            fail(f"peft made a {p.dtype} LoRA parameter in a {dtype} model")
        p.requires_grad_(True)

    schedule = dict(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                    num_train_timesteps=1000, clip_sample=False)
    scheduler = DDPMScheduler(**schedule, rescale_betas_zero_snr=cfg["zero_terminal_snr"])
    # kohya prepare_scheduler_for_custom_training: snr = (sqrt(a) / sqrt(1 - a)) ** 2, computed
    # before kohya rescales for zero terminal SNR, so of the plain schedule.
    alphas_cumprod = DDPMScheduler(**schedule).alphas_cumprod.to(dtype)
    all_snr = (alphas_cumprod.sqrt() / (1.0 - alphas_cumprod).sqrt()) ** 2
    optimizer = torch.optim.AdamW(list(params.values()), lr=cfg["learning_rate"], betas=tuple(cfg["adam_betas"]),
                                  eps=cfg["adam_eps"], weight_decay=cfg["weight_decay"])
    lr_scheduler = get_scheduler(cfg["lr_scheduler"], optimizer, num_warmup_steps=cfg["lr_warmup_steps"],
                                 num_training_steps=steps // accum, num_cycles=cfg["lr_scheduler_num_cycles"],
                                 power=cfg["lr_scheduler_power"])

    losses, grad_norms, lrs, first_grads, keys_scaled = [], [], [], {}, []
    for step in range(steps):
        batch = {key: inputs[key][step] for key in INPUT_NDIMS}
        if "alpha_masks" in inputs:
            batch["alpha_masks"] = inputs["alpha_masks"][step]
        loss = micro_batch_loss(cfg, scheduler, all_snr, unet, text_encoder, batch)
        (loss / accum).backward()
        losses.append(loss.item())
        if (step + 1) % accum == 0:
            optimizer_step(cfg, params, optimizer, lr_scheduler, first_grads, grad_norms, lrs)
        # kohya runs the max-norm pass after every micro-batch, also those that do not step.
        keys_scaled.append(max_norm_pass(layers, cfg["scale_weight_norms"]) if cfg["scale_weight_norms"] else 0)

    out = {"loss": losses, "keys_scaled": keys_scaled, "grad_norm": grad_norms, "lr": lrs,
           "alphas_cumprod": scheduler.alphas_cumprod, **first_grads}
    out.update({f"{key}.weight": p.detach() for key, p in params.items()})
    out.update({f"{name}.alpha": groups[name]["alpha"] for name in layers})
    save_file({k: torch.as_tensor(v, dtype=dtype).contiguous() for k, v in out.items()}, args.out)


def optimizer_step(cfg, params, optimizer, lr_scheduler, first_grads, grad_norms, lrs):
    """Clipping, AdamW and the schedule, once per G micro-batches; the first step's gradients
    (before clipping) go into first_grads."""
    # A LoRA the loss never reaches (e.g. the last TE layer under clip_skip > 1) keeps grad None:
    # it is reported as zeros and AdamW skips it, weight decay included, as in kohya.
    if not first_grads:
        first_grads.update({f"{k}.grad": (p.grad if p.grad is not None else torch.zeros_like(p)).clone()
                            for k, p in params.items()})
    total_norm = torch.nn.utils.get_total_norm([p.grad for p in params.values() if p.grad is not None])
    if cfg["max_grad_norm"] > 0:
        torch.nn.utils.clip_grads_with_norm_(list(params.values()), cfg["max_grad_norm"], total_norm)
    grad_norms.append(total_norm.item())
    lrs.append(optimizer.param_groups[0]["lr"])
    optimizer.step()
    lr_scheduler.step()
    optimizer.zero_grad(set_to_none=True)

if __name__ == "__main__":
    main()
