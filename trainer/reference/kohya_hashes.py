"""kohya's sshs_model_hash and sshs_legacy_hash of a LoRA file, as sd-scripts computes them before
saving (library/train_util.py, precalculate_safetensors_hashes): the file's tensors and its ss_*
metadata serialised again by the safetensors package, then addnet_hash_safetensors (sha256 of
what follows the header) and addnet_hash_legacy (sha256 of the 64 KiB at 1 MiB, 8 hex digits).

Usage: kohya_hashes.py FILE    prints {"sshs_model_hash": ..., "sshs_legacy_hash": ...}
"""
import hashlib
import json
import sys

from safetensors import safe_open
from safetensors.torch import load_file, save


def main():
    path = sys.argv[1]
    with safe_open(path, framework="pt") as f:
        metadata = {k: v for k, v in (f.metadata() or {}).items() if k.startswith("ss_")}
    serialised = save(load_file(path), metadata)
    header = int.from_bytes(serialised[:8], "little")
    print(json.dumps({
        "sshs_model_hash": hashlib.sha256(serialised[8 + header:]).hexdigest(),
        "sshs_legacy_hash": hashlib.sha256(serialised[0x100000:0x110000]).hexdigest()[:8],
    }))


if __name__ == "__main__":
    main()
