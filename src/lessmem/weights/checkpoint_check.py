"""Checks on a lessmem checkpoint, run before anything large is allocated.

A checkpoint directory (``weights.checkpoint``) is data from outside: its
``lessmem_quant.json`` may be damaged or written to attack the reader. Nothing in it
is trusted until checked here:

- ``read_meta``: the JSON parses and has the documented fields with the right types
  (ints are ints, flags are bools, bits and group sizes are allowed values);
- ``model_class``: ``architecture`` names a model class of transformers (a subclass of
  ``transformers.PreTrainedModel`` that takes the stored config), never any other
  attribute of the package (a function such as ``pipeline`` is refused, not called);
- ``check_tensors``: every module name is a linear layer that exists in the model built
  from the stored config (on the meta device: shapes only, nothing allocated), with the stored ``in_features``/``out_features``, and every
  tensor in ``model.safetensors`` has exactly the shape and dtype that layer needs; so
  no size from the file decides an allocation before it has been checked. ``FP8Linear``
  entries (``fp8_modules``: ``act`` "fp8" or null, ``fmt`` "e4m3") need a float8_e4m3fn
  ``qweight [N, K]`` and a float32 ``scale [N, 1]``, those exact dtypes, since the layer
  holds them as they are.

Every failure is ``ValueError("<path>: not a valid lessmem checkpoint: <what>")``.

Example:
    >>> import json, tempfile
    >>> from pathlib import Path
    >>> d = Path(tempfile.mkdtemp())
    >>> _ = (d / "lessmem_quant.json").write_text('{"format": "lessmem-quant", "version": 1')
    >>> read_meta(d / "lessmem_quant.json")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: ...lessmem_quant.json: not a valid lessmem checkpoint: not JSON (...)
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from ..formats.packing import packed_nbytes
from ..kernels.gguf_linear_cpp import check_shape as gguf_check_shape

BITS = (2, 3, 4, 8)
QUANT_FIELDS = {"bits": int, "group_size": int, "symmetric": bool, "act_bits": (int, type(None)),
                "in_features": int, "out_features": int, "bias": bool}
BUFFER_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                 "float64": torch.float64}
GGUF_FIELDS = {"gguf_type": str, "in_features": int, "out_features": int, "bias": bool}
FP8_FIELDS = {"act": (str, type(None)), "fmt": str, "in_features": int, "out_features": int, "bias": bool}
SECTIONS = (("modules", QUANT_FIELDS), ("gguf_modules", GGUF_FIELDS), ("fp8_modules", FP8_FIELDS))


def bad(path, what: str) -> ValueError:
    """The one error a bad checkpoint gives."""
    return ValueError(f"{path}: not a valid lessmem checkpoint: {what}")


def read_meta(path: Path) -> dict:
    """The parsed, type-checked ``lessmem_quant.json`` at ``path`` (see the module doc)."""
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise bad(path, f"not JSON ({e})") from None
    except UnicodeDecodeError as e:
        raise bad(path, f"not UTF-8 text ({e})") from None
    if not isinstance(meta, dict):
        raise bad(path, f"the top level is a {type(meta).__name__}, not an object")
    if meta.get("format") != "lessmem-quant" or meta.get("version") != 1:
        raise bad(path, f"format={meta.get('format')!r} version={meta.get('version')!r}; "
                        "allowed: lessmem-quant version 1")
    arch = meta.get("architecture")
    if not isinstance(arch, str) or not arch.isidentifier() or arch.startswith("_"):
        raise bad(path, f"architecture={arch!r} is not a class name")
    cfg = meta.get("model_config")
    if not isinstance(cfg, dict) or not isinstance(cfg.get("model_type"), str):
        raise bad(path, "model_config must be an object with a model_type string")
    if not isinstance(meta.get("quantization"), (dict, type(None))):
        raise bad(path, "quantization must be an object or null")
    for key, fields in SECTIONS:
        meta[key] = _entries(path, meta.get(key, {}), key, fields)
    for i, (a, _) in enumerate(SECTIONS):
        for b, _ in SECTIONS[i + 1:]:
            both = set(meta[a]) & set(meta[b])
            if both:
                raise bad(path, f"{sorted(both)[:3]} listed in both {a} and {b}")
    for name, spec in meta["modules"].items():
        _check_quant_spec(path, name, spec)
    for name, spec in meta["fp8_modules"].items():
        if spec["act"] not in ("fp8", None):
            raise bad(path, f"fp8_modules[{name!r}].act={spec['act']!r}; allowed: \"fp8\" or null")
        if spec["fmt"] != "e4m3":
            raise bad(path, f"fp8_modules[{name!r}].fmt={spec['fmt']!r}; allowed: \"e4m3\"")
    tied = meta.get("tied", {})
    if not isinstance(tied, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                             for k, v in tied.items()):
        raise bad(path, "tied must map tensor names to tensor names (strings)")
    meta["tied"] = tied
    dtypes = meta.get("buffer_dtypes", {})
    if not isinstance(dtypes, dict) or not all(isinstance(k, str) and v in BUFFER_DTYPES
                                               for k, v in dtypes.items()):
        raise bad(path, f"buffer_dtypes must map buffer names to one of {', '.join(BUFFER_DTYPES)}")
    meta["buffer_dtypes"] = dtypes
    return meta


def _entries(path, entries, key: str, fields: dict) -> dict:
    if not isinstance(entries, dict):
        raise bad(path, f"{key} must be an object of module name -> fields")
    for name, spec in entries.items():
        if not name or not isinstance(spec, dict) or set(spec) != set(fields):
            got = sorted(spec) if isinstance(spec, dict) else type(spec).__name__
            raise bad(path, f"{key}[{name!r}] must have exactly the fields "
                            f"{', '.join(sorted(fields))}; got {got}")
        for field, want in fields.items():
            v = spec[field]
            ok = isinstance(v, want) and (want is bool or not isinstance(v, bool))
            if not ok:
                raise bad(path, f"{key}[{name!r}].{field}={v!r} has the wrong type")
        if not (spec["in_features"] > 0 and spec["out_features"] > 0):
            raise bad(path, f"{key}[{name!r}] has a non-positive size "
                            f"({spec['out_features']} x {spec['in_features']})")
    return entries


def _check_quant_spec(path, name: str, spec: dict) -> None:
    k, gs, bits = spec["in_features"], spec["group_size"], spec["bits"]
    if bits not in BITS:
        raise bad(path, f"modules[{name!r}].bits={bits}; allowed: {', '.join(map(str, BITS))}")
    if gs <= 0 or k % gs:
        raise bad(path, f"modules[{name!r}].group_size={gs} does not divide in_features={k}")
    if spec["act_bits"] not in (None, 8) or (spec["act_bits"] == 8 and bits != 8):
        raise bad(path, f"modules[{name!r}].act_bits={spec['act_bits']!r}; allowed: null, or 8 "
                        "with bits=8")


def model_config(path, meta: dict, n_tensors: int):
    """The transformers config object built from ``meta["model_config"]``; ``n_tensors`` (how
    many the tensor file holds) bounds the layer count, so even the meta-device model that
    ``check_tensors`` compares against stays the file's size."""
    import transformers

    cfg = dict(meta["model_config"])
    model_type = cfg.pop("model_type")
    try:
        config = transformers.AutoConfig.for_model(model_type, **cfg)
    except Exception as e:  # unknown model_type, or a field transformers' own checks refuse
        raise bad(path, f"model_config is not a valid {model_type!r} config: "
                        f"{str(e).splitlines()[0][:200]}") from None
    layers = getattr(config, "num_hidden_layers", None)
    if isinstance(layers, int) and layers > n_tensors:  # every layer stores at least one tensor
        raise bad(path, f"model_config has num_hidden_layers={layers}, but the tensor file "
                        f"holds only {n_tensors} tensors")
    return config


def model_class(path, name: str, config):
    """The transformers model class ``name``, only if it is one (see the module doc)."""
    import transformers

    try:
        cls = getattr(transformers, name)
    except (AttributeError, ImportError):
        raise bad(path, f"architecture={name!r} is not a transformers model class") from None
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
        raise bad(path, f"architecture={name!r} is a {type(cls).__name__} of transformers, "
                        "not a model class")
    want = getattr(cls, "config_class", None)
    if isinstance(want, type) and not isinstance(config, want):
        raise bad(path, f"architecture={name!r} takes a {want.__name__}; model_config has "
                        f"model_type={config.model_type!r}")
    return cls


def _expected(spec: dict, gguf_row_bytes=None, fp8: bool = False) -> dict[str, tuple[torch.dtype, tuple]]:
    """Stored tensors a quantized (or GGUF, with its row bytes, or FP8) linear needs: suffix ->
    (dtype, shape); the dtypes of FP8 layers are exact (``EXACT``)."""
    n, k = spec["out_features"], spec["in_features"]
    if fp8:
        want = {"qweight": (torch.float8_e4m3fn, (n, k)), "scale": (torch.float32, (n, 1))}
    elif gguf_row_bytes is not None:
        want = {"qweight": (torch.uint8, (n, gguf_row_bytes))}
    else:
        g = k // spec["group_size"]
        want = {"qweight": (torch.uint8, (packed_nbytes(n * k, spec["bits"]),)),
                "scale": (torch.float16, (n, g)), "zero_point": (torch.uint8, (n, g))}
    if spec["bias"]:
        want["bias"] = (None, (n,))  # None: any floating dtype
    return want


def _gguf_row_bytes(path, name: str, spec: dict) -> int:
    try:
        t = gguf_check_shape(spec["gguf_type"], spec["out_features"], spec["in_features"])
    except ValueError as e:
        raise bad(path, f"gguf_modules[{name!r}]: {e}") from None
    return spec["in_features"] // t.block_size * t.type_size


def check_tensors(path, meta: dict, model: nn.Module, stored: dict) -> None:
    """Check module names, sizes and every stored tensor against ``model`` (built on the meta
    device from the stored config) before any of them is used; ``stored`` maps tensor name to
    ``(dtype, shape)``."""
    modules = dict(model.named_modules())
    expected: dict[str, tuple] = {}
    exact: set[str] = set()  # tensors held as stored: their dtype must match exactly
    for key, _ in SECTIONS:
        for name, spec in meta[key].items():
            lin = modules.get(name)
            if not isinstance(lin, nn.Linear):
                what = "no module" if lin is None else f"a {type(lin).__name__}, not a linear layer,"
                raise bad(path, f"{key} names {name!r}, but the model has {what} at that path")
            shape = (spec["out_features"], spec["in_features"], spec["bias"])
            if shape != (lin.out_features, lin.in_features, lin.bias is not None):
                raise bad(path, f"{key}[{name!r}] is {shape[0]} x {shape[1]} (bias {shape[2]}); "
                                f"the model's layer is {lin.out_features} x {lin.in_features} "
                                f"(bias {lin.bias is not None})")
            rb = _gguf_row_bytes(path, name, spec) if key == "gguf_modules" else None
            want = _expected(spec, rb, fp8=key == "fp8_modules")
            expected.update({f"{name}.{s}": w for s, w in want.items()})
            if key == "fp8_modules":
                exact.update(f"{name}.{s}" for s in ("qweight", "scale"))
    replaced = tuple(f"{n}." for key, _ in SECTIONS for n in meta[key])
    own = {k: (t.dtype, tuple(t.shape)) for k, t in model.state_dict(keep_vars=True).items()
           if not k.startswith(replaced)}
    expected.update(own)
    for key, (dtype, shape) in stored.items():
        if key not in expected:
            raise bad(path, f"model.safetensors holds {key!r}, which the model does not have")
        want_dtype, want_shape = expected[key]
        if want_dtype is not None and (key in exact or not want_dtype.is_floating_point):
            dtype_ok = dtype == want_dtype
        else:
            dtype_ok = dtype.is_floating_point
        if tuple(shape) != tuple(want_shape) or not dtype_ok:
            raise bad(path, f"tensor {key!r} is {dtype} {list(shape)}; the model needs "
                            f"{want_dtype or 'float'} {list(want_shape)}")
    for key, src in meta["tied"].items():
        if key not in own or key in stored or src not in stored or src not in own:
            raise bad(path, f"tied entry {key!r} -> {src!r}: both must be the model's own tensors "
                            "and only the second stored")
        if own[key][1] != own[src][1]:
            raise bad(path, f"tied entry {key!r} -> {src!r}: shapes differ")
    unsaved = set(dict(model.named_buffers())) - set(model.state_dict())
    odd = sorted(set(meta["buffer_dtypes"]) - unsaved)
    if odd:
        raise bad(path, f"buffer_dtypes names {odd[:3]}, not buffers the model computes itself")
    missing = [k for k in expected if k not in stored and k not in meta["tied"]]
    if missing:
        raise bad(path, f"model.safetensors lacks {missing[:5]}")
