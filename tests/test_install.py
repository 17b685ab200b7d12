"""The runtime installs and runs alone: no lab, LangChain or plotting code or dependency.

``pip install .`` must give a working ``KVSession`` without hypothesis, matplotlib, rich,
langchain or langgraph. Here ``runtime_check.py`` runs a real repair in a child interpreter
that refuses those imports (as in a clean venv); the wheel's file list and metadata are checked for lab code.
``make install-check`` runs the same script in a clean venv after a plain ``pip install .``.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from runtime_check import LAB_ONLY

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.real_model
def test_runtime_repairs_without_lab_or_langchain_dependencies():
    out = subprocess.run([sys.executable, str(ROOT / "tests" / "runtime_check.py"), "--refuse", ",".join(LAB_ONLY)],
                         capture_output=True, text=True, timeout=600, cwd=ROOT / "tests")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "lab/LangChain modules loaded: []" in out.stdout, out.stdout


def test_wheel_holds_only_the_runtime(tmp_path):
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q",
                            "-w", str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = tmp_path.glob("kvmemory-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        metadata = zf.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
        sources = {n: zf.read(n).decode() for n in names if n.endswith(".py")}
    packages = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert packages == {"kvmemory", "langchain_kvmemory"}
    lab_words = ("bench", "fuzz", "harness", "evaluation", "invariants", "calibration", "trajectory", "demo",
                 "cli.py", "metrics.py")
    assert not [n for n in sources if any(w in n for w in lab_words)]
    assert not [n for n, text in sources.items() if "matplotlib" in text or "hypothesis" in text]
    runtime_requires = [line for line in metadata.splitlines()
                        if line.startswith("Requires-Dist:") and "extra ==" not in line]
    assert runtime_requires, metadata[:2000]
    for name in ("langchain", "langgraph", "hypothesis", "matplotlib", "rich", "tqdm", "xgrammar"):
        assert not [r for r in runtime_requires if r.split()[1].lower().startswith(name)], runtime_requires
    assert any("extra == \"langchain\"" in line and "langgraph" in line for line in metadata.splitlines())
