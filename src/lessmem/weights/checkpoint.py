"""Quantized checkpoints: ``save_quantized(model, dir)`` and ``load_quantized(dir)``.

Format (a directory):

- ``lessmem_quant.json`` — ``{"format": "lessmem-quant", "version": 1, "architecture":
  "<transformers class>", "model_config": {...}, "quantization": {method config},
  "modules": {name: {"bits", "group_size", "symmetric", "act_bits", "in_features",
  "out_features", "bias"}}, "tied": {key: stored key}, "buffer_dtypes": {name: dtype}}``
  (tied tensors stored once; buffers the model computes itself, such as rotary
  ``inv_freq``, are not stored, only their dtype, so a bf16 model gets bf16 ones back)
- ``model.safetensors`` — every float parameter/buffer of the model except the quantized
  linears, plus per quantized linear ``<name>.qweight`` (codes ``u [N, K]`` packed with
  ``formats.packing.pack_bits``: little-endian bit stream, row-major), ``<name>.scale``
  (fp16 ``[N, K/group_size]``), ``<name>.zero_point`` (uint8 ``[N, K/group_size]``, code
  units; 2^(b-1) when symmetric) and ``<name>.bias``.  W_hat = scale · (u − zero_point).
- ``GGUFLinear`` layers (``GGUFConfig``): ``<name>.qweight`` holds the raw GGUF blocks
  (uint8 ``[N, row_bytes]``, llama.cpp's bytes) and ``<name>.bias``; the config lists them
  under ``"gguf_modules": {name: {"gguf_type", "in_features", "out_features", "bias"}}``.
- ``FP8Linear`` layers (``FP8Config``, ``weights.fp8``): ``<name>.qweight`` (float8_e4m3fn
  ``[N, K]``, safetensors ``F8_E4M3``), ``<name>.scale`` (float32 ``[N, 1]``) and
  ``<name>.bias``, as held (W_hat = qweight · scale); listed under ``"fp8_modules": {name:
  {"act", "fmt", "in_features", "out_features", "bias"}}`` (``act``: "fp8" or null).
- the tokenizer files, when a tokenizer is given.

``lessmem.load(dir)`` calls ``load_quantized`` when ``lessmem_quant.json`` exists.

Loading trusts nothing in the directory until ``weights.checkpoint_check`` has checked it
(a damaged or tampered checkpoint gives ``ValueError("<path>: not a valid lessmem
checkpoint: <what>")``). The model is then built with its parameters on the meta device
(buffers such as rotary ``inv_freq`` are computed for real), and each stored tensor is
read once, straight into the tensor the model keeps: the float model is never allocated,
so loading needs the quantized model's size plus what the heap keeps of per-layer
temporaries, not the float model's (SmolLM2-135M int4: the model holds 165 MiB; peak RSS
grew by 240-380 MiB over the imports, against 629 MiB when the float model was built first).

Example:
    >>> import tempfile, torch, lessmem
    >>> from lessmem.models import tiny_random
    >>> from lessmem.weights.checkpoint import load_quantized
    >>> m = tiny_random("llama")
    >>> _ = lessmem.quantize_(m, lessmem.RTNConfig(bits=4, group_size=32), progress=False)
    >>> d = tempfile.mkdtemp()
    >>> lessmem.save_quantized(m, d)
    >>> m2, _ = load_quantized(d)
    >>> x = torch.randint(0, 256, (1, 8))
    >>> torch.equal(m(x).logits, m2(x).logits)
    True
"""

from __future__ import annotations

import itertools
import json
import os
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn
from torch.nn.modules.module import register_module_parameter_registration_hook

from ..formats.packing import pack_bits, unpack_bits
from . import checkpoint_check as check
from .arch import get_module, set_module
from .experts import split_experts
from .fp8 import FP8Linear
from .gguf_linear import GGUFLinear
from .qlinear import QuantLinear
from .rtn import QuantizedWeight

MARKER = "lessmem_quant.json"
WEIGHTS = "model.safetensors"


def save_quantized(model, directory, tokenizer=None) -> None:
    """Write ``model`` (with its QuantLinear layers) to ``directory`` (see the module doc);
    ``tokenizer`` defaults to the one ``lessmem.load`` returned with the model."""
    if not isinstance(model, nn.Module) or not hasattr(model, "config"):
        raise TypeError(f"save_quantized needs a transformers model (with .config), got "
                        f"{type(model).__name__}")
    if tokenizer is None:
        tokenizer = getattr(model, "_lessmem_tokenizer", None)
    from safetensors.torch import save_file

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    qmods = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    tensors: dict[str, torch.Tensor] = {}
    modules = {}
    for name, m in qmods.items():
        tensors[f"{name}.qweight"] = pack_bits(m.codes(), m.bits)
        tensors[f"{name}.scale"] = m.scales().to(torch.float16)
        tensors[f"{name}.zero_point"] = m.zero().to(torch.uint8)
        if m.bias is not None:
            tensors[f"{name}.bias"] = m.bias.data
        modules[name] = {"bits": m.bits, "group_size": m.group_size, "symmetric": m.symmetric,
                         "act_bits": m.act_bits, "in_features": m.in_features,
                         "out_features": m.out_features, "bias": m.bias is not None}
    gguf_modules = {n: {"gguf_type": m.gguf_type, "in_features": m.in_features,
                        "out_features": m.out_features, "bias": m.bias is not None}
                    for n, m in model.named_modules() if isinstance(m, GGUFLinear)}
    fp8_modules = {n: {"act": m.act, "fmt": m.fmt, "in_features": m.in_features,
                       "out_features": m.out_features, "bias": m.bias is not None}
                   for n, m in model.named_modules() if isinstance(m, FP8Linear)}
    for key, t in model.state_dict().items():  # GGUFLinear, FP8Linear: their tensors, as they are
        owner = key.rpartition(".")[0]
        if owner in qmods:
            continue
        tensors[key] = t
    seen: dict[int, str] = {}
    tied: dict[str, str] = {}
    for key in list(tensors):  # tied tensors (lm_head = embeddings) are stored once
        ptr = tensors[key].data_ptr()
        if ptr in seen:
            tied[key] = seen[ptr]
            del tensors[key]
            continue
        seen[ptr] = key
        tensors[key] = tensors[key].detach().contiguous()
    save_file(tensors, str(d / WEIGHTS))
    unsaved = set(dict(model.named_buffers())) - set(model.state_dict())  # rotary inv_freq ...
    buffer_dtypes = {n: str(b.dtype).removeprefix("torch.") for n, b in model.named_buffers()
                     if n in unsaved and b.is_floating_point()}
    meta = {"format": "lessmem-quant", "version": 1,
            "architecture": type(model).__name__,
            "model_config": model.config.to_dict(),
            "quantization": getattr(model, "_lessmem_quant", None),
            "modules": modules, "tied": tied, "buffer_dtypes": buffer_dtypes}
    if gguf_modules:
        meta["gguf_modules"] = gguf_modules
    if fp8_modules:
        meta["fp8_modules"] = fp8_modules
    (d / MARKER).write_text(json.dumps(meta, indent=1, default=str))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(d))


def load_quantized(directory):
    """``(model, tokenizer or None)`` from a directory written by ``save_quantized``.

    Nothing in the directory is trusted before ``weights.checkpoint_check`` has checked it;
    the model is built on the meta device and takes the stored tensors as they are, so the
    float model is never allocated (see the module doc for the memory this takes).
    """
    if not isinstance(directory, (str, os.PathLike)):
        raise TypeError(f"load_quantized needs a directory path, got {type(directory).__name__}")
    d = Path(directory)
    if not (d / MARKER).exists():
        raise ValueError(f"{d} holds no {MARKER}; not a lessmem quantized checkpoint")
    meta = check.read_meta(d / MARKER)
    tensors = TensorFile(d / WEIGHTS)
    config = check.model_config(d / MARKER, meta, len(tensors.layout))
    cls = check.model_class(d / MARKER, meta["architecture"], config)
    try:
        with torch.device("meta"):  # shapes only, buffers too: a config sized to attack allocates nothing
            probe = cls(config)
        split_experts(probe)  # MoE experts as quantize_ stored them: per-expert linears
    except Exception as e:  # a config transformers' own classes cannot build
        raise check.bad(d / MARKER, f"model_config does not build a {cls.__name__}: "
                                    f"{str(e).splitlines()[0][:200] if str(e) else type(e).__name__}") from None
    check.check_tensors(d, meta, probe, tensors.layout)
    del probe
    with parameters_on_meta():  # now the real skeleton: buffers computed, parameters empty
        model = cls(config)
        split_experts(model)
    with tensors:
        _fill(model, meta, tensors)
    model._lessmem_quant = meta.get("quantization")
    model.eval()
    tok = None
    if (d / "tokenizer_config.json").exists() or (d / "tokenizer.json").exists():
        import transformers

        tok = transformers.AutoTokenizer.from_pretrained(str(d))
        model._lessmem_tokenizer = tok  # as lessmem.load does: quantize_/save_quantized use it
    return model, tok


@contextmanager
def parameters_on_meta():
    """While active, every parameter a module registers is replaced by an empty one on the
    meta device (shape and dtype only); buffers stay real, so values computed at construction
    (rotary ``inv_freq``, masks) are right. The float weights' memory is never touched
    (``torch.empty`` pages that are never written are not resident). Global while active,
    like any parameter-registration hook: build one model at a time."""

    def to_meta(module, name, param):
        if param is None or param.is_meta:  # already meta: keep it (and ties to it) as it is
            return None
        return nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=param.requires_grad)

    handle = register_module_parameter_registration_hook(to_meta)
    try:
        yield
    finally:
        handle.remove()


_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
              "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
              "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn}


class TensorFile:
    """A safetensors file read one tensor at a time with plain reads into fresh tensors.

    ``layout`` (name -> dtype and shape) comes from the header alone, checked by the
    safetensors library, so it can be validated before any tensor is read. Reading with
    ``readinto`` (no memory map) means each byte is in memory once, in its tensor: mapping
    the file and copying out of it would hold the file's pages as well.
    """

    def __init__(self, path: Path):
        from safetensors import SafetensorError, safe_open

        self.path = path
        try:
            with safe_open(str(path), framework="pt") as f:  # validates the header
                self.layout = {}
                for key in f.keys():
                    sl = f.get_slice(key)
                    if sl.get_dtype() not in _ST_DTYPES:
                        raise check.bad(path, f"tensor {key!r} has dtype {sl.get_dtype()}")
                    self.layout[key] = (_ST_DTYPES[sl.get_dtype()], tuple(sl.get_shape()))
            with open(path, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(n))
        except (OSError, SafetensorError, ValueError) as e:
            raise check.bad(path, f"not a readable safetensors file ({e})") from None
        self._data_start = 8 + n
        self._offsets = {k: v["data_offsets"] for k, v in header.items() if k in self.layout}
        self._file = None

    def __enter__(self):
        self._file = open(self.path, "rb")
        return self

    def __exit__(self, *exc):
        self._file.close()

    def read(self, key: str) -> torch.Tensor:
        dtype, shape = self.layout[key]
        t = torch.empty(shape, dtype=dtype)
        buf = t.reshape(-1).view(torch.uint8).numpy()
        begin, end = self._offsets[key]
        self._file.seek(self._data_start + begin)
        if end - begin != buf.nbytes or self._file.readinto(buf) != buf.nbytes:
            raise check.bad(self.path, f"tensor {key!r} is cut short")
        return t


def _fill(model, meta: dict, file: TensorFile) -> None:
    """Put the checked tensors into ``model`` (built by ``parameters_on_meta``): quantized
    layers replace their linears, everything else is assigned in place of the meta tensors."""
    for name, spec in meta["modules"].items():  # read, repacked, dropped: one layer at a time
        n, k, bits = spec["out_features"], spec["in_features"], spec["bits"]
        codes = unpack_bits(file.read(f"{name}.qweight"), bits, n * k).view(n, k)
        qw = QuantizedWeight(codes, file.read(f"{name}.scale"), file.read(f"{name}.zero_point"),
                             bits, spec["group_size"], spec["symmetric"])
        bias = file.read(f"{name}.bias") if spec["bias"] else None
        set_module(model, name, QuantLinear.from_quantized(qw, bias, spec["act_bits"]))
    for name, spec in meta["gguf_modules"].items():  # filled by load_state_dict below
        with parameters_on_meta(), torch.device("meta"):
            layer = GGUFLinear(spec["in_features"], spec["out_features"], spec["gguf_type"], spec["bias"])
        set_module(model, name, layer)
    for name, spec in meta["fp8_modules"].items():  # filled by load_state_dict below
        with parameters_on_meta(), torch.device("meta"):
            layer = FP8Linear(spec["in_features"], spec["out_features"], spec["bias"], spec["act"], spec["fmt"])
        set_module(model, name, layer)
    done = tuple(f"{n}." for n in meta["modules"])
    tensors = {key: file.read(key) for key in file.layout if not key.startswith(done)}
    for key, src in meta["tied"].items():  # tied tensors were stored once
        tensors[key] = tensors[src]
    model.load_state_dict(tensors, strict=False, assign=True)
    for key, src in meta["tied"].items():  # the same Parameter object again, not a copy
        owner, _, leaf = key.rpartition(".")
        setattr(get_module(model, owner) if owner else model, leaf, model.get_parameter(src)
                if src in dict(model.named_parameters()) else model.get_buffer(src))
    for key, dt in meta["buffer_dtypes"].items():  # recomputed in float32: the source's dtype
        owner, _, leaf = key.rpartition(".")
        mod = get_module(model, owner) if owner else model
        setattr(mod, leaf, getattr(mod, leaf).to(check.BUFFER_DTYPES[dt]))
    left = [n for n, t in itertools.chain(model.named_parameters(), model.named_buffers()) if t.is_meta]
    if left:  # check_tensors accounts for every stored tensor; this guards that promise
        raise RuntimeError(f"load_quantized left tensors unset: {left[:5]}")
