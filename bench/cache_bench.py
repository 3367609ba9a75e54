#!/usr/bin/env python3
"""Random batched latent reads: lorapipe's LMDB store against kohya-style per-image .npz files
read with numpy.load, same machine, same run, same record count and batch size (16), both with a
warm page cache. Also bytes per 512x512 SD1.5 image on disk.

    $LORAPIPE_PYTHON bench/cache_bench.py [--build build] [--records 512] [--batches 400]
kohya writes np.savez(latents=float32 [4, 64, 64], original_size, crop_ltrb) per image; lorapipe
stores the latent distribution (mean and std, fp16) in one protobuf record per image.
"""
import argparse
import os
import random
import re
import subprocess
import tempfile
import time

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--build", default="build")
    parser.add_argument("--records", type=int, default=512)
    parser.add_argument("--batches", type=int, default=400)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = subprocess.run([os.path.join(args.build, "bin", "cache_bench"),
                              os.path.join(tmp, "store"), str(args.records), str(args.batches)],
                             check=True, capture_output=True, text=True).stdout
        m = re.search(r"lorapipe_store (\d+) records/s, (\d+) bytes/record, (\d+) bytes on disk", out)
        ours, record_bytes, disk_bytes = float(m.group(1)), int(m.group(2)), int(m.group(3))

        rng = np.random.default_rng(0)
        paths = []
        for i in range(args.records):
            path = os.path.join(tmp, f"{i:06d}_512x512.npz")
            np.savez(path, latents=rng.standard_normal((4, 64, 64), dtype=np.float32),
                     original_size=np.array([512, 512]), crop_ltrb=np.array([0, 0, 512, 512]))
            paths.append(path)
        npz_bytes = sum(os.path.getsize(p) for p in paths) / len(paths)
        pick = random.Random(1)

        def read(batches):
            for _ in range(batches):
                for path in (paths[pick.randrange(len(paths))] for _ in range(16)):
                    with np.load(path) as z:
                        z["latents"], z["original_size"], z["crop_ltrb"]

        read(args.batches // 4)  # warm the page cache
        start = time.perf_counter()
        read(args.batches)
        theirs = args.batches * 16 / (time.perf_counter() - start)
    print(f"random batched reads: lorapipe store {ours:.0f} records/s, numpy.load .npz "
          f"{theirs:.0f} records/s, ratio {ours / theirs:.1f}x")
    print(f"bytes per 512x512 image: lorapipe record {record_bytes} ({disk_bytes} on disk incl. "
          f"LMDB pages), kohya .npz {npz_bytes:.0f}")


if __name__ == "__main__":
    main()
