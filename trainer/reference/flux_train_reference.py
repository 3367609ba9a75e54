"""Reference FLUX.1 LoRA training for lorapipe's FluxTrainParity tests (CPU, float64).

diffusers' FluxTransformer2DModel, transformers' CLIPTextModel and T5EncoderModel and torch's
AdamW doing what kohya sd-scripts' flux_train_network.py does per micro-batch, with every random
draw supplied by the caller: CLIP-L's pooled output and T5's last hidden state as the
conditioning, the latents packed 2x2 with their image ids, the flow's noisy input
(1 - sigma) x0 + sigma noise, the transformer given sigma and the distilled guidance, and kohya's
model_prediction_type (raw: the output; sigma_scaled: output * -sigma + noisy) against
noise - x0, L2 per sample times the samples' loss weights.

kohya's Flux LoRA fuses modules diffusers keeps apart (img_attn.qkv is to_q, to_k and to_v;
single_blocks.N.linear1 is those and proj_mlp): one down matrix and one up matrix whose rows
cut into the parts. Two ways to put that on diffusers' modules:
  --mode peft   peft adapters on every part, each A a copy of the shared down and each B its rows
                of the up: the up gradient is the B gradients stacked, the down gradient the sum
                of the A gradients. One step only (the copies would part ways in AdamW).
  --mode fused  kohya's form directly: each part's output gains scale * up[rows] @ down @ x with
                the one shared down and up as the parameters, trained with AdamW for S steps.
  --mode split  kohya's split_qkv: each part its own down and up (the file's merged form read as
                kohya reads it: the down's rows and the up's diagonal blocks), scale alpha over
                one part's rank, trained for S steps; gradients and weights reported merged.

    python flux_train_reference.py --model DIR --lora INIT.safetensors --inputs IN.safetensors \
        --config CONFIG.json --out OUT.safetensors --mode peft|fused

DIR     a diffusers FLUX.1 folder (transformer/, text_encoder/, text_encoder_2/).
INIT    the kohya-named LoRA (<name>.lora_down.weight, .lora_up.weight, .alpha); every module
        must be placed (flux_diffusers_lora_check.py's table from BFL names to diffusers').
INPUTS  latents, noise [S,B,16,h,w]; sigmas [S,B]; input_ids [S,B,77], t5_ids [S,B,T] int64;
        loss_weights [S,B].
CONFIG  steps, learning_rate, model_prediction_type, guidance, train_text_encoder,
        max_grad_norm, adam_eps, weight_decay.
OUT     loss [S]; per module <name>.lora_{down,up}.grad (first step, before clipping) and, in
        fused mode, <name>.lora_{down,up}.weight (final).
"""
import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F
from diffusers import FluxTransformer2DModel
from peft import LoraConfig, inject_adapter_in_model
from safetensors.torch import load_file, save_file
from transformers import CLIPTextModel, T5EncoderModel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from flux_diffusers_lora_check import clip_table, flux_table  # noqa: E402
from train_reference import optimizer_step, read_lora  # noqa: E402


def fail(message):
    sys.exit(f"flux_train_reference: {message}")


def pack(x):
    b, c, h, w = x.shape
    return x.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // 2) * (w // 2), c * 4)


def unpack(x, h, w):
    b, _, d = x.shape
    c = d // 4
    return x.view(b, h // 2, w // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, c, h, w)


def image_ids(h, w):
    ids = torch.zeros(h // 2, w // 2, 3)
    ids[..., 1] += torch.arange(h // 2)[:, None]
    ids[..., 2] += torch.arange(w // 2)[None, :]
    return ids.reshape(-1, 3)


def fused(table, groups):
    """kohya's form: forward hooks adding scale * up[rows] @ down @ x; {param key: Parameter}."""
    params = {}
    for name, parts in groups.items():
        down = torch.nn.Parameter(parts["lora_down.weight"].clone())
        up = torch.nn.Parameter(parts["lora_up.weight"].clone())
        scale = parts["alpha"].item() / down.shape[0]
        for linear, rows in table[name]:
            def hook(module, inputs, output, down=down, up=up, rows=rows, scale=scale):
                u = up if rows is None else up[rows[0]:rows[1]]
                return output + scale * F.linear(F.linear(inputs[0], down), u)
            linear.register_forward_hook(hook)
        params[f"{name}.lora_down"], params[f"{name}.lora_up"] = down, up
    return params


def split(table, groups):
    """kohya's split_qkv form: {kohya name: [(down_j, up_j)]}; every part's own LoRA."""
    parts = {}
    for name, g in groups.items():
        n = len(table[name])
        down, up = g["lora_down.weight"], g["lora_up.weight"]
        rank = down.shape[0] // n
        scale = g["alpha"].item() / rank
        parts[name] = []
        for j, (linear, rows) in enumerate(table[name]):
            d = torch.nn.Parameter(down[j * rank:(j + 1) * rank].clone())
            r = (0, up.shape[0]) if rows is None else rows
            u = torch.nn.Parameter(up[r[0]:r[1], j * rank:(j + 1) * rank].clone())

            def hook(module, inputs, output, d=d, u=u, scale=scale):
                return output + scale * F.linear(F.linear(inputs[0], d), u)
            linear.register_forward_hook(hook)
            parts[name].append((d, u))
    return parts


def merged(parts, value):
    """A module's parts as kohya saves them: the downs stacked, the ups block-diagonal."""
    downs = [value(d) for d, _ in parts]
    ups = [value(u) for _, u in parts]
    rank = downs[0].shape[0]
    up = torch.zeros(sum(u.shape[0] for u in ups), rank * len(ups))
    row = 0
    for j, u in enumerate(ups):
        up[row:row + u.shape[0], j * rank:(j + 1) * rank] = u
        row += u.shape[0]
    return torch.cat(downs), up


def peft_split(models, tables, groups):
    """peft adapters on every part; {kohya name: [(layer, rows)]}."""
    placed = {}
    for key, model in models.items():
        paths = {id(m): p for p, m in model.named_modules()}
        targets = {}
        for name in groups:
            if name in tables[key]:
                placed[name] = [(paths[id(linear)], rows) for linear, rows in tables[key][name]]
                for path, _ in placed[name]:
                    targets[path] = name
        if not targets:
            continue
        ranks = {p: groups[n]["lora_down.weight"].shape[0] for p, n in targets.items()}
        alphas = {p: groups[n]["alpha"].item() for p, n in targets.items()}
        first = next(iter(ranks))
        import re
        config = LoraConfig(r=ranks[first], lora_alpha=alphas[first], lora_dropout=0.0,
                            target_modules=list(ranks),
                            rank_pattern={re.escape(p): r for p, r in ranks.items()},
                            alpha_pattern={re.escape(p): a for p, a in alphas.items()})
        inject_adapter_in_model(config, model)
        for path, name in targets.items():
            layer = model.get_submodule(path)
            rows = dict(placed[name])[path]
            up = groups[name]["lora_up.weight"]
            with torch.no_grad():
                layer.lora_A["default"].weight.copy_(groups[name]["lora_down.weight"])
                layer.lora_B["default"].weight.copy_(up if rows is None else up[rows[0]:rows[1]])
            layer.lora_A["default"].weight.requires_grad_(True)
            layer.lora_B["default"].weight.requires_grad_(True)
        placed.update({n: [(model.get_submodule(p), r) for p, r in placed[n]]
                       for n in set(targets.values())})
    return placed


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag in ("--model", "--lora", "--inputs", "--config", "--out", "--mode"):
        parser.add_argument(flag, required=True)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    dtype = torch.float64
    torch.set_default_dtype(dtype)
    with open(args.config) as f:
        cfg = {"model_prediction_type": "raw", "guidance": 3.5, "train_text_encoder": False,
               "max_grad_norm": 0.0, "adam_eps": 1e-8, "weight_decay": 0.01, **json.load(f)}
    groups = read_lora(args.lora)
    inputs = {k: v.to(dtype) if v.is_floating_point() else v
              for k, v in load_file(args.inputs).items()}
    transformer = FluxTransformer2DModel.from_pretrained(f"{args.model}/transformer", torch_dtype=dtype)
    clip = CLIPTextModel.from_pretrained(f"{args.model}/text_encoder", dtype=dtype)
    t5 = T5EncoderModel.from_pretrained(f"{args.model}/text_encoder_2", dtype=dtype)
    models = {"transformer": transformer, "clip": clip}
    for m in (transformer, clip, t5):
        m.requires_grad_(False).eval()
    tables = {"transformer": flux_table(transformer), "clip": clip_table(clip)}
    unplaced = [n for n in groups if not any(n in t for t in tables.values())]
    if unplaced:
        fail(f"modules with no place in diffusers' Flux: {unplaced[:5]}")

    if args.mode == "fused":
        table = {**tables["transformer"], **tables["clip"]}
        params = fused(table, groups)
    elif args.mode == "split":
        table = {**tables["transformer"], **tables["clip"]}
        split_parts = split(table, groups)
        params = {f"{name}.{j}.{which}": p for name, ps in split_parts.items()
                  for j, pair in enumerate(ps) for which, p in zip("du", pair)}
    else:
        placed = peft_split(models, tables, groups)
        params = {}
        for name, parts in placed.items():
            for i, (layer, _) in enumerate(parts):
                params[f"{name}.{i}.A"] = layer.lora_A["default"].weight
                params[f"{name}.{i}.B"] = layer.lora_B["default"].weight
    optimizer = torch.optim.AdamW(list(params.values()), lr=cfg["learning_rate"],
                                  eps=cfg["adam_eps"], weight_decay=cfg["weight_decay"])
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)  # constant
    steps = cfg["steps"] if args.mode in ("fused", "split") else 1
    losses, grad_norms, lrs, first_grads = [], [], [], {}
    for step in range(steps):
        b = {k: v[step] for k, v in inputs.items()}
        x0, noise, sigma = b["latents"], b["noise"], b["sigmas"]
        n, _, h, w = x0.shape
        with torch.set_grad_enabled(cfg["train_text_encoder"]):
            pooled = clip(b["input_ids"]).pooler_output
        states = t5(b["t5_ids"])[0]
        s = sigma.view(-1, 1, 1, 1)
        noisy = (1 - s) * x0 + s * noise
        guidance = (torch.full((n,), float(cfg["guidance"]))
                    if transformer.config.guidance_embeds else None)
        out = transformer(hidden_states=pack(noisy), timestep=sigma, guidance=guidance,
                          pooled_projections=pooled, encoder_hidden_states=states,
                          txt_ids=torch.zeros(states.shape[1], 3), img_ids=image_ids(h, w),
                          return_dict=False)[0]
        pred = unpack(out, h, w)
        if cfg["model_prediction_type"] == "sigma_scaled":
            pred = pred * (-s) + noisy  # kohya's; compared with noise - x0 all the same
        elif cfg["model_prediction_type"] == "additive":
            pred = pred + noisy
        target = noise - x0
        loss = (F.mse_loss(pred, target, reduction="none").mean([1, 2, 3]) * b["loss_weights"]).mean()
        loss.backward()
        losses.append(loss.item())
        if args.mode in ("fused", "split"):
            optimizer_step(cfg, params, optimizer, lr_scheduler, first_grads, grad_norms, lrs)

    out = {"loss": torch.tensor(losses)}
    if args.mode == "split":
        for name, ps in split_parts.items():
            grads = [(first_grads[f"{name}.{j}.d.grad"], first_grads[f"{name}.{j}.u.grad"])
                     for j in range(len(ps))]
            out[f"{name}.lora_down.grad"], out[f"{name}.lora_up.grad"] = merged(grads, lambda t: t)
            out[f"{name}.lora_down.weight"], out[f"{name}.lora_up.weight"] = merged(
                ps, lambda t: t.detach())
    elif args.mode == "fused":
        out.update(first_grads)
        out.update({f"{key}.weight": p.detach() for key, p in params.items()})
    else:
        # kohya's parameters' gradients from the split ones: the down's is the sum of every
        # part's A gradient, the up's the parts' B gradients stacked in kohya's row order.
        for name, parts in placed.items():
            grads_a = [params[f"{name}.{i}.A"].grad for i in range(len(parts))]
            grads_b = [params[f"{name}.{i}.B"].grad for i in range(len(parts))]
            zero_a = torch.zeros_like(params[f"{name}.0.A"])
            out[f"{name}.lora_down.grad"] = sum((g if g is not None else zero_a) for g in grads_a)
            out[f"{name}.lora_up.grad"] = torch.cat(
                [g if g is not None else torch.zeros_like(params[f"{name}.{i}.B"])
                 for i, g in enumerate(grads_b)])
            out[f"{name}.parts"] = torch.tensor(float(len(parts)))
    save_file({k: torch.as_tensor(v, dtype=dtype).contiguous() for k, v in out.items()}, args.out)


if __name__ == "__main__":
    main()
