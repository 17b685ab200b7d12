"""Run a KVSession repair with the runtime alone; exit 0 when it works.

    python tests/runtime_check.py                      # in a venv that holds only `pip install .`
    python tests/runtime_check.py --refuse rich,...    # here: those imports fail as if not installed

Checks that none of the lab/LangChain packages is installed, imports every runtime module (but
the Triton kernels, an extra), deletes a tool result from a history on the embedded model and
requires a repair that reused and recomputed rows, with no lab/LangChain/plotting module loaded.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import pkgutil
import sys

LAB_ONLY = ("hypothesis", "matplotlib", "rich", "langchain", "langchain_core", "langgraph", "xgrammar",
            "kvmemory_lab", "langchain_kvmemory")
# what a plain `pip install .` must not install (rich is left out: transformers' CLI, typer, brings it)
NOT_INSTALLED = ("hypothesis", "matplotlib", "langchain", "langchain_core", "langgraph", "xgrammar", "kvmemory_lab")
HISTORY = [
    {"role": "system", "content": "You answer from the tool results.", "id": "sys"},
    {"role": "user", "content": "Where is the tower?", "id": "u1"},
    {"role": "tool", "content": "The tower stands in Belem, by the river.", "id": "t1"},
    {"role": "tool", "content": "Trams run every ten minutes.", "id": "t2"},
    {"role": "user", "content": "Answer in one word.", "id": "q"},
]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--refuse", default="", help="comma-separated packages to treat as not installed")
    args = parser.parse_args()
    for name in filter(None, args.refuse.split(",")):
        sys.modules[name] = None  # `import name` raises ImportError; find_spec(name) answers None
    present = [name for name in NOT_INSTALLED if importlib.util.find_spec(name) is not None]
    if present:
        print(f"not a runtime-only environment: {present} importable")
        return 1
    import kvmemory

    for info in pkgutil.walk_packages(kvmemory.__path__, "kvmemory."):
        if not info.name.startswith("kvmemory.kernels"):  # the `triton` extra
            importlib.import_module(info.name)
    from kvmemory import KVSession, RepairPolicy, load_model

    lm = load_model()
    session = KVSession(lm.model, lm.tokenizer, RepairPolicy(budget=5))
    session.prepare(HISTORY)
    report = session.prepare([m for m in HISTORY if m["id"] != "t1"])
    loaded = sorted(m for m, mod in sys.modules.items() if mod is not None and m.split(".")[0] in LAB_ONLY)
    print(f"repair: reused {report.reused_tokens}, recomputed {report.recomputed_tokens}, fallback {report.fallback}; "
          f"lab/LangChain modules loaded: {loaded}")
    return 0 if report.reused_tokens > 0 and report.recomputed_tokens > 0 and not loaded else 1


if __name__ == "__main__":
    sys.exit(main())
