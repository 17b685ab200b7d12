"""The README is for users: short, and everything it shows works.

Its Python blocks run as written (in a fresh interpreter, in an empty folder, on the embedded
model); its shell blocks name make targets, extras and folders that exist; its links resolve.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"^```(\w*)\n(.*?)^```", README, flags=re.S | re.M)
PYTHON_BLOCKS = [code for lang, code in BLOCKS if lang == "python"]


def test_readme_is_short_and_has_no_development_history():
    assert len(README.splitlines()) <= 200
    assert not re.search(r"\bissue[- ]?\d|#\d{1,4}\b|changelog", README, flags=re.I)
    assert len(PYTHON_BLOCKS) >= 2 and all(lang in ("python", "bash") for lang, _ in BLOCKS)


@pytest.mark.real_model
@pytest.mark.parametrize("index", range(len(PYTHON_BLOCKS)))
def test_readme_python_block_runs_as_written(index, tmp_path):
    script = tmp_path / "block.py"
    script.write_text(PYTHON_BLOCKS[index])
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip(), "the block prints what it did"


def test_readme_shell_blocks_name_targets_extras_and_folders_that_exist():
    makefile = (ROOT / "Makefile").read_text()
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    shell = "\n".join(code for lang, code in BLOCKS if lang == "bash")
    for target in re.findall(r"^make (\S+)", shell, flags=re.M):
        assert re.search(rf"^{re.escape(target)}:", makefile, flags=re.M), target
    for named in re.findall(r'pip install "\.\[([\w,]+)\]"', shell):
        assert set(named.split(",")) <= extras, named
    for folder in re.findall(r"pip install (\./\S+)", shell):
        assert (ROOT / folder / "pyproject.toml").is_file(), folder


def test_readme_links_resolve():
    for target in re.findall(r"\]\(([^)#]+)\)", README):
        if not target.startswith("http"):
            assert (ROOT / target).exists(), target
