"""Model-specific knowledge as a small table (no per-model forked drivers).

For each supported ``config.model_type``: where the decoder blocks live, and per block
the *scaling groups* — a preceding op whose output feeds a set of linears (so a
per-input-channel scale can be folded into it, AWQ/SmoothQuant) and the sub-module
whose output AWQ inspects — and the *true-sequential stages* GPTQ quantizes in order.

Example:
    >>> from lessmem.weights.arch import arch_for
    >>> a = arch_for("llama")
    >>> [g.prev for g in a.groups]
    ['input_layernorm', 'self_attn.v_proj', 'post_attention_layernorm', 'mlp.up_proj']
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ScaleGroup:
    prev: str  # a norm (scale its weight) or a linear (scale its output rows)
    linears: tuple[str, ...]  # linears whose input channels take the inverse scale
    inspect: str  # sub-module whose output error AWQ measures
    smooth: bool  # SmoothQuant folds into this group (norm -> linear only)


@dataclass(frozen=True)
class Arch:
    blocks: str  # attribute path of the ModuleList of decoder blocks
    groups: tuple[ScaleGroup, ...]
    stages: tuple[tuple[str, ...], ...]  # true-sequential order inside a block


_LLAMA = Arch(
    blocks="model.layers",
    groups=(
        ScaleGroup("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                   "self_attn", True),
        # v -> o only when shapes match (no GQA): o's input channel j comes from v's output j
        ScaleGroup("self_attn.v_proj", ("self_attn.o_proj",), "self_attn.o_proj", False),
        ScaleGroup("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"), "mlp", True),
        ScaleGroup("mlp.up_proj", ("mlp.down_proj",), "mlp.down_proj", False),
    ),
    stages=(("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("self_attn.o_proj",),
            ("mlp.gate_proj", "mlp.up_proj"), ("mlp.down_proj",)),
)

ARCHS: dict[str, Arch] = {"llama": _LLAMA, "mistral": _LLAMA, "qwen2": _LLAMA, "qwen3": _LLAMA}


def arch_for(model_type: str) -> Arch:
    if model_type not in ARCHS:
        raise ValueError(f"model_type={model_type!r} has no entry for calibrated quantization; "
                         f"supported: {', '.join(sorted(ARCHS))} (RTN works on any model)")
    return ARCHS[model_type]


def get_module(root, path: str):
    m = root
    for part in path.split("."):
        m = getattr(m, part)
    return m


def set_module(root, path: str, new) -> None:
    parent, _, name = path.rpartition(".")
    setattr(get_module(root, parent) if parent else root, name, new)
