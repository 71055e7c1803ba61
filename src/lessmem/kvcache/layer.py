"""One layer of the quantized KV cache (a transformers ``CacheLayerMixin``).

Storage, in chronological order: ``sinks`` (first tokens, full precision), the
quantized history (append-only blocks), ``window`` (most recent tokens, full
precision). New tokens go to the sinks until they hold ``sinks`` tokens, then to
the window; whenever the window holds ``window + block_size`` tokens or more, its
oldest whole blocks are quantized once and appended to the history. History codes are
never dequantized and re-quantized.

The history of a layer (codes, scales, zero points of keys and values, tokens along dim 2)
is held in pieces of ``SEGMENT_TOKENS`` tokens on the CPU: blocks are appended to the last
piece by concatenation, and a piece that is full is never copied again. Attention reads
the pieces in place (a :class:`~lessmem.kernels.attention.SegmentedKV`). One growing
tensor would be copied whole at every block a layer appends, leaving the old copy's pages
to the allocator (``benchmarks/results/e2e_16k.json`` at 86add28 against the version before
it: best-4's decode RSS over imports 271 -> 250 MiB, with GGUF q/k rows kept mapped too).
On other devices (and in sliding layers,
whose history is bounded) the history is one piece. ``history`` gives it as one dict
(joined: a copy when there are several pieces); ``blocks()`` returns the immutable
per-block views.
Attention reads the history through exactly one method, ``read_history()``: a tiered
subclass (offload) overrides it (and ``_append_history``) to fetch blocks from its tiers.

``update()`` returns either the dequantized keys/values (reference path: any attention
implementation can use them) or, when the model runs lessmem's fused attention
(``lessmem.kvcache.enable(model)``), a :class:`~lessmem.kvcache.view.LayerView` handle
that the fused attention reads directly.
"""

from __future__ import annotations

import numbers
from typing import Callable

import torch
from transformers.cache_utils import CacheLayerMixin

from ..base.cpu import trim_heap
from ..base.placement import window_capacity
from ..formats.permutation import channel_permutation
from ..kernels.attention import QuantKV, QuantSide, SegmentedKV
from . import codec
from .block import KVBlock
from .codec import kv_layout
from .config import KVConfig, KVTensorConfig
from .encode_op import encode_chunk  # torch.ops.lessmem.kv_encode: Triton on CUDA
from .key_rounding import QueryMoments, applies, round_keys
from .view import LayerView, _rot_matrix, attend_rows

_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
SEGMENT_TOKENS = 2048  # tokens per piece of a layer's history on the CPU (module doc)
# A long prefill chunk on the CPU: every TRIM_EVERY_LAYERS layers, before a layer appends at
# least TRIM_MIN_TOKENS tokens, the C heap's free pages go back to the OS (base.cpu.trim_heap).
# Each layer frees its activations, but the allocator keeps their pages and the next layer's
# differently sized temporaries fragment them, so a chunk's peak RSS grew with depth. A trim
# every 10 layers lowered a 4k-token best-4 prefill's peak on the built-in model for a few
# percent more prefill time, one every layer cost far more time (the A/B is in the commit
# that added this; benchmarks/results/e2e_trim_after.json against e2e_trim_before.json has
# it with the other trims).
TRIM_EVERY_LAYERS = 10
TRIM_MIN_TOKENS = 128


def trim_for_chunk(layer_idx: int, x: torch.Tensor) -> None:
    """``trim_heap`` where layer ``layer_idx`` takes a prompt chunk ``x`` [..., T, D] of at
    least ``TRIM_MIN_TOKENS`` tokens on the CPU, every ``TRIM_EVERY_LAYERS`` layers (above): a
    lessmem layer's update asks, and the switched attention for a ``DynamicCache``'s layers
    (``kvcache.attention.DYNAMIC_PROMPT``)."""
    if (x.shape[-2] >= TRIM_MIN_TOKENS and layer_idx % TRIM_EVERY_LAYERS == TRIM_EVERY_LAYERS - 1
            and x.device.type == "cpu"):
        trim_heap()  # (see TRIM_EVERY_LAYERS)


def crop_to_length(tokens_to_remove, length: int) -> int:
    """The length to keep for transformers' ``crop(tokens_to_remove)`` on ``length`` tokens.

    A negative value removes that many tokens (what transformers passes), a positive one
    is the final length (the older ``crop(max_length)``), 0 removes nothing. Anything
    else (a non-integer, or more than ``length``) raises, naming what is allowed."""
    if isinstance(tokens_to_remove, bool) or not isinstance(tokens_to_remove, numbers.Integral):
        raise TypeError(f"crop({tokens_to_remove!r}); allowed: an integer (negative: tokens to "
                        "remove, positive: the length to keep)")
    n = int(tokens_to_remove)
    if abs(n) > length:
        raise ValueError(f"crop({n}): the cache holds {length} tokens; allowed: -{length}..-1 "
                         f"(tokens to remove), 0, or 1..{length} (the length to keep)")
    return length + n if n < 0 else (n or length)


def _side(spec: KVTensorConfig, codes, scale, zp, head_dim) -> QuantSide:
    """Kernel view of one side's stored parts, laid out as ``kv_layout(spec, head_dim)``
    says (a zero point is kept only when the layout stores one)."""
    layout = kv_layout(spec, head_dim)
    return QuantSide(codes, scale, zp if layout.has_zero_point else None, layout)


def count_part(m: dict[str, int], name: str, nbytes: int) -> None:
    """Add ``nbytes`` of the history part ``name`` (``k_codes``, ``v_scale``,
    ``k_zero_point``...) to a ``memory()`` dict: under its kind (``codes``, ``scales``,
    ``zero_points``) and its side (``k_quant_bytes`` / ``v_quant_bytes``)."""
    kind = "codes" if name.endswith("codes") else ("scales" if name.endswith("scale") else "zero_points")
    m[kind] += nbytes
    m["k_quant_bytes" if name.startswith("k_") else "v_quant_bytes"] += nbytes


class QuantizedKVLayer(CacheLayerMixin):
    """Quantized cache layer; see the module doc. Built by :class:`~lessmem.kvcache.KVCache`."""

    is_sliding = False
    is_croppable = True
    segment_tokens: int | None = SEGMENT_TOKENS  # None: the history is one piece
    trim_on_prefill = True  # a long chunk's update trims the C heap (TRIM_EVERY_LAYERS)

    def __init__(self, config: KVConfig, layer_idx: int, rotations=(None, None),
                 fused: Callable[[], bool] = lambda: False):
        super().__init__()
        self.config, self.layer_idx = config, layer_idx
        self.kspec, self.vspec = config.for_layer(layer_idx)
        if self.kspec.quantized != self.vspec.quantized:
            raise ValueError(
                f"layer {layer_idx}: keys format {self.kspec.format!r} and values format "
                f"{self.vspec.format!r}; allowed: both quantized or both 'none'"
            )
        self.quantized = self.kspec.quantized
        self.rot_k = rotations[0] if self.quantized else None
        if self.quantized and self.kspec.channel_order:  # keys stored sorted by their channel bits
            self.rot_k = channel_permutation(self.kspec.channel_order, len(self.kspec.channel_bits))
        self.rot_v = rotations[1] if self.quantized else None
        self._fused = fused
        self.reset()

    # ---- state ------------------------------------------------------------------
    def reset(self) -> None:
        self.keys = self.values = None  # full-precision tensors of an unquantized layer
        self.sinks: tuple[torch.Tensor, torch.Tensor] | None = None
        self.window: tuple[torch.Tensor, torch.Tensor] | None = None
        self._pieces: list[dict[str, torch.Tensor]] = []  # the history: full pieces, then the last
        self._read = None  # the history as attention reads it (read_history's memo)
        self._wbuf = self._wview = None  # the window's buffer and the views of it last set
        self.n_history = 0
        self.length = 0
        self.is_initialized = False
        self.queries: QueryMoments | None = None  # key_rounding="attention": the queries seen

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype
        self.batch_size, self.num_heads, _, self.head_dim = key_states.shape
        if self.quantized:  # the stored layout of each side (raises when head_dim does not fit)
            self.layouts = {"k": kv_layout(self.kspec, self.head_dim), "v": kv_layout(self.vspec, self.head_dim)}
            if self.config.key_rounding == "attention" and applies(self.kspec):
                self.queries = QueryMoments(self.num_heads, self.head_dim)
        wd = self.config.window_dtype
        self.store_dtype = self.dtype if (wd == "model" or not self.quantized) else _DTYPES[wd]
        empty = key_states.new_zeros((self.batch_size, self.num_heads, 0, self.head_dim), dtype=self.store_dtype)
        if self.quantized:
            self.sinks = (empty, empty.clone())
            self.window = (empty.clone(), empty.clone())
        else:
            self.keys, self.values = empty, empty.clone()
        self.is_initialized = True

    # ---- transformers interface -------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.trim_on_prefill:
            trim_for_chunk(self.layer_idx, key_states)
        if not self.quantized:  # behaves exactly like DynamicLayer
            self.keys = torch.cat([self.keys, key_states], dim=-2)
            self.values = torch.cat([self.values, value_states], dim=-2)
            self.length = self.keys.shape[2]
            return self.keys, self.values
        view = self.append_view(key_states, value_states)
        if self._fused():
            return view, view
        return view.materialize()

    def append_view(self, key_states: torch.Tensor, value_states: torch.Tensor) -> LayerView:
        """Append new tokens to this quantized, initialized layer and return the step's view of
        it (what ``update`` returns on the fused path), with no checks: for callers that made
        the keys and values for this layer themselves (the lean decode step)."""
        view = LayerView(self.sinks, self.read_history(), self.window, (key_states, value_states),
                         self.rot_k, self.rot_v, self.queries)
        self._append(key_states, value_states)
        return view

    def decode_row(self, q: torch.Tensor, key_states: torch.Tensor, value_states: torch.Tensor,
                   scaling: float) -> torch.Tensor:
        """``append_view(k, v).attend(q, None, scaling)`` for one decode row (batch 1, one new
        token, q [1, Hq, 1, D]), without the view in between where it can: the same pieces
        (sinks, history, window, the token) go to the same one-call kernel, so the output is
        the same bit for bit. The lean decode step calls this in every layer (the view and
        its checks had cost ~16 µs of a layer's ~530)."""
        parts = self.row_parts(key_states, value_states)
        if parts is not None and q.device.type == "cpu" and q.shape[0] == 1 and q.shape[2] == 1:
            Hq, D = q.shape[1], q.shape[3]
            out = attend_rows(self, q.reshape(1, Hq, D), scaling, [parts[0]], [parts[1]])
            if out is not None:
                self._append(key_states, value_states)
                out = out.view(1, Hq, 1, D)
                return out if q.dtype == torch.float32 else out.to(q.dtype)
        return self.append_view(key_states, value_states).attend(q, None, scaling)

    def row_parts(self, key_states: torch.Tensor, value_states: torch.Tensor):
        """(history, full-precision pieces) that one decode row's token ``key_states`` /
        ``value_states`` is attended over (the pieces: sinks, window, the token), as the view
        of ``append_view`` hands them to the one-call kernel; the caller attends, then
        ``_append``s (``decode_row``; a serving step's rows, ``decode.LeanDecode``). None where
        that is not the whole of an update: no history yet, the queries still being gathered
        (key rounding), or a subclass whose update does more (a sliding layer drops what slid
        out, a tiered one accounts for the forward)."""
        hist = self.read_history()
        if hist is None or (self.queries is not None and not self.queries.full):
            return None
        pieces = [p for p in (self.sinks, self.window) if p[0].shape[2]]
        pieces.append((key_states, value_states))
        return hist, pieces

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    # ---- append-only storage ------------------------------------------------------
    def _append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        n = k.shape[2]
        take = max(0, min(n, self.config.sinks - self.length))
        if take:
            ks, vs = k[:, :, :take].to(self.store_dtype), v[:, :, :take].to(self.store_dtype)
            self.sinks = (torch.cat([self.sinks[0], ks], 2), torch.cat([self.sinks[1], vs], 2))
        if take < n:
            self._window_append(k[:, :, take:], v[:, :, take:]) if take else self._window_append(k, v)
        self.length += n
        B = self.config.block_size
        nblk = (self.window[0].shape[2] - self.config.window) // B
        if nblk > 0:
            t = nblk * B
            wk, wv = self.window
            self._append_history(self._encode(wk[:, :, :t], wv[:, :, :t]))
            self._window_append(wk[:, :, t:], wv[:, :, t:], fresh=True)

    def _window_append(self, k: torch.Tensor, v: torch.Tensor, fresh: bool = False) -> None:
        """Write ``k``, ``v`` after the window (``fresh``: as the whole window, in a new buffer).

        The window is a prefix of a buffer with room for its tokens rounded up to
        ``WINDOW_GRAIN``; a decode step writes its token into the room instead of concatenating
        the whole window, and a window that outgrows its buffer moves into a larger one. Only
        positions past the window's end are written, so a view taken earlier (a step's
        ``LayerView``, a serving snapshot) keeps its tokens; a window set from outside (crop,
        batch operations, a restore) is copied into a new buffer first, and so is the rest
        after a flush."""
        w, n = self.window, k.shape[2]
        m = 0 if fresh else w[0].shape[2]
        buf = self._wbuf
        if fresh or buf is None or w is not self._wview or m + n > buf[0].shape[2]:
            shape = (k.shape[0], k.shape[1], window_capacity(m + n), k.shape[3])
            buf = tuple(torch.empty(shape, dtype=self.store_dtype, device=k.device) for _ in range(2))
            if m:
                buf[0][:, :, :m].copy_(w[0])
                buf[1][:, :, :m].copy_(w[1])
            self._wbuf = buf
        buf[0][:, :, m:m + n].copy_(k)
        buf[1][:, :, m:m + n].copy_(v)
        self.window = self._wview = (buf[0][:, :, :m + n], buf[1][:, :, :m + n])

    def window_held(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The window's keys and values as held: its whole buffer (room included) while the
        window is the view last written into it, else the window's own tensors."""
        if self.window is None:
            return None
        return self._wbuf if self._wbuf is not None and self.window is self._wview else self.window

    def _encode(self, k: torch.Tensor, v: torch.Tensor) -> dict[str, torch.Tensor]:
        kf, vf = k.float(), v.float()
        rk = _rot_matrix(self.rot_k, kf.device, kf.shape[1]) if self.rot_k is not None else None
        if rk is not None:  # rotate(x) = x @ Rᵀ (dense matmul: faster than the FWHT loop)
            kf = kf @ rk
        if self.rot_v is not None:
            vf = vf @ _rot_matrix(self.rot_v, vf.device)
        ek = encode_chunk(kf, self.kspec)
        if self.queries is not None:  # codes chosen for the scores (key_rounding="attention")
            U = self.queries.factor(rk)
            if U is not None:
                ek = round_keys(kf, ek, self.kspec, U.to(kf.device))
        encoded = (("k", ek), ("v", encode_chunk(vf, self.vspec)))
        # history part names: "k_codes", "k_scale", "k_zero_point" (if stored), "v_..."
        return {f"{side}_{part}": t for side, enc in encoded for part, t in enc.parts().items()}

    def _append_history(self, new: dict[str, torch.Tensor]) -> None:
        """Append encoded tokens (codes/scales/zero points, tokens along dim 2)."""
        self._read = None  # (the old parts are freed once the step's view lets go of them)
        self._add_pieces(new)
        self.n_history += new["k_codes"].shape[2]

    def _segment(self) -> int | None:
        """Tokens per piece of the history (a multiple of the block size), None for one piece."""
        S = self.segment_tokens
        if S is None or self.device.type != "cpu":
            return None
        B = self.config.block_size
        return max(B, S // B * B)

    def _add_pieces(self, new: dict[str, torch.Tensor]) -> None:
        """Append ``new`` to the last piece; full pieces are split off and never copied again."""
        S = self._segment()
        last = self._pieces.pop() if self._pieces and (S is None or self._n_tokens(self._pieces[-1]) < S) else None
        joined = new if last is None else {n: torch.cat([last[n], t], dim=2) for n, t in new.items()}
        n = self._n_tokens(joined)
        if S is None or n <= S:
            self._pieces.append({name: t.contiguous() for name, t in joined.items()})
            return
        for t0 in range(0, n, S):  # (copies of at most S tokens: the pieces own their storage)
            self._pieces.append({name: t.clone() for name, t in self._slice(joined, t0, min(n, t0 + S)).items()})

    @staticmethod
    def _n_tokens(piece: dict[str, torch.Tensor]) -> int:
        return piece["k_codes"].shape[2]

    @property
    def history(self) -> dict[str, torch.Tensor] | None:
        """The whole quantized history as one dict of tensors (tokens along dim 2): the piece
        itself when there is one, else the pieces joined (a copy)."""
        if not self._pieces:
            return None
        if len(self._pieces) == 1:
            return self._pieces[0]
        return {n: torch.cat([p[n] for p in self._pieces], dim=2) for n in self._pieces[0]}

    @history.setter
    def history(self, h: dict[str, torch.Tensor] | None) -> None:
        """Replace the history (``n_history`` is the caller's to set)."""
        self._pieces, self._read = [], None
        if h is not None:
            self._add_pieces(h)

    def read_history(self) -> QuantKV | SegmentedKV | None:
        """The quantized history as attention reads it (the one read point): one piece as a
        QuantKV, several read in place as a SegmentedKV. The same object until the history
        changes, so what the kernels derive from it (argument lists, the pointer table) is
        made once per block, not once per step."""
        if self._read is not None or not self._pieces:
            return self._read
        D = self.head_dim

        def kv(h):
            return QuantKV(_side(self.kspec, h["k_codes"], h["k_scale"], h.get("k_zero_point"), D),
                           _side(self.vspec, h["v_codes"], h["v_scale"], h.get("v_zero_point"), D))
        f = kv(self._pieces[0])
        if len(self._pieces) > 1:
            kz, vz = f.keys.zero_point is not None, f.values.zero_point is not None
            f = SegmentedKV(f.keys, f.values,
                            tuple((p["k_codes"], p["k_scale"], p["k_zero_point"] if kz else None) for p in self._pieces),
                            tuple((p["v_codes"], p["v_scale"], p["v_zero_point"] if vz else None) for p in self._pieces),
                            self._segment())
        self._read = f
        return f

    def blocks(self) -> list[KVBlock]:
        """The history as immutable blocks of ``block_size`` tokens (views, no copy)."""
        B = self.config.block_size
        return [KVBlock(self.history_start + t0, B, self._history_slice(t0, t0 + B))
                for t0 in range(0, self.n_history // B * B, B)]

    def _slice(self, parts: dict[str, torch.Tensor], t0: int, t1: int) -> dict[str, torch.Tensor]:
        """Tokens ``[t0, t1)`` (on token-group edges) of every part of ``parts``, as views."""
        out = {}
        for name, t in parts.items():
            side, part = name.split("_", 1)
            tg = self.layouts[side].tokens_per_row(part)
            out[name] = t[:, :, t0 // tg:t1 // tg]
        return out

    def _history_slice(self, t0: int, t1: int) -> dict[str, torch.Tensor]:
        """History tokens ``[t0, t1)`` (on token-group edges) of every part: views when they lie
        in one piece (a block always does), else joined."""
        got, start = [], 0
        for piece in self._pieces:
            n = self._n_tokens(piece)
            a, b = max(t0, start), min(t1, start + n)
            if a < b:
                got.append(self._slice(piece, a - start, b - start))
            start += n
        if len(got) == 1:
            return got[0]
        return {n: torch.cat([g[n] for g in got], dim=2) for n in got[0]}

    @property
    def history_start(self) -> int:
        """Position of the first token of the quantized history (after the sinks)."""
        return self.config.sinks

    # ---- memory ------------------------------------------------------------------
    def fp16_equivalent(self) -> int:
        """Bytes the same layer would hold in an fp16 cache (keys and values of
        ``fp16_tokens``)."""
        if not self.is_initialized:
            return 0
        return 2 * 2 * self.batch_size * self.num_heads * self.fp16_tokens * self.head_dim

    @property
    def fp16_tokens(self) -> int:
        """Tokens an fp16 cache of this layer would hold: every one."""
        return self.length

    def memory(self) -> dict[str, int]:
        """Bytes held by part (see ``KVCache.memory``)."""
        def nb(t):
            return 0 if t is None else t.numel() * t.element_size()

        m = dict(codes=0, scales=0, zero_points=0, window=0, sinks=0, k_quant_bytes=0,
                 v_quant_bytes=0, quant_elements=0, tokens=self.length, window_room=0)
        if not self.is_initialized:
            return m
        if not self.quantized:
            m["window"] = nb(self.keys) + nb(self.values)
            return m
        m["sinks"] = nb(self.sinks[0]) + nb(self.sinks[1])
        m["window"] = nb(self.window[0]) + nb(self.window[1])
        held = self.window_held()
        m["window_room"] = 0 if held is None else nb(held[0]) + nb(held[1]) - m["window"]
        for piece in self._pieces:
            for name, t in piece.items():
                count_part(m, name, nb(t))
        if self._pieces:
            m["quant_elements"] = self.batch_size * self.num_heads * self.n_history * self.head_dim
        return m

    # ---- batch / beam operations ----------------------------------------------------
    def _map(self, fn) -> None:
        if not self.is_initialized:
            return
        if not self.quantized:
            self.keys, self.values = fn(self.keys), fn(self.values)
        else:
            self.sinks = (fn(self.sinks[0]), fn(self.sinks[1]))
            self.window = (fn(self.window[0]), fn(self.window[1]))
            self._pieces = [{n: fn(t) for n, t in piece.items()} for piece in self._pieces]
            self._read = None
        self.batch_size = (self.keys if not self.quantized else self.window[0]).shape[0]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map(lambda t: t[indices])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map(lambda t: t.repeat_interleave(repeats, dim=0))

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` tokens (negative count, as transformers passes
        it) when they are still in full precision; cropping into the quantized history
        raises ValueError (it would need re-quantization). A positive value is the
        legacy form, a final length (see :func:`crop_to_length`); lessmem's own code calls
        :meth:`truncate_to`."""
        self.truncate_to(crop_to_length(tokens_to_remove, self.length))

    def check_truncate(self, length: int) -> None:
        """Raise ValueError, changing nothing, when :meth:`truncate_to` cannot keep
        ``length`` tokens: beyond the length held, or cutting into the quantized history."""
        if isinstance(length, bool) or not isinstance(length, numbers.Integral):
            raise TypeError(f"length={length!r}; allowed: an integer 0..{self.length}")
        if not 0 <= length <= self.length:
            raise ValueError(f"length={length}: layer {self.layer_idx} holds {self.length} "
                             f"tokens; allowed: 0..{self.length}")
        n = self.length - length
        win = self.window[0].shape[2] if self.quantized and self.is_initialized else n
        if n > win and self.n_history:
            raise ValueError(
                f"cannot crop {n} tokens: only the {win} full-precision window tokens can be "
                "removed; allowed: crop sizes up to the window length"
            )

    def truncate_to(self, length: int) -> None:
        """Keep the first ``length`` tokens and drop the rest (only tokens still held in
        full precision can go; see :meth:`check_truncate`, which runs first)."""
        self.check_truncate(length)
        n = self.length - int(length)
        if n <= 0 or not self.is_initialized:
            return
        if not self.quantized:
            self.keys, self.values = self.keys[:, :, :-n], self.values[:, :, :-n]
            self.length -= n
            return
        win = self.window[0].shape[2]
        if n <= win:
            self.window = (self.window[0][:, :, : win - n], self.window[1][:, :, : win - n])
        else:
            keep = self.sinks[0].shape[2] - (n - win)
            self.window = (self.window[0][:, :, :0], self.window[1][:, :, :0])
            self.sinks = (self.sinks[0][:, :, :keep], self.sinks[1][:, :, :keep])
        self.length -= n


def append_rows(layers: list, k: torch.Tensor, v: torch.Tensor) -> None:
    """Token b of ``k`` / ``v`` ([B, H, 1, D]) appended to ``layers[b]`` (quantized, initialized
    layers, a different one a row), as ``layers[b]._append(k[b:b+1], v[b:b+1])`` does, bit
    for bit. A token that only goes into the room of its window's buffer (no sink to take, no
    block to flush, the window the view last written into the buffer) is written with the
    others in one C++ call (``write_rows`` in ``csrc/kv_encode.cpp``); the rest, and every
    token without the C++ module or off the CPU, by ``_append``. A serving step's decode rows
    (``decode.LeanDecode._rows_attend``), where each row of each layer had made two views
    and two ``copy_`` calls: 12 rows and 30 layers at ~300 tokens, 5.9-6.1 ms a step of
    appends before, 4.2 ms after (the flushes' block encodes included in both)."""
    cpu = (k.device.type == "cpu" and k.dtype == torch.float32 and v.dtype == torch.float32
           and k.stride(3) == 1 and v.stride(3) == 1)
    mod = codec._affine_cpp() if cpu else None
    fast, rest = [], []
    for b, layer in enumerate(layers):
        w, buf, cfg = layer.window, layer._wbuf, layer.config
        if (mod is not None and buf is not None and w is layer._wview and layer.length >= cfg.sinks
                and (m := w[0].shape[2]) < buf[0].shape[2] and m + 1 - cfg.window < cfg.block_size
                and buf[0].device.type == "cpu"):
            fast.append((b, layer, buf, m))
        else:
            rest.append(b)
    if fast:
        if rest:
            rows = torch.tensor([f[0] for f in fast])
            kf, vf = k.index_select(0, rows), v.index_select(0, rows)
        else:
            kf, vf = k, v
        mod.write_rows([f[2][0] for f in fast], [f[2][1] for f in fast], [f[3] for f in fast], kf, vf)
        for _, layer, buf, m in fast:  # (the window's new view, as _window_append makes it)
            layer.window = layer._wview = (buf[0].narrow(2, 0, m + 1), buf[1].narrow(2, 0, m + 1))
            layer.length += 1
    for b in rest:
        layers[b]._append(k[b:b + 1], v[b:b + 1])


class SlidingQuantizedKVLayer(QuantizedKVLayer):
    """A sliding-window layer that keeps only what its window can still see, quantized.

    A query at position p attends positions p - sliding_window + 1 .. p (transformers'
    sliding mask), so once the next query is at ``length``, tokens before
    ``length - sliding_window + 1`` are never read again. After each update the layer
    forgets the tokens before that position rounded down to a whole block (``dropped``
    counts them; quantized history first, then full-precision window tokens), so it holds
    at most ``sliding_window + block_size`` tokens whatever the context length. The drop
    point depends on the length alone, so every sliding layer of a cache (quantized, or a
    skipped one kept in full precision) holds the same positions, and ``get_mask_sizes``
    reports them (length and offset) as transformers' ``DynamicSlidingWindowLayer`` does.
    No sinks (they would lie outside the window). Only tokens still in full precision can
    be cropped. Built by :class:`~lessmem.kvcache.KVCache` for sliding layers with
    ``KVConfig(sliding="quantize")``.
    """

    is_sliding = True
    segment_tokens = None  # (the history is bounded: one piece)

    def __init__(self, config: KVConfig, layer_idx: int, sliding_window: int, rotations=(None, None),
                 fused: Callable[[], bool] = lambda: False):
        if isinstance(sliding_window, bool) or not isinstance(sliding_window, numbers.Integral) \
                or sliding_window < 1:
            raise ValueError(f"sliding_window={sliding_window!r}; allowed: an integer >= 1")
        self.sliding_window = int(sliding_window)
        super().__init__(config.replace(sinks=0), layer_idx, rotations, fused)

    def reset(self) -> None:
        super().reset()
        self.dropped = 0

    @property
    def history_start(self) -> int:
        return self.dropped

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length - self.dropped + query_length, self.dropped

    def get_max_length(self) -> int:
        return self.sliding_window

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        out = super().update(key_states, value_states, *args, **kwargs)
        if not self.quantized:  # the base counts what it holds; here that omits the dropped
            self.length = self.dropped + self.keys.shape[2]
            self._drop_slid_out()
        return out

    def append_view(self, key_states: torch.Tensor, value_states: torch.Tensor) -> LayerView:
        view = super().append_view(key_states, value_states)
        self._drop_slid_out()
        return view

    def row_parts(self, key_states: torch.Tensor, value_states: torch.Tensor):
        return None  # (each update also drops what slid out: through append_view)

    def _drop_slid_out(self) -> None:
        B = self.config.block_size
        self._drop_before(max(0, self.length - self.sliding_window + 1) // B * B)

    def _drop_before(self, position: int) -> None:
        """Forget every token before ``position`` (a multiple of the block size)."""
        n = position - self.dropped
        if n <= 0:
            return
        if not self.quantized:
            self.keys, self.values = self.keys[:, :, n:], self.values[:, :, n:]
            self.dropped += n
            return
        h = min(n, self.n_history)  # whole blocks: the history starts and ends on block edges
        if h == self.n_history:
            self.history = None
        elif h:  # a copy: a view would keep the dropped rows' storage alive
            self.history = {name: t.clone() for name, t in self._history_slice(h, self.n_history).items()}
        self._read = None
        self.n_history -= h
        if n > h:
            self.window = (self.window[0][:, :, n - h:], self.window[1][:, :, n - h:])
        self.dropped += n

    @property
    def fp16_tokens(self) -> int:
        """An fp16 sliding layer (transformers') holds the last ``sliding_window - 1`` tokens."""
        return min(self.length, self.sliding_window - 1)

    def check_truncate(self, length: int) -> None:
        super().check_truncate(length)
        if length < self.dropped + self.n_history:
            raise ValueError(f"cannot keep {length} tokens: layer {self.layer_idx} dropped its "
                             f"first {self.dropped} (out of its sliding window of "
                             f"{self.sliding_window}) and holds the next {self.n_history} "
                             "quantized; allowed: crop sizes up to the full-precision window length")
