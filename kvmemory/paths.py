"""Where kvmemory keeps what it derives once and reuses: converted models, GGUF block copies and
compiled kernels, under one cache folder."""

from __future__ import annotations

import os
from pathlib import Path

from platformdirs import user_cache_dir


def cache_root() -> Path:
    """Folder for converted models, block copies and kernel builds; ``KVMEMORY_CACHE_DIR``
    overrides the platform cache dir."""
    return Path(os.environ.get("KVMEMORY_CACHE_DIR") or user_cache_dir("kvmemory"))
