"""``lessmem.formats._vml``: MKL VML's first call of a process is made on one thread.

Where torch's first multi-threaded VML call of a process goes wrong (see the module doc:
about one process in twenty on the machine it was found on), it goes wrong only in a fresh
process, so the checks run in one: importing the formats layer (and hence loading a model)
has made the warm-up call, and the first two-thread ``cos`` over a rotary table, the first
VML call of a forward, then matches float64.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

_PROBE = """
import torch
torch.set_num_threads(2)
import lessmem.models
from lessmem.formats import _vml
print("warm", _vml._WARM)
inv = 1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64))
freqs = torch.arange(256)[:, None].float() * inv
emb = torch.cat((freqs, freqs), dim=-1)
for name in ("cos", "sin"):
    got = getattr(emb, name)()
    ref = getattr(emb.double(), name)()
    print(name, int(((got.double() - ref).abs() > 1e-6).sum()))
"""


def test_a_fresh_process_has_made_the_first_vml_call_on_one_thread_before_any_forward():
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = dict(line.split() for line in out.stdout.splitlines())
    assert lines == {"warm": "True", "cos": "0", "sin": "0"}, out.stdout


def test_warm_vml_is_idempotent_and_leaves_results_alone():
    from lessmem.formats._vml import warm_vml

    x = torch.linspace(-3, 3, 5000)
    before = x.cos()
    assert warm_vml() is True and warm_vml() is True
    assert torch.equal(x.cos(), before)
