#!/usr/bin/env python3
"""Round trips between lorapipe's safetensors code and the real `safetensors` package.

    safetensors_roundtrip.py write OUT.safetensors   # the package writes, lorapipe reads
    safetensors_roundtrip.py check IN.safetensors    # lorapipe wrote, the package reads

Both sides use the same deterministic content: tensor "t_<DTYPE>" of shape (3, 5, 7) (and one
0-d and one empty tensor) whose raw bytes are byte i = (i * 7 + k) % 256, with k the dtype's
index, except BOOL whose bytes are i % 2. Comparing raw bytes checks dtype, shape, order and
endianness without depending on any float conversion. Metadata: {"ss_network_dim": "16",
"lorapipe": "caf\u00e9"}. Exit 0 when everything matches.
"""
import sys

import torch
from safetensors import safe_open
from safetensors.torch import save_file

DTYPES = [("F64", torch.float64), ("F32", torch.float32), ("F16", torch.float16),
          ("BF16", torch.bfloat16), ("F8_E4M3", torch.float8_e4m3fn),
          ("F8_E5M2", torch.float8_e5m2), ("I64", torch.int64), ("I32", torch.int32),
          ("I16", torch.int16), ("I8", torch.int8), ("U8", torch.uint8), ("BOOL", torch.bool)]
SHAPE = (3, 5, 7)
METADATA = {"ss_network_dim": "16", "lorapipe": "caf\u00e9"}


def pattern(k: int, name: str, n_bytes: int) -> bytes:
    if name == "BOOL":
        return bytes(i % 2 for i in range(n_bytes))
    return bytes((i * 7 + k) % 256 for i in range(n_bytes))


def expected():
    out = {}
    for k, (name, dtype) in enumerate(DTYPES):
        numel = SHAPE[0] * SHAPE[1] * SHAPE[2]
        size = torch.empty(0, dtype=dtype).element_size()
        raw = torch.frombuffer(bytearray(pattern(k, name, numel * size)), dtype=torch.uint8)
        out[f"t_{name}"] = raw.view(dtype).reshape(SHAPE)
    out["scalar"] = torch.frombuffer(bytearray(pattern(1, "F32", 4)), dtype=torch.uint8).view(
        torch.float32).reshape(())
    out["empty"] = torch.zeros((0, 4), dtype=torch.float16)
    return out


def raw_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def main() -> int:
    mode, path = sys.argv[1], sys.argv[2]
    want = expected()
    if mode == "write":
        save_file(want, path, metadata=METADATA)
        return 0
    with safe_open(path, framework="pt") as f:
        if f.metadata() != METADATA:
            print(f"metadata differs: {f.metadata()!r}")
            return 1
        if set(f.keys()) != set(want):
            print(f"names differ: {sorted(f.keys())}")
            return 1
        for name, w in want.items():
            got = f.get_tensor(name)
            if got.dtype != w.dtype or tuple(got.shape) != tuple(w.shape):
                print(f"{name}: {got.dtype} {tuple(got.shape)} != {w.dtype} {tuple(w.shape)}")
                return 1
            if raw_bytes(got) != raw_bytes(w):
                print(f"{name}: bytes differ")
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
