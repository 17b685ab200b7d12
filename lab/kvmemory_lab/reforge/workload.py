"""The RQ4 workload on the embedded model: held-out QA prompts from the shared HotpotQA and
2WikiMultihopQA files, a rank-8 LoRA on one projection, and a trajectory of consecutive
answer-supervised updates (CacheReforge §RQ4, S2.1). Calibration, training and evaluation items
are disjoint slices of the data files."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from kvmemory.online_adapter import answer_supervised_ids, lora_update_step

from ..demo_cases import HOTPOT_FILE, SYSTEM_PROMPT

WIKI_FILE = Path("2wikimultihopqa") / "ircot_prompt_demos_train20.jsonl"
# disjoint index ranges per split: (hotpotqa, 2wiki)
SPLITS = {"calibration": ((0, 40), (0, 6)), "eval": ((40, 120), (6, 14)), "train": ((120, 200), (14, 20))}


@dataclass(frozen=True)
class QASample:
    """One request: chat ``messages`` (system, passages as tool results, question) and gold ``answer``."""

    sample_id: str
    source: str
    messages: tuple[dict, ...]
    answer: str


def _messages(question: str, passages: list[tuple[str, str]]) -> tuple[dict, ...]:
    msgs = [{"role": "system", "content": SYSTEM_PROMPT, "id": "system"}]
    for i, (title, text) in enumerate(passages):
        msgs.append({"role": "tool", "content": f"{title}: {text}", "id": f"result-{i}"})
    msgs.append({"role": "user", "content": f"Answer the question: {question} Reply with just the answer.", "id": "query"})
    return tuple(msgs)


def _choose(support: list, others: list, passages: int, rng: random.Random) -> list:
    """The supporting passages plus distractors up to ``passages``, shuffled (0: no passages,
    e.g. a short training interaction)."""
    if passages <= 0:
        return []
    chosen = support[:passages] + rng.sample(others, max(0, min(len(others), passages - len(support))))
    rng.shuffle(chosen)
    return chosen


def _hotpot(data_dir: Path, lo: int, hi: int, passages: int, rng: random.Random) -> list[QASample]:
    items = json.loads((data_dir / HOTPOT_FILE).read_text())[lo:hi]
    out = []
    for item in items:
        gold = {t for t, _ in item["supporting_facts"]}
        paras = [(t, "".join(s).strip()) for t, s in item["context"]]
        support = [p for p in paras if p[0] in gold]
        others = [p for p in paras if p[0] not in gold]
        chosen = _choose(support, others, passages, rng)
        out.append(QASample(item["_id"], "hotpotqa", _messages(item["question"], chosen), item["answer"]))
    return out


def _wiki(data_dir: Path, lo: int, hi: int, passages: int, rng: random.Random) -> list[QASample]:
    lines = (data_dir / WIKI_FILE).read_text().splitlines()[lo:hi]
    out = []
    for line in lines:
        item = json.loads(line)
        paras = [(p["title"], p["paragraph_text"]) for p in item["paragraphs"]]
        support = [p for p, raw in zip(paras, item["paragraphs"]) if raw.get("is_supporting")]
        others = [p for p, raw in zip(paras, item["paragraphs"]) if not raw.get("is_supporting")]
        chosen = _choose(support, others, passages, rng)
        out.append(QASample(item["qid"], "2wikimultihopqa", _messages(item["question"], chosen), item["answer"]))
    return out


def qa_samples(data_dir: str | Path, split: str, n: int, *, passages: int = 4, seed: int = 0) -> list[QASample]:
    """``n`` samples of ``split`` (calibration / eval / train), alternating HotpotQA and 2Wiki,
    drawn with ``seed`` from that split's disjoint slice.

    Raises:
        FileNotFoundError: a data file is missing (pass --data pointing at the shared data folder).
        ValueError: unknown split.
    """
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; use one of {', '.join(SPLITS)}")
    data_dir = Path(data_dir)
    for f in (HOTPOT_FILE, WIKI_FILE):
        if not (data_dir / f).is_file():
            raise FileNotFoundError(f"{data_dir / f} not found: pass --data pointing at the shared data folder")
    rng = random.Random(seed)
    (hlo, hhi), (wlo, whi) = SPLITS[split]
    hot, wiki = _hotpot(data_dir, hlo, hhi, passages, rng), _wiki(data_dir, wlo, whi, passages, rng)
    rng.shuffle(hot)
    rng.shuffle(wiki)
    out = []
    while len(out) < n and (hot or wiki):
        for pool in (hot, wiki):
            if pool and len(out) < n:
                out.append(pool.pop())
    return out


def middle_layer(num_layers: int) -> int:
    """The RQ4 middle layer: N // 2 (layer 15 of 30 leaves a 15-layer, 50 % executable suffix)."""
    return num_layers // 2


def attach_lora(model, target: str = "v_proj", layer: int | list[int] | None = None, rank: int = 8, alpha: int = 16,
                seed: int = 0):
    """Wrap ``model`` with a rank-``rank`` peft LoRA on ``target`` at decoder ``layer`` (default:
    the middle layer; a list puts one LoRA on each of those layers). B starts at zero (version 0 =
    the base model).

    Returns:
        ``(peft_model, update_target, adapter_config)`` labels for the calibration profile key.
    """
    from peft import LoraConfig, get_peft_model

    n = model.config.get_text_config().num_hidden_layers
    layers = [middle_layer(n)] if layer is None else [layer] if isinstance(layer, int) else sorted(layer)
    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=[target], layers_to_transform=layers)
    peft_model = get_peft_model(model, config)
    peft_model.eval()
    return peft_model, f"{target}@{','.join(map(str, layers))}", f"lora r={rank} alpha={alpha} targets={target}"


def trainable_snapshot(model) -> dict[str, torch.Tensor]:
    """Copies of the trainable (LoRA) parameters, by name."""
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def load_snapshot(model, snapshot: dict[str, torch.Tensor]) -> None:
    """Set the trainable parameters to ``snapshot`` in place (an adapter version)."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in snapshot.items():
            params[name].copy_(value)


def update_trajectory(model, tokenizer, train: list[QASample], steps: int, lr: float = 1e-2, seed: int = 0,
                      progress=None) -> list[dict[str, torch.Tensor]]:
    """Versions v_0..v_steps of the adapter: v_0 is the current state, then one Adam step (step
    size ``lr``, the update magnitude) per update on an answer-supervised interaction drawn with
    ``seed`` from ``train``. The model ends at v_0 again.

    Raises:
        ValueError: no training samples.
    """
    if not train:
        raise ValueError("no training interactions for the update trajectory")
    rng = random.Random(seed)
    start = trainable_snapshot(model)
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=lr)
    versions = [start]
    for _ in range(steps):
        sample = rng.choice(train)
        prompt_ids, target_ids = answer_supervised_ids(tokenizer, sample.messages, sample.answer)
        lora_update_step(model, optimizer, prompt_ids, target_ids)
        versions.append(trainable_snapshot(model))
        if progress is not None:
            progress.update(1)
    load_snapshot(model, start)
    return versions
