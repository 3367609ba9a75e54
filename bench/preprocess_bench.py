#!/usr/bin/env python3
"""Decode + bucket + resize + crop of large JPEGs: lorapipe-preprocess against Pillow.

Same files, same run, same work: lorapipe's report gives every image's bucket, cover size and
crop; the Pillow side (the Python trainers' path: Image.draft + convert + LANCZOS resize + crop)
does exactly those. A second reference is kohya's own load_image, which decodes every image at
full size before resizing (no draft). Prints images/s for one worker and for all cores, the
ratios (median over rounds that alternate which side goes first, with their range), and
lorapipe's peak RSS. Not a test: nothing here passes or fails on a time.

    bench/preprocess_bench.py [--images 24] [--build build] [--dir ~/.cache/lorapipe/bench-jpegs]
        [--rounds 3]
Needs the test venv (numpy, Pillow): run it with $LORAPIPE_PYTHON.
"""
import argparse
import concurrent.futures
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
from PIL import Image

SIZES = [(4000, 3000), (3000, 4000), (6000, 4000), (4000, 6000), (5472, 3648), (4032, 3024)]


def make_images(folder: str, count: int) -> None:
    sub = os.path.join(folder, "1_photo")
    os.makedirs(sub, exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(count):
        path = os.path.join(sub, f"{i:03d}.jpg")
        if os.path.exists(path):
            continue
        w, h = SIZES[i % len(SIZES)]
        # Photo-like content: smooth gradients plus fine noise, so JPEG sizes are realistic.
        y, x = np.mgrid[0:h, 0:w].astype(np.float32)
        base = np.stack([(x / w) * 255, (y / h) * 255, ((x + y) / (w + h)) * 255], axis=-1)
        noise = rng.normal(0, 12, size=(h, w, 3)).astype(np.float32)
        pixels = np.clip(base + noise, 0, 255).astype(np.uint8)
        Image.fromarray(pixels).save(path, quality=90)


def pillow_one(job, draft=True):
    path, resized, bucket, offset = job
    with Image.open(path) as im:
        if draft:  # JPEG DCT scaling, as lorapipe's shrink-on-load
            im.draft("RGB", tuple(resized))
        im = im.convert("RGB")
        im = im.resize(tuple(resized), Image.LANCZOS)
        left, top = offset
        im = im.crop((left, top, left + bucket[0], top + bucket[1]))
        return len(im.tobytes())


def pillow_full(job):
    """kohya's load_image: the whole image decoded at full size, then resized."""
    return pillow_one(job, draft=False)


def noop(_):
    return 0


def run_pillow(jobs, workers: int, work=pillow_one) -> float:
    # Pillow runs in worker processes (as a DataLoader's workers do), started before the clock,
    # so this process stays small and lorapipe's RSS reading is its own.
    with concurrent.futures.ProcessPoolExecutor(max_workers=workers) as pool:
        list(pool.map(noop, range(workers)))
        start = time.perf_counter()
        total = sum(pool.map(work, jobs, chunksize=1))
        elapsed = time.perf_counter() - start
    assert total == sum(b[0] * b[1] * 3 for _, _, b, _ in jobs)
    return elapsed


def run_lorapipe(binary: str, folder: str, resolution: str, threads: int, report: str = ""):
    command = [binary, f"--data_dir={folder}", "--report_only", f"--resolution={resolution}",
               f"--threads={threads}"]
    if report:
        command.append(f"--report_json={report}")
    start = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    elapsed = time.perf_counter() - start
    if status != 0:
        sys.exit(f"lorapipe-preprocess failed with status {status}")
    return elapsed, usage.ru_maxrss / 1024.0  # MiB


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--images", type=int, default=24)
    parser.add_argument("--build", default="build")
    parser.add_argument("--dir", default=os.path.expanduser("~/.cache/lorapipe/bench-jpegs"))
    parser.add_argument("--resolution", default="512,1024")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with concurrent.futures.ProcessPoolExecutor(max_workers=1) as pool:
        pool.submit(make_images, args.dir, args.images).result()
    binary = os.path.join(args.build, "bin", "lorapipe-preprocess")
    cores = os.cpu_count() or 1
    print(f"preprocess_bench: {args.images} JPEGs of 12-24 MP, {cores} cores")
    for resolution in args.resolution.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            report_path = os.path.join(tmp, "report.json")
            # Also warms the page cache, so both sides read the files from memory.
            run_lorapipe(binary, args.dir, resolution, cores, report_path)
            report = json.load(open(report_path))
            jobs = [(i["path"], i["resized"], i["bucket"], i["crop_offset"])
                    for i in report["images"]]
            n = len(jobs)
            pillow_one_worker = None
            for workers in sorted({1, cores}):
                # Rounds alternate which side runs first; on a shared machine the median of the
                # per-round ratios is far steadier than one run of each.
                ratios, full_ratios, rates, rss = [], [], [], 0.0
                for r in range(args.rounds):
                    if r % 2:
                        theirs = run_pillow(jobs, workers)
                        ours, peak = run_lorapipe(binary, args.dir, resolution, workers)
                    else:
                        ours, peak = run_lorapipe(binary, args.dir, resolution, workers)
                        theirs = run_pillow(jobs, workers)
                    full = run_pillow(jobs, workers, pillow_full)
                    ratios.append(theirs / ours)
                    full_ratios.append(full / ours)
                    rates.append((n / ours, n / theirs, n / full))
                    rss = max(rss, peak)
                ours_rate, pillow_rate, full_rate = (statistics.median(x) for x in zip(*rates))
                if workers == 1:
                    pillow_one_worker = pillow_rate
                print(f"resolution {resolution:>4} workers {workers}: lorapipe {ours_rate:6.2f} "
                      f"img/s (peak RSS {rss:.0f} MiB), Pillow {pillow_rate:6.2f} img/s, "
                      f"lorapipe/Pillow {statistics.median(ratios):.2f}x [{min(ratios):.2f}-"
                      f"{max(ratios):.2f}]; Pillow without draft (kohya's full decode) "
                      f"{full_rate:6.2f} img/s, lorapipe/that {statistics.median(full_ratios):.2f}x",
                      flush=True)
                if workers > 1 and pillow_one_worker:
                    # The Python trainers' path is one process: all of lorapipe's threads
                    # against it (medians of separate runs, so noisier than the paired ratios).
                    print(f"resolution {resolution:>4}: lorapipe on {workers} threads / Pillow "
                          f"in one process {ours_rate / pillow_one_worker:.2f}x", flush=True)

if __name__ == "__main__":
    main()
