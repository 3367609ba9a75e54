#!/usr/bin/env python3
"""One optimizer step on one tensor of N parameters: lorapipe's AdamW8bit (kernels/adamw8bit.h)
against torch.optim.AdamW and bitsandbytes' AdamW8bit, on the same machine in the same run.

    $LORAPIPE_PYTHON bench/adamw8bit_bench.py [--build build] [--sizes 10M,100M,1B] [--rounds N]
        [--steps S] [--device cpu|cuda] [--dtype fp32|bf16] [--threads T]

Each side runs in its own process (so a 1B-parameter run of one side never shares memory with
another's), S timed steps after one warm-up, and reports its median; the sides' order rotates
every round, and the ratio printed is the median over rounds of lorapipe / reference (below 1:
lorapipe is faster). On the CPU the references are torch's AdamW (foreach, the default) and
bitsandbytes' CPU AdamW8bit; on CUDA, torch's fused AdamW and bitsandbytes' CUDA AdamW8bit where
it is installed. Also printed: each side's optimizer state in bytes per parameter, and on CUDA the
memory-bandwidth bound (the bytes one step must move over the device's measured copy bandwidth)
and how far lorapipe's kernel is from it, and --paged's device memory against the plain state.
Gradients are fp32 N(0, 0.01), parameters N(0, 0.1), lr 1e-3, weight decay 0.01.
"""
import argparse
import os
import statistics
import subprocess
import sys

WORKER = r'''
import sys, time, warnings
warnings.filterwarnings("ignore")
import torch
side, n, steps, device, dtype, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), \
    sys.argv[4], sys.argv[5], int(sys.argv[6])
if threads > 0:
    torch.set_num_threads(threads)
dt = torch.bfloat16 if dtype == "bf16" else torch.float32
p = torch.nn.Parameter((torch.randn(n, device=device) * 0.1).to(dt))
p.grad = (torch.randn(n, device=device) * 0.01).to(dt)
if side == "torch":
    opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=0.01, fused=(device == "cuda"))
else:
    import bitsandbytes as bnb
    opt = bnb.optim.AdamW8bit([p], lr=1e-3, weight_decay=0.01)
def sync():
    if device == "cuda":
        torch.cuda.synchronize()
times = []
for step in range(steps + 1):
    sync()
    start = time.perf_counter()
    opt.step()
    sync()
    if step > 0:
        times.append((time.perf_counter() - start) * 1e3)
state = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
            if torch.is_tensor(t) and t.numel() > 1 and t.data_ptr() != 0
            and not (t.numel() == 256 and t.dtype == torch.float32))  # the shared code maps
times.sort()
print(f"{side} {times[len(times) // 2]:.3f} {state}", flush=True)
'''


def parse_size(text):
    scale = {"K": 10**3, "M": 10**6, "B": 10**9}
    return int(float(text[:-1]) * scale[text[-1]]) if text[-1] in scale else int(text)


def run(command):
    """The command's output lines, or None (with a note) when it failed: a side that runs out of
    memory at 1B parameters is reported, and the others still run."""
    # Not from the checkout: its kernels/ folder would shadow the `kernels` package bitsandbytes
    # looks for.
    out = subprocess.run(command, capture_output=True, text=True, cwd="/tmp")
    if out.returncode != 0:
        reason = "killed (out of memory?)" if out.returncode < 0 else f"exit {out.returncode}"
        tail = [line for line in out.stderr.splitlines() if "kernels-community" not in line][-3:]
        side = "ours" if command[0] != sys.executable else command[3]
        print(f"  {side} failed: {reason} {' | '.join(tail)}", flush=True)
        return None
    return out.stdout.split("\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--build", default="build")
    ap.add_argument("--sizes", default="10M,100M,1B")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    binary = os.path.abspath(os.path.join(args.build, "bin", "adamw8bit_bench"))
    references = ["torch"]
    probe = subprocess.run([sys.executable, "-c", "import bitsandbytes"], capture_output=True)
    if probe.returncode == 0:
        references.append("bnb")
    else:
        print("bitsandbytes is not installed here: comparing with torch's AdamW only")
    print(f"device {args.device}, {args.dtype} parameters, {args.steps} steps per round, "
          f"{args.rounds} rounds; references: {', '.join(references)}")
    for size_text in args.sizes.split(","):
        n = parse_size(size_text)
        ms = {side: [] for side in ["ours"] + references}
        state = {}
        extra = {}
        sides = ["ours"] + references
        for r in range(args.rounds):
            order = sides[r % len(sides):] + sides[:r % len(sides)]
            for side in order:
                if side == "ours":
                    cmd = [binary, str(n), str(args.steps), "--device", args.device, "--dtype",
                           args.dtype, "--threads", str(args.threads)]
                else:
                    cmd = [sys.executable, "-c", WORKER, side, str(n), str(args.steps),
                           args.device, args.dtype, str(args.threads)]
                for line in run(cmd) or []:
                    words = line.split()
                    if len(words) >= 3 and words[0] == side:
                        ms[side].append(float(words[1]))
                        state[side] = int(words[2])
                        if side == "ours" and len(words) >= 4:
                            extra["moved"] = int(words[3])
                    elif len(words) == 2:
                        extra[words[0]] = float(words[1])
        if not ms["ours"]:
            print(f"{size_text}: lorapipe's side failed", flush=True)
            continue
        line = f"{size_text}: ours {statistics.median(ms['ours']):.2f} ms ({state['ours'] / n:.3f} B/param)"
        for ref in references:
            if not ms[ref]:
                line += f"; {ref} failed"
                continue
            ratios = [a / b for a, b in zip(ms["ours"], ms[ref])]
            line += (f"; {ref} {statistics.median(ms[ref]):.2f} ms ({state[ref] / n:.3f} B/param), "
                     f"ours/{ref} {statistics.median(ratios):.2f}x [{min(ratios):.2f}-{max(ratios):.2f}]")
        print(line, flush=True)
        if args.device.startswith("cuda") and "copy_gbps" in extra:
            bound_ms = extra["moved"] / (extra["copy_gbps"] * 1e9) * 1e3
            print(f"{size_text}: bandwidth bound {bound_ms:.3f} ms ({extra['moved'] / n:.1f} bytes "
                  f"per parameter at the measured copy bandwidth {extra['copy_gbps']:.0f} GB/s); "
                  f"ours is {statistics.median(ms['ours']) / bound_ms:.2f}x the bound", flush=True)
            paged = {}
            for flag in ([], ["--paged"]):
                for line_out in run([binary, str(n), str(args.steps), "--device", args.device,
                                     "--dtype", args.dtype] + flag) or []:
                    words = line_out.split()
                    if words and words[0] == "state_device_mib":
                        paged[bool(flag)] = float(words[1])
            print(f"{size_text}: device memory taken by the state: plain {paged.get(False, -1):.1f} "
                  f"MiB, paged {paged.get(True, -1):.1f} MiB (managed memory, evictable to the host)",
                  flush=True)


if __name__ == "__main__":
    main()
