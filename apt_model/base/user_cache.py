"""The user's cache folder for apt_model: what is worth keeping between runs (compiled FP4
kernels, device probe results).

``$APT_MODEL_CACHE``, else ``$XDG_CACHE_HOME/apt_model``, else ``~/.cache/apt_model`` (the XDG Base
Directory convention). Nothing is created here.
"""
from __future__ import annotations

import os
from pathlib import Path

from apt_model.base.settings import CACHE_ROOT, read_env


def user_cache_dir() -> Path:
    """The cache folder (see the module docstring); not created here."""
    found = read_env(CACHE_ROOT)
    if found is not None:
        return Path(found[0]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "apt_model"
