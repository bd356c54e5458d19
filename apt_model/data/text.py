"""Text corpora as byte-level tokens (ids 0-255), split into train and held-out parts.

The default corpus is the Python standard library source of the running interpreter, present
on every machine: ``sysconfig.get_paths()["stdlib"]``, ``.py`` files, without ``test``/``tests``
folders and ``site-packages``, in sorted order (about 12-13 MB on CPython 3.11).
"""
from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import torch

from apt_model.base.errors import ConfigError

TEXT_SUFFIXES = (".txt", ".py", ".md", ".rst", ".json", ".csv", ".c", ".h", ".html", ".xml", ".yaml", ".yml", ".toml")
_SKIP_DIRS = {"test", "tests", "site-packages", "dist-packages", "__pycache__", "idle_test"}


def stdlib_corpus_files(root: str | os.PathLike | None = None) -> list[Path]:
    """Sorted ``.py`` files of the standard library (or of ``root``), test folders excluded."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
        files.extend(Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py"))
    return files


def _folder_files(folder: Path) -> list[Path]:
    files = []
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        files.extend(Path(dirpath) / f for f in sorted(filenames) if f.lower().endswith(TEXT_SUFFIXES))
    return files


def load_text_bytes(path: str | os.PathLike | None = None, max_bytes: int | None = None) -> bytes:
    """Read a corpus as raw bytes.

    Args:
        path: a text file, a folder (every text file under it, sorted), or None for the
            standard-library corpus.
        max_bytes: stop after this many bytes (None reads everything).

    Raises:
        ConfigError: the path does not exist, or holds no text files, or the corpus is empty.
    """
    if path is None:
        files = stdlib_corpus_files()
        label = "the standard library"
    else:
        p = Path(path)
        if not p.exists():
            raise ConfigError(f"--data {str(path)!r} does not exist; give a text file or a folder of text files")
        files = [p] if p.is_file() else _folder_files(p)
        label = str(p)
    if not files:
        raise ConfigError(f"no text files ({', '.join(TEXT_SUFFIXES)}) under {label}")
    chunks, total = [], 0
    for f in files:
        try:
            data = f.read_bytes()
        except OSError:
            continue
        if max_bytes is not None and total + len(data) > max_bytes:
            data = data[: max_bytes - total]
        chunks.append(data)
        total += len(data)
        if max_bytes is not None and total >= max_bytes:
            break
    blob = b"\n".join(chunks)
    if max_bytes is not None:
        blob = blob[:max_bytes]
    if not blob:
        raise ConfigError(f"the corpus from {label} is empty")
    return blob


class ByteCorpus:
    """A corpus as a uint8 tensor, with a contiguous held-out tail.

    Args:
        data: the corpus bytes.
        val_fraction: share of the bytes (taken from the end) held out for evaluation, in (0, 0.5].

    Raises:
        ConfigError: for a bad fraction or a corpus too short to split.
    """

    vocab_size = 256

    def __init__(self, data: bytes, val_fraction: float = 0.05):
        if not 0.0 < val_fraction <= 0.5:
            raise ConfigError(f"val_fraction={val_fraction} must be in (0, 0.5]")
        tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        n_val = int(len(tokens) * val_fraction)
        if n_val < 2 or len(tokens) - n_val < 2:
            raise ConfigError(f"corpus of {len(tokens)} bytes is too short to split with val_fraction={val_fraction}")
        self.train = tokens[:-n_val]
        self.val = tokens[-n_val:]

    def batch(self, split: str, batch_size: int, seq_len: int, generator: torch.Generator,
              device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """Random windows: inputs ``(batch_size, seq_len)`` int64 and next-byte targets, same shape.

        Raises:
            ConfigError: unknown split, or a split shorter than ``seq_len + 1``.
        """
        if split not in ("train", "val"):
            raise ConfigError(f"split={split!r}; valid: train, val")
        data = self.train if split == "train" else self.val
        if len(data) <= seq_len + 1:
            raise ConfigError(f"the {split} split has {len(data)} bytes, too few for seq_len={seq_len}")
        starts = torch.randint(0, len(data) - seq_len - 1, (batch_size,), generator=generator)
        offsets = torch.arange(seq_len + 1)
        windows = data[starts[:, None] + offsets].long()
        x, y = windows[:, :-1], windows[:, 1:]
        return x.to(device), y.to(device)
