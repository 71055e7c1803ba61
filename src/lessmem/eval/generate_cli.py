"""``lessmem generate``: stream text from a model through a quantized KV cache.

The chat template is applied when the tokenizer has one (``--raw`` feeds the prompt
as is). At the end the KV bytes held are printed by part.

With ``--offload`` (and optionally ``--kv-budget``) the cache is a ``TieredKVCache``:
the quantized blocks beyond the device budget go down the named tiers, and the bytes
held per tier are printed at the end. The prompt is prefilled in chunks of the block
size and its state saved in the tiers, so running the same prompt again (or one that
starts the same way) over the same store loads it instead of computing it. Without
``--offload`` a prompt longer than 512 tokens (``kvcache.cache.PREFILL_CHUNK``) is prefilled
in chunks of that many (``prefill_chunks``), so its activations are held a chunk at a time.

Example:
    $ lessmem generate "Why is the sky blue?" --kv int4 --max-new-tokens 64
    $ lessmem generate "Why is the sky blue?" --kv int4 --kv-budget 1MiB --offload host,disk:/tmp/kv
"""

from __future__ import annotations

import os
import sys

from lessmem import _cli_types as T
from lessmem._cli_model import (
    add_device_option,
    add_weights_option,
    check_model,
    peek_model,
    to_device,
)
from lessmem.base.units import fmt_bytes

HELP = "generate text with a quantized KV cache"


def add_arguments(p) -> None:
    p.add_argument("prompt", type=T.nonempty_text, help="the prompt text")
    p.add_argument("--kv", default="int4",
                   help="KV cache: a lessmem preset or KVConfig .json (field=value changes after colons: "
                        "best-4:sliding=quantize), 'dynamic', or a peer such as quanto-int4 (default int4)")
    p.add_argument("--model", default="smollm2-135m", help="model alias, .gguf, directory or hub id")
    add_weights_option(p)
    p.add_argument("--max-new-tokens", type=T.integer(1, T.MAX_TOKENS), default=128,
                   help="tokens to generate (default 128; prompt + these must fit the model's context)")
    p.add_argument("--sample", action="store_true", help="sample (temperature/top-p) instead of greedy")
    p.add_argument("--temperature", type=T.number(0, 100, lo_open=True), default=0.7,
                   help="with --sample: > 0, higher = more random (default 0.7)")
    p.add_argument("--top-p", type=T.number(0, 1, lo_open=True), default=0.9,
                   help="with --sample: nucleus mass in (0, 1] (default 0.9)")
    p.add_argument("--seed", type=T.integer(0, 2**63 - 1), default=0, help="with --sample: RNG seed (default 0)")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.add_argument("--threads", type=T.THREADS, default=None, help="torch CPU threads, 1..1024")
    add_device_option(p)
    add_offload_arguments(p)


def add_offload_arguments(p) -> None:
    """``--offload``, ``--kv-budget``, ``--block-tokens``, ``--no-prefetch`` (generate and eval)."""
    p.add_argument("--offload", type=T.offload_tiers, default=None, metavar="TIERS",
                   help="tiers below the device for lessmem presets, fastest first, each with an optional "
                        "@SIZE capacity: host,disk:/path,redis://127.0.0.1:6379/0 (e.g. host@1GiB,disk:/tmp/kv)")
    p.add_argument("--kv-budget", type=T.size(), default=None, metavar="SIZE",
                   help="device bytes for the KV cache with --offload, e.g. 64MiB (KB/MB/GB are 1000-based, "
                        "KiB/MiB/GiB and a bare K/M/G 1024-based; default: no limit)")
    p.add_argument("--block-tokens", type=T.integer(1, 2**16), default=256,
                   help="tokens per offloaded block with --offload (a multiple of the preset's block size; "
                        "default 256: finer prefix reuse; 1024 decodes faster from a disk tier, fewer and "
                        "larger files to read each step)")
    p.add_argument("--no-prefetch", action="store_true",
                   help="with --offload: fetch each layer's blocks when attention needs them, not ahead")


def offload_spec(args, spec):
    """``spec`` held in a tiered cache when --offload is given (else ``spec`` unchanged);
    ValueError for --kv-budget without --offload or a cache that cannot be tiered."""
    from lessmem.eval.caches import with_offload

    if args.offload is None:
        if args.kv_budget is not None:
            raise T.OptionError("--kv-budget", args.kv_budget, "needs --offload TIERS "
                                "(e.g. host or host,disk:/path) for what does not fit")
        return spec
    try:
        return with_offload(spec, args.offload, args.kv_budget, block_tokens=args.block_tokens,
                            prefetch=not args.no_prefetch)
    except ValueError as exc:
        if "block_tokens" in str(exc):
            raise T.OptionError("--block-tokens", args.block_tokens, str(exc)) from None
        raise T.OptionError("--offload", args.offload, str(exc)) from None


def set_threads(n: int | None) -> None:
    """``torch.set_num_threads(n)`` when ``--threads`` was given. Otherwise, unless
    ``OMP_NUM_THREADS`` chooses, no more threads than the cores other work leaves idle
    (:func:`lessmem.base.cpu.free_cores`: more threads than free cores make every parallel
    region wait for a parked thread), said in one line on stderr when that is fewer."""
    import torch

    if n is not None:
        torch.set_num_threads(n)
        return
    if os.environ.get("OMP_NUM_THREADS"):
        return
    from lessmem.base.cpu import free_cores, usable_cores

    free = free_cores()
    if free < torch.get_num_threads():
        print(f"[lessmem] other work keeps {usable_cores() - free} of {usable_cores()} cores busy: "
              f"using {free} thread{'s' if free > 1 else ''} (--threads or OMP_NUM_THREADS to choose)",
              file=sys.stderr)
        torch.set_num_threads(free)


def load_model(name: str, **kw):
    """``lessmem.models.load`` with a download failure as a plain error (``ValueError``)."""
    from lessmem.models import ModelFetchError, load

    try:
        return load(name, **kw)
    except ModelFetchError as exc:
        raise ValueError(str(exc)) from exc


def check_context(option: str, value, n_tokens: int, context: int | None, what: str) -> None:
    """OptionError when ``n_tokens`` (``what``: "N tokens per window") exceed the model's
    ``context`` (None: not known, no check)."""
    if context is not None and n_tokens > context:
        raise T.OptionError(option, value, f"{what}, but the model's context is {context:,} tokens; "
                            f"allowed: at most {context:,} in all")


def placement_lines(pl: dict) -> list[str]:
    """Human lines for where a tiered cache's bytes are (``eval.caches.placement``).

    Example:
        >>> print("\\n".join(placement_lines({"device_bytes": 3072, "device_peak": 4096,
        ...     "device_budget": 4096, "tiers": {"device": 1024, "host": 2048}, "resident": 2048})))
        device 3.00 KiB held, peak 4.00 KiB, budget 4.00 KiB; tiers: device 1.00 KiB, host 2.00 KiB
    """
    budget = pl.get("device_budget")
    lines = [f"device {_format_bytes(pl.get('device_bytes', 0))} held, peak "
             f"{_format_bytes(pl.get('device_peak', 0))}, budget "
             f"{_format_bytes(budget) if budget else 'none'}; tiers: "
             + ", ".join(f"{k} {_format_bytes(v)}" for k, v in pl.get("tiers", {}).items())]
    if budget and pl.get("device_peak", 0) > budget:
        lines.append(f"note: the device held more than --kv-budget: the window and sinks "
                     f"({_format_bytes(pl.get('resident', 0))}) always stay resident")
    return lines


def _format_bytes(n: float) -> str:
    return fmt_bytes(n, both=False)


def memory_lines(mem: dict) -> list[str]:
    """Human lines for a memory dict: byte parts, then totals and bits.

    Example:
        >>> memory_lines({"codes": 2048, "window": 1024, "total": 3072, "fp16_equivalent": 6144,
        ...               "k_bits": 4.25, "v_bits": 4.25})[-1]
        'total 3.00 KiB (fp16: 6.00 KiB, 2.00x smaller), K 4.25 bits, V 4.25 bits'
    """
    skip = {"total", "fp16_equivalent", "k_bits", "v_bits", "compression", "tokens"}
    lines = [f"  {k:<12} {_format_bytes(v)}" for k, v in mem.items()
             if k not in skip and isinstance(v, (int, float))]
    total, fp16 = mem.get("total", 0), mem.get("fp16_equivalent", 0)
    ratio = f", {fp16 / total:.2f}x smaller" if total else ""
    kb, vb = mem.get("k_bits") or 0.0, mem.get("v_bits") or 0.0
    bits = (f"K {kb:.2f} bits, V {vb:.2f} bits" if kb or vb
            else "nothing quantized yet (all tokens in the window/sinks)")
    lines.append(f"total {_format_bytes(total)} (fp16: {_format_bytes(fp16)}{ratio}), {bits}")
    return lines


def check(args) -> None:
    """Everything checked before the model loads: the cache config, its tiers, the context."""
    from lessmem.eval.caches import resolve_config

    try:
        spec = resolve_config(args.kv)
    except ValueError as exc:
        raise T.OptionError("--kv", args.kv, str(exc)) from None
    args.spec = offload_spec(args, spec)
    check_model(args.model)
    shape = peek_model(args.model)
    check_context("--max-new-tokens", args.max_new_tokens, args.max_new_tokens, shape and shape["context"],
                  f"{args.max_new_tokens:,} new tokens")


def _encode(tok, args):
    """The prompt's token ids (through the chat template unless --raw or there is none)."""
    if not args.raw and getattr(tok, "chat_template", None):
        text = tok.apply_chat_template([{"role": "user", "content": args.prompt}],
                                       tokenize=False, add_generation_prompt=True)
        return tok(text, return_tensors="pt", add_special_tokens=False)
    return tok(args.prompt, return_tensors="pt")


def _generate_kwargs(tok, args) -> dict:
    import torch
    from transformers import TextStreamer

    gen = dict(max_new_tokens=args.max_new_tokens, do_sample=args.sample,
               streamer=TextStreamer(tok, skip_prompt=True, skip_special_tokens=True))
    if args.sample:
        torch.manual_seed(args.seed)
        gen.update(temperature=args.temperature, top_p=args.top_p)
    else:
        gen.update(temperature=None, top_p=None, top_k=None)
    if tok.pad_token_id is None and tok.eos_token_id is not None:
        gen["pad_token_id"] = tok.eos_token_id
    return gen


def _print_summary(spec, enc, out, cache, reused) -> None:
    from lessmem.eval.caches import measure_memory, placement

    n_new = out.shape[1] - enc["input_ids"].shape[1]
    mem = measure_memory(cache)
    print(f"\n--- KV cache {spec.name}: {enc['input_ids'].shape[1]} prompt + {n_new} new tokens")
    for line in memory_lines(mem):
        print(line)
    pl = placement(mem)
    if pl is not None:
        for line in placement_lines(pl):
            print(line)
    if reused is not None:
        print(f"prompt tokens loaded from the tiers instead of computed: {reused}")


def run(args) -> int:
    import torch

    from lessmem.eval.caches import cache_kwarg, close_cache
    from lessmem.eval.report import quiet_transformers
    from lessmem.kvcache import cache as kv_cache
    from lessmem.kvcache import enable

    if not hasattr(args, "spec"):
        check(args)
    set_threads(args.threads)
    quiet_transformers()  # no loading bars or warnings around the streamed text
    model, tok = load_model(args.model, weights=args.weights)
    device = to_device(model, args)
    enc = _encode(tok, args).to(device)
    n_prompt = enc["input_ids"].shape[1]
    context = getattr(model.config, "max_position_embeddings", None)
    check_context("--max-new-tokens", args.max_new_tokens, n_prompt + args.max_new_tokens, context,
                  f"the prompt's {n_prompt:,} tokens and {args.max_new_tokens:,} new ones")
    cache = args.spec.make(model.config, model=model)  # a tiered cache keys its state by the weights
    gen = _generate_kwargs(tok, args)
    reused = None
    try:
        with torch.inference_mode(), enable(model):  # fused attention over the quantized blocks
            ids = enc["input_ids"]
            if hasattr(cache, "prefix_tokens_reused") and ids.shape[0] == 1 and ids.shape[1] > 1:
                # a tiered cache takes the prompt (all but its last token) in chunks of its block
                # size, so blocks are sealed and placed as they fill instead of one huge chunk
                # emptying the device tier; a stored prefix of it is loaded, not recomputed
                cache.prefill(model, ids[:, :-1])
                reused = cache.prefix_tokens_reused
            elif ids.shape[0] == 1 and ids.shape[1] > kv_cache.PREFILL_CHUNK + 1:
                # a long prompt a chunk at a time (its activations held a chunk at a time)
                kv_cache.prefill_chunks(model, cache, ids[:, :-1])
            out = model.generate(**enc, **{cache_kwarg(model): cache}, **gen)
        _print_summary(args.spec, enc, out, cache, reused)
    finally:
        close_cache(cache)
    return 0
