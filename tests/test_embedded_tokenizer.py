"""The embedded model's tokenizer equals the model's own: token ids checked against a reference
byte-level BPE encoder that reads the GGUF's vocabulary and merges directly (independent of
transformers' GGUF converter), plus the cache-folder upgrade and the effect on answer reuse."""

from __future__ import annotations

import copy
import json
import logging
import math
import shutil
import threading

import pytest
import regex

from kvmemory import KVSession
from kvmemory.models import COMPLETE_MARKER, embedded_gguf_path, embedded_model_dir
from kvmemory.prompt import normalize_messages, render_prompt
from support import QUERY, history

# llama.cpp (src/llama-vocab.cpp) tokenizes LLAMA_VOCAB_PRE_TYPE_SMOLLM with these regexes,
# applied in sequence to the pieces the previous one produced: every number code point alone,
# then GPT-2's pattern (its custom GPT-2 splitter also ends with "\s+", which keeping the
# unmatched gaps below reproduces).
GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
SMOLLM_PATTERNS = (r"\p{N}", GPT2_PATTERN)
EMBEDDED_DIR = "SmolLM2-135M-Instruct"  # the folder name older kvmemory versions used too
CONTROL, USER_DEFINED = 3, 4  # GGUF token types that llama.cpp matches as whole special tokens


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters (the alphabet of the vocab)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + len(mapping) - len(printable))
    return mapping


class GGUFReferenceBPE:
    """Byte-level BPE over ``tokenizer.ggml.tokens`` / ``tokenizer.ggml.merges``, pre-tokenized
    like llama.cpp's ``smollm`` type: special tokens first, then the regex sequence, then merges
    by rank (lowest rank first, leftmost on ties, as llama.cpp's priority queue does)."""

    def __init__(self, fields):
        self.pre_type = str(fields["tokenizer.ggml.pre"].contents())
        tokens = fields["tokenizer.ggml.tokens"].contents()
        types = fields["tokenizer.ggml.token_type"].contents()
        self.ids = {t: i for i, t in enumerate(tokens)}
        self.ranks = {tuple(m.split(" ")): r for r, m in enumerate(fields["tokenizer.ggml.merges"].contents())}
        specials = sorted((t for t, k in zip(tokens, types) if k in (CONTROL, USER_DEFINED)), key=len, reverse=True)
        self.special_pattern = "(" + "|".join(map(regex.escape, specials)) + ")"
        self.byte_chars = byte_to_unicode()
        self.chat_template = str(fields["tokenizer.chat_template"].contents())

    def encode(self, text: str) -> list[int]:
        ids = []
        for i, part in enumerate(regex.split(self.special_pattern, text)):
            if i % 2:
                ids.append(self.ids[part])
            elif part:
                for piece in self.pre_tokenize(part):
                    ids.extend(self.bpe(piece))
        return ids

    @staticmethod
    def pre_tokenize(text: str) -> list[str]:
        pieces = [text]
        for pattern in SMOLLM_PATTERNS:
            pieces = [p for piece in pieces for p in split_keeping_gaps(piece, pattern)]
        return pieces

    def bpe(self, piece: str) -> list[int]:
        parts = [self.byte_chars[b] for b in piece.encode("utf-8")]
        while len(parts) > 1:
            rank, i = min((self.ranks.get(pair, math.inf), i) for i, pair in enumerate(zip(parts, parts[1:])))
            if rank == math.inf:
                break
            parts[i : i + 2] = [parts[i] + parts[i + 1]]
        ids = []
        for part in parts:  # llama.cpp spells a merge result missing from the vocab byte by byte
            ids.extend([self.ids[part]] if part in self.ids else [self.ids[c] for c in part])
        return ids


def split_keeping_gaps(text: str, pattern: str) -> list[str]:
    """Matches of ``pattern`` and the stretches between them, in order (llama.cpp's semantics)."""
    pieces, pos = [], 0
    for m in regex.finditer(pattern, text):
        if m.start() > pos:
            pieces.append(text[pos : m.start()])
        if m.end() > m.start():
            pieces.append(m.group())
        pos = m.end()
    if pos < len(text):
        pieces.append(text[pos:])
    return pieces


@pytest.fixture(scope="module")
def reference():
    from gguf import GGUFReader

    return GGUFReferenceBPE(GGUFReader(str(embedded_gguf_path())).fields)


PYTHON = (
    "def area(r):\n    \"\"\"Circle area.\"\"\"\n    if r < 0:\n        raise ValueError('negative radius')\n"
    "    return 3.14159 * r ** 2\n\n\nfor i in range(10):\n\tprint(i, area(i))  # 2 spaces before\n"
)
SAMPLES = {
    "blank line then digit": "\n\n1",
    "digits": "12345",
    "decimal": "3.14",
    "date": "2026-12-01",
    "numbers in prose": "Total: 1,000,000 (about 10^6) on 2026-12-01 at 09:30, i.e. 42 % of 7 x1y22z333.",
    "space runs before digits": "a  7 b   12\n    3",
    "whitespace runs": "a  b   c\n\n\nnext line   \t\ttabs\tand  spaces \n trailing   ",
    "leading spaces": "   leading",
    "contractions": "I'm sure they'll say it's fine, don't you think? We've seen IT'S done.",
    "python": PYTHON,
    "accents": "Café naïve résumé façade Ångström, e\u0301 combining",
    "cjk": "你好，世界！这是一个测试。日本語のテキストとカタカナ 한국어 텍스트",
    "emoji": "Emoji: 😀👍🏽🇺🇸 and ❤️ done",
    "other scripts": "Россия и Україна; مرحبا بالعالم",
    "unicode numbers": "full-width １２３, Roman Ⅻ, fractions ½ ¾, Arabic-Indic ٣٤",
    "special tokens in text": "<|im_start|>user\nwhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4",
}


def test_reference_reads_the_smollm_pre_tokenizer(reference):
    assert reference.pre_type == "smollm"  # the regex sequence above is llama.cpp's for this type
    assert reference.encode("\n\n1") == [1116, 33]  # llama.cpp's ids on this GGUF (measured)


@pytest.mark.parametrize("name", list(SAMPLES))
def test_tokenizer_equals_gguf_reference(tokenizer, reference, name):
    text = SAMPLES[name]
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids == reference.encode(text)
    assert tokenizer.decode(ids) == text  # byte-level: lossless


def test_chat_template_output_equals_gguf_reference(tokenizer, reference):
    assert tokenizer.chat_template == reference.chat_template
    digits = [{"role": "user", "content": "Count:\n\n1 2 3, then the year 2026.", "id": "c1"},
              {"role": "assistant", "content": "1\n\n2\n\n3\n\n2026", "id": "c2"},
              {"role": "user", "content": "Now the code:\n" + PYTHON, "id": "c3"}]
    for messages in (history() + [QUERY], digits):
        rendered = render_prompt(tokenizer, normalize_messages(messages))
        assert rendered.token_ids == tuple(reference.encode(rendered.text))
        for seg, msg in zip(rendered.segments, rendered.messages):  # offsets still map messages
            assert rendered.text[seg.content_start : seg.content_end] == msg.content


def test_unknown_gguf_pre_tokenizer_is_refused_not_guessed(monkeypatch):
    import kvmemory.tokenizer
    from kvmemory import ModelNotFoundError

    monkeypatch.setattr(kvmemory.tokenizer, "gguf_pre_tokenizer_type", lambda gguf: "some-new-type")
    with pytest.raises(ModelNotFoundError, match="'some-new-type'.*--model PATH"):
        kvmemory.tokenizer.tokenizer_from_gguf(embedded_gguf_path())


# --------------------------------------------------------------- cache folder upgrade
# The pre-tokenizer transformers' GGUF converter writes for SmolLM2 (no per-digit split). It is
# the only difference between the tokenizer files of an older conversion and a current one
# (tokenizer.json otherwise equal key by key, tokenizer_config.json and chat_template.jinja equal).
CONVERTER_PRE_TOKENIZER = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}


@pytest.fixture(scope="module")
def old_tokenizer_files(real, tmp_path_factory):
    """The tokenizer files an older kvmemory saved."""
    folder = tmp_path_factory.mktemp("old-tokenizer")
    for name in ("tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(real.path / name, folder / name)
    data = json.loads((real.path / "tokenizer.json").read_text())
    data["pre_tokenizer"] = CONVERTER_PRE_TOKENIZER
    (folder / "tokenizer.json").write_text(json.dumps(data))
    return folder


def old_format_folder(root, old_tokenizer_files):
    """An embedded-model folder as an older kvmemory left it: its tokenizer, a marker naming
    only the GGUF, and stand-in weight files (this upgrade must not read or rewrite them)."""
    folder = root / EMBEDDED_DIR
    shutil.copytree(old_tokenizer_files, folder)
    (folder / "config.json").write_text('{"stand-in": true}')
    (folder / "model.safetensors").write_bytes(b"stand-in weights")
    (folder / COMPLETE_MARKER).write_text(embedded_gguf_path().name)
    return folder


def assert_current_tokenizer(folder):
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(folder)("\n\n1", add_special_tokens=False)["input_ids"] == [1116, 33]
    assert (folder / "model.safetensors").read_bytes() == b"stand-in weights"  # weights kept, not reconverted
    assert (folder / "config.json").read_text() == '{"stand-in": true}'
    assert sorted(p.name for p in folder.parent.iterdir()) == [EMBEDDED_DIR]  # no staging leftovers
    assert not [p for p in folder.iterdir() if p.name.startswith(COMPLETE_MARKER + ".")]

    from kvmemory.models import CONVERSION_FORMAT, conversion_format

    assert conversion_format(folder) == CONVERSION_FORMAT
    assert json.loads((folder / COMPLETE_MARKER).read_text())["format"] == CONVERSION_FORMAT


def test_older_folder_gets_its_tokenizer_rebuilt_in_place(tmp_path, monkeypatch, caplog, old_tokenizer_files):
    monkeypatch.setenv("KVMEMORY_CACHE_DIR", str(tmp_path))
    folder = old_format_folder(tmp_path, old_tokenizer_files)
    with caplog.at_level(logging.WARNING, logger="kvmemory.models"):
        assert embedded_model_dir() == folder
    assert "rebuilding the tokenizer" in caplog.text and "format 1 -> 2" in caplog.text
    assert_current_tokenizer(folder)
    caplog.clear()
    assert embedded_model_dir() == folder and not caplog.text  # once only


def test_concurrent_upgrades_and_readers_never_see_a_partial_tokenizer(tmp_path, monkeypatch, tokenizer,
                                                                      old_tokenizer_files):
    """Two upgraders race on one folder while a reader keeps parsing its tokenizer.json: every
    read is a whole old or whole new file, both upgraders return the folder, the end state is
    current. (The tokenizer build itself is stubbed with the current tokenizer: the race is in
    the file swaps; the test above runs the real build.)"""
    import kvmemory.models
    from tokenizers import Tokenizer

    monkeypatch.setenv("KVMEMORY_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(kvmemory.models, "tokenizer_from_gguf", lambda gguf: copy.deepcopy(tokenizer))
    folder = old_format_folder(tmp_path, old_tokenizer_files)
    results, errors, seen = [], [], []
    done = threading.Event()

    def upgrade():
        try:
            results.append(embedded_model_dir())
        except Exception as exc:  # reported below; a thread would swallow it
            errors.append(exc)

    def read():
        while not done.wait(0.005):
            seen.append(Tokenizer.from_file(str(folder / "tokenizer.json")).pre_tokenizer.__getstate__())

    reader = threading.Thread(target=read)
    reader.start()
    upgraders = [threading.Thread(target=upgrade) for _ in range(3)]
    for t in upgraders:
        t.start()
    for t in upgraders:
        t.join()
    done.set()
    reader.join()
    assert not errors and results == [folder] * 3
    assert {json.loads(state)["type"] for state in seen} <= {"ByteLevel", "Sequence"}
    assert_current_tokenizer(folder)


def test_folder_from_a_newer_kvmemory_is_refused_with_the_fix(tmp_path, monkeypatch):
    from kvmemory import ModelNotFoundError

    monkeypatch.setenv("KVMEMORY_CACHE_DIR", str(tmp_path))
    folder = tmp_path / EMBEDDED_DIR
    folder.mkdir()
    (folder / COMPLETE_MARKER).write_text(json.dumps({"gguf": "x.gguf", "format": 99}))
    with pytest.raises(ModelNotFoundError, match="newer kvmemory.*KVMEMORY_CACHE_DIR"):
        embedded_model_dir()


# ------------------------------------------------------------- effect on answer reuse
FEW_SHOT = [
    {"role": "system", "content": "Answer with a label line, a blank line, then the number.", "id": "s"},
    {"role": "user", "content": "When did the Berlin Wall fall?", "id": "u1"},
    {"role": "assistant", "content": "Year:\n\n1989", "id": "a1"},
    {"role": "user", "content": "When did the first moon landing happen?", "id": "u2"},
]
YEAR = [{"role": "user", "content": "In which year did World War II end?", "id": "u1"}]


@pytest.mark.parametrize("messages", [FEW_SHOT, YEAR], ids=["blank-line-then-year", "year-in-prose"])
def test_committed_answer_with_digits_is_reused_next_turn(real, reference, messages):
    """The model's own answer re-tokenizes to the ids it generated (the GGUF reference's ids),
    so the next turn that sends it back recomputes only the new turn."""
    s = KVSession(real.model, real.tokenizer)
    s.prepare(messages)
    answer = s.generate(max_new_tokens=32)
    assert answer.finish_reason == "stop" and regex.search(r"\d", answer.text), answer.text  # precondition
    assert answer.token_ids == reference.encode(answer.text)
    assert s.commit_answer({"role": "assistant", "content": answer.text, "id": "answer"})
    held = len(s.token_ids)
    follow_up = {"role": "user", "content": "And two years later?", "id": "next"}
    report = s.prepare(messages + [{"role": "assistant", "content": answer.text, "id": "answer"}, follow_up])
    assert report.reused_tokens == held and report.fallback is None
    new_turn = "<|im_start|>user\nAnd two years later?<|im_end|>\n<|im_start|>assistant\n"
    assert report.recomputed_tokens == report.prompt_tokens - held == len(reference.encode(new_turn))
    s.check_invariants()
