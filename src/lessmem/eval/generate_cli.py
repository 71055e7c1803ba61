"""``lessmem generate``: stream text from a model through a quantized KV cache.

The chat template is applied when the tokenizer has one (``--raw`` feeds the prompt
as is). At the end the KV bytes held are printed by part.

With ``--offload`` (and optionally ``--kv-budget``) the cache is a ``TieredKVCache``:
the quantized blocks beyond the device budget go down the named tiers, and the bytes
held per tier are printed at the end. The prompt is prefilled in chunks of the block
size and its state saved in the tiers, so running the same prompt again (or one that
starts the same way) over the same store loads it instead of computing it.

Example:
    $ lessmem generate "Why is the sky blue?" --kv int4 --max-new-tokens 64
    $ lessmem generate "Why is the sky blue?" --kv int4 --kv-budget 1MiB --offload host,disk:/tmp/kv
"""

from __future__ import annotations

from lessmem.base.units import fmt_bytes

HELP = "generate text with a quantized KV cache"


def add_arguments(p) -> None:
    p.add_argument("prompt", help="the prompt text")
    p.add_argument("--kv", default="int4",
                   help="KV cache: a lessmem preset, 'dynamic', or a peer such as quanto-int4 (default int4)")
    p.add_argument("--model", default="smollm2-135m", help="model alias, .gguf, directory or hub id")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate (default 128)")
    p.add_argument("--sample", action="store_true", help="sample (temperature/top-p) instead of greedy")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    add_offload_arguments(p)


def add_offload_arguments(p) -> None:
    """``--offload``, ``--kv-budget``, ``--block-tokens``, ``--no-prefetch`` (generate and eval)."""
    p.add_argument("--offload", default=None, metavar="TIERS",
                   help="tiers below the device for lessmem presets, fastest first, each with an optional "
                        "@SIZE capacity: host,disk:/path,redis://127.0.0.1:6379/0 (e.g. host@1GiB,disk:/tmp/kv)")
    p.add_argument("--kv-budget", default=None, metavar="SIZE",
                   help="device bytes for the KV cache with --offload, e.g. 64MiB (KB/MB/GB are 1000-based, "
                        "KiB/MiB/GiB and a bare K/M/G 1024-based; default: no limit)")
    p.add_argument("--block-tokens", type=int, default=256,
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
            raise ValueError(f"--kv-budget={args.kv_budget} needs --offload TIERS "
                             "(e.g. host or host,disk:/path) for what does not fit")
        return spec
    return with_offload(spec, args.offload, args.kv_budget, block_tokens=args.block_tokens,
                        prefetch=not args.no_prefetch)


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


def run(args) -> int:
    import torch

    from lessmem.eval.caches import (
        cache_kwarg,
        close_cache,
        measure_memory,
        placement,
        resolve_config,
    )

    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens={args.max_new_tokens}; allowed: an integer >= 1")
    if not args.prompt.strip():
        raise ValueError("the prompt is empty; allowed: any non-empty text")
    if args.sample and not (args.temperature > 0 and 0 < args.top_p <= 1):
        raise ValueError(f"--temperature={args.temperature}, --top-p={args.top_p}; allowed: "
                         "temperature > 0 and 0 < top-p <= 1")
    spec = offload_spec(args, resolve_config(args.kv))  # fails before the model loads
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads={args.threads}; allowed: an integer >= 1")
        torch.set_num_threads(args.threads)

    from transformers import TextStreamer

    from lessmem.models import ModelFetchError, load

    try:
        model, tok = load(args.model)
    except ModelFetchError as exc:
        raise ValueError(str(exc)) from exc
    if not args.raw and getattr(tok, "chat_template", None):
        text = tok.apply_chat_template([{"role": "user", "content": args.prompt}],
                                       tokenize=False, add_generation_prompt=True)
        enc = tok(text, return_tensors="pt", add_special_tokens=False)
    else:
        enc = tok(args.prompt, return_tensors="pt")
    cache = spec.make(model.config)
    gen = dict(max_new_tokens=args.max_new_tokens, do_sample=args.sample,
               streamer=TextStreamer(tok, skip_prompt=True, skip_special_tokens=True))
    if args.sample:
        torch.manual_seed(args.seed)
        gen.update(temperature=args.temperature, top_p=args.top_p)
    else:
        gen.update(temperature=None, top_p=None, top_k=None)
    if tok.pad_token_id is None and tok.eos_token_id is not None:
        gen["pad_token_id"] = tok.eos_token_id
    from lessmem.kvcache import enable

    reused = None
    with torch.inference_mode(), enable(model):  # fused attention over the quantized blocks
        ids = enc["input_ids"]
        if hasattr(cache, "prefill") and ids.shape[0] == 1 and ids.shape[1] > 1:
            # a tiered cache takes the prompt (all but its last token) in chunks of its block
            # size, so blocks are sealed and placed as they fill instead of one huge chunk
            # emptying the device tier; a stored prefix of it is loaded, not recomputed
            cache.prefill(model, ids[:, :-1])
            reused = cache.prefix_tokens_reused
        out = model.generate(**enc, **{cache_kwarg(model): cache}, **gen)
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
    close_cache(cache)
    return 0
