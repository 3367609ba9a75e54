"""Check that diffusers loads a lorapipe kohya-format LoRA file exactly as written (SD1.5, fp32, CPU).

    python diffusers_lora_check.py --model DIR --lora FILE --out RESULT.json

DIR   diffusers layout; unet/, text_encoder/, tokenizer/ (and vae/) are loaded into a StableDiffusionPipeline.
FILE  kohya sd-scripts LoRA/LoCon: <name>.lora_down.weight, <name>.lora_up.weight, <name>.alpha with
      <name> = lora_unet_<unet module path> or lora_te_<CLIPTextModel module path>, '.' -> '_'.

Users load our files with `pipe.load_lora_weights`, which renames kohya keys through diffusers'
`_convert_non_diffusers_lora_to_diffusers` and injects peft adapters. This script proves that path
drops, mis-maps or mis-scales nothing:
  * text encoder last_hidden_state (fixed prompts) and UNet output (seed-0 latents [2,4,8,8],
    timesteps [10, 500], always conditioned on the base text encoder's output) are taken before
    loading (base), after `load_lora_weights` at scale 1 (lora), and with every file module merged
    by hand into a copy of the base weights, W += up.flatten(1) @ down.flatten(1) * alpha / rank
    (merged; this composition is exact for linear, 1x1 and 3x3 conv LoRA), so a dropped or
    mis-scaled module shows as a max_rel_diff far above float rounding (~1e-6);
  * each file module's adapter is read back from the model: a down/up/alpha key counts as left over
    unless lora_A/lora_B equal the file's down/up and peft's scaling equals alpha / rank. (diffusers
    0.36 applies an attention q/k/v/out alpha only when it equals the most common alpha of its
    model: `_get_alpha_name` keeps the legacy `to_q_lora.down.weight` name, whose alpha_pattern entry
    matches no module; such keys are reported here.)
  * diffusers/transformers/peft log records and Python warnings raised while loading that mention
    unexpected, unused or missing keys are kept.
RESULT.json: file_modules, adapted_modules (modules holding the adapter), leftover_keys,
load_warnings, {unet,text}_max_rel_diff = max|lora - merged| / max|merged| and
{unet,text}_change = max|lora - base| / max|base| (0 for a part the file has no modules for), and
kohya_sshs_model_hash: the web UIs' hash as kohya computes it before saving
(train_util.precalculate_safetensors_hashes: the file's tensors and its ss_* metadata serialised by
safetensors, sha256 of everything after the header).
Exits non-zero with a message if the file is malformed or load_lora_weights raises.
"""
import argparse
import copy
import hashlib
import json
import logging
import re
import sys
import warnings

import torch
from diffusers import PNDMScheduler, StableDiffusionPipeline
from peft.tuners.tuners_utils import BaseTunerLayer
from safetensors import safe_open
from safetensors.torch import load_file, save

ADAPTER = "lorapipe_check"
PARTS = ("lora_down.weight", "lora_up.weight", "alpha")
KEY_PROBLEM = re.compile(r"unexpected keys|missing keys|unused|not found in|not been correctly renamed", re.IGNORECASE)


def fail(message):
    sys.exit(f"diffusers_lora_check: {message}")


def read_lora(path):
    """{kohya name: {part: fp32 tensor}}, every name carrying exactly down, up and alpha."""
    groups = {}
    for key, tensor in load_file(path).items():
        name, _, part = key.partition(".")
        if part not in PARTS or not name.startswith(("lora_unet_", "lora_te_")):
            fail(f"{path}: unexpected key {key!r}")
        groups.setdefault(name, {})[part] = tensor.float()
    for name, parts in groups.items():
        if set(parts) != set(PARTS) or parts["alpha"].numel() != 1:
            fail(f"{path}: {name} has {sorted(parts)} (alpha must hold one value), needs {list(PARTS)}")
    return groups


def module_paths(model, prefix, groups):
    """{kohya name: module path in `model`} for the file's modules with this prefix."""
    paths = {}
    for path, module in model.named_modules():
        if isinstance(module, (torch.nn.Linear, torch.nn.Conv2d)):
            paths.setdefault(prefix + path.replace(".", "_"), []).append(path)
    found = {}
    for name in (n for n in groups if n.startswith(prefix)):
        if len(paths.get(name, [])) != 1:
            fail(f"LoRA module {name} matches {paths.get(name, [])} in the model, needs exactly one")
        found[name] = paths[name][0]
    return found


def text_and_unet(text_encoder, unet, input_ids, latents, timesteps, condition=None):
    with torch.no_grad():
        text = text_encoder(input_ids).last_hidden_state
        return text, unet(latents, timesteps, text if condition is None else condition).sample


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages = []

    def emit(self, record):
        self.messages.append(f"{record.name}: {record.getMessage()}")


def kohya_model_hash(path):
    with safe_open(path, framework="pt") as f:
        metadata = {k: v for k, v in (f.metadata() or {}).items() if k.startswith("ss_")}
    serialised = save(load_file(path), metadata)
    header = int.from_bytes(serialised[:8], "little")
    return hashlib.sha256(serialised[8 + header:]).hexdigest()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag in ("--model", "--lora", "--out"):
        parser.add_argument(flag, required=True)
    args = parser.parse_args()
    torch.manual_seed(0)
    groups = read_lora(args.lora)
    pipe = StableDiffusionPipeline.from_pretrained(
        args.model, torch_dtype=torch.float32, scheduler=PNDMScheduler(steps_offset=1), safety_checker=None,
        feature_extractor=None, requires_safety_checker=False).to("cpu")
    parts = {"text": (pipe.text_encoder, module_paths(pipe.text_encoder, "lora_te_", groups)),
             "unet": (pipe.unet, module_paths(pipe.unet, "lora_unet_", groups))}

    input_ids = pipe.tokenizer(["a red circle", "square"], padding="max_length", max_length=77,
                               truncation=True, return_tensors="pt").input_ids
    latents = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    timesteps = torch.tensor([10, 500])
    base_text, base_unet = text_and_unet(pipe.text_encoder, pipe.unet, input_ids, latents, timesteps)
    fresh = {key: copy.deepcopy(model) for key, (model, _) in parts.items()}

    records = Records()
    loggers = [logging.getLogger(name) for name in ("diffusers", "transformers", "peft")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.addHandler(records)
        logger.setLevel(logging.INFO)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pipe.load_lora_weights(args.lora, adapter_name=ADAPTER)
    except Exception as error:  # noqa: BLE001 - any failure to load is the finding
        fail(f"load_lora_weights raised {type(error).__name__}: {error}")
    finally:
        for logger, level in zip(loggers, levels):
            logger.removeHandler(records)
            logger.setLevel(level)
    messages = records.messages + [f"{w.category.__name__}: {w.message}" for w in caught]
    lora_text, lora_unet = text_and_unet(pipe.text_encoder, pipe.unet, input_ids, latents, timesteps, base_text)

    leftover, adapted = [], 0
    for key, (model, paths) in parts.items():
        adapted += sum(isinstance(m, BaseTunerLayer) and ADAPTER in m.lora_A for m in model.modules())
        for name, path in paths.items():
            down, up, alpha = (groups[name][part] for part in PARTS)
            scale = alpha.item() / down.shape[0]
            weight = fresh[key].get_submodule(path).weight
            with torch.no_grad():
                weight += (up.flatten(1) @ down.flatten(1) * scale).reshape(weight.shape)
            layer = model.get_submodule(path)
            if not (isinstance(layer, BaseTunerLayer) and ADAPTER in layer.lora_A):
                leftover += [f"{name}.{part}" for part in PARTS]
                continue
            loaded = (layer.lora_A[ADAPTER].weight, layer.lora_B[ADAPTER].weight)
            ok = [got.shape == want.shape and torch.equal(got.float(), want) for got, want in zip(loaded, (down, up))]
            ok.append(abs(layer.scaling[ADAPTER] - scale) <= 1e-6 * abs(scale))
            leftover += [f"{name}.{part}" for part, good in zip(PARTS, ok) if not good]
    merged_text, merged_unet = text_and_unet(fresh["text"], fresh["unet"], input_ids, latents, timesteps, base_text)

    result = {
        "file_modules": len(groups), "adapted_modules": adapted, "leftover_keys": sorted(leftover),
        "load_warnings": [m for m in messages if KEY_PROBLEM.search(m)],
        "unet_max_rel_diff": rel(lora_unet, merged_unet), "text_max_rel_diff": rel(lora_text, merged_text),
        "unet_change": rel(lora_unet, base_unet), "text_change": rel(lora_text, base_text),
        "kohya_sshs_model_hash": kohya_model_hash(args.lora),
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
