"""kvmemory's row-level edits on the engine's cache layout (one K and one V buffer
``[layers, kv_heads, capacity, head_dim]`` per session), against today's DynamicCache.

Scenario (fp32, the embedded model): a ~2,000-token prompt x = p + e + s is cached; the span e
(a middle chunk) is deleted. Then, on both layouts:
  * delete:  move rows [b, n) down to [a, n - e) -- one strided copy over all layers at once
             on the engine buffer; ``kvcache.gather_rows`` (a new cache, 60 tensors) today;
  * Shift:   rotate the moved keys by -e positions with kvmemory's own RotaryShifter, applied to
             the whole [layers, kv_heads, S, head_dim] block in one call (today: once per layer);
  * Replay:  recompute rows [a, n - e) in place (engine.forward_rows, the direct executor's
             recurrence) -- the exact repair;
and compares next-token logits with a Re-prefill of p + s (max-abs, KL), timing each op
(median of 3). Shows that the decode-friendly layout keeps delete / rotate / rewrite-in-place.

Run: OMP_NUM_THREADS=2 .venv/bin/python benchmarks/engine_prototype/cache_ops.py   (~1 min)
"""

from __future__ import annotations

import json
import statistics
import time

import torch

import common
from engine import Engine
from kvmemory import kvcache
from kvmemory.executors.sequential import forward_rows
from kvmemory.shift import RotaryShifter


def timed3(fn):
    times = []
    for _ in range(3):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return out, statistics.median(times)


@torch.no_grad()
def main():
    lm = common.load("fp32")
    ids = common.prompt_ids(lm.tokenizer, 2000)
    n, a, b = ids.shape[0], 600, 900  # delete rows [600, 900): 300 rows, suffix of 1,100 moves
    e, edited = b - a, torch.cat([ids[:a], ids[b:]])
    s = n - b
    shifter = RotaryShifter(lm.model)
    coeffs = shifter.coefficients(torch.arange(b, n), torch.arange(a, a + s))
    report = {"n": n, "deleted": [a, b], "moved_rows": s, "load": common.loadavg()}

    # Re-prefill reference of the edited prompt
    ref_cache = kvcache.new_cache(lm.model.config)
    ref = forward_rows(lm.model, ref_cache, edited, 0)

    # ---- engine layout
    eng = Engine(lm.model, fmt="fp32", head="fp32", max_len=n + 64)
    eng.forward_rows(ids, 0)
    K, V = eng.k_cache, eng.v_cache
    snapshot = (K.clone(), V.clone())

    def eng_delete_shift():
        K.copy_(snapshot[0]); V.copy_(snapshot[1])
        t = time.perf_counter()
        K[:, :, a:a + s] = K[:, :, b:n].clone()  # overlapping move: copy the source first
        V[:, :, a:a + s] = V[:, :, b:n].clone()
        t_move = time.perf_counter() - t
        t = time.perf_counter()
        K[:, :, a:a + s] = shifter.apply(K[:, :, a:a + s], coeffs)  # all 30 layers in one call
        return t_move, time.perf_counter() - t

    (eng_move, eng_rot), _ = timed3(eng_delete_shift)
    shift_logits = eng.forward_rows(edited[-1:], n - e - 1)  # recompute the last row only
    report["engine"] = {"delete_move_ms": round(eng_move * 1e3, 2), "shift_rotate_ms": round(eng_rot * 1e3, 2),
                        "shift_vs_reprefill": common.logits_diff(ref, shift_logits)}
    replay_logits, t_replay = timed3(lambda: eng.forward_rows(edited[a:], a))
    report["engine"]["replay_ms"] = round(t_replay * 1e3, 1)
    report["engine"]["replay_vs_reprefill"] = common.logits_diff(ref, replay_logits)

    # ---- DynamicCache today (gather_rows + per-layer rotation, kvmemory.repair's route)
    cache = kvcache.new_cache(lm.model.config)
    forward_rows(lm.model, cache, ids, 0)
    rows = torch.cat([torch.arange(a), torch.arange(b, n)])

    def dyn_delete_shift():
        t = time.perf_counter()
        moved = kvcache.gather_rows(cache, rows)
        t_move = time.perf_counter() - t
        t = time.perf_counter()
        for layer in moved.layers:
            layer.keys[:, :, a:] = shifter.apply(layer.keys[:, :, a:], coeffs)
        return moved, t_move, time.perf_counter() - t

    (moved, dyn_move, dyn_rot), _ = timed3(dyn_delete_shift)
    kvcache.crop_to(moved, n - e - 1)
    dyn_shift = forward_rows(lm.model, moved, edited[-1:], n - e - 1)
    report["dynamic_cache"] = {"delete_gather_ms": round(dyn_move * 1e3, 2), "shift_rotate_ms": round(dyn_rot * 1e3, 2),
                               "shift_vs_reprefill": common.logits_diff(ref, dyn_shift)}
    report["engine_shift_vs_dynamic_shift"] = common.logits_diff(dyn_shift, shift_logits)
    print(json.dumps(report, indent=1))
    common.RESULTS.mkdir(exist_ok=True)
    (common.RESULTS / "cache_ops.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
