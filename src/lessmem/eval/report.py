"""Presenting evaluation results: a rich table, JSON rows, a Δppl-vs-bits plot; and what
``lessmem eval`` says on stderr while it works (:class:`Progress`, :func:`quiet_transformers`).

Example:
    >>> rows = [{"config": "dynamic", "ppl": 10.0, "delta_ppl_pct": 0.0, "kld": 0.0,
    ...          "top1": 1.0, "k_bits": 32.0, "v_bits": 32.0, "kv_bytes": 2**20,
    ...          "fp16_kv_bytes": 2**19, "compression": 0.5, "tok_per_s": 50.0}]
    >>> json_rows(rows)[0]["kv_mib"]
    1.0
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path

MIB = 1024 * 1024
JSON_KEYS = ("config", "kind", "ppl", "delta_ppl_pct", "kld", "top1", "k_bits", "v_bits",
             "kv_bytes", "fp16_kv_bytes", "compression", "tok_per_s", "speed_vs_baseline",
             "first_use_s", "tokens_scored", "model", "text", "windows", "window_len", "chunk",
             "prefill", "warmup")


def _clean(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None  # JSON has no NaN/inf
    if isinstance(v, dict):
        return {str(k): _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    return v


def json_rows(rows: list[dict], passkey: dict | None = None) -> list[dict]:
    """One JSON-able object per config (protocol included; NaN -> null)."""
    out = []
    for r in rows:
        o = {k: r[k] for k in JSON_KEYS if k in r}
        o["kv_mib"] = r["kv_bytes"] / MIB
        for k in ("memory", "detail", "offload"):
            if k in r:
                o[k] = r[k]
        if passkey and r["config"] in passkey:
            p = passkey[r["config"]]
            o["passkey"] = {"accuracy": p["accuracy"], "found": p["found"], "trials": p["trials"],
                            "by_length": p["by_length"]}
        out.append(_clean(o))
    return out


def dumps(rows: list[dict], passkey: dict | None = None) -> str:
    return json.dumps(json_rows(rows, passkey), indent=2)


def _f(v, fmt):
    return "—" if v is None or (isinstance(v, float) and not math.isfinite(v)) else format(v, fmt)


# column -> what it means; the arrow says which way is better (none: a property, not a score)
COLUMNS = {
    "config": "the KV cache: DynamicCache (the unquantized baseline, first row), a lessmem preset or a peer",
    "K/V bits": "bits per key / value element over the quantized tokens, scales and zero points "
                "included (unquantized: the bits held)",
    "KV MiB ↓": "bytes the cache holds after a full window",
    "x fp16 ↑": "how many times smaller than an fp16 cache of the same tokens",
    "ppl ↓": "perplexity of the scored tokens",
    "Δppl % ↓": "perplexity change vs the baseline (0 = nothing lost)",
    "KLD ↓": "KL divergence of the next-token distribution from the baseline's (nats; 0 = the same)",
    "top-1 ↑": "how often the most likely next token is the baseline's",
    "tok/s ↑": "tokens per second fed in chunks after the prefill, timed after a warm-up",
    "x speed ↑": "tok/s divided by the baseline's",
    "first use s": "one-time cost of a config's first use (kernels built or loaded), paid in the "
                   "warm-up and not in tok/s",
    "passkey ↑": "passkey prompts whose hidden number the model repeated",
}


def _cells(r: dict, passkey: dict | None, first_use: bool) -> list[str]:
    cells = [
        r["config"],
        f"{_f(r['k_bits'], '.2f')}/{_f(r['v_bits'], '.2f')}",
        _f(r["kv_bytes"] / MIB, ".2f"),
        _f(r["compression"], ".2f"),
        _f(r["ppl"], ".3f"),
        _f(r["delta_ppl_pct"], "+.2f"),
        _f(r["kld"], ".5f"),
        _f(100 * r["top1"], ".1f") + "%",
        _f(r["tok_per_s"], ".1f"),
        _f(r.get("speed_vs_baseline"), ".2f"),
    ]
    if first_use:
        cells.append(_f(r.get("first_use_s"), ".2f"))
    if passkey:
        p = passkey.get(r["config"])
        cells.append(f"{p['found']}/{p['trials']}" if p else "—")
    return cells


def print_table(rows: list[dict], passkey: dict | None = None, console=None) -> None:
    """A rich table (bits, KV MiB and compression, ppl, Δ%, KLD, top-1, tok/s, first use,
    passkey), then a legend: which way each score is better and what each column means."""
    from rich.console import Console
    from rich.table import Table

    if console is None:
        console = Console()
        if not console.is_terminal:  # piped or captured: do not squeeze into 80 columns
            console = Console(width=160)
    r0 = rows[0]
    title = (f"{r0['model']} on {r0['text']}: {r0['windows']} x {r0['window_len']} tokens, "
             f"prefill {r0['prefill']}, chunk {r0['chunk']}")
    first_use = any(isinstance(r.get("first_use_s"), float) and math.isfinite(r["first_use_s"])
                    for r in rows)
    cols = [c for c in COLUMNS if (c != "first use s" or first_use) and (c != "passkey ↑" or passkey)]
    t = Table(title=title)
    for col in cols:
        t.add_column(col, justify="left" if col == "config" else "right")
    for r in rows:
        t.add_row(*_cells(r, passkey, first_use))
    console.print(t)
    console.print("↓ lower is better, ↑ higher is better; every score is measured against "
                  "DynamicCache on the same tokens.", markup=False, highlight=False)
    width = max(len(c) for c in cols)
    for c in cols[1:]:
        console.print(f"  {c:<{width}}  {COLUMNS[c]}", markup=False, highlight=False, soft_wrap=True)


def plot(rows: list[dict], path: str | Path) -> Path:
    """Scatter of Δppl % against mean effective bits ((k_bits + v_bits) / 2), one point per config."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    # unquantized caches (>= 16 bits) are the y = 0 reference line, not points
    pts = [r for r in rows if math.isfinite(r["delta_ppl_pct"])
           and math.isfinite((r["k_bits"] + r["v_bits"]) / 2) and (r["k_bits"] + r["v_bits"]) / 2 < 16]
    for i, r in enumerate(sorted(pts, key=lambda r: ((r["k_bits"] + r["v_bits"]) / 2, r["delta_ppl_pct"]))):
        bits = (r["k_bits"] + r["v_bits"]) / 2
        ax.scatter(bits, r["delta_ppl_pct"], s=30, color="tab:gray" if r.get("kind") == "peer" else "tab:blue")
        ax.annotate(r["config"], (bits, r["delta_ppl_pct"]), textcoords="offset points",
                    xytext=(5, 6 if i % 2 == 0 else -11), fontsize=8)
    ax.axhline(0, color="black", linewidth=0.6, label="unquantized (DynamicCache)")
    ax.set_xlabel("effective bits per K/V element (mean of K and V)")
    ax.set_ylabel("Δ perplexity vs DynamicCache (%)")
    ds = [r["delta_ppl_pct"] for r in pts] or [0.0]
    log = any(abs(d) > 5 for d in ds)
    if log:
        ax.set_yscale("symlog", linthresh=1.0)
    ax.set_ylim(min(-0.5, 1.5 * min(ds)), max(ds) * (4 if log else 1.15) + 0.5)
    ax.legend(loc="upper right", fontsize=8)
    r0 = rows[0]
    ax.set_title(f"{r0['model']}, {r0['text']}: {r0['windows']}x{r0['window_len']} tokens, chunk {r0['chunk']}",
                 fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------- console


def quiet_transformers() -> None:
    """Silence transformers' loading noise (the ``Loading weights`` tqdm bar, hub
    download bars, info and warning logs) for a command-line run. An explicit
    ``TRANSFORMERS_VERBOSITY`` or ``HF_HUB_DISABLE_PROGRESS_BARS`` in the environment
    is kept."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    from transformers.utils import logging

    if os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS") != "0":
        logging.disable_progress_bar()
    if "TRANSFORMERS_VERBOSITY" not in os.environ:
        logging.set_verbosity_error()


class Progress:
    """What a long command says on stderr while it works, readable also in a log file.

    ``say(msg)`` writes one line per stage, with the seconds since the start::

        [eval]   4.1s loading smollm2-135m

    Inside ``with progress.steps("window 1/1"):`` the object is a ``progress(done,
    total)`` callback: on a terminal a rich bar, elsewhere (a pipe, a file, CI) a line
    at each quarter of the steps. ``enabled=False`` says nothing.

    Example:
        >>> import io
        >>> out = io.StringIO()
        >>> p = Progress(stream=out)
        >>> with p.steps("perplexity"):
        ...     for i in range(1, 9):
        ...         p(i, 8)
        >>> [line.split("s ", 1)[1] for line in out.getvalue().splitlines()]
        ['perplexity: 25% (2/8 steps)', 'perplexity: 50% (4/8 steps)', 'perplexity: 75% (6/8 steps)', 'perplexity: 100% (8/8 steps)']
    """

    def __init__(self, enabled: bool = True, stream=None, name: str = "eval"):
        self.enabled, self.name = enabled, name
        self.stream = sys.stderr if stream is None else stream
        self.t0 = time.perf_counter()
        self._bar = self._task = None
        self._label, self._quarter = "", 1

    def say(self, msg: str) -> None:
        if not self.enabled:
            return
        line = f"[{self.name}] {time.perf_counter() - self.t0:6.1f}s {msg}"
        if self._bar is not None:
            self._bar.console.print(line, markup=False, highlight=False)
        else:
            print(line, file=self.stream, flush=True)

    @contextmanager
    def steps(self, label: str):
        self._label, self._quarter, self._task = label, 1, None
        isatty = getattr(self.stream, "isatty", lambda: False)
        if not (self.enabled and isatty()):
            yield self
            return
        from rich.console import Console
        from rich.progress import BarColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
        from rich.progress import Progress as Bar

        self._bar = Bar(TextColumn("{task.description}"), BarColumn(),
                        TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(),
                        TimeRemainingColumn(), console=Console(file=self.stream), transient=True)
        try:
            with self._bar:
                yield self
        finally:
            self._bar = None

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled or total <= 0:
            return
        if self._bar is not None:
            if self._task is None:
                self._task = self._bar.add_task(self._label, total=total)
            self._bar.update(self._task, completed=done, total=total)
            return
        q = min(4, 4 * done // total)
        if q >= self._quarter:
            self._quarter = q + 1
            self.say(f"{self._label}: {25 * q}% ({done}/{total} steps)")
