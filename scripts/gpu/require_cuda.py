"""Prints why this Python cannot run the GPU targets (nothing when it can): read by the Makefile at parse time, so
`make gpu-check` / `make test-gpu` / `make node` stop at once in one line (exit 2) on a machine without CUDA."""

import sys

try:
    import torch
except Exception as exc:  # noqa: BLE001 — any import failure is the reason
    print(f"no CUDA device: {sys.executable} cannot import torch ({type(exc).__name__}: {exc})")
else:
    if not torch.cuda.is_available():
        print(f"no CUDA device: torch {torch.__version__} ({sys.executable}) sees none "
              "(torch.cuda.is_available() is False); the CPU smoke of gpu-check runs in make test")
