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
    venv.create(env_dir, with_pip=False)  # this environment's pip installs into it (--python): no ensurepip run
    python = env_dir / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    (site / "harness_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index",
                    str(wheel)], check=True, capture_output=True, timeout=300)
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


# Standard-library names by the Python that added them, after the lowest requires-python may declare (3.10): a module,
# ``module.name``, a builtin, or ``.method`` (any attribute of that name)
NEWER_STDLIB = {
    (3, 11): {"tomllib", "wsgiref.types", "typing.Self", "typing.LiteralString", "typing.Never", "typing.assert_never",
              "typing.assert_type", "typing.reveal_type", "typing.Required", "typing.NotRequired",
              "typing.TypeVarTuple", "typing.Unpack", "typing.dataclass_transform", "typing.get_overloads",
              "datetime.UTC", "enum.StrEnum", "enum.ReprEnum", "enum.verify", "enum.member", "enum.nonmember",
              "enum.global_enum", "asyncio.TaskGroup", "asyncio.timeout", "asyncio.Runner", "contextlib.chdir",
              "hashlib.file_digest", "operator.call", "math.cbrt", "math.exp2", "logging.getLevelNamesMapping",
              "ExceptionGroup", "BaseExceptionGroup", ".add_note"},
    (3, 12): {"typing.override", "typing.TypeAliasType", "itertools.batched", "calendar.Month", "calendar.Day",
              "sys.monitoring", "os.path.isjunction", "math.sumprod"},
    (3, 13): {"warnings.deprecated", "copy.replace", "typing.ReadOnly", "typing.TypeIs", "typing.NoDefault"},
}
# run only by the repository's own Python (CI's, 3.11) to read pyproject.toml, never on a user's node
NEWER_ALLOWED = {"scripts/compat.py": {"tomllib"}}


def _newer_uses(tree, floor: tuple[int, int]) -> list[tuple[int, str, tuple[int, int]]]:
    """``(line, name, version)`` of each standard-library name of :data:`NEWER_STDLIB` newer than ``floor`` that the
    module imports or reaches (``module.name`` through its imports, a builtin, a ``.method``): one walk of the tree."""
    import ast

    newer = {name: v for v, names in NEWER_STDLIB.items() if v > floor for name in names}
    aliases, found, reached = {}, [], []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            reached.append(node)
        elif isinstance(node, ast.Name):
            if node.id in newer:
                reached.append(node)
        elif isinstance(node, ast.Import):
            for a in node.names:
                aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
                if a.name in newer:
                    found.append((node.lineno, a.name, newer[a.name]))
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                for name in (node.module, f"{node.module}.{a.name}"):
                    if name in newer:
                        found.append((node.lineno, name, newer[name]))
    for node in reached:
        if isinstance(node, ast.Name):
            if node.id not in aliases:
                found.append((node.lineno, node.id, newer[node.id]))
            continue
        if f".{node.attr}" in newer:
            found.append((node.lineno, f".{node.attr}", newer[f".{node.attr}"]))
        parts, inner = [node.attr], node.value
        while isinstance(inner, ast.Attribute):
            parts.append(inner.attr)
            inner = inner.value
        if isinstance(inner, ast.Name) and inner.id in aliases:
            dotted = [aliases[inner.id], *reversed(parts)]
            for k in range(len(dotted), 1, -1):
                if ".".join(dotted[:k]) in newer:
                    found.append((node.lineno, ".".join(dotted[:k]), newer[".".join(dotted[:k])]))
                    break
    return found


def test_the_code_needs_no_python_newer_than_requires_python():
    """pyproject.toml's ``requires-python`` floor is what the code may use: every module of the package, the scripts
    (``scripts/gpu`` runs on a node's own Python) and the tests parses under that version's grammar (``ast.parse``'s
    ``feature_version``: no ``except*`` below 3.11) and uses no standard-library name added after it
    (:data:`NEWER_STDLIB`). Only Python 3.11 runs the suite here (docs/development.md#tested-versions): this is what
    stands for the older ones."""
    import ast
    import re

    spec = re.search(r'^requires-python\s*=\s*"([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    floor = tuple(int(x) for x in re.fullmatch(r">=\s*(\d+)\.(\d+)", spec).groups())
    assert floor <= sys.version_info[:2]
    files = sorted(p for d in ("spark_bench", "scripts", "tests") for p in (ROOT / d).rglob("*.py"))
    assert len(files) > 100
    problems = []
    for path in files:
        rel = path.relative_to(ROOT).as_posix()
        source = path.read_text(encoding="utf-8")
        try:
            tree = ast.parse(source, filename=rel, feature_version=floor)
        except SyntaxError as err:
            problems.append(f"{rel}:{err.lineno}: not Python {floor[0]}.{floor[1]} syntax: {err.msg}")
            continue
        for line, name, version in _newer_uses(tree, floor):
            if name not in NEWER_ALLOWED.get(rel, ()):
                problems.append(f"{rel}:{line}: {name} needs Python {version[0]}.{version[1]}")
    assert not problems, "\n".join(problems)


def test_the_python_check_sees_newer_syntax_and_names():
    """The check above catches what it is for: ``except*`` (3.11 grammar), ``tomllib``, ``typing.Self`` imported or
    reached, ``datetime.UTC`` through an alias, ``.add_note``; nothing in code that stays within 3.10."""
    import ast

    with pytest.raises(SyntaxError):
        ast.parse("try:\n    pass\nexcept* ValueError:\n    pass\n", feature_version=(3, 10))
    code = ("import tomllib\nimport datetime as dt\nfrom typing import Self\nimport typing\n"
            "x = dt.UTC\ny: typing.Self\ne = ValueError()\ne.add_note('n')\nz = ExceptionGroup('g', [e])\n")
    found = {(line, name) for line, name, _ in _newer_uses(ast.parse(code), (3, 10))}
    assert found == {(1, "tomllib"), (3, "typing.Self"), (5, "datetime.UTC"), (6, "typing.Self"), (8, ".add_note"),
                     (9, "ExceptionGroup")}
    assert _newer_uses(ast.parse("import datetime\nfrom typing import Optional\nx = datetime.timezone.utc\n"),
                       (3, 10)) == []
    assert _newer_uses(ast.parse("import tomllib\n"), (3, 11)) == []
