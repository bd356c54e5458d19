"""The user's cache folder for apt_model: what is worth keeping between runs (compiled FP4
kernels, device probe results).

``$APT_MODEL_CACHE``, else ``$XDG_CACHE_HOME/apt_model``, else ``~/.cache/apt_model`` (the XDG Base
Directory convention). Nothing is created here.
"""
from __future__ import annotations

import os
from pathlib import Path


def user_cache_dir() -> Path:
    """The cache folder (see the module docstring); not created here."""
    root = os.environ.get("APT_MODEL_CACHE", "").strip()
    if root:
        return Path(root).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "apt_model"
