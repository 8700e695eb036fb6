"""A normal install works: the built wheel, in a fresh virtual environment with no repository on the path, carries
its configs (the repository's ``conf/``, shipped as ``spark_bench/conf``), resolves a config and runs a tiny model from any directory."""

import json
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The wheel built from this checkout, installed (no dependencies) into a fresh venv that sees the harness's
    dependencies through a path entry to this environment's site-packages — whose ``.pth`` files, the editable
    install of the repository among them, a path entry does not run."""
    tmp = tmp_path_factory.mktemp("install")
    source = tmp / "source"  # setuptools builds in the source tree: build a copy, never write into the checkout
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for name in ("spark_bench", "conf"):
        shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp / "dist"), str(source)], check=True, capture_output=True, timeout=300)
    (wheel,) = (tmp / "dist").glob("spark_bench-*.whl")
    env_dir = tmp / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    (site / "harness_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True,
                   capture_output=True, timeout=300)
    return env_dir, tmp


def test_the_wheel_is_imported_from_the_venv_not_the_repository(installed):
    env_dir, tmp = installed
    where = subprocess.run([str(env_dir / "bin" / "python"), "-c", "import spark_bench.cli as c; "
                            "print(c.__file__); print(c.CONF_DIR)"], cwd=tmp, capture_output=True, text=True,
                           check=True).stdout.split()
    assert all(str(env_dir) in w and str(ROOT) not in w for w in where)
    assert (Path(where[1]) / "config.yaml").is_file() and (Path(where[1]) / "experiment" / "table1.yaml").is_file()


def test_cfg_job_and_a_tiny_run_outside_the_repository(installed):
    env_dir, tmp = installed
    tool = str(env_dir / "bin" / "spark-bench")
    job = subprocess.run([tool, "model=tiny-llama", "method=snapkv+spark", "ratio=0.8", "--cfg", "job"], cwd=tmp,
                         capture_output=True, text=True, timeout=120)
    assert job.returncode == 0, job.stderr
    assert "name: tiny-llama" in job.stdout and "ratio: 0.8" in job.stdout
    out = tmp / "out"
    run = subprocess.run([tool, "model=tiny-llama", "benchmark.tasks=[niah_single_1]", "benchmark.length=512",
                          "benchmark.num_samples=1", "benchmark.max_new_tokens=3", "method=snapkv+spark",
                          "ratio=0.5", "budget=64", f"output_root={out}", "run=tiny", "progress=false"],
                         cwd=tmp, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    (line,) = (out / "tiny" / "predictions.jsonl").read_text().splitlines()
    assert json.loads(line)["config"] == "SnapKV+SparK(0.5) @64"
