"""How well do cheap signals find the clean-state oracle's rows? (a lab probe, not a repair)

For each case: prefill the pre-edit history, apply the edit under ``oracle@<b>`` and, inside the
oracle's selection, score every stale row by candidate signals. For each signal it reports the
share of the oracle's own deviation mass (Σ ‖ΔK‖² + ‖ΔV‖² over all layers, clean vs Shift) that
its top-B rows capture, and its overlap with the oracle's top-B. 1.0 = the oracle's rows.

Signals and what computing them would cost at repair time:

- ``deviation@layer<l>``: the K/V deviation at one layer (needs a clean prefill through l+1 layers);
- ``deleted_attention@...``: each row's true attention mass on the removed rows (Cache-Craft's
  signal; needs a forward of the dirty suffix through that layer);
- ``exposure_estimate@layer<l>`` and ``exposure`` (the allocator): the same attention with each
  row's query estimated from its cached K/V (:mod:`kvmemory.selection.exposure`; no forward);
  ``exposure_inserted_only``: the estimated mass on the inserted text in the edited prompt (a
  forward of the inserted tokens, :func:`inserted_exposure`), and its max / sum with ``exposure``;
- ``<signal>@<layer set>`` (``quarters``, ``every4``, ``every2``, ``all``, ...): a signal averaged
  over a set of layers (which layers the estimate should probe);
- ``sur``, ``template``, ``head+template``, ``nearest_to_*``, ``shift_norm*``: text or cache
  geometry only (free).

The probe swaps the oracle's entry of the allocator registry for ``analyse`` while it runs (lab
code: the repair itself then proceeds as ``oracle@<b>``).

Usage:
  OMP_NUM_THREADS=1 .venv/bin/python benchmarks/oracle_row_overlap.py --model qwen2.5-coder-0.5b \
      --task niah --lengths 2048 --cases 4 --budget 10 --out benchmarks/results/oracle_row_overlap/niah2k
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from kvmemory import kvcache
from kvmemory.models import load_model
from kvmemory.policy import RepairPolicy
from kvmemory.selection import allocators as registry
from kvmemory.selection.allocators import select
from kvmemory.selection.exposure import estimated_exposure, probe_layers
from kvmemory.selection.intervals import to_intervals
from kvmemory.selection.signals import capture_attention, decoder_layers, eager_attention, forward_at, stop_after
from kvmemory.session import KVSession
from kvmemory_lab.bench.quality import build_cases
from kvmemory_lab.demo_cases import default_data_dir
from kvmemory_lab.gguf_models import resolve_model


def per_layer_deviation(signals, rows: torch.Tensor) -> torch.Tensor:
    """[layers, S]: ‖ΔK‖² + ‖ΔV‖² between the clean cache and the Shift cache per layer."""
    out = []
    for clean, shifted in zip(signals.clean_cache().layers, signals.shift_cache().layers):
        d = torch.zeros(len(rows))
        for a, b in ((clean.keys, shifted.keys), (clean.values, shifted.values)):
            d += (a[0][:, rows].float() - b[0][:, rows].float()).square().sum(dim=(0, 2))
        out.append(d)
    return torch.stack(out)


def norms(signals, rows: torch.Tensor) -> torch.Tensor:
    """[layers, S]: ‖K‖² + ‖V‖² of the Shift cache's rows (free: no forward)."""
    out = []
    for layer in signals.shift_cache().layers:
        out.append(layer.keys[0][:, rows].float().square().sum(dim=(0, 2))
                   + layer.values[0][:, rows].float().square().sum(dim=(0, 2)))
    return torch.stack(out)


def deleted_attention_per_layer(signals) -> torch.Tensor:
    """[layers, S]: each stale row's attention mass on the deleted keys in the dirty forward,
    per layer (Cache-Craft's signal before its layer average)."""
    old_rows = signals.old_rows()
    n = len(decoder_layers(signals.model))
    last = old_rows[-1] + 1
    deleted = torch.as_tensor(signals.removed_rows(), dtype=torch.long)
    mass = torch.zeros(n, last)

    def sink(layer, w):  # w [1, heads, q, k] over the whole dirty prompt
        q = w.shape[2]
        mass[layer, :q] = w[0][..., deleted].sum(dim=-1).mean(dim=0)[:last] if len(deleted) else 0

    cache = kvcache.new_cache(signals.model.config)
    with eager_attention(signals.model), capture_attention(signals.model, sink):
        forward_at(signals.model, cache, signals.old_ids[:last], 0)
    return mass[:, torch.as_tensor(old_rows)]


def inserted_exposure(signals) -> torch.Tensor:
    """[S]: each stale row's estimated attention mass on the inserted text in the edited prompt.

    The inserted rows (positions of the retained context that no stale row holds) are forwarded
    span by span through the probed layers on a copy of the Shift cache, each attending to the
    rows before it; then the stale rows' predicted queries, at their new positions, attend over
    that cache. With the kept rows' logits unchanged, max(removed mass, inserted mass) is the
    total-variation distance between a row's dirty and clean attention."""
    stale = set(signals.eligible)
    inserted = [p for p in range(signals.exact_prefix, signals.context_end) if p not in stale]
    if not inserted:
        return torch.zeros(len(signals.eligible))
    layers = probe_layers(len(decoder_layers(signals.model)))
    depth = max(layers) + 1
    cache = kvcache.clone_cache(signals.shift_cache())
    for a, b in to_intervals(inserted):
        part = kvcache.prefix_copy(cache, a)
        with stop_after(signals.model, depth):
            forward_at(signals.model, part, signals.token_ids[a:b], a)
        for mine, theirs in zip(cache.layers[:depth], part.layers[:depth]):
            mine.keys[:, :, a:b], mine.values[:, :, a:b] = theirs.keys[:, :, a:b], theirs.values[:, :, a:b]
    return estimated_exposure(signals.model, cache, signals.eligible, inserted, signals.shifter,
                              signals.calibration_ids(), layers)


def template_mask(inp) -> torch.Tensor:
    """[S] bool: the stale row is a chat-template token (outside every message's content)."""
    inside = torch.zeros(len(inp.token_ids), dtype=torch.bool)
    for m in inp.messages:
        for p in range(m.token_start, m.token_end):
            a, b = inp.offsets[p]
            inside[p] = m.content_start <= a and b <= m.content_end and b > a
    return ~inside[torch.as_tensor(list(inp.eligible))]


def layer_sets(L: int) -> dict[str, list[int]]:
    """Candidate sets of probed layers, named by how they are chosen."""
    return {"quarters": sorted({(L * k) // 4 for k in (1, 2, 3)}), "every4": list(range(2, L, 4)), "every2": list(range(1, L, 2)),
            "all": list(range(L)), "upper_half": list(range(L // 2, L)), "middle_half": list(range(L // 4, (3 * L) // 4))}


def topk_set(scores: torch.Tensor, k: int) -> set[int]:
    return set(torch.argsort(-scores, stable=True)[:k].tolist())


def analyse(inp, B, signals, seed, record: dict) -> list[int]:
    rows = torch.as_tensor(list(inp.eligible))
    S = len(rows)
    dev = per_layer_deviation(signals, rows)  # [L, S]
    total = dev.sum(dim=0)
    L = dev.shape[0]
    oracle = topk_set(total.sqrt(), B)
    best_mass = total[list(oracle)].sum().item()
    cands: dict[str, torch.Tensor] = {}
    for l in range(L):
        cands[f"deviation@layer{l}"] = dev[l]
    cands["deviation@layers0-3"] = dev[:4].sum(dim=0)
    nrm = norms(signals, rows)
    cands["shift_norm@all"] = nrm.sum(dim=0)
    cands["shift_norm@upper_half"] = nrm[L // 2 :].sum(dim=0)
    cands["shift_vnorm@last"] = nrm[-1]
    att = deleted_attention_per_layer(signals)
    cands["deleted_attention@mean"] = att.mean(dim=0)
    for l in range(L):
        cands[f"deleted_attention@layer{l}"] = att[l]
    cands["deleted_attention@layers0-2"] = att[:3].mean(dim=0)
    cands["deleted_attention@upper_half"] = att[L // 2 :].mean(dim=0)
    old_rows, removed = signals.old_rows(), signals.removed_rows()
    removed_mass, inserted_mass = signals.removed_exposure(), inserted_exposure(signals)
    cands["exposure (allocator: layers " + ",".join(map(str, probe_layers(L))) + ")"] = removed_mass
    cands["exposure_inserted_only"] = inserted_mass
    cands["exposure_max(removed,inserted)"] = removed_mass.maximum(inserted_mass)
    cands["exposure_removed+inserted"] = removed_mass + inserted_mass
    estimate = torch.stack([estimated_exposure(signals.model, signals.dirty_cache, old_rows, removed, signals.shifter,
                                               signals.calibration_ids(), layers=[l]) for l in range(L)])
    for l in range(L):
        cands[f"exposure_estimate@layer{l}"] = estimate[l]
    for name, chosen in layer_sets(L).items():  # which layers to average: estimate vs true attention
        cands[f"exposure_estimate@{name}"] = estimate[chosen].mean(dim=0)
        cands[f"deleted_attention@{name}"] = att[chosen].mean(dim=0)
    tmpl = template_mask(inp).float()
    head = (torch.arange(S) < B // 3).float()
    cands["template"] = tmpl
    cands["head+template"] = 2 * head + tmpl
    cands["nearest_to_edit"] = -torch.arange(S, dtype=torch.float32)
    cands["nearest_to_query"] = torch.arange(S, dtype=torch.float32)
    emb = signals.model.get_input_embeddings().weight
    sur = set(inp.eligible.index(p) for p in select("sur", inp, B, embedding=emb, seed=seed))
    scores = {"sur": sur, **{k: topk_set(v, B) for k, v in cands.items()}}
    record["S"], record["B"] = S, B
    record["layer_share_of_deviation"] = (dev.sum(dim=1) / dev.sum()).tolist()
    record["signals"] = {
        k: {"mass": total[list(v)].sum().item() / best_mass, "overlap": len(v & oracle) / B} for k, v in scores.items()
    }
    record["oracle_rows"] = sorted(inp.eligible[k] for k in oracle)
    record["oracle_tokens"] = [int(signals.token_ids[inp.eligible[k]]) for k in sorted(oracle)]
    return sorted(inp.eligible[k] for k in oracle)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen2.5-coder-0.5b")
    p.add_argument("--task", default="niah")
    p.add_argument("--lengths", default="2048")
    p.add_argument("--cases", type=int, default=6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget", type=float, default=10)
    p.add_argument("--edits", default="delete,replace,summary")
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    loaded = load_model(resolve_model(a.model))
    settings = {"task": a.task, "lengths": [int(x) for x in a.lengths.split(",")], "cases": a.cases,
                "seed": a.seed, "edits": a.edits.split(",") if a.task == "qa" else None,
                "datasets": ["hotpotqa"]}
    cases = build_cases(settings, Path(default_data_dir()), loaded.tokenizer)
    a.out.mkdir(parents=True, exist_ok=True)
    session = KVSession(loaded.model, loaded.tokenizer)
    records = []
    for case in cases:
        record = {"case_id": case.case_id}
        registry.SIGNAL_ALLOCATORS["oracle"] = lambda inp, B, s, seed: analyse(inp, B, s, seed, record)
        session.reset()
        session.prepare(case.dirty_messages())
        session.fork().prepare(case.edited_messages(), policy=RepairPolicy.coerce(f"oracle@{a.budget:g}"))
        record["oracle_token_text"] = [loaded.tokenizer.decode([t]) for t in record.pop("oracle_tokens")]
        records.append(record)
        print(case.case_id, json.dumps({k: round(v["mass"], 2) for k, v in record["signals"].items()}), flush=True)
        (a.out / "records.json").write_text(json.dumps(records, indent=1))
    L = len(records[0]["layer_share_of_deviation"])
    shown = {"sur", "template", "head+template", "nearest_to_edit", "nearest_to_query", "shift_norm@all",
             "deleted_attention@mean", *(k for k in records[0]["signals"] if k.startswith("exposure (")),
             *(f"deviation@layer{l}" for l in (1, 3, 5, L // 2, L - 1)),
             *(f"deleted_attention@layer{l}" for l in (0, 1, L // 4, L // 2, (3 * L) // 4, L - 1)),
             *(f"exposure_estimate@layer{l}" for l in (L // 4, L // 2, (3 * L) // 4)),
             *(f"{kind}@{name}" for name in layer_sets(L) for kind in ("exposure_estimate", "deleted_attention"))}
    keys = [k for k in records[0]["signals"] if k in shown]
    table = ["| signal | deviation mass captured (mean) | overlap with oracle top-B (mean) |", "|---|---|---|"]
    for k in sorted(keys, key=lambda k: -sum(r["signals"][k]["mass"] for r in records)):
        m = sum(r["signals"][k]["mass"] for r in records) / len(records)
        o = sum(r["signals"][k]["overlap"] for r in records) / len(records)
        table.append(f"| {k} | {m:.2f} | {o:.2f} |")
    table.append(f"\n{len(records)} cases ({', '.join(r['case_id'] for r in records)}), B = {a.budget:g} % of S; "
                 "every layer's figures are in records.json")
    (a.out / "summary.md").write_text("\n".join(table) + "\n")
    print("\n".join(table))


if __name__ == "__main__":
    main()
