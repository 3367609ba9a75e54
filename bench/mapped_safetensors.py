"""A safetensors file's tensors as views of its pages, for the reference side of a bench.

Two processes that load the same file this way share its pages in the page cache, as lorapipe's
--map_weights (models/mapped_weights.h) does on the other side: both copies of a model whose
weights alone fill half the machine (SDXL's U-Net in fp32, 10 GiB) then fit beside each other, so
their steps can be interleaved and compared pair by pair. The mapping is private and writable
(copy-on-write): a write, which a frozen base never makes, would copy that page for the writer.
"""
import json
import struct

import numpy as np
import torch

DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32}


def map_safetensors(path):
    """{name: tensor} over `path`'s pages; the mapping lives as long as any of the tensors."""
    with open(path, "rb") as f:
        (header_bytes,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_bytes))
    data = np.memmap(path, dtype=np.uint8, mode="c", offset=8 + header_bytes)
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in DTYPES:
            raise ValueError(f"{path}: {name}: dtype {info['dtype']} is not mapped here")
        begin, end = info["data_offsets"]
        raw = torch.from_numpy(data[begin:end])
        tensors[name] = raw.view(DTYPES[info["dtype"]]).reshape(info["shape"])
    return tensors


def load_mapped(model, path):
    """Gives `model` (built on the meta device) the file's tensors as its own, by name; every
    parameter and buffer must be there and nothing else."""
    model.load_state_dict(map_safetensors(path), strict=True, assign=True)
    return model
