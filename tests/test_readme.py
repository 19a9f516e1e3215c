"""Every ```python block of README.md runs as written: in a fresh interpreter, from an empty
temporary folder (so nothing of the checkout's folder is at hand but the installed package).

A fragment that is not meant to run must not be fenced as python (use ```text or no
language); this test is what keeps the README's examples true.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text(encoding="utf-8")
PYTHON_BLOCKS = re.findall(r"^```python[ \t]*\n(.*?)^```[ \t]*$", README, flags=re.S | re.M)


def test_the_readme_has_python_examples():
    assert len(PYTHON_BLOCKS) >= 2  # the Engine and the library examples


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=[f"block{i}" for i in range(len(PYTHON_BLOCKS))])
def test_readme_python_block_runs(block, tmp_path):
    # PYTHONPATH: the checkout under test, as an editable install would provide it.
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, "-c", block], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, f"README block failed:\n{block}\n--- stderr:\n{result.stderr[-4000:]}"
    assert "Traceback" not in result.stderr
