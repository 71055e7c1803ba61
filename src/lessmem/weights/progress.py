"""Per-layer progress on stderr for the passes that quantize or observe a model layer by layer
(``quantize_``, ``collect_imatrix``)."""

from __future__ import annotations

import sys


class _Progress:
    """A per-layer progress bar on stderr (rich when available and interactive)."""

    def __init__(self, total: int, desc: str, enabled: bool):
        self.total, self.desc, self.enabled, self.i = total, desc, enabled, 0
        self._rich = None
        if enabled and sys.stderr.isatty():
            try:
                from rich.progress import Progress

                self._rich = Progress(transient=True)
                self._rich.start()
                self._task = self._rich.add_task(desc, total=total)
            except ImportError:
                self._rich = None

    def step(self, what: str) -> None:
        self.i += 1
        if self._rich is not None:
            self._rich.update(self._task, advance=1, description=f"{self.desc}: {what}")
        elif self.enabled:
            print(f"[{self.i}/{self.total}] {self.desc}: {what}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._rich is not None:
            self._rich.stop()
