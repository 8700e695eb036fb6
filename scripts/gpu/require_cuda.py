"""Prints why this Python cannot run the GPU targets and exits 2 (nothing, exit 0, when it can): read by the
Makefile at parse time, so `make gpu-check` / `make test-gpu` / `make node` stop at once in one line (exit 2) on a
machine without CUDA."""

import sys


def reason() -> str | None:
    """The one line saying why no CUDA device is usable here, or None when torch sees one."""
    try:
        import torch
    except Exception as exc:  # noqa: BLE001 — any import failure is the reason
        return f"no CUDA device: {sys.executable} cannot import torch ({type(exc).__name__}: {exc})"
    if not torch.cuda.is_available():
        return (f"no CUDA device: torch {torch.__version__} ({sys.executable}) sees none "
                "(torch.cuda.is_available() is False); the CPU smoke of gpu-check runs in make test")
    return None


if __name__ == "__main__":
    why = reason()
    if why:
        print(why)
        sys.exit(2)
