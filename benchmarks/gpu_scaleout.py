"""Block restore vs Re-prefill on a GPU machine (docs/scale-out.md, "on a GPU engine").

A random-weight model with Qwen3-8B's shape (bf16, 36 layers, 8 KV heads x 128) prefills N tokens
on the device; its cache state is cut into kvmemory token blocks and written to a block store
(a folder: the device machine reaches no servers); then the state is read back, verified
(sha256 + chain keys) and copied onto the device, as a worker resuming a thread would. Reports
per N: Re-prefill ms, block write ms, restore ms (read + verify + host->device), bytes per
token, restore / Re-prefill. Median of --trials after --warmup.

GPU:  .venv/bin/python benchmarks/gpu_scaleout.py --out benchmarks/results/gpu-scaleout
CPU smoke test of the same path: .venv/bin/python benchmarks/gpu_scaleout.py --config qwen3-tiny --device cpu \
      --dtype fp32 --contexts 256 --trials 1 --warmup 0 --out /tmp/gpu-scaleout
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from kvmemory import kvcache
from kvmemory_lab.bench.refresh import RANDOM_CONFIGS
from kvmemory.engine import forward_rows
from kvmemory.persistence import CacheState
from langchain_kvmemory.blockstore import FilesystemBlockStore
from langchain_kvmemory.kvblocks import decode_manifest, encode_state, load_rows


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _timed(fn, device: str) -> tuple[float, object]:
    _sync(device)
    t0 = time.perf_counter()
    out = fn()
    _sync(device)
    return (time.perf_counter() - t0) * 1000, out


def one_context(model, n: int, args, store: FilesystemBlockStore) -> dict:
    ids = torch.randint(0, model.config.vocab_size, (n,))
    prefill = lambda: forward_rows(model, kvcache.new_cache(model.config), ids.to(args.device), 0)  # noqa: E731
    cache = kvcache.new_cache(model.config)
    with torch.no_grad():
        forward_rows(model, cache, ids.to(args.device), 0)
    layers = [(k.cpu(), v.cpu()) for k, v in kvcache.layer_tensors(cache)]
    versions = {"layer_versions": ["base"] * len(layers), "versions": {}}
    state = CacheState(token_ids=ids.tolist(), messages=[], tools=None, exact_rows=n, layers=layers,
                       model_name="random", model_dtype=str(args.torch_dtype), weights_digest="random",
                       adapter_versions=versions)

    def write():
        encoded = encode_state(state, args.block_tokens, is_stored=store.exists)
        for key, data in encoded.block_bytes.items():
            store.put(key, data)
        store.put(encoded.manifest_key, encoded.manifest)
        return encoded

    def restore(encoded):
        manifest = decode_manifest(store.get(encoded.manifest_key))
        rows, _, error = load_rows(store, manifest, {})
        assert error is None, error
        return [(k.to(args.device, non_blocking=True), v.to(args.device, non_blocking=True)) for k, v in rows]

    times = {"reprefill_ms": [], "write_ms": [], "restore_ms": []}
    for trial in range(args.warmup + args.trials):
        for key in [k for k, _ in store.list("")]:
            store.delete(key)  # every write stores every block (no sharing across trials)
        with torch.no_grad():
            t_pre, _ = _timed(prefill, args.device)
        t_write, encoded = _timed(write, args.device)
        t_restore, restored = _timed(lambda: restore(encoded), args.device)
        if trial >= args.warmup:
            times["reprefill_ms"].append(t_pre)
            times["write_ms"].append(t_write)
            times["restore_ms"].append(t_restore)
    for (k, v), (rk, rv) in zip(restored, kvcache.layer_tensors(cache)):
        assert torch.equal(k, rk) and torch.equal(v, rv), "restored rows differ from the cache"
    med = {k: round(statistics.median(v), 2) for k, v in times.items()}
    return {"tokens": n, **med, "restore_over_reprefill": round(med["restore_ms"] / med["reprefill_ms"], 3),
            "bytes_per_token": store.nbytes("block/") // n, "blocks": len(encoded.blocks)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="qwen3-8b", choices=sorted(RANDOM_CONFIGS))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--contexts", default="2048,8192")
    parser.add_argument("--block-tokens", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/gpu-scaleout"))
    args = parser.parse_args(argv)
    args.torch_dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(Qwen3Config(**RANDOM_CONFIGS[args.config]), dtype=args.torch_dtype).eval()
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        store = FilesystemBlockStore(folder)
        for n in [int(x) for x in args.contexts.split(",")]:
            rows.append(one_context(model, n, args, store))
            print(rows[-1])
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device
    meta = {"config": args.config, "device": device, "dtype": args.dtype, "block_tokens": args.block_tokens,
            "trials": args.trials, "warmup": args.warmup, "torch": torch.__version__}
    (args.out / "gpu_scaleout.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"wrote {args.out / 'gpu_scaleout.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
