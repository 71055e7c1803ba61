"""Calibration data and the block-by-block pass shared by GPTQ, AWQ and SmoothQuant.

``calibration_ids`` turns text (a file path, a string, a list of strings; default: the
built-in corpus, Python's ``pydoc_data.topics`` joined by ``lessmem.base.corpus.
pydoc_corpus``, the evaluator's own built-in text) or integer token ids into ``n_samples``
windows of ``seq_len`` tokens, non-overlapping, in order. A ``pathlib.Path`` is always a
file; a ``str`` is a file name only when it is one line and names an existing file,
otherwise it is the text itself (so ``open("train.txt").read()`` and ``"train.txt"``
both work, and a text that names no existing file is never opened).

``BlockInputs`` captures what the first decoder block receives for each window (hidden
states and the keyword arguments: rotary ``position_embeddings``, mask, positions), so
each block can then be run, observed, solved and replaced on its own, and its quantized
output becomes the next block's input: only one block's activations are live at a time.

Example:
    >>> from lessmem.weights.calibrate import builtin_corpus
    >>> len(builtin_corpus()) > 100_000
    True
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..base.corpus import pydoc_corpus
from .observer import StopForward

# the built-in calibration text is the evaluator's built-in corpus (one definition)
builtin_corpus = pydoc_corpus


def _is_path(c) -> bool:
    """A ``Path`` (or other path object) is a file name. A ``str`` is one only if it looks like
    a path (one line, no NUL, at most 4095 characters) and names an existing file; any other
    string is the calibration text itself."""
    if isinstance(c, os.PathLike):
        return True
    return (isinstance(c, str) and "\n" not in c and "\0" not in c and len(c) < 4096
            and os.path.isfile(c))  # isfile is False (never an error) for names the OS refuses


def describe(calibration) -> str:
    if calibration is None:
        return "built-in corpus (pydoc_data.topics)"
    if isinstance(calibration, torch.Tensor):
        return f"token ids {tuple(calibration.shape)}"
    if _is_path(calibration):
        return f"file {calibration}"
    if isinstance(calibration, str):
        return f"text given by the caller ({len(calibration)} characters)"
    return "text given by the caller"


def _read_file(path) -> str:
    if not os.path.isfile(path):
        raise ValueError(f"calibration={os.fspath(path)!r} is not an existing file (pass the "
                         "text itself as a str to calibrate on it)")
    return Path(path).read_text(encoding="utf-8", errors="replace")


def _token_ids(calibration: torch.Tensor) -> torch.Tensor:
    if calibration.is_floating_point() or calibration.is_complex() or calibration.dtype == torch.bool:
        raise ValueError(f"calibration token ids must be an integer tensor, got {calibration.dtype}")
    ids = calibration.reshape(-1).long()
    if ids.numel() and int(ids.min()) < 0:
        raise ValueError(f"calibration token ids must be >= 0, got {int(ids.min())}")
    return ids


def calibration_ids(calibration, tokenizer, n_samples: int, seq_len: int) -> torch.Tensor:
    """LongTensor [n_samples, seq_len] of calibration tokens (see the module doc)."""
    hint = ""
    if isinstance(calibration, torch.Tensor):
        ids = _token_ids(calibration)
    else:
        if calibration is None:
            text = builtin_corpus()
        elif _is_path(calibration):
            text = _read_file(calibration)
        elif isinstance(calibration, str):
            text = calibration
            if "\n" not in text and len(text) < 256:
                hint = f" (calibration={text[:60]!r} was taken as text: no such file exists)"
        elif isinstance(calibration, (list, tuple)) and all(isinstance(t, str) for t in calibration):
            text = "\n\n".join(calibration)
        else:
            raise ValueError(f"calibration={type(calibration).__name__}; allowed: None (built-in "
                             "corpus), a file path, a string, a list of strings, or token ids")
        if tokenizer is None:
            raise ValueError("calibration text needs tokenizer=... (a model from lessmem.load "
                             "brings its own); or pass token ids")
        ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
    need = n_samples * seq_len
    if ids.numel() < need:
        raise ValueError(f"calibration text is too short: {ids.numel()} tokens, but n_samples="
                         f"{n_samples} x seq_len={seq_len} needs {need}; give more text or lower "
                         f"n_samples/seq_len{hint}")
    return ids[:need].view(n_samples, seq_len)


class BlockInputs:
    """Inputs of decoder block 0 for each calibration window, captured by a pre-hook."""

    def __init__(self, model, blocks, ids: torch.Tensor):
        self.hidden: list[torch.Tensor] = []
        self.kwargs: dict = {}

        def grab(mod, args, kwargs):
            x = args[0] if args else kwargs["hidden_states"]
            self.hidden.append(x.detach())
            if not self.kwargs:
                self.kwargs = {k: v for k, v in kwargs.items()
                               if k not in ("hidden_states", "past_key_values", "past_key_value",
                                            "use_cache")}
            raise StopForward

        h = blocks[0].register_forward_pre_hook(grab, with_kwargs=True)
        emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        dev = emb.weight.device if emb is not None else ids.device  # token ids go where the model is
        try:
            with torch.no_grad():
                for i in range(ids.shape[0]):
                    try:
                        model(input_ids=ids[i:i + 1].to(dev), use_cache=False)
                    except StopForward:
                        pass
        finally:
            h.remove()


def run_block(block, hidden: list[torch.Tensor], kwargs: dict, collect: bool = False):
    """Run ``block`` on every captured input; StopForward (early stop) ends a sample quietly."""
    outs = []
    with torch.no_grad():
        for x in hidden:
            try:
                y = block(x, **kwargs)
            except StopForward:
                continue
            if collect:
                outs.append((y[0] if isinstance(y, tuple) else y).detach())
    return outs
