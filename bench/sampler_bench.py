#!/usr/bin/env python3
"""Preview renders: lorapipe's sampler (sampler/render.h) against diffusers'
StableDiffusionPipeline on the same weights, same prompt and settings, same machine, same run.

    $LORAPIPE_PYTHON bench/sampler_bench.py [--build build] [--size tiny|full] [--rounds N]
        [--steps 20] [--resolution 512] [--sampler ddim] [--threads N]

--size tiny is lorapipe's tiny SD1.5 (lorapipe-make-tiny-model); --size full is SD1.5's real
UNet, VAE and CLIP text encoder with random weights (diffusers and transformers build them from
SD1.5's configs, no download; the tokenizer is the tiny model's). Both render one image of the
bench's prompt with a negative prompt, CFG 7.5, the sampler kohya builds, --steps steps at
--resolution: text encoding, the denoising loop and the VAE decode, as a preview costs.

Both sides stay up as separate processes (each peak RSS is its own) and their renders are
interleaved, the order alternating every round; round 0 warms up and is not counted. Prints the
median time of each side, images/s, the median of the pairwise ratios (lorapipe / diffusers:
below 1 means lorapipe is faster) with their range, and each side's peak RSS over the renders.
"""
import argparse
import os
import statistics
import subprocess
import sys
import tempfile

QUIET = "ignore"

WRITER = r'''
import sys, torch, json
from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer
folder, unet_config, tokenizer = sys.argv[1], sys.argv[2], sys.argv[3]
torch.manual_seed(0)
unet = UNet2DConditionModel.from_config(json.load(open(unet_config)))
vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4,
                    down_block_types=["DownEncoderBlock2D"] * 4,
                    up_block_types=["UpDecoderBlock2D"] * 4,
                    block_out_channels=[128, 256, 512, 512], layers_per_block=2, sample_size=512)
text = CLIPTextModel(CLIPTextConfig(vocab_size=49408, hidden_size=768, intermediate_size=3072,
                                    num_hidden_layers=12, num_attention_heads=12,
                                    max_position_embeddings=77, hidden_act="quick_gelu"))
pipe = StableDiffusionPipeline(vae=vae, text_encoder=text, tokenizer=CLIPTokenizer.from_pretrained(tokenizer),
                               unet=unet, scheduler=DDIMScheduler(), safety_checker=None,
                               feature_extractor=None, requires_safety_checker=False)
pipe.save_pretrained(folder)
'''

REFERENCE = r'''
import resource, sys, time, warnings
warnings.filterwarnings("ignore")
import torch
from diffusers import (DDIMScheduler, DPMSolverMultistepScheduler, EulerAncestralDiscreteScheduler,
                       EulerDiscreteScheduler, StableDiffusionPipeline)
folder, width, height, steps, threads, sampler = (sys.argv[1], int(sys.argv[2]), int(sys.argv[3]),
                                                  int(sys.argv[4]), int(sys.argv[5]), sys.argv[6])
torch.set_num_threads(threads)
def status_mib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) / 1024
    return -1
classes = {"ddim": (DDIMScheduler, {}), "euler": (EulerDiscreteScheduler, {}),
           "euler_a": (EulerAncestralDiscreteScheduler, {}),
           "dpmsolver++": (DPMSolverMultistepScheduler, {"algorithm_type": "dpmsolver++"})}
cls, kwargs = classes[sampler]
scheduler = cls(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012,
                beta_schedule="scaled_linear", **kwargs)  # as kohya's get_my_scheduler
pipe = StableDiffusionPipeline.from_pretrained(folder, scheduler=scheduler, safety_checker=None,
                                               feature_extractor=None,
                                               requires_safety_checker=False)
if hasattr(pipe.scheduler.config, "clip_sample") and pipe.scheduler.config.clip_sample is False:
    pipe.scheduler.config.clip_sample = True
pipe.set_progress_bar_config(disable=True)
print(f"ready {status_mib('VmHWM:'):.0f} {status_mib('VmRSS:'):.0f}", flush=True)
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
for line in sys.stdin:
    if line.strip() != "render":
        continue
    s, c = time.perf_counter(), time.process_time()
    with torch.no_grad():
        image = pipe("a photo of a cat sitting on a wooden table, soft light",
                     negative_prompt="blurry, lowres", width=width, height=height,
                     num_inference_steps=steps, guidance_scale=7.5,
                     generator=torch.Generator().manual_seed(0), output_type="np").images[0]
    print(f"{(time.perf_counter() - s) * 1e3:.1f} {(time.process_time() - c) * 1e3:.1f} "
          f"{image.mean() * 255:.4f}", flush=True)
print(f"peak_rss {status_mib('VmHWM:'):.0f}", flush=True)
'''


class Side:
    """A process answering "render" on stdin with "<wall ms> <CPU ms> <mean pixel>"."""

    def __init__(self, name, command):
        self.name = name
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        text=True, bufsize=1, cwd="/tmp")
        _, self.load_peak, self.loaded = self.expect("ready").split()
        self.times = []

    def expect(self, prefix):
        line = self.process.stdout.readline()
        if not line.startswith(prefix) and not (prefix == "" and line.strip()):
            sys.exit(f"{self.name}: expected '{prefix}', got {line!r} (exit {self.process.poll()})")
        return line.strip()

    def render(self):
        self.process.stdin.write("render\n")
        self.process.stdin.flush()
        return [float(x) for x in self.expect("").split()]

    def finish(self):
        self.process.stdin.close()
        rss = float(self.expect("peak_rss").split()[1])
        self.process.wait()
        return rss


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", default="build")
    ap.add_argument("--size", choices=["tiny", "full"], default="tiny")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--resolution", type=int, default=512)
    ap.add_argument("--sampler", default="ddim")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--keep-freed", action="store_true",
                    help="lorapipe on the trainer's heap policy (common/heap.h) instead of "
                         "glibc's default, which the sampler uses")
    args = ap.parse_args()
    build = os.path.abspath(args.build)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([f"{build}/bin/lorapipe-make-tiny-model", tmp], check=True,
                       capture_output=True)
        folder = f"{tmp}/tiny-sd15-diffusers"
        if args.size == "full":
            config = subprocess.run([f"{build}/bin/trainer_bench", "config", "full"], check=True,
                                    capture_output=True, text=True).stdout
            with open(f"{tmp}/unet.json", "w") as f:
                f.write(config)
            folder = f"{tmp}/full"
            subprocess.run([sys.executable, "-W", QUIET, "-c", WRITER, folder, f"{tmp}/unet.json",
                            f"{tmp}/tiny-sd15-diffusers/tokenizer"], check=True, cwd="/tmp")
        size = [str(args.resolution), str(args.resolution), str(args.steps)]
        ours = Side("lorapipe", [f"{build}/bin/sampler_bench", folder, *size, "--threads",
                                 str(args.threads), "--sampler", args.sampler] +
                    (["--keep-freed"] if args.keep_freed else []))
        ref = Side("diffusers", [sys.executable, "-W", QUIET, "-c", REFERENCE, folder, *size,
                                 str(args.threads), args.sampler])
        label = f"{args.size} {args.resolution}px {args.steps} steps {args.sampler}"
        ratios = []
        for r in range(args.rounds + 1):
            pair = (ours, ref) if r % 2 == 0 else (ref, ours)
            took = {side.name: side.render() for side in pair}
            if r == 0:
                print(f"  {label} warm-up: mean pixel lorapipe {took['lorapipe'][2]:.2f}, "
                      f"diffusers {took['diffusers'][2]:.2f}", flush=True)
                continue
            ours.times.append(took["lorapipe"][0])
            ref.times.append(took["diffusers"][0])
            ratios.append(took["lorapipe"][0] / took["diffusers"][0])
            print(f"  {label} round {r}: lorapipe {took['lorapipe'][0]:.0f} ms, diffusers "
                  f"{took['diffusers'][0]:.0f} ms, ratio {ratios[-1]:.2f}x", flush=True)
        ours_rss, ref_rss = ours.finish(), ref.finish()
    a, b = statistics.median(ours.times), statistics.median(ref.times)
    print(f"{label}: lorapipe {a:.0f} ms ({1000 / a:.3f} images/s), peak RSS {ours_rss:.0f} MiB; "
          f"diffusers {b:.0f} ms ({1000 / b:.3f} images/s), peak RSS {ref_rss:.0f} MiB")
    print(f"{label}: time ratio lorapipe/diffusers (median of {len(ratios)} pairs) "
          f"{statistics.median(ratios):.2f}x [{min(ratios):.2f}-{max(ratios):.2f}], "
          f"peak RSS ratio {ours_rss / ref_rss:.2f}x")


if __name__ == "__main__":
    main()
