// Translation unit that carries the shared LibTorch precompiled header.
