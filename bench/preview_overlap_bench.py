#!/usr/bin/env python3
"""What previews rendered beside the training cost the training, measured on the CPU.

Issue 33's goal for previews on the training card: the trainer's step time while the sampler
renders stays within 10% of its time without. On a GPU the sampler attaches the trainer's
weights over CUDA IPC and takes a tenth of the device's time (--device_share); on the CPU
`lorapipe run --device=cpu` runs both mapping the model file (--map_weights), and --shared runs
the GPU's machinery here (both on "auto": the trainer's published weights in shared memory, the
sampler's renders at its default share of 1 on the CPU). This measures those cases:
the demo run (built-in tiny SD1.5, the demo dataset) trained with no previews during training,
and again with a preview every 2 steps, so the sampler renders all the time the trainer trains
(it always takes the newest checkpoint). Each stage gets one thread (--threads=1
--sampler_threads=1: a core each on a 2-core machine, as a card's compute would be shared by
streams). Runs alternate, in pairs, so the machine's drift falls on both sides alike.

The figure: the median of the trainer's own seconds per step (its TrainProgress events in
events.jsonl), over the steps after the first --skip, with previews over without, per pair and
the median over pairs; and how many previews were rendered while the trainer trained.

    bench/preview_overlap_bench.py [--bin build/bin] [--pairs 3] [--steps 60] [--skip 5] [--shared]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile


def run(binary, out, steps, previews, shared):
    cmd = [os.path.join(binary, "lorapipe"), "run", f"--output={out}", f"--max_train_steps={steps}",
           "--threads=1", "--sampler_threads=1", "--save_every_n_steps=0",
           f"--sample_every_n_steps={2 if previews else 0}"]
    if shared:
        # Both on "auto" (the CPU here): the sampler attaches the trainer's published weights, the
        # machinery of previews on the training GPU.
        cmd += ["--device=auto", "--sampler_device=auto"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{' '.join(cmd)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
    steps_s, trained_until, rendered = {}, None, []
    with open(os.path.join(out, "events.jsonl")) as events:
        for line in events:
            e = json.loads(line)
            if e.get("event") == "TrainProgress" and "seconds_per_step" in e:
                steps_s[int(e.get("step", 0))] = float(e["seconds_per_step"])
            elif e.get("event") == "SampleReady":
                rendered.append(int(e.get("step", 0)))
    trained_until = max(steps_s) if steps_s else 0
    during = sum(1 for s in rendered if s < trained_until)
    return steps_s, during


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--bin", default="build/bin")
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--skip", type=int, default=5)
    p.add_argument("--shared", action="store_true",
                   help="the sampler over the trainer's published weights (--share_weights) "
                        "instead of the file's mapped pages")
    a = p.parse_args()
    ratios = []
    print("| pair | s/step without previews | s/step with previews | ratio | previews rendered "
          "during training |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="lorapipe-preview-bench-") as tmp:
        for pair in range(a.pairs):
            medians = {}
            for previews in ((False, True) if pair % 2 == 0 else (True, False)):
                out = os.path.join(tmp, f"{pair}-{'with' if previews else 'without'}")
                steps_s, during = run(a.bin, out, a.steps, previews, a.shared)
                kept = [s for step, s in sorted(steps_s.items()) if step > a.skip]
                if not kept:
                    sys.exit(f"no step times past step {a.skip} in {out}/events.jsonl")
                medians[previews] = (statistics.median(kept), during)
            ratio = medians[True][0] / medians[False][0]
            ratios.append(ratio)
            print(f"| {pair + 1} | {medians[False][0]:.4f} | {medians[True][0]:.4f} | "
                  f"{ratio:.3f} | {medians[True][1]} |", flush=True)
    print(f"\nmedian ratio over {a.pairs} pairs: {statistics.median(ratios):.3f} "
          f"(goal on a GPU: at most 1.10)")


if __name__ == "__main__":
    main()
