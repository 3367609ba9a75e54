#!/usr/bin/env python3
"""What each small-card option saves, family by family, measured on one machine in one run.

Runs `trainer_bench solo` (one LoRA training step as the trainer runs it: rank 16, AdamW, bf16
base, gradient checkpointing, batch 1) for each family at full size -- FLUX.1 at full width and
reduced depth (--depth, D double and 2D single blocks), since no CPU here holds its 24 GB -- with
and without each option, and prints a markdown table: seconds per step and its ratio to the
family's run without options, the peak of allocated tensor memory over the timed step (on the CPU
every tensor's storage, the counterpart of CUDA's max_memory_allocated; block swap's host copies
are outside it, as host memory is outside a GPU's allocator), the bytes the option saved against
that run, and the option's own analytic figure (float8: the weights' bytes before less after,
scales included; block swap: the swapped weights less the ring's two slots).

    bench/small_card_bench.py [--bench build/bin/trainer_bench] [--device cpu] [--quick]

--quick runs SD1.5 alone. On the CPU --cpu_offload_checkpointing saves nothing by construction
(the "host" is the device), so it is measured on CUDA only (tests/gpu/run.sh).
"""
import argparse
import re
import subprocess
import sys
import time

FAMILIES = [
    # name, trainer_bench size and its arguments, options to compare
    ("SD1.5", ["full", "--resolution", "256"],
     [[], ["--fp8_base"], ["--fp8_base", "--fp8_scaled"], ["--blocks_to_swap", "3"],
      ["--blocks_to_swap", "6"], ["--fp8_base", "--fp8_scaled", "--blocks_to_swap", "6"]]),
    ("SDXL", ["sdxl", "--resolution", "512"],
     [[], ["--fp8_base"], ["--fp8_base", "--fp8_scaled"], ["--blocks_to_swap", "6"]]),
    ("FLUX.1 [dev], 3 double + 6 single blocks", ["flux", "--depth", "3", "--resolution", "256"],
     [[], ["--fp8_base", "--fp8_scaled"], ["--blocks_to_swap", "3"]]),
]

LINE = re.compile(r"([0-9.]+) s/it, [0-9.]+ samples/s, peak allocated ([0-9.]+) MiB")
FLOAT8 = re.compile(r"float8 analytic saving ([0-9.]+) MiB")
SWAP = re.compile(r"swap analytic saving (-?[0-9.]+) MiB")


def run(bench, device, size_args, options):
    cmd = [bench, "solo", *size_args, "--device", device, "--dtype", "bf16",
           "--gradient_checkpointing", "--steps", "1", *options]
    started = time.time()
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{out.stderr}")
    line = out.stdout.strip().splitlines()[-1]
    m = LINE.search(line)
    if not m:
        sys.exit(f"no figures in: {line}")
    analytic = sum(float(x.group(1)) for x in (FLOAT8.search(line), SWAP.search(line)) if x)
    print(f"  {' '.join(options) or 'no option'}: {line} ({time.time() - started:.0f} s)",
          file=sys.stderr)
    return float(m.group(1)), float(m.group(2)), analytic


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--bench", default="build/bin/trainer_bench")
    p.add_argument("--device", default="cpu")
    p.add_argument("--quick", action="store_true")
    a = p.parse_args()
    print(f"device {a.device}; bf16 base, LoRA rank 16 (fp32), AdamW, checkpointing, batch 1\n")
    print("| family | option | s/it | x time | peak allocated MiB | saved MiB | analytic MiB "
          "| saved / analytic |")
    print("|---|---|---|---|---|---|---|---|")
    for name, size_args, option_sets in FAMILIES[:1] if a.quick else FAMILIES:
        print(f"{name}:", file=sys.stderr)
        base = None
        for options in option_sets:
            s, peak, analytic = run(a.bench, a.device, size_args, options)
            if base is None:
                base = (s, peak)
            saved = base[1] - peak
            ratio = f"{saved / analytic:.2f}" if analytic > 0 else "-"
            print(f"| {name} ({' '.join(size_args[1:])}) | {' '.join(options) or '-'} | {s:.2f} "
                  f"| {s / base[0]:.2f} | {peak:.0f} | {saved:.0f} | {analytic:.0f} | {ratio} |",
                  flush=True)


if __name__ == "__main__":
    main()
