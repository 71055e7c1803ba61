"""Run Triton kernels under the interpreter in a child process (``TRITON_INTERPRET=1``).

Triton fixes its mode when it is imported (its own library functions are built for the
compiler or for the interpreter then), so interpreted kernels run in a fresh process
and the test process (and every other test in it) keeps the normal mode.

``run_interpreted(calls, tmp_path)``: ``calls`` = {name: ("module:function", args, kwargs)};
returns {name: ("ok", result) or ("error", exception type name, message)}.
As a script: ``python _triton_interpret.py IN OUT`` does the same from torch.save files.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import torch


def run_interpreted(calls: dict, tmp_path: Path, timeout: float = 300.0) -> dict:
    src, dst = tmp_path / "calls.pt", tmp_path / "results.pt"
    torch.save(calls, src)
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
               PYTHONPATH=os.pathsep.join([str(root / "src"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, __file__, str(src), str(dst)], env=env, capture_output=True,
                          text=True, timeout=timeout)
    if proc.returncode:
        raise RuntimeError(f"the interpreter child failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return torch.load(dst, weights_only=False)


def _main(src: str, dst: str) -> None:
    import triton

    assert triton.knobs.runtime.interpret, "TRITON_INTERPRET=1 must be set before triton is imported"
    out = {}
    for name, (target, args, kwargs) in torch.load(src, weights_only=False).items():
        mod, fn = target.split(":")
        try:
            out[name] = ("ok", getattr(importlib.import_module(mod), fn)(*args, **kwargs))
        except Exception as e:  # reported to the test, which decides
            out[name] = ("error", type(e).__name__, str(e))
    torch.save(out, dst)


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2])
