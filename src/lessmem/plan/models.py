"""Model dimensions for planning: presets, HF ``config.json`` parsing, parameter counts.

Only the numbers that decide bytes matter here: layers L, KV heads H_kv, head_dim d
(KV bytes per token = 2·L·H_kv·d·b), and the weight shapes (parameter count, and which
tensors a GGUF mix such as Q4_K_M stores at more bits).

Example:
    >>> from lessmem.plan.models import get_model
    >>> m = get_model("llama-3-8b")
    >>> m.layers, m.kv_heads, m.head_dim, 2 * m.layers * m.kv_heads * m.head_dim
    (32, 8, 128, 65536)
    >>> round(m.n_params / 1e9, 2)
    8.03
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path


@dataclass(frozen=True)
class Tensor2D:
    """One weight matrix (or vector) of the model: ``rows × cols`` elements."""

    name: str  # GGUF-style role: token_embd, attn_q, attn_k, attn_v, attn_output, ffn_gate, ...
    rows: int
    cols: int  # the contiguous (input) dimension: what GGUF blocks run along
    layer: int | None = None

    @property
    def numel(self) -> int:
        return self.rows * self.cols


@dataclass(frozen=True)
class ModelDims:
    """The shape of a decoder-only transformer, as far as bytes are concerned.

    ``params`` overrides the count computed from the shapes (a checkpoint's own
    number, or a round "8B").
    """

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied_embeddings: bool = False
    max_context: int = 4096
    attn_bias: bool = False
    params: float | None = None
    source: str = "preset"
    notes: dict = field(default_factory=dict, compare=False)

    def __post_init__(self):
        for k in ("layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "vocab",
                  "max_context"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"model {self.name!r}: {k}={v!r} must be a positive integer")
        if self.heads % self.kv_heads:
            raise ValueError(
                f"model {self.name!r}: heads={self.heads} is not a multiple of kv_heads={self.kv_heads}"
            )
        if self.params is not None and not self.params > 0:
            raise ValueError(f"model {self.name!r}: params={self.params!r} must be positive")

    @property
    def kv_elements_per_token(self) -> int:
        """K and V elements one token adds to the cache: 2·L·H_kv·d."""
        return 2 * self.layers * self.kv_heads * self.head_dim

    def tensors(self) -> list[Tensor2D]:
        """Every weight of a Llama-style block stack (norms included), GGUF names."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        out = [Tensor2D("token_embd", self.vocab, h)]
        for i in range(self.layers):
            out += [
                Tensor2D("attn_norm", 1, h, i),
                Tensor2D("attn_q", q, h, i),
                Tensor2D("attn_k", kv, h, i),
                Tensor2D("attn_v", kv, h, i),
                Tensor2D("attn_output", h, q, i),
                Tensor2D("ffn_norm", 1, h, i),
                Tensor2D("ffn_gate", self.intermediate, h, i),
                Tensor2D("ffn_up", self.intermediate, h, i),
                Tensor2D("ffn_down", h, self.intermediate, i),
            ]
            if self.attn_bias:
                out.append(Tensor2D("attn_bias", 1, q + 2 * kv, i))
        out.append(Tensor2D("output_norm", 1, h))
        if not self.tied_embeddings:
            out.append(Tensor2D("output", self.vocab, h))
        return out

    @property
    def computed_params(self) -> int:
        return sum(t.numel for t in self.tensors())

    @property
    def n_params(self) -> float:
        return float(self.params) if self.params is not None else float(self.computed_params)

    def with_params(self, params: float) -> ModelDims:
        return replace(self, params=params)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["n_params"] = self.n_params
        d["kv_elements_per_token"] = self.kv_elements_per_token
        return d


def _llama(name, layers, hidden, heads, kv_heads, intermediate, vocab, ctx, tied=False,
           head_dim=None, bias=False, params=None):
    return ModelDims(name, layers, hidden, heads, kv_heads, head_dim or hidden // heads,
                     intermediate, vocab, tied, ctx, bias, params)


MODEL_PRESETS: dict[str, ModelDims] = {
    m.name: m
    for m in (
        _llama("llama-3-8b", 32, 4096, 32, 8, 14336, 128256, 8192),
        _llama("llama-3.1-8b", 32, 4096, 32, 8, 14336, 128256, 131072),
        _llama("llama-3-70b", 80, 8192, 64, 8, 28672, 128256, 8192),
        _llama("llama-2-7b", 32, 4096, 32, 32, 11008, 32000, 4096),
        _llama("llama-2-13b", 40, 5120, 40, 40, 13824, 32000, 4096),
        _llama("mistral-7b", 32, 4096, 32, 8, 14336, 32000, 32768),
        _llama("qwen2.5-7b", 28, 3584, 28, 4, 18944, 152064, 32768, bias=True),
        _llama("smollm2-135m", 30, 576, 9, 3, 1536, 49152, 8192, tied=True),
        _llama("smollm2-1.7b", 24, 2048, 32, 32, 8192, 49152, 8192, tied=True),
    )
}
ALIASES = {
    "meta-llama/meta-llama-3-8b": "llama-3-8b", "meta-llama/llama-3.1-8b": "llama-3.1-8b",
    "meta-llama/meta-llama-3-70b": "llama-3-70b", "meta-llama/llama-2-7b-hf": "llama-2-7b",
    "mistralai/mistral-7b-v0.1": "mistral-7b", "qwen/qwen2.5-7b": "qwen2.5-7b",
    "huggingfacetb/smollm2-135m-instruct": "smollm2-135m", "huggingfacetb/smollm2-135m": "smollm2-135m",
    "smollm2": "smollm2-135m",
}


def model_choices() -> str:
    return ", ".join(MODEL_PRESETS) + ", or a path to a Hugging Face config.json"


def _first(cfg: dict, keys: tuple[str, ...], path: str, required: bool = True):
    for k in keys:
        if k in cfg and cfg[k] is not None:
            v = cfg[k]
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{path}: {k}={v!r} must be a positive integer")
            return v
    if required:
        raise ValueError(f"{path}: missing {' / '.join(keys)} (needed to count KV bytes)")
    return None


def from_hf_config(path: str | Path) -> ModelDims:
    """Read layers, heads, KV heads, head_dim, sizes (and params if stated) from a config.json.

    Multimodal configs are read from their ``text_config``. Raises ValueError naming the
    file and the missing or malformed field.
    """
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise ValueError(f"model config {str(p)!r} does not exist; choose one of: {model_choices()}")
    try:
        cfg = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{p}: malformed config.json ({exc})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{p}: malformed config.json (expected a JSON object, got {type(cfg).__name__})")
    if isinstance(cfg.get("text_config"), dict):
        cfg = {**cfg, **cfg["text_config"]}
    where = str(p)
    layers = _first(cfg, ("num_hidden_layers", "n_layer", "num_layers", "n_layers"), where)
    hidden = _first(cfg, ("hidden_size", "n_embd", "d_model", "dim"), where)
    heads = _first(cfg, ("num_attention_heads", "n_head", "num_heads", "n_heads"), where)
    kv = _first(cfg, ("num_key_value_heads", "n_kv_heads", "num_kv_heads", "multi_query_group_num"),
                where, required=False) or heads
    head_dim = _first(cfg, ("head_dim", "kv_channels"), where, required=False)
    if head_dim is None:
        if hidden % heads:
            raise ValueError(f"{where}: hidden_size={hidden} is not divisible by heads={heads}; give head_dim")
        head_dim = hidden // heads
    inter = _first(cfg, ("intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size"), where,
                   required=False) or 4 * hidden
    vocab = _first(cfg, ("vocab_size", "padded_vocab_size"), where)
    ctx = _first(cfg, ("max_position_embeddings", "n_positions", "seq_length", "max_seq_len"),
                 where, required=False) or 4096
    params = cfg.get("num_parameters") or cfg.get("n_params")
    if params is not None and (isinstance(params, bool) or not isinstance(params, (int, float)) or params <= 0):
        raise ValueError(f"{where}: num_parameters={params!r} must be a positive number")
    name = cfg.get("_name_or_path") or cfg.get("model_type") or p.parent.name or "config"
    try:
        return ModelDims(str(name), layers, hidden, heads, kv, head_dim, inter, vocab,
                         bool(cfg.get("tie_word_embeddings", False)), ctx,
                         bool(cfg.get("attention_bias", cfg.get("model_type") == "qwen2")),
                         float(params) if params else None, source=str(p))
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


def get_model(name_or_path: str | ModelDims) -> ModelDims:
    """A preset by name (case-insensitive, HF ids of the presets accepted) or a config.json path."""
    if isinstance(name_or_path, ModelDims):
        return name_or_path
    key = str(name_or_path).strip().lower()
    key = ALIASES.get(key, key)
    if key in MODEL_PRESETS:
        return MODEL_PRESETS[key]
    s = str(name_or_path)
    if s.endswith(".json") or "/" in s or Path(s).exists():
        if Path(s).exists():
            return from_hf_config(s)
        raise ValueError(f"model config {s!r} does not exist; choose one of: {model_choices()}")
    raise ValueError(f"unknown model {s!r}; choose one of: {model_choices()}")
