"""GPU check of the ``"cuda_graphs"`` engine against transformers' eager forward on the same GPU.

The 2 K agent chat of ``kvmemory bench agent`` (HotpotQA passages as tool results), the embedded
SmolLM2-135M-Instruct in ``--dtype`` on ``cuda``: for each engine a KVSession prefills the chat,
decodes ``--tokens`` greedy tokens (decode tokens/s, CUDA-synchronized), then repairs a deletion
of a tool result in the middle (ms to the first answer token) and decodes 20 more. Checks: the
greedy tokens of both engines (equal in fp32; bf16 may part after a near tie, reported), the
largest logit difference after the prefill and after the repair. Writes ``gpu_decode.json`` and
``gpu_decode.md`` to ``--out``. Needs a CUDA GPU (run it where one is lent):

    PYTHONPATH=.:lab python benchmarks/gpu_decode.py --dtype bf16 --out benchmarks/results/gpu_decode
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from kvmemory import KVSession, engine, load_model
from kvmemory_lab.bench.agent import SEARCH_TOOL, agent_chat
from kvmemory_lab.demo_cases import default_data_dir


def _synced_ms(fn) -> tuple[float, object]:
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3, out


def run_engine(lm, name: str, chat, tokens: int) -> dict:
    engine.attach(lm.model, None, name)
    session = KVSession(lm.model, lm.tokenizer, "sur@5", tools=[SEARCH_TOOL], prompt_lookup=0)
    prefill_ms, _ = _synced_ms(lambda: session.prepare(chat.steps["append"]))
    after_prefill = session.next_logits.float().cpu()
    session.generate(2)  # first replay records the graph: not timed
    decode_ms, out = _synced_ms(lambda: session.generate(tokens))
    repair_ms, report = _synced_ms(lambda: session.prepare(chat.steps["delete"]))
    after_repair = session.next_logits.float().cpu()
    answer = session.generate(20).token_ids
    return {"engine": engine.status(lm.model).name, "prefill_ms": prefill_ms, "decode_tok_s": tokens / decode_ms * 1e3,
            "repair_first_token_ms": repair_ms, "recomputed_tokens": report.recomputed_tokens,
            "decoded": out.token_ids, "answer_after_repair": answer,
            "_logits": (after_prefill, after_repair)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", default="bf16", choices=["fp32", "bf16"])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU here: this check runs where a GPU is lent")
    lm = load_model(dtype=args.dtype, engine="transformers")
    lm.model.to("cuda")
    chat = agent_chat(Path(default_data_dir()), lm.tokenizer, 2048, 8000, 0)
    results = [run_engine(lm, name, chat, args.tokens) for name in ("transformers", "cuda_graphs")]
    (eager_prefill, eager_repair), (graph_prefill, graph_repair) = (r.pop("_logits") for r in results)
    same = sum(a == b for a, b in zip(results[0]["decoded"], results[1]["decoded"]))
    summary = {
        "gpu": torch.cuda.get_device_name(), "dtype": args.dtype, "torch": torch.__version__, "runs": results,
        "speedup_decode": results[1]["decode_tok_s"] / results[0]["decode_tok_s"],
        "same_decoded_tokens": f"{same}/{args.tokens}",
        "same_answer_after_repair": results[0]["answer_after_repair"] == results[1]["answer_after_repair"],
        "max_logit_diff_prefill": float((eager_prefill - graph_prefill).abs().max()),
        "max_logit_diff_repair": float((eager_repair - graph_repair).abs().max()),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_decode.json").write_text(json.dumps(summary, indent=1))
    lines = [f"# cuda_graphs vs transformers eager ({summary['gpu']}, {args.dtype})", "",
             "| engine | prefill ms | decode tok/s | repair, first token ms |", "|---|---|---|---|"]
    lines += [f"| {r['engine']} | {r['prefill_ms']:.1f} | {r['decode_tok_s']:.1f} | {r['repair_first_token_ms']:.1f} |" for r in results]
    lines += ["", f"Decode speed-up {summary['speedup_decode']:.2f}x; same decoded tokens {summary['same_decoded_tokens']}; "
              f"same answer after the repair: {summary['same_answer_after_repair']}; largest logit difference "
              f"{summary['max_logit_diff_prefill']:.2e} (prefill), {summary['max_logit_diff_repair']:.2e} (repair)."]
    (args.out / "gpu_decode.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
