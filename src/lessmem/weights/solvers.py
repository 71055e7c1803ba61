"""Per-block solve steps of the calibrated methods (observe, then solve).

Each ``solve_*`` receives one decoder block, its captured inputs (``hidden``: one
``[1, T, H]`` tensor per calibration window, ``kwargs``: rotary embeddings, mask), the
per-linear configs (``cfgs``: block-relative name -> config; absent = keep float) and
replaces the block's linears by ``QuantLinear`` in place.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..formats.gguf import dequantize_gguf, quantize_gguf
from .arch import Arch, get_module, set_module
from .awq import fold_scale, search_clip, search_scale
from .calibrate import run_block
from .gguf_gptq import gptq_gguf
from .gguf_linear import GGUFLinear
from .gptq import gptq_quantize
from .observer import observe
from .qlinear import QuantLinear
from .rtn import rtn_quantize
from .smoothquant import smooth_scale


class LayerSpec(NamedTuple):
    """What one linear gets: bits, resolved group size (in_features = per-channel), symmetric."""

    bits: int
    group_size: int
    symmetric: bool


def _replace(block, name: str, qw, act_bits=None) -> None:
    lin = get_module(block, name)
    set_module(block, name, QuantLinear.from_quantized(qw, lin.bias, act_bits))


def solve_gptq(block, arch: Arch, hidden, kwargs, cfgs: dict, config) -> dict:
    stages = arch.stages if config.true_sequential else (tuple(n for st in arch.stages for n in st),)
    info = {}
    for stage in stages:
        mods = {n: get_module(block, n) for n in stage if n in cfgs}
        if not mods:
            continue
        obs = observe(mods, lambda: run_block(block, hidden, kwargs), want_xtx=True, stop_early=True)
        for n, lin in mods.items():
            c = cfgs[n]
            qw = gptq_quantize(lin.weight, obs[n].hessian(), c.bits, c.group_size, c.symmetric,
                               config.damp, config.block_size, config.act_order, config.static_groups)
            _replace(block, n, qw)
            info[n] = {"tokens": obs[n].n}
    return info


def _group_inputs(block, arch: Arch, hidden, kwargs) -> dict[str, torch.Tensor]:
    """Each scaling group's input (its first linear's), all windows: {first linear: [n, T, K]}."""
    first = [g.linears[0] for g in arch.groups]
    xs: dict[str, list] = {n: [] for n in first}
    hooks = [get_module(block, n).register_forward_pre_hook(
        lambda m, inp, n=n: xs[n].append(inp[0].detach())) for n in first]
    try:
        run_block(block, hidden, kwargs)
    finally:
        for h in hooks:
            h.remove()
    return {n: torch.cat(v) for n, v in xs.items()}


def _foldable(block, g, lins: dict, k: int) -> bool:
    """Whether a scale over the group's k input channels folds into ``g.prev`` exactly."""
    prev = get_module(block, g.prev)
    return all(m.in_features == k for m in lins.values()) and (
        not hasattr(prev, "out_features") or prev.out_features == k)


def _gguf_fake_quant(types: dict, x: torch.Tensor):
    """AWQ's Q for GGUF, for a group whose input is ``x``: the linear's block type, weighted as
    llama.cpp would weigh the scaled input (importance mean((x / s)²))."""
    x_sq = x.reshape(-1, x.shape[-1]).double().pow(2).mean(0)

    def q(n, ws, s):
        raw = quantize_gguf(ws.detach().float(), types[n], imatrix=(x_sq / (s * s)).float().cpu())
        return dequantize_gguf(raw, types[n], tuple(ws.shape))
    return q


def _search_and_fold(block, arch: Arch, hidden, kwargs, cfgs: dict, config, quantizer_for=None):
    """AWQ's first phase, on the float block: each scaling group's scale searched
    (``awq.search_scale`` over ``config.n_grid`` exponents, on the first
    ``config.search_samples`` windows; Q: ``quantizer_for(x)`` or RTN with ``cfgs``) and
    folded into its ``prev``. Returns (info, groups): ``groups`` one ``(linears, x, s)`` per
    group with linears to quantize, ``x`` its input before the fold [n, T, K], ``s`` the
    folded scale (None: the group does not fold)."""
    mods = {n: get_module(block, n) for g in arch.groups for n in g.linears if n in cfgs}
    # inputs of each group's first linear, full windows (the inspected modules need sequences)
    xs = _group_inputs(block, arch, hidden, kwargs)
    info, groups = {}, []
    for g in arch.groups:
        lins = {n: mods[n] for n in g.linears if n in mods}
        if not lins:
            continue
        x, s = xs[g.linears[0]], None
        if _foldable(block, g, lins, x.shape[-1]):
            xs_search = x[:config.search_samples] if config.search_samples else x
            s, best, loss0 = search_scale(block, g, lins, {n: cfgs[n] for n in lins}, xs_search, kwargs,
                                          config.n_grid, quantizer=quantizer_for(x) if quantizer_for else None)
            fold_scale(block, g, s)
            info[g.prev] = {"loss_alpha0": loss0, "loss_best": best}
        groups.append((lins, x, s))
    return info, groups


def solve_gguf(block, arch: Arch, hidden, kwargs, cfgs: dict, config) -> dict:
    """``GGUFConfig(gptq=True and/or awq=True)``: ``cfgs`` maps each linear to its GGUF type.

    ``awq``: each scaling group's per-channel scale searched first (``_search_and_fold`` with
    the group's block types as Q), folded into the norm / preceding linear; then, stage by
    stage (attention then MLP, on inputs through the already-encoded layers), each linear
    encoded with its measured importance (diag H / 2): by GPTQ inside the blocks
    (``gptq``) or by llama.cpp's weighted quantizer."""
    info: dict = {}
    if config.awq:
        info, _ = _search_and_fold(block, arch, hidden, kwargs, cfgs, config,
                                   quantizer_for=lambda x: _gguf_fake_quant(cfgs, x))
    for stage in arch.stages:
        mods = {n: get_module(block, n) for n in stage if n in cfgs}
        if not mods:
            continue
        obs = observe(mods, lambda: run_block(block, hidden, kwargs), want_xtx=True, stop_early=True)
        for n, lin in mods.items():
            h = obs[n].hessian()
            if config.gptq:
                raw = gptq_gguf(lin.weight, h, cfgs[n], config.damp)
            else:
                raw = quantize_gguf(lin.weight.detach(), cfgs[n], imatrix=(torch.diag(h) / 2).cpu())
            set_module(block, n, GGUFLinear.from_raw(torch.from_numpy(raw), cfgs[n], lin.in_features, lin.bias,
                                                     device=lin.weight.device))
            info.setdefault(n, {}).update(tokens=obs[n].n, type=cfgs[n])  # beside its AWQ entry as prev
    return info


def solve_awq(block, arch: Arch, hidden, kwargs, cfgs: dict, config, keep_tokens: int = 512) -> dict:
    info, groups = _search_and_fold(block, arch, hidden, kwargs, cfgs, config)  # phase 1
    kept = []
    for lins, x, s in groups:
        xt = (x if s is None else x / s).reshape(-1, x.shape[-1])  # the input the folded model sees
        kept.append((lins, xt[torch.linspace(0, xt.shape[0] - 1, min(keep_tokens, xt.shape[0])).long()]))
    for lins, xt in kept:  # phase 2: clipping search, then quantize
        for n, lin in lins.items():
            c = cfgs[n]
            clip = None
            if config.clip_search and not n.endswith(("q_proj", "k_proj")):
                clip = search_clip(lin.weight.data, xt, c.bits, c.group_size, c.symmetric,
                                   config.max_shrink)
            _replace(block, n, rtn_quantize(lin.weight.data, c.bits, c.group_size, c.symmetric, clip))
    return info


def smooth_block(block, arch: Arch, hidden, kwargs, cfgs: dict, alpha: float) -> dict:
    """SmoothQuant's folding alone (no quantization): the block's float output is unchanged."""
    names = [n for g in arch.groups for n in g.linears if n in cfgs]
    mods = {n: get_module(block, n) for n in names}
    obs = observe(mods, lambda: run_block(block, hidden, kwargs))
    info = {}
    for g in arch.groups:
        lins = {n: mods[n] for n in g.linears if n in mods}
        if not g.smooth or not lins:
            continue
        xmax = torch.stack([obs[n].abs_max for n in lins]).amax(0)
        s = smooth_scale(xmax, [m.weight for m in lins.values()], alpha)
        fold_scale(block, g, s)
        info[g.prev] = {"act_absmax_before": float(xmax.max()), "act_absmax_after": float((xmax / s).max())}
    return info


def solve_smoothquant(block, arch: Arch, hidden, kwargs, cfgs: dict, config) -> dict:
    info = smooth_block(block, arch, hidden, kwargs, cfgs, config.alpha)
    for n in [n for g in arch.groups for n in g.linears if n in cfgs]:
        lin = get_module(block, n)
        _replace(block, n, rtn_quantize(lin.weight.data, 8, None, True), act_bits=8)
    return info


SOLVERS = {"gptq": solve_gptq, "awq": solve_awq, "smoothquant": solve_smoothquant, "gguf": solve_gguf}
