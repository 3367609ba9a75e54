#!/usr/bin/env python3
"""Calibrates `lorapipe plan`'s memory and FLOPs model against real training steps, and measures
its accuracy on settings the fit never saw.

The plan predicts a step's peak allocated memory as analytic parts (weights by storage dtype,
float8 and its scales, LoRA, gradients, optimizer state, block swap's host share and slots, the
allocator's rounding: `lorapipe plan --explain` prints them) plus the activations, which depend on
how each family's kernels keep their tensors: a least-squares fit, per family and per gradient
checkpointing, of

    activations = a0 + a1 B T + a2 B T^2 + a3 B T n + a4 B T^2 n

(B the batch, T the tokens the denoiser attends over -- latent pixels for the U-Nets, packed image
plus text tokens for FLUX.1 -- and n its transformer blocks; the U-Nets' n is fixed, so their
fit uses a0..a2) to the measured peak less the analytic parts. The FLOPs of a step are fitted
the same way (with the batch B in place of the constant) to trainer_bench's analytic counts
(models::unet_forward_flops, flux_forward_flops). Under float8 one layer's weight is widened at a time; the share of the
largest widened copy that is alive at the peak depends on where each family's peak falls, and is
fitted per family from float8 steps.

Each point is `trainer_bench solo` on the CPU: the family's real architecture at full size (FLUX.1
at full width and reduced depth: D double and 2D single blocks), fp32 base (this CPU has
no bf16 matrix units: the plan scales the activations to the run's dtype), LoRA rank 16, one
timed step after one warm-up at 64 px (the optimizer's state and the LoRA's gradients it leaves
are the same at any size: the peaks equal those after warm-ups at the measured size, to the MiB);
its peak is every tensor's storage alive at once over that step,
the counterpart of CUDA's max_memory_allocated. `--write_structure` gives the plan the same
model's header.

    bench/plan_calibrate.py [--bench build/bin/trainer_bench] [--lorapipe build/bin/lorapipe]
                            [--families sd15,sdxl,flux] [--write deploy/plan_calibration.json]

It writes the calibration (rebuild the launcher to embed it) and prints the accuracy table: every
point, fitted and held out, predicted against measured, and the worst error.

    bench/plan_calibrate.py --preview [--sampler_bench build/bin/sampler_bench]

calibrates the previews' share of a training card instead (the calibration's "preview", the rest
kept): `sampler_bench solo` renders one image (one step, CFG) on each family's full-size model on
the CPU in fp32 and prints what a sampler over the trainer's shared U-Net holds beside it -- its
text encoders, VAE and the render's peak working memory, every tensor counted. The encoders and
VAE are kept as measured; the render is fitted as r0 + r1 P + r2 P^2 over the preview's pixels P
(measured: linear, the VAE decode's full-resolution convolutions), and the held-out sizes are
printed predicted against measured.
"""
import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import numpy as np

# family: trainer_bench size, checkpointing modes fitted, fit grid (resolution, batch, depth);
# float8 steps that fit the share of the largest upcast copy alive at the peak (resolution, batch,
# depth, checkpointing, trainer flags); held-out settings in the same form, which no fit sees:
# other resolutions, batches and depths, float8, block swap.
FAMILIES = {
    "sd15": ("full", (True, False),
             [(256, 1, 0), (256, 2, 0), (320, 1, 0), (320, 2, 0), (384, 1, 0), (384, 2, 0)],
             [(256, 1, 0, True, ["--fp8_base", "--fp8_scaled"]),
              (384, 2, 0, True, ["--fp8_base"]),
              (256, 1, 0, False, ["--fp8_base", "--fp8_scaled"])],
             [(288, 3, 0, True, ["--fp8_base", "--fp8_scaled"]),
              (288, 3, 0, True, ["--fp8_base"])]),
    "sdxl": ("sdxl", (True, False),
             [(256, 1, 0), (256, 2, 0), (320, 1, 0)],
             [(320, 2, 0, True, ["--fp8_base"])],
             [(256, 1, 0, True, ["--fp8_base", "--fp8_scaled"]), (288, 1, 0, False, [])]),
    "flux": ("flux", (True, False),
             [(r, b, d) for d in (1, 2) for r, b in ((256, 1), (256, 2), (320, 1))],
             [(256, 1, 1, True, ["--fp8_base"])],
             [(384, 1, 1, True, []), (320, 1, 1, True, ["--fp8_base", "--fp8_scaled"]),
              (288, 1, 1, False, [])]),
}
# Without checkpointing, fewer points: the fit is the same form.
NO_CHECKPOINTING_GRID = {"sd15": [(256, 1, 0), (256, 2, 0), (320, 1, 0), (384, 1, 0)],
                         "sdxl": [(256, 1, 0), (256, 2, 0), (320, 1, 0), (384, 1, 0)]}
FEATURES = {"sd15": 3, "sdxl": 3, "flux": 5}

LINE = re.compile(r"peak allocated ([0-9.]+) MiB")
FLOPS = re.compile(r"step flops ([0-9.e+]+)")


def fit(X, y):
    """Least squares with every coefficient but the constant held at zero or above (an active
    set: a negative one leaves the fit and it is refitted), so that no prediction falls as the
    batch or the resolution grows past the points measured."""
    active = list(range(X.shape[1]))
    while True:
        c, *_ = np.linalg.lstsq(X[:, active], y, rcond=None)
        negative = [j for j, v in zip(active, c) if v < 0 and j != 0]
        if not negative:
            full = np.zeros(X.shape[1])
            full[active] = c
            return full
        active.remove(min(negative, key=lambda j: c[active.index(j)]))


MEASURED = {}  # the cache: one line per step measured, reused by a later run of the same command


def measure(a, family, res, batch, depth, ckpt, extra, folder):
    key = json.dumps([family, res, batch, depth, ckpt, extra])
    if key in MEASURED:
        m = MEASURED[key]
        if m["structure"] is None:
            m["structure"] = write_structure(a, family, depth, folder)
        return m["structure"], m["peak"], m["flops"]
    structure, peak, flops = measure_now(a, family, res, batch, depth, ckpt, extra, folder)
    MEASURED[key] = {"structure": structure, "peak": peak, "flops": flops}
    with open(a.measurements, "a") as f:
        f.write(json.dumps({"key": key, "peak": peak, "flops": flops}) + "\n")
    return structure, peak, flops


STRUCTURES = {}


def write_structure(a, family, depth, folder):
    if folder not in STRUCTURES:
        cmd = [a.bench, "solo", FAMILIES[family][0], "--dtype", "fp32", "--steps", "0",
               "--write_structure", folder] + (["--depth", str(depth)] if depth else [])
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
        STRUCTURES[folder] = next(l.split(" ", 1)[1] for l in out.stdout.splitlines()
                                  if l.startswith("structure "))
    return STRUCTURES[folder]


def measure_now(a, family, res, batch, depth, ckpt, extra, folder):
    size = FAMILIES[family][0]
    cmd = [a.bench, "solo", size, "--device", "cpu", "--dtype", "fp32", "--batch", str(batch),
           "--resolution", str(res), "--steps", "1", "--warmup", "1", "--warmup_resolution", "64",
           "--write_structure", folder, *extra]
    if depth:
        cmd += ["--depth", str(depth)]
    if ckpt:
        cmd.append("--gradient_checkpointing")
    started = time.time()
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{out.stderr}")
    lines = out.stdout.strip().splitlines()
    structure = next(l.split(" ", 1)[1] for l in lines if l.startswith("structure "))
    peak = float(LINE.search(lines[-1]).group(1)) * 2**20
    flops = float(FLOPS.search(lines[-1]).group(1))
    print(f"  {family} {res} b{batch} d{depth} {'ckpt' if ckpt else 'no ckpt'} {' '.join(extra)}: "
          f"{peak / 2**30:.3f} GiB ({time.time() - started:.0f} s)", file=sys.stderr, flush=True)
    return structure, peak, flops


def explain(a, structure, res, batch, ckpt, extra):
    # The structure folder holds the denoiser alone: the family is named, not detected.
    family = "sdxl" if structure.rstrip("/").endswith("sdxl-0") else None
    cmd = [a.lorapipe, "plan", "--explain", f"--model={structure}", f"--resolutions={res}",
           *([f"--model_family={family}"] if family else []),
           f"--train_batch_size={batch}", "--network_dim=16", "--mixed_precision=no"]
    flags = list(extra)
    if "--optimizer_type" in flags:
        i = flags.index("--optimizer_type")
        cmd.append(f"--optimizer_type={flags[i + 1]}")
        del flags[i:i + 2]
    if "--blocks_to_swap" in flags:
        i = flags.index("--blocks_to_swap")
        cmd.append(f"--blocks_to_swap={flags[i + 1]}")
        del flags[i:i + 2]
    cmd += flags
    if ckpt:
        cmd.append("--gradient_checkpointing")
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{out.stderr}{out.stdout}")
    return json.loads(out.stdout)


def static_bytes(e):
    """The analytic parts less float8's upcast copy, whose share is fitted."""
    return e["weights"] + e["lora"] + e["optimizer"] + e["rounding"]


def mode_key(ckpt):
    return "checkpointing" if ckpt else "no_checkpointing"


def activations(fitted, r):
    coeff = np.array(fitted[mode_key(r["ckpt"])]["activations"])
    return max(0.0, float(np.dot(coeff, r["e"]["features"])))


def step(a, tmp, family, res, batch, depth, ckpt, extra):
    """One measured step and the plan's explanation of the same setting."""
    folder = os.path.join(tmp, f"{family}-{depth}")
    structure, peak, flops = measure(a, family, res, batch, depth, ckpt, extra, folder)
    return {"res": res, "batch": batch, "depth": depth, "ckpt": ckpt, "extra": extra,
            "e": explain(a, structure, res, batch, ckpt, extra), "peak": peak, "flops": flops}


# The FLOPs of a step, counted (trainer_bench solo --steps 0 prints them without a step) over
# sizes from the smallest to the largest the plan weighs, and for FLUX.1 depths: the counts are
# exactly of the form B, B T, B T^2 (B T n, B T^2 n), so the fit reproduces them wherever the
# plan looks (fitted to the memory grid's few small sizes instead, with batch scaling out of it,
# SDXL's T^2 term went negative and its predicted FLOPs to nothing past 900 px).
FLOPS_GRID = {"sd15": [(r, 0) for r in (256, 512, 768, 1024)],
              "sdxl": [(r, 0) for r in (256, 512, 768, 1024)],
              "flux": [(r, d) for r in (256, 512, 1024) for d in (1, 2, 3)]}
FLOPS_FITTED = {}


def flops_fit(a, tmp, family):
    if family in FLOPS_FITTED:
        return FLOPS_FITTED[family]
    k = FEATURES[family]
    X, y = [], []
    for res, depth in FLOPS_GRID[family]:
        cmd = [a.bench, "solo", FAMILIES[family][0], "--dtype", "bf16", "--steps", "0",
               "--resolution", str(res)] + (["--depth", str(depth)] if depth else [])
        out = subprocess.run(cmd, capture_output=True, text=True)
        m = FLOPS.search(out.stdout)
        if out.returncode != 0 or not m:
            sys.exit(f"{' '.join(cmd)} failed:\n{out.stderr}{out.stdout}")
        structure = write_structure(a, family, depth, os.path.join(tmp, f"{family}-{depth}"))
        X.append(explain(a, structure, res, 1, True, [])["flops_features"][:k])
        y.append(float(m.group(1)))
    coefficients = fit(np.array(X), np.array(y))
    worst = max(abs(float(np.dot(coefficients, x)) / v - 1) for x, v in zip(X, y))
    print(f"  {family} FLOPs fitted over {len(y)} counts: worst {100 * worst:.3f}%",
          file=sys.stderr, flush=True)
    FLOPS_FITTED[family] = [float(v) for v in coefficients] + [0.0] * (5 - k)
    return FLOPS_FITTED[family]


def point_of(family, r, which, fitted):
    predicted = (static_bytes(r["e"]) + activations(fitted, r) +
                 fitted["float8_share"] * r["e"].get("float8_copy", 0.0))
    return {"family": family, "resolution": r["res"], "batch": r["batch"], "depth": r["depth"],
            "checkpointing": r["ckpt"], "options": r["extra"], "set": which,
            "measured_bytes": r["peak"], "predicted_bytes": predicted}


# family: preview sizes fitted, held out (sampler_bench solo at 1 step, 1 image). SDXL's U-Net
# is built for each (3.3 B parameters in fp32 on the CPU): fewer points.
PREVIEWS = {"sd15": ([256, 384, 512], [448]), "sdxl": ([256, 384], [320])}
SHARE = re.compile(r"preview share ([0-9.]+) MiB: text encoders ([0-9.]+) MiB, VAE ([0-9.]+) MiB, "
                   r"LoRA and the rest ([0-9.]+) MiB, render ([0-9.]+) MiB")


def measure_preview(a, family, res, extra=()):
    cmd = [a.sampler_bench, "solo", "--family", family, "--device", "cpu", "--dtype", "fp32",
           "--resolution", str(res), "--steps", "1", "--images", "1", *extra]
    started = time.time()
    out = subprocess.run(cmd, capture_output=True, text=True)
    m = SHARE.search(out.stdout)
    if out.returncode != 0 or not m:
        sys.exit(f"{' '.join(cmd)} failed:\n{out.stderr}{out.stdout}")
    share, text, vae, _, render = (float(v) * 2**20 for v in m.groups())
    print(f"  preview {family} {res}x{res}: share {share / 2**30:.3f} GiB, render "
          f"{render / 2**30:.3f} GiB ({time.time() - started:.0f} s)", file=sys.stderr, flush=True)
    return {"share": share, "text": text, "vae": vae, "render": render}


def calibrate_previews(a, calibration):
    previews, table = {}, []
    for family, (fit_sizes, held_out) in PREVIEWS.items():
        fitted = {r: measure_preview(a, family, r) for r in fit_sizes}
        X = np.array([[1, r * r, (r * r) ** 2] for r in fit_sizes], dtype=float)
        render = fit(X, np.array([fitted[r]["render"] for r in fit_sizes]))
        first = fitted[fit_sizes[0]]
        # --fp8_base: the encoders' Linear weights in float8 (1 byte), the rest in fp32 (4): the
        # count of the float8 ones from the two totals.
        float8 = measure_preview(a, family, fit_sizes[0], ["--fp8_base"])
        previews[family] = {"text_encoder_bytes": first["text"], "vae_bytes": first["vae"],
                            "text_encoder_float8_params": (first["text"] - float8["text"]) / 3,
                            "render": [float(v) for v in render], "dtype_bytes": 4}
        for r, which in [(r, "fit") for r in fit_sizes] + [(r, "held out") for r in held_out]:
            m = fitted.get(r) or measure_preview(a, family, r)
            predicted = first["text"] + first["vae"] + float(np.dot(render, [1, r * r, (r * r) ** 2]))
            table.append((family, r, which, m["share"], predicted))
    calibration["preview"] = previews
    print("| family | preview | set | measured GiB | predicted GiB | error |")
    print("|---|---|---|---|---|---|")
    for family, r, which, measured, predicted in table:
        print(f"| {family} | {r}x{r} | {which} | {measured / 2**30:.3f} | {predicted / 2**30:.3f} | "
              f"{100 * (predicted / measured - 1):+.1f}% |")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--preview", action="store_true",
                   help="calibrate the previews' share of the card (sampler_bench) instead")
    p.add_argument("--sampler_bench", default="build/bin/sampler_bench")
    p.add_argument("--bench", default="build/bin/trainer_bench")
    p.add_argument("--lorapipe", default="build/bin/lorapipe")
    p.add_argument("--families", default="sd15,sdxl,flux")
    p.add_argument("--write", default="deploy/plan_calibration.json")
    p.add_argument("--measurements", default="bench/results/plan_measurements.jsonl",
                   help="the steps measured (reused: delete it to measure again)")
    a = p.parse_args()
    if os.path.exists(a.measurements):
        with open(a.measurements) as f:
            for line in f:
                m = json.loads(line)
                MEASURED[m["key"]] = {"peak": m["peak"], "flops": m["flops"], "structure": None}
    with open(a.write) as f:
        calibration = json.load(f)
    if a.preview:
        calibrate_previews(a, calibration)
        with open(a.write, "w") as f:
            json.dump(calibration, f, indent=1)
            f.write("\n")
        return
    calibration.setdefault("families", {})
    points = [pt for pt in calibration.get("points", [])
              if pt["family"] not in a.families.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        for family in a.families.split(","):
            _, modes, fit_grid, float8_grid, held_out = FAMILIES[family]
            k = FEATURES[family]
            fitted, rows = {}, []
            for ckpt in modes:
                grid = fit_grid if ckpt else NO_CHECKPOINTING_GRID.get(family, fit_grid)
                mode_rows = [step(a, tmp, family, res, batch, depth, ckpt, [])
                             for res, batch, depth in grid]
                X = np.array([r["e"]["features"][:k] for r in mode_rows])
                y = np.array([r["peak"] - static_bytes(r["e"]) for r in mode_rows])
                act = fit(X, y)
                fitted[mode_key(ckpt)] = {"activations": [float(v) for v in act] + [0.0] * (5 - k),
                                          "flops": flops_fit(a, tmp, family)}
                rows += mode_rows
            # The float8 share: what the float8 steps hold beyond their weights and activations,
            # as a share of the largest widened copy (least squares, within [0, 1]).
            float8_rows = [step(a, tmp, family, *point) for point in float8_grid]
            residual = np.array([r["peak"] - static_bytes(r["e"]) - activations(fitted, r)
                                 for r in float8_rows])
            copies = np.array([r["e"]["float8_copy"] for r in float8_rows])
            share = float(np.clip(residual @ copies / (copies @ copies), 0, 1)) if len(copies) else 1
            fitted["float8_share"] = share
            rows += float8_rows
            for r in rows:
                points.append(point_of(family, r, "fit", fitted))
            for point in held_out:
                points.append(point_of(family, step(a, tmp, family, *point), "held out", fitted))
            calibration["families"][family] = fitted
    calibration["dtype_bytes"] = 4
    calibration["generated_by"] = ("bench/plan_calibrate.py on " + os.uname().nodename + ", " +
                                   datetime.date.today().isoformat() +
                                   ": trainer_bench solo on the CPU, fp32 base, LoRA rank 16")
    calibration["points"] = points
    with open(a.write, "w") as f:
        json.dump(calibration, f, indent=1)
        f.write("\n")
    print("| family | resolution | batch | depth | checkpointing | options | set | measured GiB "
          "| predicted GiB | error |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    worst = 0
    for pt in points:
        err = pt["predicted_bytes"] / pt["measured_bytes"] - 1
        worst = max(worst, abs(err))
        print(f"| {pt['family']} | {pt['resolution']} | {pt['batch']} | {pt['depth'] or 'full'} | "
              f"{'yes' if pt['checkpointing'] else 'no'} | {' '.join(pt['options']) or '-'} | "
              f"{pt['set']} | {pt['measured_bytes'] / 2**30:.3f} | "
              f"{pt['predicted_bytes'] / 2**30:.3f} | {100 * err:+.1f}% |")
    print(f"\nworst error {100 * worst:.1f}% over {len(points)} points")


if __name__ == "__main__":
    main()
