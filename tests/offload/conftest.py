"""Offload tests run on one thread (the redis-server fixtures, ``redis_server`` and
``redis_proc``, live in ``tests/conftest.py``)."""

from __future__ import annotations

import torch

# 2 shared cores: OpenMP spinning across busy processes makes tiny ops 100x slower
torch.set_num_threads(1)
