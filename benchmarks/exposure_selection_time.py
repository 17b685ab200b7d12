"""How long does the ``exposure`` allocator's selection take on one real case? (a lab timing)

Prefills one Erasing-NIAH case's history, then times
:func:`kvmemory.selection.exposure.estimated_exposure` on the removed rows over the default probe
layers (the query predictors fitted beforehand, as a warm session has them).
With ``--reference PATH`` (a copy of another version of ``exposure.py``, e.g.
``git show <rev>:kvmemory/selection/exposure.py > /tmp/exposure_ref.py``) the two versions run in
interleaved trials and their scores are compared.

Usage:
  OMP_NUM_THREADS=1 .venv/bin/python benchmarks/exposure_selection_time.py --length 4096 --seed 1 \\
      --reference /tmp/exposure_ref.py
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import time
from pathlib import Path

import torch

from kvmemory.models import load_model
from kvmemory.selection import exposure
from kvmemory.session import KVSession
from kvmemory.shift import RotaryShifter
from kvmemory_lab.bench.quality import build_cases
from kvmemory_lab.demo_cases import default_data_dir
from kvmemory_lab.gguf_models import resolve_model


def load_reference(path: Path):
    spec = importlib.util.spec_from_file_location("exposure_reference", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen2.5-coder-0.5b")
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--seed", type=int, default=1, help="case seed (1: cases no fidelity result reports)")
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--reference", type=Path, help="another version of exposure.py to compare with")
    a = p.parse_args()
    loaded = load_model(resolve_model(a.model))
    settings = {"task": "niah", "lengths": [a.length], "cases": 1, "seed": a.seed, "edits": None, "datasets": ["hotpotqa"]}
    case = build_cases(settings, Path(default_data_dir()), loaded.tokenizer)[0]
    session = KVSession(loaded.model, loaded.tokenizer)
    session.prepare(case.dirty_messages())
    start, end = case.meta["deleted_span"]  # the removed needle; every later row is stale
    removed, old_rows = list(range(start, end)), list(range(end, len(session.token_ids)))
    ids = loaded.tokenizer(exposure.CALIBRATION_TEXT, add_special_tokens=False)["input_ids"]
    layers = exposure.probe_layers(loaded.model.config.num_hidden_layers)
    exposure.fit_query_predictors(loaded.model, ids, layers)
    versions = {"current": exposure}
    if a.reference:
        versions["reference"] = reference = load_reference(a.reference)
        reference._FITS[loaded.model] = exposure._FITS[loaded.model]  # the same fit: time the scoring only
    seconds, scores = {k: [] for k in versions}, {}
    shifter = RotaryShifter(loaded.model)
    for _ in range(a.trials):
        for name, module in versions.items():
            t0 = time.perf_counter()
            score = getattr(module, "estimated_exposure", None) or module.removed_exposure  # an older module's name
            scores[name] = score(loaded.model, session.cache, old_rows, removed, shifter, ids, layers=layers)
            seconds[name].append(time.perf_counter() - t0)
    result = {"case": case.case_id, "N": len(session.token_ids), "S": len(old_rows), "layers": len(layers),
              "threads": torch.get_num_threads(), "load": os.getloadavg(),
              "seconds": seconds, "median_s": {k: statistics.median(v) for k, v in seconds.items()}}
    if a.reference:
        result["max_abs_difference"] = (scores["current"] - scores["reference"]).abs().max().item()
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
