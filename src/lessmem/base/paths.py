"""Where lessmem keeps what it downloads or builds: ``$LESSMEM_CACHE`` or the user cache dir."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir(*parts: str) -> Path:
    """``$LESSMEM_CACHE`` (default ``$XDG_CACHE_HOME/lessmem`` or ``~/.cache/lessmem``)."""
    root = os.environ.get("LESSMEM_CACHE")
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        root = str(Path(xdg) / "lessmem")
    p = Path(root).expanduser().joinpath(*parts)
    p.mkdir(parents=True, exist_ok=True)
    return p


def repo_data_file(*parts: str) -> Path | None:
    """A file under ``../shared/data`` next to a source checkout, if present."""
    here = Path(__file__).resolve()
    for up in here.parents:
        cand = up.parent / "shared" / "data" / Path(*parts)
        if cand.exists():
            return cand
    return None
