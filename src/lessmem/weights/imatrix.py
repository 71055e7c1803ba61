"""Importance matrices (llama.cpp's "imatrix"): collect, read, write, and use for GGUF.

An importance matrix holds, for every linear ``W [N, K]``, the statistics of its inputs
``x [rows, K]`` over a calibration text, as ``llama-imatrix`` gathers them for each matmul:

- ``in_sum2[j] += Σ_rows x[row, j]²`` (float, one value per input column ``j``)
- ``counts += rows`` (how many input rows were seen)

and ``llama-quantize --imatrix`` hands its quantizers the per-column importance
``in_sum2[j] / counts`` (a column whose count is 0 gets 1), which the K-quant and legacy
scale searches use to weight the error of each column (``formats.gguf.quantize_gguf(...,
imatrix=...)``). ``IMatrix.importance(name)`` computes exactly that, in float32.

- ``collect_imatrix(model, calibration, ...)`` runs ``n_samples`` windows of ``seq_len``
  tokens of calibration text (``weights.calibrate``: the built-in corpus by default) through
  the model once, with a forward pre-hook on every linear (``nn.Linear``, ``GGUFLinear``,
  ``QuantLinear``, ``FP8Linear``). Entries are keyed by GGUF tensor name
  (``blk.0.attn_q.weight``, via ``gguf_mix.gguf_name``; ``<module>.weight`` for a linear
  without one); ``IMatrix.importance`` also takes the HF module name
  (``model.layers.0.self_attn.q_proj``). As ``llama-imatrix`` does, the output projection
  (``lm_head`` → ``output.weight``) is left out unless ``process_output=True``, and a tied
  one always (llama.cpp has no ``output.weight`` then). Differences from llama-imatrix: no
  BOS is put in front of each window, sums are accumulated in float64, and matmuls of
  fewer than 16 rows are not skipped (lessmem only runs whole windows).
- ``read_imatrix(path)`` reads either file format (a file that starts with ``GGUF`` is the
  GGUF one, as llama.cpp tries that first); ``write_imatrix(im, path)`` writes the GGUF
  format for a ``.gguf`` name, else the legacy one (or ``fmt="gguf"|"dat"``).

The two file formats, as llama.cpp reads and writes them (``tools/imatrix/imatrix.cpp``:
``save_imatrix``, ``save_imatrix_legacy``, ``load_imatrix``, ``load_imatrix_legacy``;
``tools/quantize/quantize.cpp``: ``load_imatrix`` / ``load_legacy_imatrix``;
``common/imatrix-loader.cpp``; ``ggml/src/gguf.cpp``: ``gguf_write_to_buf``), all
little-endian:

Legacy ``.dat``::

    int32 n_entries                       (>= 1)
    n_entries times, names sorted:
        int32 len, len bytes name         (e.g. "blk.0.attn_q.weight", no terminator)
        int32 ncall                       (chunks seen: ceil(count / chunk_size))
        int32 nval                        (>= 1; columns x matrices)
        float32 values[nval]              (in_sum2 / count * ncall)
    int32 last chunk count                \\ optional: older files stop before either
    int32 len, len bytes dataset name     /

so a value divided by ``ncall`` is the mean of x² over all rows (what llama-quantize
passes on; ``ncall = 0``: the values as they are). Read back here, an entry is
``in_sum2 = values``, ``counts = ncall`` (``chunk_size = 1``), which gives that same
importance, and writing it again reproduces the file byte for byte.

GGUF (version 3, alignment 32; ``general.type = "imatrix"``): the metadata keys, in this
order, ``general.type`` (string), ``imatrix.datasets`` (array of strings),
``imatrix.chunk_count`` (uint32), ``imatrix.chunk_size`` (uint32, tokens per chunk), then
per entry, names sorted, the F32 tensors ``<name>.in_sum2`` (ne = [columns, matrices])
and ``<name>.counts`` (ne = [1, matrices]), and ``<name>.in_sum`` (Σ x) where the file
had it. llama-quantize refuses a GGUF imatrix without the three ``imatrix.*`` keys; other
tensors are ignored. ``export_gguf_imatrix`` records, as llama-quantize does, the keys
``quantize.imatrix.file`` / ``.dataset`` (strings) and ``.entries_count`` /
``.chunks_count`` (uint32) in the quantized model.

Using one (llama.cpp ``src/llama-quant.cpp``): a tensor without an entry is quantized
without importance, entries naming no tensor of the model are ignored, and an entry whose
length differs from the tensor's column count is an error (``ValueError`` naming the
tensor), except for ``token_embd.weight``, where it is ignored.

Every reader check raises ``ValueError`` naming the file and what is wrong (a truncated
or garbled file, a count larger than the bytes left, NaN or negative sums, missing
metadata, a non-F32 tensor…), never a traceback from deep inside.

Example:
    >>> import os, tempfile
    >>> from lessmem.models import tiny_random
    >>> m = tiny_random("llama", hidden_size=64, intermediate_size=128)
    >>> im = collect_imatrix(m, torch.randint(0, 256, (64,)), n_samples=2, seq_len=32)
    >>> len(im), im.importance("model.layers.0.mlp.down_proj").shape
    (14, (128,))
    >>> path = os.path.join(tempfile.mkdtemp(), "imatrix.gguf")
    >>> _ = write_imatrix(im, path)
    >>> read_imatrix(path) == im
    True
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

GGUF_MAGIC = b"GGUF"
GGUF_VERSION = 3
GGUF_ALIGNMENT = 32
GGML_MAX_NAME = 64  # ggml tensor names hold at most 63 bytes
SUFFIXES = (".in_sum2", ".counts", ".in_sum")
KEY_TYPE, KEY_DATASETS, KEY_CHUNK_COUNT, KEY_CHUNK_SIZE = (
    "general.type", "imatrix.datasets", "imatrix.chunk_count", "imatrix.chunk_size")
# what llama-quantize records in the model it quantized with an imatrix
QUANTIZE_KEYS = ("quantize.imatrix.file", "quantize.imatrix.dataset", "quantize.imatrix.entries_count",
                 "quantize.imatrix.chunks_count")
FORMATS = ("gguf", "dat")
_U32_MAX = 2**32 - 1
_I32_MAX = 2**31 - 1


# ----------------------------------------------------------------------------- the object


@dataclass(eq=False)
class IMatrixEntry:
    """One tensor's statistics: ``in_sum2`` float32 ``[matrices * columns]`` (Σ x² per
    column, matrix after matrix), ``counts`` int64 ``[matrices]`` (rows seen), and the
    optional ``in_sum`` (Σ x per column, as newer llama-imatrix files carry)."""

    in_sum2: np.ndarray
    counts: np.ndarray
    in_sum: np.ndarray | None = None

    def __post_init__(self):
        self.in_sum2 = np.ascontiguousarray(np.asarray(self.in_sum2, dtype=np.float32).reshape(-1))
        self.counts = np.asarray(self.counts, dtype=np.int64).reshape(-1)
        if self.in_sum is not None:
            self.in_sum = np.ascontiguousarray(np.asarray(self.in_sum, dtype=np.float32).reshape(-1))
        n, m = self.in_sum2.size, self.counts.size
        if n < 1 or m < 1 or n % m:
            raise ValueError(f"imatrix entry: {n} sums and {m} counts; allowed: at least one of each, "
                             "and the sums a whole multiple of the counts (columns x matrices)")
        if self.in_sum is not None and self.in_sum.size != n:
            raise ValueError(f"imatrix entry: {self.in_sum.size} in_sum values but {n} in_sum2 values; "
                             "allowed: the same number")
        if not np.isfinite(self.in_sum2).all() or (self.in_sum2 < 0).any():
            raise ValueError("imatrix entry: in_sum2 holds NaN, infinite or negative values; allowed: "
                             "finite sums of squares >= 0")
        if (self.counts < 0).any():
            raise ValueError(f"imatrix entry: negative count {int(self.counts.min())}; allowed: >= 0")

    @property
    def n_mat(self) -> int:
        """Matrices (experts) the entry covers; 1 for a dense linear."""
        return int(self.counts.size)

    @property
    def n_cols(self) -> int:
        """Input columns per matrix."""
        return int(self.in_sum2.size // self.counts.size)

    def importance(self) -> np.ndarray:
        """float32 ``in_sum2 / count`` per matrix (1 where a matrix saw no rows), as
        llama-quantize computes it."""
        sums = self.in_sum2.reshape(self.n_mat, self.n_cols)
        out = np.ones_like(sums)
        for j, c in enumerate(self.counts):
            if c > 0:
                out[j] = sums[j] / np.float32(c)
        return out.reshape(-1)

    def __eq__(self, other) -> bool:
        if not isinstance(other, IMatrixEntry):
            return NotImplemented
        same_sum = (self.in_sum is None) == (other.in_sum is None) and (
            self.in_sum is None or np.array_equal(self.in_sum, other.in_sum))
        return (np.array_equal(self.in_sum2, other.in_sum2) and np.array_equal(self.counts, other.counts)
                and same_sum)


@dataclass(eq=True)
class IMatrix:
    """An importance matrix: ``entries`` (GGUF tensor name → ``IMatrixEntry``), plus what
    llama.cpp records with it: ``chunk_size`` (tokens per chunk), ``chunk_count`` (chunks
    processed) and ``datasets`` (where the text came from)."""

    entries: dict[str, IMatrixEntry] = field(default_factory=dict)
    chunk_size: int = 1
    chunk_count: int = 0
    datasets: tuple[str, ...] = ()

    def __post_init__(self):
        if not isinstance(self.entries, dict) or not all(
                isinstance(k, str) and isinstance(v, IMatrixEntry) for k, v in self.entries.items()):
            raise ValueError("IMatrix entries must be a dict of tensor name (str) -> IMatrixEntry")
        for what, v, lo in (("chunk_size", self.chunk_size, 1), ("chunk_count", self.chunk_count, 0)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not lo <= v <= _U32_MAX:
                raise ValueError(f"IMatrix {what}={v!r} must be an integer in [{lo}, {_U32_MAX}]")
        self.chunk_size, self.chunk_count = int(self.chunk_size), int(self.chunk_count)
        ds = (self.datasets,) if isinstance(self.datasets, str) else self.datasets
        if not isinstance(ds, (list, tuple)) or not all(isinstance(d, str) for d in ds):
            raise ValueError(f"IMatrix datasets={self.datasets!r} must be a list of strings")
        self.datasets = tuple(ds)

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, name) -> bool:
        return self.key(name) is not None

    def key(self, name: str) -> str | None:
        """The entry name for ``name``: a GGUF tensor name (``blk.0.attn_q.weight``), an HF
        module name (``model.layers.0.self_attn.q_proj``, ``lm_head``) or HF parameter name
        (``model.layers.0.self_attn.q_proj.weight``); None if absent."""
        if not isinstance(name, str):
            return None
        if name in self.entries:
            return name
        from .gguf_load import gguf_tensor_name
        from .gguf_mix import gguf_name

        for k in (gguf_name(name), gguf_tensor_name(name), f"{name}.weight"):
            if k is not None and k in self.entries:
                return k
        return None

    def importance(self, name: str) -> np.ndarray | None:
        """float32 per-column importance of tensor/module ``name`` (``in_sum2 / counts``, what
        llama-quantize passes to its quantizers), or None if the matrix has no entry for it."""
        k = self.key(name)
        return None if k is None else self.entries[k].importance()

    def for_tensor(self, name: str, n_cols: int) -> np.ndarray | None:
        """The importance to quantize a tensor of ``n_cols`` columns with, as llama.cpp applies
        it: None when there is no entry (or when ``token_embd.weight``'s does not fit);
        ``ValueError`` naming the tensor when the entry's length is not ``n_cols``."""
        k = self.key(name)
        if k is None:
            return None
        w = self.entries[k].importance()
        if w.size != n_cols:
            if "token_embd.weight" in (k, name):  # llama.cpp ignores it there (it always differs)
                return None
            raise ValueError(f"imatrix entry {k!r} has {w.size} values but tensor {name!r} has "
                             f"{n_cols} columns; allowed: one value per column (is the imatrix "
                             "from another model?)")
        return w


# ----------------------------------------------------------------------------- collecting


def _linear_types() -> tuple[type, ...]:
    from .fp8 import FP8Linear
    from .gguf_linear import GGUFLinear
    from .qlinear import QuantLinear

    return nn.Linear, GGUFLinear, QuantLinear, FP8Linear


def _dataset_name(calibration) -> str:
    from .calibrate import _is_path, describe

    if calibration is not None and not isinstance(calibration, torch.Tensor) and _is_path(calibration):
        return os.fspath(calibration)
    return describe(calibration)


def collect_imatrix(model: nn.Module, calibration=None, tokenizer=None, n_samples: int = 32,
                    seq_len: int = 512, process_output: bool = False, filter_fn=None,
                    progress: bool = False) -> IMatrix:
    """The importance matrix of ``model``'s linears over ``n_samples`` windows of ``seq_len``
    tokens of ``calibration`` (None: the built-in corpus; text, a file, a list of texts or
    token ids, as ``quantize_`` takes; text is tokenized with ``tokenizer``, by default the
    one ``lessmem.load`` attached); see the module doc. ``filter_fn(name, module) -> bool``
    picks linears (default: all but the output projection; ``process_output=True`` adds it).
    The model runs once per window under ``torch.no_grad``; it is not changed.
    """
    from .calibrate import calibration_ids
    from .checks import _check_bool, _check_int
    from .gguf_mix import gguf_name
    from .progress import _Progress

    if not isinstance(model, nn.Module):
        raise TypeError(f"collect_imatrix needs a torch.nn.Module as model, got {type(model).__name__}")
    _check_int("n_samples", "collect_imatrix", n_samples, 1)
    _check_int("seq_len", "collect_imatrix", seq_len, 1)
    _check_bool("process_output", "collect_imatrix", process_output)
    _check_bool("progress", "collect_imatrix", progress)
    if filter_fn is not None and not callable(filter_fn):
        raise TypeError(f"filter_fn must be None or a function (name, module) -> bool, got "
                        f"{type(filter_fn).__name__}")
    cfg = getattr(model, "config", None)
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    kinds = _linear_types()
    targets: dict[str, tuple[str, nn.Module]] = {}  # entry name -> (module name, module)
    seen = set()
    for name, mod in model.named_modules():
        if not isinstance(mod, kinds) or id(mod) in seen:
            continue
        key = gguf_name(name) or f"{name}.weight"
        if key == "output.weight" and (tied or not process_output):
            continue
        if filter_fn is not None and not filter_fn(name, mod):
            continue
        seen.add(id(mod))
        targets[key] = (name, mod)
    if not targets:
        raise ValueError("collect_imatrix: the model has no linear layer to observe")
    if tokenizer is None:
        tokenizer = getattr(model, "_lessmem_tokenizer", None)
    ids = calibration_ids(calibration, tokenizer, n_samples, seq_len)
    vocab = getattr(cfg, "vocab_size", None)
    if isinstance(vocab, int) and int(ids.max()) >= vocab:
        raise ValueError(f"calibration token id {int(ids.max())} is outside the model's vocabulary "
                         f"(vocab_size={vocab}); was the text tokenized for another model?")
    sums: dict[str, torch.Tensor] = {}
    rows = dict.fromkeys(targets, 0)

    def hook(mod, args, key):
        x = args[0].detach()
        x = x.reshape(-1, x.shape[-1]).double()
        s = (x * x).sum(0)
        sums[key] = s if key not in sums else sums[key] + s
        rows[key] += x.shape[0]

    first = next(iter(model.parameters()), None)
    if first is None:
        first = next(iter(model.buffers()), None)
    device = first.device if first is not None else torch.device("cpu")
    handles = [m.register_forward_pre_hook(lambda mod, args, k=k: hook(mod, args, k))
               for k, (_, m) in targets.items()]
    was_training = model.training
    model.eval()
    bar = _Progress(n_samples, "imatrix", progress)
    try:
        with torch.no_grad():
            for i in range(n_samples):
                model(input_ids=ids[i:i + 1].to(device), use_cache=False)
                bar.step(f"window {i + 1}")
    finally:
        bar.close()
        for h in handles:
            h.remove()
        model.train(was_training)
    entries = {k: IMatrixEntry(sums[k].cpu().numpy().astype(np.float32), [rows[k]])
               for k in sorted(targets) if rows[k] > 0}
    return IMatrix(entries, chunk_size=seq_len, chunk_count=n_samples,
                   datasets=(_dataset_name(calibration),))


# ----------------------------------------------------------------------------- reading


class _Bytes:
    """A bounds-checked little-endian reader over a legacy imatrix file."""

    def __init__(self, data: bytes, path):
        self.data, self.path, self.pos = data, os.fspath(path), 0

    def fail(self, what: str):
        raise ValueError(f"not a valid imatrix file: {self.path}: {what}")

    def left(self) -> int:
        return len(self.data) - self.pos

    def take(self, n: int, what: str) -> bytes:
        if n > self.left():
            self.fail(f"{what} at byte {self.pos} needs {n} bytes but the file ends {self.left()} "
                      "bytes later (truncated?)")
        b = self.data[self.pos:self.pos + n]
        self.pos += n
        return b

    def i32(self, what: str) -> int:
        return struct.unpack("<i", self.take(4, what))[0]


def _read_legacy(path) -> IMatrix:
    r = _Bytes(Path(path).read_bytes(), path)
    n = r.i32("the entry count")
    if n < 1:
        r.fail(f"entry count {n}; allowed: at least 1 (llama.cpp: no data in the file)")
    if n * 16 > r.left():  # each entry: name length, ncall, nval, one value at least
        r.fail(f"entry count {n} needs at least {n * 16} bytes but {r.left()} follow (garbled or "
               "truncated)")
    entries: dict[str, IMatrixEntry] = {}
    for i in range(n):
        length = r.i32(f"entry {i + 1}'s name length")
        if length < 0 or length > r.left():
            r.fail(f"entry {i + 1}'s name length {length}; allowed: 0 to the {r.left()} bytes left")
        raw = r.take(length, f"entry {i + 1}'s name")
        name = raw.decode("utf-8", errors="replace")
        if "\ufffd" in name:
            r.fail(f"entry {i + 1}'s name {raw[:40]!r} is not UTF-8 text")
        if not name or "\0" in name:
            r.fail(f"entry {i + 1}'s name {name!r}; allowed: a tensor name without NUL bytes")
        if name in entries:
            r.fail(f"entry {name!r} appears twice")
        ncall = r.i32(f"entry {name!r}'s ncall")
        nval = r.i32(f"entry {name!r}'s value count")
        if ncall < 0:
            r.fail(f"entry {name!r} has ncall {ncall}; allowed: >= 0")
        if nval < 1 or 4 * nval > r.left():
            r.fail(f"entry {name!r} has {nval} values; allowed: 1 to the {r.left() // 4} that fit in "
                   "the bytes left (truncated?)")
        values = np.frombuffer(r.take(4 * nval, f"entry {name!r}'s values"), dtype="<f4").astype(np.float32)
        if not np.isfinite(values).all() or (values < 0).any():
            r.fail(f"entry {name!r} holds NaN, infinite or negative values; allowed: mean squares >= 0")
        # the values are mean squares times ncall: with counts = ncall, in_sum2 / counts is the
        # importance llama-quantize computes (ncall 0: the values as they are, count 1)
        entries[name] = IMatrixEntry(values, [ncall if ncall > 0 else 1])
    chunk_count, datasets = 0, ()
    if r.left():  # older files end after the entries, or after the chunk count
        chunk_count = r.i32("the chunk count")
        if chunk_count < 0:
            r.fail(f"chunk count {chunk_count}; allowed: >= 0")
        if r.left():
            length = r.i32("the dataset name's length")
            if length < 0 or length > r.left():
                r.fail(f"dataset name length {length}; allowed: 0 to the {r.left()} bytes left")
            raw = r.take(length, "the dataset name")
            datasets = (raw.decode("utf-8", errors="replace"),) if length else ()
            if r.left():
                r.fail(f"{r.left()} bytes follow the dataset name; a legacy imatrix file ends there")
    return IMatrix(entries, chunk_size=1, chunk_count=chunk_count, datasets=datasets)


def _field(reader, key: str):
    f = reader.fields.get(key)
    if f is None:
        return None, None
    import gguf

    return f, gguf.GGUFValueType(f.types[0])


def _read_gguf(path) -> IMatrix:
    import gguf

    from ..formats.gguf_file import open_gguf_reader

    where = f"not a valid imatrix file: {os.fspath(path)}"
    reader = open_gguf_reader(path)  # a damaged file: ValueError("not a valid GGUF file: ...")
    try:
        f, _ = _field(reader, KEY_TYPE)
        kind = f.contents() if f is not None else None
        if kind is not None and kind != "imatrix":
            raise ValueError(f"{where}: general.type is {kind!r}, not 'imatrix' (a model file?)")
        missing = [k for k in (KEY_DATASETS, KEY_CHUNK_COUNT, KEY_CHUNK_SIZE) if k not in reader.fields]
        if missing:
            raise ValueError(f"{where}: missing imatrix metadata {', '.join(missing)} (llama-quantize "
                             "refuses such a file)")
        ints = {}
        for k in (KEY_CHUNK_COUNT, KEY_CHUNK_SIZE):
            f, t = _field(reader, k)
            if t != gguf.GGUFValueType.UINT32:
                raise ValueError(f"{where}: {k} is of type {t.name.lower()}; allowed: uint32")
            ints[k] = int(f.contents())
        f, t = _field(reader, KEY_DATASETS)
        if t != gguf.GGUFValueType.ARRAY or (len(f.types) > 1 and f.types[-1] != gguf.GGUFValueType.STRING):
            raise ValueError(f"{where}: {KEY_DATASETS} must be an array of strings")
        datasets = tuple(f.contents()) if len(f.types) > 1 else ()
        if not reader.tensors:
            raise ValueError(f"{where}: it holds no tensors (llama.cpp: no data in the file)")
        parts: dict[str, dict[str, object]] = {}
        for t in reader.tensors:
            suffix = next((s for s in SUFFIXES if t.name.endswith(s)), None)
            if suffix is None:
                continue  # other tensors are ignored, as llama.cpp does
            if t.tensor_type != gguf.GGMLQuantizationType.F32:
                raise ValueError(f"{where}: tensor {t.name} is {t.tensor_type.name}; allowed: F32")
            ne = [int(s) for s in t.shape]  # ggml order: columns first
            parts.setdefault(t.name[:-len(suffix)], {})[suffix] = (
                ne, np.array(t.data, dtype=np.float32).reshape(-1))
        entries = {}
        for name in sorted(parts):
            p = parts[name]
            if ".in_sum2" not in p or ".counts" not in p:
                raise ValueError(f"{where}: mismatched sums and counts for {name} (it has "
                                 f"{', '.join(name + s for s in p)})")
            (ne, sums), (_, counts) = p[".in_sum2"], p[".counts"]
            n_mat = int(np.prod(ne[1:])) if len(ne) > 1 else 1
            if counts.size != n_mat:
                raise ValueError(f"{where}: {name}.counts has {counts.size} values but {name}.in_sum2 "
                                 f"covers {n_mat} matrices; allowed: one count per matrix")
            if not np.isfinite(counts).all() or (counts < 0).any():
                raise ValueError(f"{where}: {name}.counts holds NaN, infinite or negative values")
            in_sum = p[".in_sum"][1] if ".in_sum" in p else None
            try:
                entries[name] = IMatrixEntry(sums, np.rint(counts).astype(np.int64), in_sum)
            except ValueError as exc:
                raise ValueError(f"{where}: {name}: {str(exc).removeprefix('imatrix entry: ')}") from None
        if not entries:
            raise ValueError(f"{where}: no <name>.in_sum2 / <name>.counts tensors")
        return IMatrix(entries, chunk_size=max(ints[KEY_CHUNK_SIZE], 1),
                       chunk_count=ints[KEY_CHUNK_COUNT], datasets=datasets)
    except (KeyError, IndexError, TypeError, UnicodeDecodeError) as exc:  # the gguf package on odd fields
        raise ValueError(f"{where}: {type(exc).__name__}: {exc}") from None


def read_imatrix(path) -> IMatrix:
    """The importance matrix in the file at ``path``, GGUF or legacy format (module doc).

    Raises ``ValueError`` naming the file and the fault for anything that is not a
    well-formed imatrix file; ``OSError`` when the file cannot be read at all.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"read_imatrix needs a file path, got {type(path).__name__}")
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"imatrix file {os.fspath(path)!r} does not exist (or is not a file)")
    with open(p, "rb") as f:
        head = f.read(4)
    if not head:
        raise ValueError(f"not a valid imatrix file: {os.fspath(path)}: the file is empty")
    return _read_gguf(p) if head == GGUF_MAGIC else _read_legacy(p)


# ----------------------------------------------------------------------------- writing


def _check_names(im: IMatrix, longest_suffix: str) -> list[str]:
    if not isinstance(im, IMatrix):
        raise TypeError(f"write_imatrix needs an IMatrix (from collect_imatrix or read_imatrix), got "
                        f"{type(im).__name__}")
    if not im.entries:
        raise ValueError("write_imatrix: the imatrix has no entries (llama.cpp refuses such a file)")
    names = sorted(im.entries, key=lambda n: n.encode("utf-8"))  # std::sort: byte order
    for n in names:
        if len((n + longest_suffix).encode("utf-8")) >= GGML_MAX_NAME:
            raise ValueError(f"imatrix entry {n!r}: '{n}{longest_suffix}' is longer than the "
                             f"{GGML_MAX_NAME - 1} bytes llama.cpp allows in a tensor name")
    return names


def _legacy_bytes(im: IMatrix) -> bytes:
    names = [n for n in _check_names(im, "") if (im.entries[n].counts > 0).any()]  # no data: skipped
    if not names:
        raise ValueError("write_imatrix: no entry has seen any rows (every count is 0)")
    out = [struct.pack("<i", len(names))]
    for name in names:
        e = im.entries[name]
        raw = name.encode("utf-8")
        ncall = -(-int(e.counts.max()) // im.chunk_size)  # ceiling, as llama.cpp: never 0 with data
        count = np.repeat(e.counts, e.n_cols).astype(np.float64)
        sums = e.in_sum2.astype(np.float64)
        # a matrix with no rows stores 1, as llama.cpp's "partial data" rule
        values = np.where(count > 0, sums / np.maximum(count, 1) * ncall, 1.0 * ncall).astype("<f4")
        if ncall > _I32_MAX or e.in_sum2.size > _I32_MAX:
            raise ValueError(f"imatrix entry {name!r} is too large for the legacy format")
        out += [struct.pack("<i", len(raw)), raw, struct.pack("<ii", ncall, e.in_sum2.size), values.tobytes()]
    dataset = (im.datasets[-1] if im.datasets else "").encode("utf-8")
    out += [struct.pack("<ii", min(im.chunk_count, _I32_MAX), len(dataset)), dataset]
    return b"".join(out)


def _gguf_str(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def _gguf_bytes(im: IMatrix) -> bytes:
    names = _check_names(im, ".in_sum2")
    kv = [_gguf_str(KEY_TYPE) + struct.pack("<i", 8) + _gguf_str("imatrix"),
          _gguf_str(KEY_DATASETS) + struct.pack("<iiQ", 9, 8, len(im.datasets))
          + b"".join(_gguf_str(d) for d in im.datasets),
          _gguf_str(KEY_CHUNK_COUNT) + struct.pack("<iI", 4, im.chunk_count),
          _gguf_str(KEY_CHUNK_SIZE) + struct.pack("<iI", 4, im.chunk_size)]
    tensors = []  # (name, ne, float32 data)
    for name in names:
        e = im.entries[name]
        tensors.append((name + ".in_sum2", [e.n_cols, e.n_mat], e.in_sum2))
        tensors.append((name + ".counts", [1, e.n_mat], e.counts.astype(np.float32)))
        if e.in_sum is not None:
            tensors.append((name + ".in_sum", [e.n_cols, e.n_mat], e.in_sum))
    infos, data, offset = [], [], 0
    for name, ne, values in tensors:
        while len(ne) > 1 and ne[-1] == 1:  # ggml_n_dims: trailing 1s are not written
            ne = ne[:-1]
        infos.append(_gguf_str(name) + struct.pack("<I", len(ne)) + struct.pack(f"<{len(ne)}q", *ne)
                     + struct.pack("<iQ", 0, offset))  # type 0: F32
        raw = values.astype("<f4").tobytes()
        raw += bytes(-len(raw) % GGUF_ALIGNMENT)
        data.append(raw)
        offset += len(raw)
    head = (GGUF_MAGIC + struct.pack("<Iqq", GGUF_VERSION, len(tensors), len(kv)) + b"".join(kv)
            + b"".join(infos))
    head += bytes(-len(head) % GGUF_ALIGNMENT)
    return head + b"".join(data)


def imatrix_format(path) -> str:
    """``"gguf"`` for a name ending in ``.gguf`` (any case), else ``"dat"`` (the legacy format)."""
    return "gguf" if os.fspath(path).lower().endswith(".gguf") else "dat"


def write_imatrix(im: IMatrix, path, fmt: str | None = None) -> Path:
    """Write ``im`` to ``path`` in llama.cpp's GGUF imatrix format (``fmt="gguf"``, the default
    for a ``.gguf`` name) or its legacy binary one (``"dat"``, the default otherwise); the
    file appears complete or not at all. Returns the path."""
    if fmt is None:
        fmt = imatrix_format(path)
    if fmt not in FORMATS:
        raise ValueError(f"write_imatrix fmt={fmt!r}; allowed: {', '.join(map(repr, FORMATS))} or None "
                         "(by the file name)")
    blob = _gguf_bytes(im) if fmt == "gguf" else _legacy_bytes(im)
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(blob)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


# ----------------------------------------------------------------------------- using


def as_imatrix(value, owner: str = "imatrix") -> IMatrix:
    """``value`` as an ``IMatrix``: one already, or a path to a file in either format."""
    if isinstance(value, IMatrix):
        return value
    if isinstance(value, (str, os.PathLike)):
        return read_imatrix(value)
    raise ValueError(f"{owner}={value!r} must be an IMatrix (collect_imatrix / read_imatrix) or the path "
                     "of an imatrix file (.gguf or legacy .dat)")


def check_columns(im: IMatrix, tensors) -> list[str]:
    """Check ``(name, n_cols)`` pairs against ``im`` before anything is encoded (``ValueError``
    naming the first tensor whose entry does not fit); returns the names that have no entry."""
    missing = []
    for name, n_cols in tensors:
        if im.key(name) is None:
            missing.append(name)
        else:
            im.for_tensor(name, n_cols)
    return missing


def export_gguf_imatrix(src, out, mix: str, imatrix, progress: bool = True, imatrix_file=None) -> dict:
    """``gguf_export.export_gguf`` with an importance matrix: every tensor of ``src`` that the
    mix quantizes and ``imatrix`` has an entry for is encoded with ``imatrix.for_tensor``'s
    weights (``formats.gguf.quantize_gguf(..., imatrix=...)``), as ``llama-quantize --imatrix``
    does; the llama-quantize ``quantize.imatrix.*`` keys are recorded (``imatrix_file``: the
    file name to record, if any). Column counts are checked before anything is written."""
    from ..formats.gguf import quantize_gguf
    from .gguf_export import Source

    im = as_imatrix(imatrix)
    source = Source(src, mix, has_imatrix=True)
    quantized = [(n, shape[-1]) for n, (shape, typ) in source.plan.items() if typ != "f32"]
    missing = check_columns(im, quantized)  # every column count checked before the file opens
    used = sum(1 for n, k in quantized if im.for_tensor(n, k) is not None)
    rep = source.write(out, encode=lambda name, w, typ: quantize_gguf(
        w, typ, imatrix=im.for_tensor(name, w.shape[-1])), add_keys=lambda writer: record_imatrix(
        writer, im, imatrix_file), progress=progress)
    rep["imatrix"] = {"entries": len(im), "tensors_weighted": used, "not_found": missing}
    return rep


def record_imatrix(writer, im: IMatrix, imatrix_file=None) -> None:
    """The ``quantize.imatrix.*`` keys llama-quantize writes, in place of any the source had."""
    for kvs in writer.kv_data:  # a source quantized with another imatrix: not this one's record
        for k in QUANTIZE_KEYS:
            kvs.pop(k, None)
    if imatrix_file is not None:
        writer.add_string(QUANTIZE_KEYS[0], os.fspath(imatrix_file))
    if im.datasets:
        writer.add_string(QUANTIZE_KEYS[1], im.datasets[0])
    writer.add_uint32(QUANTIZE_KEYS[2], len(im))
    if im.chunk_count > 0:
        writer.add_uint32(QUANTIZE_KEYS[3], im.chunk_count)


__all__ = ["IMatrix", "IMatrixEntry", "collect_imatrix", "read_imatrix", "write_imatrix", "imatrix_format",
           "as_imatrix", "check_columns", "export_gguf_imatrix"]
