"""Subprocess for the restart and shared-prefix tests: ``_gen.run_saved_prompt(spec)`` -> out.pt.

argv: tiers-spec  out.pt
"""

import sys

import torch

torch.set_num_threads(1)
sys.path.insert(0, __file__.rsplit("/", 1)[0])
import _gen  # noqa: E402

torch.save(_gen.run_saved_prompt(sys.argv[1]), sys.argv[2])
