#!/usr/bin/env python3
"""One LoRA training step, fp32 on CPU: lorapipe's trainer::TrainingStep against diffusers + peft
on the same UNet weights and inputs, on the same machine in the same run.

    $LORAPIPE_PYTHON bench/trainer_bench.py [--build build] [--size tiny|full|sdxl] [--rounds N]
        [--dtype fp32|bf16] [--gradient_checkpointing] [--threads N] [--profile DIR]
    $LORAPIPE_PYTHON bench/trainer_bench.py --checkpointing-memory [--size full] [--rounds N]
        [--batch N]

The step, both sides: noised latents (kohya's DDPM schedule), UNet forward, l2 loss against the
noise, backward, clip_grad_norm_ 1.0, AdamW (lr 1e-4, weight decay 0.01) on a LoRA of rank 16,
alpha 16 on kohya's UNet targets (every Linear and 1x1 conv inside the Transformer2D blocks: 192
on SD1.5); the base is frozen and the text encoder is not trained (a fixed [B, 77, C] context).
--size tiny is models/tiny.h's UNet on a 16x16 latent, batch 2; --size full is SD1.5 on 64x64,
batch 1; --size sdxl is SDXL's full-size UNet on 64x64, batch 1, with its added conditions (a
pooled text embedding, and the time ids of a 512x512 image uncropped: what lorapipe's trainer
builds for such a sample) and kohya's 722 SDXL targets; its base is bf16 by default where the CPU
computes bf16 natively (AVX512-BF16 or AMX), else fp32 (--dtype; the LoRA stays fp32 on both
sides, as --mixed_precision bf16 trains). Two fp32 copies of SDXL (10 GiB of weights each) would
not fit beside each other in 24 GiB: for SDXL both sides map the one weights file's pages
(trainer_bench step --map_weights, and bench/mapped_safetensors.py), hold one copy between them,
and are paired like the rest. The UNet config comes from lorapipe (trainer_bench config), a
separate process writes random weights and the inputs with diffusers, and both sides load them.

Both sides stay up as separate processes (so each peak RSS is that side's own) and their steps
are interleaved, the order alternating every round: on a shared, noisy machine the two halves of
a pair see the same load. Round 0 warms both up, is not counted, and must give both sides the
same loss (same weights, same inputs, LoRA up = 0). Prints the median milliseconds of each side
(and of forward+backward and clip+optimizer), the median of the pairwise ratios (lorapipe /
reference: below 1 means lorapipe is faster) with their range, and each side's peak RSS over the
steps: once loaded, each side hands back what loading freed (malloc_trim; lorapipe's heap policy
would otherwise keep its copies of the weights resident) and restarts its high-water mark, so the
load's own peak, printed beside it, is left out. --checkpointing-memory runs lorapipe with and
without gradient checkpointing side by side the same way and prints the cut in the steps' peak
RSS and in peak tensor memory (every CPU tensor's storage counted as it is allocated and freed:
torch.cuda.max_memory_allocated's counterpart, the weights included, the heap's slack not).
Then it runs diffusers + peft with and without its own gradient checkpointing
(enable_gradient_checkpointing) the same way and prints that cut in peak RSS too: how far the
reference gets on the same step is the yardstick for ours. --batch sets the batch size.

Both sides use every core by default (--threads). On a machine that other processes keep busy,
OpenMP's spinning barriers make single steps many times slower, on both sides: read the range.
"""
import argparse
import os
import statistics
import subprocess
import sys
import tempfile

# Batch, latent side and default counted rounds of each --size (the UNet config is lorapipe's).
SIZES = {"tiny": {"batch": 2, "latent": 16, "rounds": 20, "dtype": "fp32"},
         "full": {"batch": 1, "latent": 64, "rounds": 3, "dtype": "fp32"},
         "sdxl": {"batch": 1, "latent": 64, "rounds": 3, "dtype": None}}  # None: by the CPU

# How far the two sides' warm-up losses may differ, relative, by base dtype: fp32 runs the same
# function to rounding (1e-4); bf16 keeps 8 bits of mantissa, so each side's own rounding of
# every activation is ~4e-3 relative and the loss, a mean of squares, differs by up to ~1e-2.
LOSS_TOLERANCE = {"fp32": 1e-4, "bf16": 1e-2}

# diffusers warns at import that CUDA is missing, once per module that asks for autocast.
QUIET = "ignore:CUDA is not available"

WRITER = r'''
import json, sys, torch
from diffusers import UNet2DConditionModel
from safetensors.torch import save_file
folder, batch, side, dtype = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
torch.manual_seed(0)
# Built in the base dtype: a full SDXL UNet in fp32 alone takes 10 GiB.
torch.set_default_dtype(torch.bfloat16 if dtype == "bf16" else torch.float32)
unet = UNet2DConditionModel.from_config(UNet2DConditionModel.load_config(folder))
torch.set_default_dtype(torch.float32)
# One diffusion_pytorch_model.safetensors beside config.json (fp32 SDXL would be sharded).
unet.save_pretrained(folder, max_shard_size="100GB")
inputs = {
    "latents": torch.randn(batch, 4, side, side),
    "noise": torch.randn(batch, 4, side, side),
    "timesteps": torch.randint(0, 1000, (batch,)),
    "context": torch.randn(batch, 77, unet.config.cross_attention_dim),
    "loss_weights": torch.ones(batch),
}
if unet.config.addition_embed_type == "text_time":  # SDXL: the pooled text embedding
    pooled = unet.config.projection_class_embeddings_input_dim - 6 * unet.config.addition_time_embed_dim
    inputs["pooled"] = torch.randn(batch, pooled)
save_file(inputs, f"{folder}/inputs.safetensors")
'''

REFERENCE = r'''
import ctypes, resource, sys, time, torch
import torch.nn.functional as F
from diffusers import DDPMScheduler, UNet2DConditionModel
from diffusers.models.transformers.transformer_2d import Transformer2DModel
from peft import LoraConfig
from safetensors import safe_open
from safetensors.torch import load_file
folder, checkpointing, threads = sys.argv[1], sys.argv[2] == "1", int(sys.argv[3])
dtype = torch.bfloat16 if sys.argv[4] == "bf16" else torch.float32
torch.set_num_threads(threads)
def status_mib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) / 1024
    return -1
def peak_rss_mib():
    hwm = status_mib("VmHWM:")
    return hwm if hwm >= 0 else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
torch.manual_seed(0)
weights = f"{folder}/diffusion_pytorch_model.safetensors"
if len(sys.argv) > 5 and sys.argv[5] == "map":
    # Built on the meta device and given the file's pages, which lorapipe's side maps too
    # (bench/mapped_safetensors.py): one copy of the weights between the two sides.
    from mapped_safetensors import load_mapped
    with torch.device("meta"):
        unet = UNet2DConditionModel.from_config(UNet2DConditionModel.load_config(folder))
    load_mapped(unet, weights)
else:
    torch.set_default_dtype(dtype)  # built in the base dtype, as lorapipe builds it
    unet = UNet2DConditionModel.from_config(UNet2DConditionModel.load_config(folder))
    torch.set_default_dtype(torch.float32)
    # One tensor at a time, so loading adds no more than one tensor to the peak RSS.
    with safe_open(weights, framework="pt") as f, torch.no_grad():
        state = unet.state_dict()
        assert set(f.keys()) == set(state), "the file and diffusers name different weights"
        for key, value in state.items():
            value.copy_(f.get_tensor(key))
unet.requires_grad_(False).train()
inputs = load_file(f"{folder}/inputs.safetensors")
latents, noise, timesteps = inputs["latents"], inputs["noise"], inputs["timesteps"]
context, loss_weights = inputs["context"].to(dtype), inputs["loss_weights"]
added = None
if "pooled" in inputs:  # SDXL: time ids of the latents' own size, uncropped, as lorapipe's default
    h, w = latents.shape[2] * 8, latents.shape[3] * 8
    time_ids = torch.tensor([[h, w, 0, 0, h, w]] * latents.shape[0], dtype=dtype)
    added = {"text_embeds": inputs["pooled"].to(dtype), "time_ids": time_ids}
# kohya's rule (networks/lora.py): every Linear and Conv2d inside a Transformer2DModel.
targets = [f"{path}.{child}" for path, module in unet.named_modules()
           if isinstance(module, Transformer2DModel)
           for child, leaf in module.named_modules()
           if isinstance(leaf, (torch.nn.Linear, torch.nn.Conv2d))]
# peft keeps the adapters in fp32 over a bf16 base (autocast_adapter_dtype), as lorapipe does.
unet.add_adapter(LoraConfig(r=16, lora_alpha=16, init_lora_weights=True, target_modules=targets))
params = [p for p in unet.parameters() if p.requires_grad]
assert len(params) == 2 * len(targets), f"{len(params)} trainable tensors, {len(targets)} targets"
if checkpointing:
    unet.enable_gradient_checkpointing()
optimizer = torch.optim.AdamW(params, lr=1e-4)
scheduler = DDPMScheduler(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012,
                          beta_schedule="scaled_linear")
def work():
    start = time.perf_counter()
    noisy = scheduler.add_noise(latents, noise, timesteps)
    pred = unet(noisy.to(dtype), timesteps, context, added_cond_kwargs=added).sample
    loss = F.mse_loss(pred.float(), noise.float(), reduction="none").mean([1, 2, 3]) * loss_weights
    loss = loss.mean()
    value = loss.item()
    loss.backward()
    middle = time.perf_counter()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return value, (middle - start) * 1e3, (time.perf_counter() - middle) * 1e3
ctypes.CDLL("libc.so.6").malloc_trim(0)  # what loading freed goes back first, as on our side
print(f"ready {peak_rss_mib():.0f} {status_mib('VmRSS:'):.0f} {len(targets)} "
      f"{sum(p.numel() for p in params)}", flush=True)
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the steps' peak from here on, not the load's
for line in sys.stdin:
    line = line.strip()
    if line == "step":
        s, c = time.perf_counter(), time.process_time()
        loss, forward_backward, update = work()
        print(f"{(time.perf_counter() - s) * 1e3:.1f} {(time.process_time() - c) * 1e3:.1f} "
              f"{loss:.6f} {forward_backward:.1f} {update:.1f}", flush=True)
    elif line.startswith("profile "):
        with torch.autograd.profiler.profile() as prof:
            work()
        prof.export_chrome_trace(line[8:])
        print("profiled", flush=True)
print(f"peak_rss {peak_rss_mib():.0f}", flush=True)
'''
# The reference imports bench/mapped_safetensors.py from beside this script.
REFERENCE = f"import sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})\n" + REFERENCE


class Side:
    """One side of the comparison: a process that answers the step protocol on stdin/stdout."""

    def __init__(self, name, command):
        self.name = name
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         text=True, bufsize=1)
        _, load_peak, loaded, self.modules, self.lora_numel = self.expect("ready").split()
        self.load_peak, self.loaded = float(load_peak), float(loaded)
        self.steps = []  # (wall, cpu, loss, forward+backward, update) of each counted step

    def expect(self, prefix):
        line = self.process.stdout.readline()
        if not line.startswith(prefix) and not (prefix == "" and line.strip()):
            sys.exit(f"{self.name}: expected '{prefix}', got {line!r} (exit {self.process.poll()})")
        return line.strip()

    def command(self, text):
        self.process.stdin.write(text + "\n")
        self.process.stdin.flush()

    def step(self):
        self.command("step")
        return tuple(float(x) for x in self.expect("").split())

    def median(self, field):
        return statistics.median(s[field] for s in self.steps)

    def finish(self):
        """The steps' peak RSS. lorapipe's side also reports its tensor memory: the most alive at
        once over the steps and what was alive before them (self.tensor_peak, self.tensor_base)."""
        self.process.stdin.close()
        fields = [float(x) for x in self.expect("peak_rss").split()[1:]]
        self.process.wait()
        if len(fields) == 3:
            self.tensor_peak, self.tensor_base = fields[1], fields[2]
        return fields[0]


def prepare(folder, binary, size, batch, dtype):
    """Writes the UNet config (lorapipe's), random weights in `dtype` and the inputs into
    `folder`."""
    config = subprocess.run([binary, "config", size], check=True, capture_output=True, text=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        f.write(config.stdout)
    subprocess.run([sys.executable, "-W", QUIET, "-c", WRITER, folder, str(batch),
                    str(SIZES[size]["latent"]), dtype], check=True)


def interleave(a, b, rounds, label, tolerance=1e-4):
    """Alternating steps of two sides, round 0 a warm-up that is not counted (first-touch
    allocation, oneDNN primitive creation, the optimizer's state). Both run the same function on
    the same weights and inputs with LoRA up = 0, so their warm-up losses must agree. Returns the
    ratio a / b of each counted round."""
    ratios = []
    for r in range(rounds + 1):
        pair = (a, b) if r % 2 == 0 else (b, a)
        took = {side.name: side.step() for side in pair}
        ta, tb = took[a.name], took[b.name]
        if r == 0:
            if abs(ta[2] - tb[2]) > tolerance * abs(tb[2]):
                sys.exit(f"first-step losses differ: {a.name} {ta[2]}, {b.name} {tb[2]}")
            continue
        a.steps.append(ta)
        b.steps.append(tb)
        ratios.append(ta[0] / tb[0])
        print(f"  {label} round {r}: {a.name} {ta[0]:.0f} ms ({ta[1]:.0f} CPU), {b.name} "
              f"{tb[0]:.0f} ms ({tb[1]:.0f} CPU), ratio {ratios[-1]:.2f}x", flush=True)
    return ratios


def native_bf16():
    """Whether this CPU computes bf16 natively (AVX512-BF16 or AMX): without, LibTorch's bf16
    convolutions fall back to a naive GEMM, many times slower than fp32."""
    with open("/proc/cpuinfo") as f:
        flags = set(f.read().split())
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def side_summary(side, rss):
    return (f"{side.name} {side.median(0):.0f} ms (forward+backward {side.median(3):.0f}, "
            f"clip+AdamW {side.median(4):.1f}), peak RSS {rss:.0f} MiB (loaded {side.loaded:.0f}, "
            f"load peak {side.load_peak:.0f})")


def compare(args, binary, threads):
    label = (f"{args.size} {args.dtype}" +
             (" checkpointing" if args.gradient_checkpointing else ""))
    checkpointing = ["--gradient_checkpointing"] if args.gradient_checkpointing else []
    # SDXL: both sides map the one weights file, so two copies of the fp32 U-Net's 10 GiB fit.
    mapped = args.size == "sdxl"
    with tempfile.TemporaryDirectory() as tmp:
        prepare(tmp, binary, args.size, args.batch, args.dtype)
        ref = Side("diffusers+peft", [sys.executable, "-W", QUIET, "-c", REFERENCE, tmp,
                                      "1" if args.gradient_checkpointing else "0", str(threads),
                                      args.dtype] + (["map"] if mapped else []))
        ours = Side("lorapipe", [binary, "step", args.size, tmp, "--threads", str(threads),
                                 "--dtype", args.dtype] + checkpointing +
                    (["--map_weights"] if mapped else []))
    if (ours.modules, ours.lora_numel) != (ref.modules, ref.lora_numel):
        sys.exit(f"the LoRAs differ: lorapipe {ours.modules} modules / {ours.lora_numel} "
                 f"parameters, reference {ref.modules} / {ref.lora_numel}")
    print(f"{label}: {threads} threads, LoRA of {ours.modules} modules, {int(ours.lora_numel):,} "
          f"parameters", flush=True)
    ratios = interleave(ours, ref, args.rounds, label, LOSS_TOLERANCE[args.dtype])
    if args.profile:
        for side in (ours, ref):
            path = os.path.join(args.profile, f"train_{args.size}_{side.name}.json")
            path = os.path.abspath(path)
            side.command(f"profile {path}")
            side.expect("profiled")
    ours_rss, ref_rss = ours.finish(), ref.finish()
    print(f"{label}: {side_summary(ours, ours_rss)}; {side_summary(ref, ref_rss)}")
    print(f"{label}: step time ratio lorapipe/reference (median of {len(ratios)} pairs) "
          f"{statistics.median(ratios):.2f}x [{min(ratios):.2f}-{max(ratios):.2f}], "
          f"peak RSS ratio {ours_rss / ref_rss:.2f}x")


def checkpointing_memory(args, binary, threads):
    with tempfile.TemporaryDirectory() as tmp:
        prepare(tmp, binary, args.size, args.batch, "fp32")
        plain = Side("lorapipe", [binary, "step", args.size, tmp, "--threads", str(threads)])
        checkpointed = Side("lorapipe+checkpointing", [binary, "step", args.size, tmp, "--threads",
                                                       str(threads), "--gradient_checkpointing"])
    ratios = interleave(checkpointed, plain, args.rounds, args.size)
    plain_rss, checkpointed_rss = plain.finish(), checkpointed.finish()
    print(f"{args.size}: {side_summary(plain, plain_rss)}; "
          f"{side_summary(checkpointed, checkpointed_rss)}")
    label = f"{args.size}, batch {args.batch}"
    print(f"{label}: gradient checkpointing cuts lorapipe's peak RSS by "
          f"{100 * (1 - checkpointed_rss / plain_rss):.1f}% ({plain_rss:.0f} -> "
          f"{checkpointed_rss:.0f} MiB), step time x{statistics.median(ratios):.2f} "
          f"[{min(ratios):.2f}-{max(ratios):.2f}]")
    # Tensor memory, as torch.cuda.max_memory_allocated counts it on a GPU: the weights (alive
    # before the steps) plus the most the steps held at once, without the heap's free space.
    base = plain.tensor_base
    print(f"{label}: peak tensor memory {plain.tensor_peak:.0f} -> {checkpointed.tensor_peak:.0f} "
          f"MiB, a {100 * (1 - checkpointed.tensor_peak / plain.tensor_peak):.1f}% cut; of that "
          f"{base:.0f} MiB are the weights and inputs, so the steps' own tensors go "
          f"{plain.tensor_peak - base:.0f} -> {checkpointed.tensor_peak - checkpointed.tensor_base:.0f} "
          f"MiB ({100 * (1 - (checkpointed.tensor_peak - checkpointed.tensor_base) / (plain.tensor_peak - base)):.1f}% cut); "
          f"with nothing kept at all the cut could reach "
          f"{100 * (1 - base / plain.tensor_peak):.1f}%")
    # The reference's own checkpointing on the same step, after ours: two sides at a time, so
    # the machine holds no more than two copies of the weights at once.
    with tempfile.TemporaryDirectory() as tmp:
        prepare(tmp, binary, args.size, args.batch, "fp32")
        ref_plain = Side("diffusers+peft", [sys.executable, "-W", QUIET, "-c", REFERENCE, tmp, "0",
                                            str(threads), "fp32"])
        ref_checkpointed = Side("diffusers+peft+checkpointing",
                                [sys.executable, "-W", QUIET, "-c", REFERENCE, tmp, "1",
                                 str(threads), "fp32"])
    ref_ratios = interleave(ref_checkpointed, ref_plain, args.rounds, args.size)
    ref_plain_rss, ref_checkpointed_rss = ref_plain.finish(), ref_checkpointed.finish()
    print(f"{args.size}: {side_summary(ref_plain, ref_plain_rss)}; "
          f"{side_summary(ref_checkpointed, ref_checkpointed_rss)}")
    print(f"{label}: diffusers' gradient checkpointing cuts its peak RSS by "
          f"{100 * (1 - ref_checkpointed_rss / ref_plain_rss):.1f}% ({ref_plain_rss:.0f} -> "
          f"{ref_checkpointed_rss:.0f} MiB), step time x{statistics.median(ref_ratios):.2f} "
          f"[{min(ref_ratios):.2f}-{max(ref_ratios):.2f}]; checkpointed, lorapipe's peak RSS is "
          f"{checkpointed_rss / ref_checkpointed_rss:.2f}x the reference's")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--build", default="build")
    parser.add_argument("--size", choices=sorted(SIZES))
    parser.add_argument("--rounds", type=int, help="counted rounds (tiny 20, full 3)")
    parser.add_argument("--dtype", choices=["fp32", "bf16"],
                        help="the frozen base's dtype (tiny, full: fp32; sdxl: bf16)")
    parser.add_argument("--gradient_checkpointing", action="store_true")
    parser.add_argument("--checkpointing-memory", action="store_true",
                        help="peak RSS with and without gradient checkpointing, lorapipe's then diffusers'")
    parser.add_argument("--batch", type=int, help="batch size (tiny 2, full 1)")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--profile", metavar="DIR")
    args = parser.parse_args()
    args.size = args.size or ("full" if args.checkpointing_memory else "tiny")
    args.rounds = args.rounds or SIZES[args.size]["rounds"]
    args.batch = args.batch or SIZES[args.size]["batch"]
    args.dtype = (args.dtype or SIZES[args.size]["dtype"] or
                  ("bf16" if native_bf16() else "fp32"))
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
    binary = os.path.join(args.build, "bin", "trainer_bench")
    if args.checkpointing_memory:
        checkpointing_memory(args, binary, args.threads)
    else:
        compare(args, binary, args.threads)


if __name__ == "__main__":
    main()
