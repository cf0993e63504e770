"""Real text corpora that every machine has, with no download: the Python standard library's source,
and the sources and docs of the installed packages.

The examples and the reproduction benchmarks train byte-level language models
on them (vocabulary 256). The standard library depends on the Python version
(3.11 here: about 12.6 MB in about 800 files, tests left out); ``site-packages``
depends on what is installed (about 410 MB in about 29K files on the lent GPU
machines' image). Runs are comparable on one installation, not across them.
"""
from __future__ import annotations

import site
import sysconfig
from pathlib import Path
from typing import List, Optional, Tuple

import torch
from torch.utils.data import Dataset

_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
SITE_PACKAGES_SUFFIXES = (".py", ".md", ".rst", ".txt")
CORPORA = ("stdlib", "site-packages")


def stdlib_text(max_bytes: Optional[int] = None) -> bytes:
    """The ``.py`` files of the standard library, in sorted path order, joined by newlines.

    Args:
        max_bytes: keep only the first this many bytes (``None``: all).

    Raises:
        FileNotFoundError: the interpreter has no standard-library source (a
            stripped install); the message names the directory searched.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if not (_SKIP_DIRS & set(p.relative_to(root).parts)))
    if not files:
        raise FileNotFoundError(f"no Python source files under {root}: this interpreter ships no stdlib source")
    return _join(files, max_bytes)


def site_packages_files(suffixes: Tuple[str, ...] = SITE_PACKAGES_SUFFIXES) -> List[Path]:
    """Every ``.py``, ``.md``, ``.rst`` and ``.txt`` file under this interpreter's package directories
    (``site-packages`` / ``dist-packages``: the environment's, then the system's), in sorted path order.

    A directory reached twice (a symlink, or one listed by two sources) counts once; links to files are
    skipped, so a file is never read twice.
    """
    roots: List[Path] = []
    paths = sysconfig.get_paths()
    for r in [paths.get("purelib"), paths.get("platlib"), *site.getsitepackages()]:
        if not r or not Path(r).is_dir():
            continue
        real = Path(r).resolve()
        if all(real != x and x not in real.parents for x in roots):
            roots = [x for x in roots if real not in x.parents] + [real]
    files = set()
    for root in roots:
        for p in root.rglob("*"):
            if p.suffix in suffixes and not p.is_symlink() and p.is_file():
                files.add(p)
    return sorted(files)


def site_packages_text(max_bytes: Optional[int] = None) -> bytes:
    """The files of :func:`site_packages_files`, joined by newlines (the installed packages' sources and docs).

    Args:
        max_bytes: keep only the first this many bytes (``None``: all).

    Raises:
        FileNotFoundError: no such file under any package directory (the message names them).
    """
    files = site_packages_files()
    if not files:
        raise FileNotFoundError(f"no {'/'.join(SITE_PACKAGES_SUFFIXES)} files under {site.getsitepackages()}")
    return _join(files, max_bytes)


def corpus_text(name: str, max_bytes: Optional[int] = None) -> bytes:
    """The corpus ``name`` (one of :data:`CORPORA`): ``"stdlib"`` (:func:`stdlib_text`) or
    ``"site-packages"`` (:func:`site_packages_text`)."""
    if name == "stdlib":
        return stdlib_text(max_bytes)
    if name == "site-packages":
        return site_packages_text(max_bytes)
    raise ValueError(f"corpus must be one of {CORPORA}, got {name!r}")


def _join(files: List[Path], max_bytes: Optional[int]) -> bytes:
    chunks, size = [], 0
    for p in files:
        try:
            b = p.read_bytes()
        except OSError:
            continue
        chunks.append(b)
        size += len(b) + 1
        if max_bytes is not None and size >= max_bytes:
            break
    data = b"\n".join(chunks)
    return data if max_bytes is None else data[:max_bytes]


def train_val_split(data: bytes, val_fraction: float = 0.05) -> Tuple[torch.Tensor, torch.Tensor]:
    """The bytes as two 1-D ``uint8`` tensors: the first ``1 - val_fraction`` for training, the rest for validation.

    Both share memory with a copy of ``data`` (no further copy).
    """
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction!r}")
    t = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    cut = int(len(t) * (1 - val_fraction))
    return t[:cut], t[cut:]


class ByteWindows(Dataset):
    """``length`` random windows of ``block + 1`` bytes; item ``i`` is ``(x, y)``, ``y`` shifted by one.

    ``data`` is a 1-D ``uint8`` tensor (:func:`train_val_split`); ``x`` and ``y`` are int64
    ``(block,)`` (token ids 0..255), so a ``DataLoader`` batches them to ``(B, block)``.

    The window offsets are drawn once from ``seed``, so item ``i`` is the same
    on every run and every rank (a distributed sampler gives ranks disjoint items).
    """

    def __init__(self, data: torch.Tensor, block: int, length: int, seed: int = 0) -> None:
        if len(data) < block + 2:
            raise ValueError(f"the corpus has {len(data)} bytes, too few for windows of {block + 1}")
        self.data = data
        self.block = int(block)
        g = torch.Generator().manual_seed(int(seed))
        self.offsets = torch.randint(0, len(data) - block - 1, (int(length),), generator=g)

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, i: int) -> Tuple[torch.Tensor, torch.Tensor]:
        o = int(self.offsets[i])
        chunk = self.data[o: o + self.block + 1].long()
        return chunk[:-1], chunk[1:]
