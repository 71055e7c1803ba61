"""``quantize_(model, config, calibration=None, filter_fn=None)``: replace ``nn.Linear``
modules by ``QuantLinear`` in place (``FP8Config``: by ``FP8Linear``; ``GGUFConfig``: by
``GGUFLinear``, ``weights.gguf_apply``).

RTN and HQQ visit every linear on their own (HQQ fits each group's zero point and scale
to the weights, ``weights.hqq``). Calibrated methods (GPTQ, AWQ, SmoothQuant) go
block by block: capture the first block's inputs once, then for each decoder block
observe its linears' inputs, solve, replace, and run the quantized block to produce the
next block's inputs. Linears outside the blocks (``lm_head`` unless skipped) get RTN.
FP8 (``weights.fp8``) visits every linear like RTN: float8_e4m3fn weights with one float32
scale per output channel, no calibration; its report adds ``bytes_held`` and
``bits_per_weight``.

Which linears: ``config.skip`` / ``config.overrides`` (name patterns) and ``filter_fn(name,
module) -> bool`` (False keeps the module in full precision).

Example:
    >>> import torch, lessmem
    >>> from lessmem.models import tiny_random
    >>> model = tiny_random("llama", hidden_size=64, intermediate_size=128)
    >>> report = lessmem.quantize_(model, lessmem.RTNConfig(bits=4, group_size=32), progress=False)
    >>> type(model.model.layers[0].mlp.down_proj).__name__, report["n_quantized"]
    ('QuantLinear', 14)
"""

from __future__ import annotations

import time
import warnings

import torch
from torch import nn

from .arch import arch_for, get_module, set_module
from .calibrate import BlockInputs, calibration_ids, describe, run_block
from .config import FP8Config, GGUFConfig, HQQConfig, WeightConfig
from .experts import fused_expert_params, split_experts
from .fp8 import FP8Linear
from .gguf_apply import apply_gguf, gguf_plan
from .hqq import hqq_quantize
from .progress import _Progress
from .qlinear import QuantLinear
from .rtn import rtn_quantize
from .solvers import SOLVERS, LayerSpec


def _targets(model: nn.Module, config: WeightConfig, filter_fn) -> dict[str, LayerSpec]:
    out = {}
    for name, mod in model.named_modules():
        if type(mod) is not nn.Linear:
            continue
        if filter_fn is not None and not filter_fn(name, mod):
            continue
        c = config.for_module(name)
        if c is None:
            continue
        gs = c.group_for(name, mod.in_features)  # raises a clear error if it does not divide
        out[name] = LayerSpec(c.bits, gs, c.symmetric)
    return out


def quantize_(model: nn.Module, config: WeightConfig, calibration=None, filter_fn=None,
              tokenizer=None, progress: bool = True) -> dict:
    """Quantize ``model``'s linears in place; returns a report (see the module doc).

    ``calibration`` (GPTQ, AWQ, SmoothQuant): None (the built-in corpus), text, a file path,
    a list of texts or integer token ids (``weights.calibrate``). Text is tokenized with
    ``tokenizer``, by default the one ``lessmem.load`` returned with the model.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"quantize_ needs a torch.nn.Module (e.g. from lessmem.load) as model, "
                        f"got {type(model).__name__}")
    if filter_fn is not None and not callable(filter_fn):
        raise TypeError(f"filter_fn must be None or a function (name, module) -> bool, got "
                        f"{type(filter_fn).__name__}")
    if not isinstance(progress, bool):
        raise TypeError(f"progress must be True or False, got {progress!r}")
    if getattr(model, "_lessmem_gguf", None) is not None:
        raise ValueError(f"this model holds the GGUF blocks of {model._lessmem_gguf['file']} as they are "
                         "stored (lessmem.load's default); quantizing needs float weights: load it "
                         "with lessmem.load(..., weights='float')")
    if isinstance(config, GGUFConfig):
        return _gguf(model, config, calibration, filter_fn, tokenizer, progress)
    if not isinstance(config, (WeightConfig, FP8Config)):
        raise ValueError(f"config={config!r} must be a weight config (RTNConfig, HQQConfig, "
                         "GPTQConfig, AWQConfig, SmoothQuantConfig, GGUFConfig, FP8Config)")
    t0 = time.perf_counter()
    if config.needs_calibration:  # an architecture without an entry fails before the model changes
        arch_for(getattr(getattr(model, "config", None), "model_type", None))
    report = {"method": config.method, "config": config.to_dict(), "layers": {}}
    _split_experts(model, report)
    if isinstance(config, FP8Config):
        return _fp8(model, config, filter_fn, progress, report, t0)
    targets = _targets(model, config, filter_fn)
    if config.needs_calibration:
        done = _calibrated(model, config, targets, calibration, tokenizer, progress, report)
    else:
        done = set()
    rest = [n for n in targets if n not in done]
    hqq = isinstance(config, HQQConfig)
    bar = _Progress(len(rest), "hqq" if hqq else "rtn", progress and bool(rest))
    for name in rest:
        c = targets[name]
        lin = get_module(model, name)
        if hqq:
            h = config.for_module(name)  # per-module overrides of iters, lp_norm, beta, kappa
            qw = hqq_quantize(lin.weight, c.bits, c.group_size, c.symmetric, iters=h.iters,
                              lp_norm=h.lp_norm, beta=h.beta, kappa=h.kappa)
        else:
            qw = rtn_quantize(lin.weight, c.bits, c.group_size, c.symmetric)
        set_module(model, name, QuantLinear.from_quantized(qw, lin.bias))
        bar.step(name)
    bar.close()
    report["n_quantized"] = len(targets)
    report["seconds"] = time.perf_counter() - t0
    model._lessmem_quant = report["config"]  # what save_quantized records
    return report


def _gguf(model, config: GGUFConfig, calibration, filter_fn, tokenizer, progress: bool) -> dict:
    """``GGUFConfig``: the mix's type per linear (``gguf_plan``); with ``gptq``/``awq`` the decoder
    blocks' linears are encoded by the calibrated pass first (``solvers.solve_gguf``),
    the rest (an untied ``lm_head``; a tied one is decoded in place) as without."""
    if not config.needs_calibration:
        return apply_gguf(model, config, filter_fn)
    t0 = time.perf_counter()
    arch_for(getattr(getattr(model, "config", None), "model_type", None))  # before any change
    plan = gguf_plan(model, config, filter_fn)
    embedding_weights = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    targets = {name: t for name, mod, _, t in plan if id(mod.weight) not in embedding_weights}
    cal: dict = {"layers": {}}
    _calibrated(model, config, targets, calibration, tokenizer, progress, cal)
    report = apply_gguf(model, config, filter_fn, plan=plan)
    report.update(calibration=cal["calibration"], layers=cal["layers"], seconds=time.perf_counter() - t0)
    return report


def _split_experts(model: nn.Module, report: dict) -> None:
    """Fused MoE experts -> per-expert linears (``weights.experts``), counted in ``report``."""
    n_split = split_experts(model)
    left = fused_expert_params(model)
    if left:
        warnings.warn(f"{len(left)} fused expert tensors ({', '.join(left[:2])}, ...) are not of the "
                      "standard gate_up_proj/down_proj kind and stay in full precision", stacklevel=3)
    if n_split:
        report["experts_split"] = n_split


def _fp8(model, config: FP8Config, filter_fn, progress: bool, report: dict, t0: float) -> dict:
    """``FP8Config``: every selected ``nn.Linear`` becomes an ``FP8Linear`` (``weights.fp8``);
    the same selection as RTN (``skip``, ``overrides``, ``filter_fn``)."""
    targets = {}
    for name, mod in model.named_modules():
        if type(mod) is not nn.Linear or (filter_fn is not None and not filter_fn(name, mod)):
            continue
        c = config.for_module(name)
        if c is not None:
            targets[name] = c
    bar = _Progress(len(targets), "fp8", progress and bool(targets))
    held = stored = numel = 0
    for name, c in targets.items():  # replaced after the walk: named_modules must not see new ones
        lin = get_module(model, name)
        q = FP8Linear.from_linear(lin, act=c.act)
        set_module(model, name, q)
        held += q.nbytes
        stored += q.qweight.numel() + 4 * q.scale.numel()
        numel += q.qweight.numel()
        bar.step(name)
    bar.close()
    report["n_quantized"] = len(targets)
    report["bytes_held"] = held  # FP8 weights + scales + bias of the replaced layers
    report["bits_per_weight"] = 8.0 * stored / max(numel, 1)  # weights + scales (8 + 32/K)
    report["seconds"] = time.perf_counter() - t0
    model._lessmem_quant = report["config"]  # what save_quantized records
    return report


def _calibrated(model, config, targets, calibration, tokenizer, progress, report) -> set:
    arch = arch_for(getattr(getattr(model, "config", None), "model_type", None))
    blocks = get_module(model, arch.blocks)
    if tokenizer is None:
        tokenizer = getattr(model, "_lessmem_tokenizer", None)  # attached by lessmem.load
    ids = calibration_ids(calibration, tokenizer, config.n_samples, config.seq_len)
    vocab = getattr(model.config, "vocab_size", None)
    if isinstance(vocab, int) and int(ids.max()) >= vocab:
        raise ValueError(f"calibration token id {int(ids.max())} is outside the model's "
                         f"vocabulary (vocab_size={vocab}); was the text tokenized for another model?")
    report["calibration"] = {"source": describe(calibration), "tokens": ids.numel(),
                             "n_samples": config.n_samples, "seq_len": config.seq_len}
    was_training = model.training
    model.eval()
    cap = BlockInputs(model, blocks, ids)
    hidden, kwargs = cap.hidden, cap.kwargs
    solve = SOLVERS[config.method]
    done = set()
    bar = _Progress(len(blocks), config.method, progress)
    with torch.no_grad():
        for i, block in enumerate(blocks):
            prefix = f"{arch.blocks}.{i}."
            cfgs = {n[len(prefix):]: c for n, c in targets.items() if n.startswith(prefix)}
            info = solve(block, arch, hidden, kwargs, cfgs, config)
            report["layers"][i] = info
            done.update(prefix + n for n in cfgs)
            hidden = run_block(block, hidden, kwargs, collect=True)
            bar.step(f"block {i}")
    bar.close()
    model.train(was_training)
    return done
