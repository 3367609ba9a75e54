#!/usr/bin/env python3
"""SD1.5 at real size, fp32 on CPU: lorapipe against diffusers on the same random weights (lorapipe
writes them, diffusers loads them), on the same machine in the same run; and SDXL's U-Net at real
size (unet_sdxl, run with --only): in bf16 where the CPU computes it natively (AVX512-BF16 or
AMX), else in fp32, where two copies (10 GiB of weights each) would not fit beside each other in
24 GiB: so both sides map the one file's pages (lorapipe's --map_weights, and
bench/mapped_safetensors.py) and hold one copy between them, and are paired like the rest. With
--only flux: FLUX.1 [dev]'s transformer at full width and reduced depth (one double and one single
block), forward + backward at 256 image and 256 T5 tokens, fp32; --only t5: T5 XXL at full width,
two blocks, encoding 512 tokens, against transformers' T5EncoderModel.

    $LORAPIPE_PYTHON bench/models_bench.py [--build build] [--rounds 5] [--only vae|unet|unet_sdxl]
        [--profile DIR] [--default-heap]    (--only also flux | t5)

Both sides stay up as separate processes (so each peak RSS is that side's own) and their steps
are interleaved, the order alternating every round: on a shared, noisy machine the two halves of
a pair see the same load, so the pairwise ratio is far steadier than two runs taken one after the
other. Round 0 warms both up and is not counted. Prints the median milliseconds of each side, the
median of the pairwise ratios (reference / lorapipe: above 1 means lorapipe is faster) with their
range, and peak RSS (lorapipe / reference). --profile writes one chrome trace per side.
lorapipe's UNet runs under the trainer's heap policy (common/heap.h); --default-heap measures it
under glibc's defaults instead.
"""
import argparse
import os
import statistics
import subprocess
import sys
import tempfile

REFERENCE = r'''
import sys, time, torch
from diffusers import AutoencoderKL, UNet2DConditionModel
from safetensors import safe_open
what, weights = sys.argv[1], sys.argv[2]
dtype = torch.float32 if len(sys.argv) > 3 and sys.argv[3] == "fp32" else torch.bfloat16
def load_same_weights(model):
    # One tensor at a time, so loading adds no more than one tensor to the peak RSS.
    with safe_open(weights, framework="pt") as f, torch.no_grad():
        state = model.state_dict()
        assert set(f.keys()) == set(state), "lorapipe and diffusers name different weights"
        for key, value in state.items():
            value.copy_(f.get_tensor(key))
torch.manual_seed(0)
if what == "vae":
    vae = AutoencoderKL(block_out_channels=(128, 256, 512, 512), layers_per_block=2,
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
        latent_channels=4, sample_size=512).eval()
    load_same_weights(vae)
    image = torch.rand(1, 3, 512, 512) * 2 - 1
    def work():
        with torch.no_grad():
            vae.encode(image)
elif what == "unet_sdxl":
    # SDXL's published unet/config.json, built on the meta device and given the pages of the file
    # lorapipe's side wrote and maps itself (bench/mapped_safetensors.py): one copy of the weights
    # serves both sides, in the dtype lorapipe's side wrote.
    from mapped_safetensors import load_mapped
    with torch.device("meta"):
        unet = UNet2DConditionModel(sample_size=128, cross_attention_dim=2048,
            attention_head_dim=[5, 10, 20], block_out_channels=(320, 640, 1280), layers_per_block=2,
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
            transformer_layers_per_block=[1, 2, 10], use_linear_projection=True,
            addition_embed_type="text_time", addition_time_embed_dim=256,
            projection_class_embeddings_input_dim=2816)
    load_mapped(unet, weights).train()
    unet.requires_grad_(False)
    latents = torch.randn(1, 4, 64, 64, dtype=dtype, requires_grad=True)
    context = torch.randn(1, 77, 2048, dtype=dtype)
    added = {"text_embeds": torch.randn(1, 1280, dtype=dtype),
             "time_ids": torch.tensor([[512.0, 512, 0, 0, 512, 512]])}
    t = torch.tensor([500])
    def work():
        unet(latents, t, context, added_cond_kwargs=added).sample.float().square().mean().backward()
elif what == "flux":
    # FLUX.1 [dev] at full width, one double and one single block: diffusers' own converter from
    # Black Forest Labs' names (it assumes the full width, which this is), built on the meta
    # device and given the converted tensors, so no second copy of the weights exists.
    from diffusers import FluxTransformer2DModel
    from diffusers.loaders.single_file_utils import convert_flux_transformer_checkpoint_to_diffusers
    from safetensors.torch import load_file
    with torch.device("meta"):
        model = FluxTransformer2DModel(num_layers=1, num_single_layers=1, guidance_embeds=True)
    model.load_state_dict(convert_flux_transformer_checkpoint_to_diffusers(load_file(weights)),
                          strict=True, assign=True)
    model.train().requires_grad_(False)
    img = torch.randn(1, 256, 64, requires_grad=True)
    ids = torch.zeros(16, 16, 3)
    ids[..., 1] += torch.arange(16)[:, None]
    ids[..., 2] += torch.arange(16)[None, :]
    args = dict(timestep=torch.tensor([0.5]), guidance=torch.tensor([3.5]),
                pooled_projections=torch.randn(1, 768), encoder_hidden_states=torch.randn(1, 256, 4096),
                txt_ids=torch.zeros(256, 3), img_ids=ids.reshape(-1, 3), return_dict=False)
    def work():
        model(hidden_states=img, **args)[0].square().mean().backward()
elif what == "t5":
    from safetensors.torch import load_file
    from transformers import T5Config, T5EncoderModel
    with torch.device("meta"):
        model = T5EncoderModel(T5Config(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240,
                                        num_layers=2, num_heads=64, feed_forward_proj="gated-gelu",
                                        dropout_rate=0.0))
    state = load_file(weights)
    state["encoder.embed_tokens.weight"] = state["shared.weight"]  # tied
    model.load_state_dict(state, strict=True, assign=True)
    model.eval()
    ids = torch.randint(0, 32128, (1, 512))
    def work():
        with torch.no_grad():
            model(ids)
else:
    unet = UNet2DConditionModel(sample_size=64, cross_attention_dim=768, attention_head_dim=8,
        block_out_channels=(320, 640, 1280, 1280), layers_per_block=2).train()
    load_same_weights(unet)
    unet.requires_grad_(False)
    latents = torch.randn(1, 4, 64, 64, requires_grad=True)
    context = torch.randn(1, 77, 768)
    t = torch.tensor([500])
    def work():
        unet(latents, t, context).sample.square().mean().backward()
print("ready", flush=True)
for line in sys.stdin:
    line = line.strip()
    if line == "step":
        s, c = time.perf_counter(), time.process_time()
        work()
        print(f"{(time.perf_counter() - s) * 1e3:.1f} {(time.process_time() - c) * 1e3:.1f}", flush=True)
    elif line.startswith("profile "):
        with torch.autograd.profiler.profile() as prof:
            work()
        prof.export_chrome_trace(line[8:])
        print("profiled", flush=True)
with open("/proc/self/status") as f:  # VmHWM, as lorapipe's side reads it
    peak = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
print(f"peak_rss {peak / 1024:.0f}", flush=True)
'''
# The reference imports bench/mapped_safetensors.py from beside this script.
REFERENCE = f"import sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})\n" + REFERENCE


class Side:
    """One side of the comparison: a process that answers the step protocol on stdin/stdout."""

    def __init__(self, name, command, env=None):
        self.name = name
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        text=True, bufsize=1, env=env)
        self.expect("ready")
        self.times = []

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
        wall, cpu = self.expect("").split()
        return float(wall), float(cpu)

    def finish(self):
        self.process.stdin.close()
        rss = float(self.expect("peak_rss").split()[1])
        self.process.wait()
        return rss


def native_bf16():
    """Whether this CPU computes bf16 natively (AVX512-BF16 or AMX): without, LibTorch's bf16
    convolutions fall back to a naive GEMM, many times slower than fp32."""
    with open("/proc/cpuinfo") as f:
        flags = set(f.read().split())
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def compare(what, binary, rounds, profile_dir, default_heap):
    env = dict(os.environ, LORAPIPE_BENCH_DEFAULT_HEAP="1") if default_heap else None
    # SDXL's U-Net in bf16 where the CPU computes it natively, else fp32; both sides map one copy.
    dtype = ([] if what != "unet_sdxl" else ["bf16" if native_bf16() else "fp32"])
    if dtype:
        print(f"{what} ({dtype[0]}): both sides map the one weights file", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        weights = os.path.join(tmp, f"{what}.safetensors")
        ours = Side("lorapipe", [binary, what, weights] + dtype, env)
        ref = Side("diffusers", [sys.executable, "-c", REFERENCE, what, weights] + dtype)
    ratios, cpu_ratios = [], []
    for r in range(rounds + 1):
        pair = (ours, ref) if r % 2 == 0 else (ref, ours)
        took = {side.name: side.step() for side in pair}
        if r == 0:
            continue  # warm-up: first-touch allocation, oneDNN primitive creation
        (ours_ms, ours_cpu), (ref_ms, ref_cpu) = took["lorapipe"], took["diffusers"]
        ours.times.append(ours_ms)
        ref.times.append(ref_ms)
        ratios.append(ref_ms / ours_ms)
        cpu_ratios.append(ref_cpu / ours_cpu)
        print(f"  {what} round {r}: lorapipe {ours_ms:.0f} ms ({ours_cpu:.0f} CPU), diffusers "
              f"{ref_ms:.0f} ms ({ref_cpu:.0f} CPU), ratio {ratios[-1]:.2f}x "
              f"(CPU {cpu_ratios[-1]:.2f}x)", flush=True)
    if profile_dir:
        for side in (ours, ref):
            path = os.path.join(profile_dir, f"{what}_{side.name}.json")
            side.command(f"profile {os.path.abspath(path)}")
            side.expect("profiled")
    ours_rss, ref_rss = ours.finish(), ref.finish()
    print(f"{what}: lorapipe {statistics.median(ours.times):.0f} ms / {ours_rss:.0f} MiB, diffusers "
          f"{statistics.median(ref.times):.0f} ms / {ref_rss:.0f} MiB; speed ratio (median of "
          f"{len(ratios)} pairs) {statistics.median(ratios):.2f}x [{min(ratios):.2f}-"
          f"{max(ratios):.2f}], CPU-time ratio {statistics.median(cpu_ratios):.2f}x, memory ratio "
          f"{ours_rss / ref_rss:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--build", default="build")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--only", choices=["vae", "unet", "unet_sdxl", "flux", "t5"])
    parser.add_argument("--profile", metavar="DIR")
    parser.add_argument("--default-heap", action="store_true")
    args = parser.parse_args()
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
    binary = os.path.join(args.build, "bin", "models_bench")
    for what in [args.only] if args.only else ["vae", "unet"]:
        compare(what, binary, args.rounds, args.profile, args.default_heap)


if __name__ == "__main__":
    main()
