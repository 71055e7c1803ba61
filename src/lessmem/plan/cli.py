"""``lessmem plan``: will it fit, how fast can it be — on paper, before loading anything.

Example:
    $ lessmem plan --model llama-3-8b --context 16384 --batch 16 --kv fp16,fp8,int4 --kv-budget 4GiB
    $ lessmem plan --model path/to/config.json --hardware rtx-4090 --weights q4_k_m --json
    $ lessmem plan --model smollm2-135m --context 8k --kv kivi-2 --kv-budget 16MiB --offload host@8MiB,disk:/tmp/kv
"""

from __future__ import annotations

import json
import re

from lessmem import _cli_types as T

HELP = "memory, bandwidth and tier splits on paper"


def add_arguments(p) -> None:
    from .hardware import DEFAULT_HARDWARE

    p.add_argument("--model", default="llama-3-8b",
                   help="preset (llama-3-8b, llama-2-7b, llama-3-70b, mistral-7b, qwen2.5-7b, "
                        "smollm2-135m, ...) or a path to a HF config.json")
    p.add_argument("--context", type=T.count(), default=None, help="tokens per request (16384 or 16k; default: the model's)")
    p.add_argument("--batch", type=T.count(1, 2**20), default="1", help="concurrent requests (default 1)")
    p.add_argument("--kv", default=None,
                   help="comma-separated KV precisions: fp16,bf16,fp8,int8,int4,int2, k8v4, lessmem "
                        "presets (lessmem:fp8, lessmem:int8, lessmem:int4, kivi-4, kivi-2, int4-rot, best-4, best-2), "
                        "NAME:g=32:window=128:sinks=4 or a KVConfig .json (lessmem kv-allocate --out) "
                        "(default fp16,fp8,int8,int4)")
    p.add_argument("--weights", default="fp16",
                   help="comma-separated weight formats: fp16, bf16, int8, int4-g32, uint4-g128, q4_0, "
                        "q6_k, q4_k_m, ... (the first drives decode and hybrid rows)")
    p.add_argument("--params", default=None, help="override the parameter count (e.g. 8e9)")
    p.add_argument("--keep-embeddings", action="store_true", help="embeddings and output in fp16")
    p.add_argument("--hardware", default=DEFAULT_HARDWARE, help="hardware preset (see --list)")
    p.add_argument("--hbm-bw", type=T.rate(), default=None, help="device memory bandwidth, e.g. 3.35TB/s")
    p.add_argument("--hbm-capacity", type=T.size(), default=None, help="device memory, e.g. 80GiB")
    p.add_argument("--pcie-gen", type=T.int_choice(PCIE_GENS), default=None, help="PCIe generation 1..6")
    p.add_argument("--pcie-width", type=T.int_choice((1, 2, 4, 8, 16)), default=None, help="PCIe lanes: 1, 2, 4, 8, 16")
    p.add_argument("--pcie-bw", type=T.rate(), default=None, help="sustained host link bandwidth, e.g. 25GB/s")
    p.add_argument("--host-ram", type=T.size(), default=None, help="host RAM for offloaded KV, e.g. 512GiB")
    p.add_argument("--nvme-bw", type=T.rate(), default=None, help="NVMe sustained read, e.g. 5GB/s")
    p.add_argument("--kv-budget", type=T.size(), default=None,
                   help="device memory for the KV cache, e.g. 4GiB (sizes: KB/MB/GB 1000-based, KiB/MiB/GiB "
                        "and a bare K/M/G 1024-based, so 4G = 4GiB)")
    p.add_argument("--offload", type=T.offload_tiers, default=None, metavar="TIERS",
                   help="tiers below the device as generate/eval take them, e.g. host@1GiB,disk:/tmp/kv: "
                        "print the KV bytes each tier holds for the request (lessmem presets in --kv; "
                        "default lessmem:int4) and the --kv-budget/--offload arguments to pass on")
    p.add_argument("--block-tokens", type=T.integer(1, 2**16), default="256", help="with --offload: tokens per offloaded block (default 256)")
    p.add_argument("--no-prefetch", action="store_true", help="with --offload: no prefetch reserve")
    p.add_argument("--prefill-chunk", type=T.integer(1, T.MAX_TOKENS), default=None,
                   help="with --offload: prompt tokens per forward (default: --block-tokens; "
                        "lessmem generate feeds the whole prompt at once)")
    p.add_argument("--decode-tokens", type=T.integer(0, T.MAX_TOKENS), default="0",
                   help="with --offload: how many of --context tokens are decoded after the prompt (default 0)")
    p.add_argument("--decode-chunk", type=T.integer(1, T.MAX_TOKENS), default="1",
                   help="with --offload: tokens per decode forward (default 1; lessmem eval feeds --chunk, "
                        "after a prefill of a quarter of the window)")
    p.add_argument("--target-tps", type=T.number(0, 1e9, lo_open=True), default="25", help="target tokens/s, all requests together (default 25)")
    p.add_argument("--buffer", type=T.size(), default=None, help="bytes for the transfer table (default: the KV budget)")
    p.add_argument("--json", action="store_true", help="print JSON in base units")
    p.add_argument("--list", action="store_true", help="list model, hardware, KV and weight presets")


PCIE_GENS = (1, 2, 3, 4, 5, 6)
MAX_FORWARDS = 100_000  # the --offload simulation walks every forward: keep it to seconds


HINTS = {"--model": "a model preset (see --list) or a path to a HF config.json",
         "--hardware": "a hardware preset (see --list)", "--kv": "KV precisions (see --list)",
         "--weights": "weight formats (see --list)", "--params": "a parameter count such as 8e9 or 8B"}


def _named_check(option: str, value, fn, *a):
    """``fn(*a)``, its ValueError prefixed with the option it is about (and what is allowed)."""
    try:
        return fn(*a)
    except ValueError as exc:
        msg = str(exc)
        if "allowed" not in msg and "choose one of" not in msg:
            msg += f"; allowed: {HINTS[option]}"
        raise T.OptionError(option, value, msg) from None


def check(args) -> None:
    """The presets and lists named, the parameter count, and the size of the tier simulation."""
    from lessmem.base.units import parse_count

    from .hardware import get_hardware
    from .kv import get_kv
    from .models import get_model
    from .planner import parse_params
    from .weights import get_weight_format

    if args.list:
        return
    model = _named_check("--model", args.model, get_model, args.model)
    _named_check("--hardware", args.hardware, get_hardware, args.hardware)
    def kv_for_model(name):  # a per-layer .json config is described over the model's layers
        return get_kv(name, num_layers=model.layers)

    for opt, value, get in (("--kv", args.kv, kv_for_model), ("--weights", args.weights, get_weight_format)):
        names = [x.strip() for x in (value or "").split(",") if x.strip()]
        if value is not None and not names:
            raise T.OptionError(opt, value, "names nothing; allowed: comma-separated names (see --list)")
        for name in names:
            _named_check(opt, value, get, name)
    if args.params is not None and not 1 <= _named_check("--params", args.params, parse_params, args.params) <= 1e15:
        raise T.OptionError("--params", args.params, "allowed: a parameter count from 1 to 1e15, e.g. 8e9 or 8B")
    context = model.max_context if args.context is None else parse_count(args.context)
    if args.decode_tokens > context:
        raise T.OptionError("--decode-tokens", args.decode_tokens, f"allowed: at most --context ({context:,})")
    if args.offload is not None:
        prompt = context - args.decode_tokens
        forwards = -(-prompt // (args.prefill_chunk or args.block_tokens)) + -(-args.decode_tokens // args.decode_chunk)
        if forwards > MAX_FORWARDS:
            opt, value = (("--decode-chunk", args.decode_chunk) if args.decode_tokens > prompt else
                          ("--prefill-chunk", args.prefill_chunk) if args.prefill_chunk else
                          ("--block-tokens", args.block_tokens))
            raise T.OptionError(opt, value,
                                f"{forwards:,} forwards to simulate; allowed: at most {MAX_FORWARDS:,} "
                                "(larger --prefill-chunk/--block-tokens/--decode-chunk or fewer tokens)")


def _list() -> str:
    from .hardware import HARDWARE_PRESETS
    from .kv import LESSMEM, RAW
    from .models import MODEL_PRESETS
    from .weights import weight_choices

    lines = ["models:"]
    lines += [f"  {m.name:14s} L {m.layers}, H_kv {m.kv_heads}, d {m.head_dim}, hidden {m.hidden}, "
              f"{m.n_params / 1e9:.4g}B params, {m.max_context:,} ctx" for m in MODEL_PRESETS.values()]
    lines.append("hardware:")
    lines += [f"  {h.name:12s} {h.description}" for h in HARDWARE_PRESETS.values()]
    lines.append("KV precisions:")
    lines += [f"  {p.name:14s} {p.description}" for p in (*RAW.values(), *LESSMEM.values())]
    lines.append("weight formats: " + weight_choices())
    return "\n".join(lines)


def _plan(args) -> dict:
    """The planner on the parsed options."""
    from .planner import plan

    return plan(
        args.model, context=args.context, batch=args.batch, kv=args.kv, weights=args.weights,
        hardware=args.hardware, kv_budget=args.kv_budget, target_tps=args.target_tps, buffer=args.buffer,
        params=args.params, keep_embeddings=args.keep_embeddings,
        hbm_bw=args.hbm_bw, hbm_capacity=args.hbm_capacity, pcie_gen=args.pcie_gen,
        pcie_width=args.pcie_width, pcie_bw=args.pcie_bw, host_ram=args.host_ram,
        nvme_bw=args.nvme_bw, offload=args.offload, block_tokens=args.block_tokens,
        prefetch=not args.no_prefetch, prefill_chunk=args.prefill_chunk,
        decode_tokens=args.decode_tokens, decode_chunk=args.decode_chunk,
    )


def run(args) -> int:
    from .report import render, summary

    if args.list:
        print(_list())
        return 0
    try:
        p = _plan(args)
    except ValueError as exc:  # a semantic check inside the planner: name the option it is about
        m = re.match(r"(\w+)=", str(exc))
        if m and getattr(args, m.group(1), None) is not None:
            raise T.OptionError("--" + m.group(1).replace("_", "-"), getattr(args, m.group(1)), str(exc)) from None
        raise
    if args.json:
        print(json.dumps(p, indent=2, default=float))
        return 0
    hw = p["hardware"]
    print(f"{p['model']['name']} on {hw['name']}: {hw['description']}")
    print(render(p), end="")
    s = summary(p)
    if s:
        print(s)
    return 0
