"""The package's layers, enforced: imports point down only and no module imports its way in a circle.

The contracts live in ``.importlinter`` at the repository's root (import-linter's own format):
layers ``tools > cluster > serving > tiers > cache > metrics | text > config``,
``pallas_kernels`` importing nothing from ``kvjax``, and no cycle between sibling modules at
any depth. Imports inside functions count, so a cycle cannot hide in a late import.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).with_name("lint-imports")


def test_layer_contracts_hold():
    if not LINT.exists():
        pytest.fail(f"{LINT} not found: install the test extra (pip install -e '.[test]'), which brings import-linter")
    result = subprocess.run([str(LINT), "--config", str(ROOT / ".importlinter")], cwd=ROOT, capture_output=True,
                            text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout


def test_a_broken_contract_is_reported(tmp_path):
    # The check above can fail: an upward import (cache -> serving) breaks the layers contract.
    package = tmp_path / "layered"
    for layer in ("low", "high"):
        (package / layer).mkdir(parents=True)
        (package / layer / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "low" / "mod.py").write_text("def f():\n    from layered.high import mod  # a late import counts\n")
    (package / "high" / "mod.py").write_text("")
    config = tmp_path / ".importlinter"
    config.write_text("[importlinter]\nroot_package = layered\n\n[importlinter:contract:c]\nname = c\n"
                      "type = layers\nlayers =\n    layered.high\n    layered.low\n")  # fmt: skip
    result = subprocess.run([str(LINT), "--config", str(config)], cwd=tmp_path, capture_output=True, text=True,
                            timeout=300, env={**os.environ, "PYTHONPATH": str(tmp_path)})  # fmt: skip
    assert result.returncode != 0 and "layered.low.mod -> layered.high.mod" in result.stdout
