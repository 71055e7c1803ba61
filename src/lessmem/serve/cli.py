"""``lessmem serve``: an OpenAI-compatible HTTP server over the batching engine.

Every option is checked before the model loads (the engine's config by
``EngineConfig.check()``, the address by binding it); once the server listens, one line
on stderr says where. Ctrl-C (SIGINT) or SIGTERM stops it: requests in flight get up to
5 s, then the engine closes and flushes its lower tiers. See :mod:`lessmem.serve.server`
for the routes.

Example:
    $ lessmem serve                                   # smollm2-135m, best-4 KV, 127.0.0.1:8000
    $ lessmem serve smollm2-135m --kv best-4 --kv-budget 256MiB --offload host@2GiB,disk:/var/kv
    $ lessmem serve ./my-model --model-name mine --host 0.0.0.0 --port 9000 --max-running 16
"""

from __future__ import annotations

import socket
import sys

from lessmem import _cli_types as T
from lessmem._cli_model import add_weights_option, check_model

HELP = "serve a model over an OpenAI-compatible HTTP API"
PREEMPT = ("auto", "swap", "recompute")
SWITCH_INTERVAL_S = 0.0005  # the GIL hand-over interval while serving (run())
# EngineConfig field -> the option that sets it (its check errors name the field)
FIELD_OPTIONS = {"kv_budget": "--kv-budget", "offload": "--offload", "max_running": "--max-running",
                 "chunk_tokens": "--chunk-tokens", "step_tokens": "--step-tokens", "preempt": "--preempt",
                 "prefix_cache": "--no-prefix-cache", "kv": "--kv"}


def add_arguments(p) -> None:
    p.add_argument("model", nargs="?", default="smollm2-135m", type=T.nonempty_text, metavar="MODEL",
                   help="model alias, .gguf, directory or hub id (default smollm2-135m)")
    add_weights_option(p)
    p.add_argument("--kv", default="best-4", type=T.nonempty_text,
                   help="KV cache preset for every request (see lessmem presets; fp16 = unquantized; "
                        "a KVConfig .json; field=value changes after colons, e.g. best-4:window=64; "
                        "default best-4)")
    p.add_argument("--kv-budget", type=T.size(), default=None, metavar="SIZE",
                   help="device bytes for the KV caches of all requests together, e.g. 256MiB "
                        "(default: no limit)")
    p.add_argument("--offload", type=T.offload_tiers, default=None, metavar="TIERS",
                   help="tiers below the device, fastest first, each with an optional @SIZE: "
                        "host,disk:/path,redis://127.0.0.1:6379/0 (e.g. host@2GiB,disk:/var/kv); "
                        "a disk or Redis tier keeps prefixes across restarts")
    p.add_argument("--max-running", type=T.integer(1, 4096), default=64, metavar="N",
                   help="most requests in the running batch at once (default 64)")
    p.add_argument("--chunk-tokens", type=T.integer(1, 2**16), default=None, metavar="N",
                   help="prompt tokens prefilled per request per step, interleaved with decoding, and the "
                        f"granularity of prefix sharing (default {_default_chunk_tokens()})")
    p.add_argument("--step-tokens", type=T.integer(1, 2**20), default=None, metavar="N",
                   help="most tokens one step computes, decode tokens and prompt chunks together: more "
                        "prefills faster and stalls decoding longer (at least --chunk-tokens + --max-running, "
                        f"so that a step has room for a whole chunk beside its decode tokens; default "
                        f"{_default_step_tokens()} or that sum, whichever is more)")
    p.add_argument("--preempt", type=T.choice(PREEMPT), default="auto", metavar="|".join(PREEMPT),
                   help="when the budget is short: swap a request's blocks down the tiers (needs --offload), "
                        "recompute it later, or auto (swap when there is a tier; default)")
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="do not share KV blocks between requests with the same prompt prefix")
    p.add_argument("--model-name", type=_model_name, default=None, metavar="NAME",
                   help="the name clients send as 'model' (default: MODEL as given)")
    p.add_argument("--host", type=_host, default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1; 0.0.0.0 or :: for every interface)")
    p.add_argument("--port", type=T.integer(0, 65535), default=8000,
                   help="TCP port (default 8000; 0 picks a free one, printed when ready)")
    p.add_argument("--threads", type=T.THREADS, default=None, metavar="N",
                   help="torch CPU threads, 1..1024 (default: the usable cores)")


def _model_name(text: str) -> str:
    if not text.strip() or not text.isprintable() or len(text) > 256:
        raise T.bad(text, "allowed: a non-empty printable name of at most 256 characters")
    return text


def _host(text: str) -> str:
    allowed = "allowed: an IP address or host name of this machine, e.g. 127.0.0.1, 0.0.0.0, ::1, localhost"
    if not text.strip() or any(c.isspace() for c in text) or len(text) > 253:
        raise T.bad(text, allowed)
    try:
        socket.getaddrinfo(text, None, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, UnicodeError):
        raise T.bad(text, f"does not resolve; {allowed}") from None
    return text


def _default_step_tokens() -> int:
    from lessmem.serve.config import DEFAULT_STEP_TOKENS

    return DEFAULT_STEP_TOKENS


def _default_chunk_tokens() -> int:
    from lessmem.serve.config import EngineConfig

    return EngineConfig.chunk_tokens


def engine_config(args):
    """The checked ``EngineConfig`` of the command line; a failed check names the option."""
    from lessmem.serve import EngineConfig

    try:
        cfg = EngineConfig(kv=args.kv, kv_budget=args.kv_budget, offload=args.offload,
                           max_running=args.max_running,
                           **({} if args.chunk_tokens is None else {"chunk_tokens": args.chunk_tokens}),
                           **({} if args.step_tokens is None else {"step_tokens": args.step_tokens}),
                           preempt=args.preempt, prefix_cache=not args.no_prefix_cache)
        cfg.check()
    except (ValueError, TypeError) as exc:
        msg = " ".join(str(exc).split())
        option = _option_named(msg)
        field = option[2:].replace("-", "_")
        value = None if option == "--no-prefix-cache" else getattr(args, field)
        words = _in_option_words(msg)
        default = getattr(EngineConfig, field, None)
        if value is None and default is not None:  # left unset: say which value the check refused
            words = f"(unset: {default}) {words}"
        raise T.OptionError(option, value, words) from None
    return cfg


def _in_option_words(msg: str) -> str:
    """A check message about fields (``chunk_tokens=100; allowed: ...``) in the command
    line's words: the leading ``field=value`` dropped (OptionError says it), ``field=`` as
    ``--option``, a field named alone as its option.

    Example:
        >>> _in_option_words("preempt='swap' needs a lower tier; allowed: offload= a tier spec")
        'needs a lower tier; allowed: --offload a tier spec'
        >>> _in_option_words("step_tokens=8; allowed: >= chunk_tokens + max_running")
        'allowed: >= --chunk-tokens + --max-running'
    """
    import re

    fields = "|".join(sorted(FIELD_OPTIONS, key=len, reverse=True))
    msg = re.sub(rf"^({fields})=\S+?[;:]?(\s|$)", "", msg)
    msg = re.sub(rf"\b({fields})=\s?", lambda m: FIELD_OPTIONS[m.group(1)] + " ", msg)
    return re.sub(rf"(?<![-\w])({fields})\b", lambda m: FIELD_OPTIONS[m.group(1)], msg).strip()


def _option_named(msg: str) -> str:
    """The option whose field (or option name) the check message names first (--kv if none)."""
    hits = []
    for field, option in FIELD_OPTIONS.items():
        for word in (option, field):
            i = _find_word(msg, word)
            if i >= 0:
                hits.append((i, -len(word), option))
    return min(hits)[2] if hits else "--kv"


def _find_word(msg: str, word: str) -> int:
    i = msg.find(word)
    while i >= 0:
        before = msg[i - 1] if i else " "
        after = msg[i + len(word)] if i + len(word) < len(msg) else " "
        if not (before.isalnum() or before in "_-") and not (after.isalnum() or after in "_-"):
            return i
        i = msg.find(word, i + 1)
    return -1


def check(args) -> None:
    """Everything checked before the model loads: the model name, the engine's config."""
    check_model(args.model, "MODEL")
    args.config = engine_config(args)
    if args.model_name is None:
        args.model_name = args.model


def describe(args) -> str:
    """The cache setup in words, for the ready line and ``/health``."""
    from lessmem.base.tierspec import format_offload_spec, parse_offload_spec

    parts = [f"kv {args.kv}"]
    if args.kv_budget:
        parts.append(f"budget {args.kv_budget}")
    if args.offload:
        parts.append(f"offload {format_offload_spec(parse_offload_spec(args.offload))}")  # passwords as ***
    parts.append(f"max running {args.max_running}")
    if args.no_prefix_cache:
        parts.append("no prefix cache")
    return ", ".join(parts)


def bind(host: str, port: int) -> socket.socket:
    """A listening-ready TCP socket on ``host:port`` (bound before the model loads, so a
    port in use fails at once); OptionError naming --port or --host otherwise."""
    import errno

    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0 if host in ("::", "") else 1)
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise T.OptionError("--port", port, f"already in use on {host}; allowed: a free port, "
                                "or 0 for any free one") from None
        if exc.errno == errno.EACCES:
            raise T.OptionError("--port", port, f"permission denied on {host} (ports below 1024 need "
                                "privileges); allowed: a port in [1024, 65535], or 0") from None
        raise T.OptionError("--host", host, f"cannot listen there ({exc.strerror}); allowed: an "
                            "address of this machine, e.g. 127.0.0.1 or 0.0.0.0") from None
    sock.set_inheritable(True)
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    if sock.family == socket.AF_INET6:
        host = f"[{host}]"
    return f"http://{host}:{port}/v1"


def serving_threads() -> int | None:
    """Compute threads when ``--threads`` is not given: every core the process may use
    (``OMP_NUM_THREADS`` chooses instead when set). The engine steps on the main thread
    and the HTTP server's event loop mostly waits on sockets; the engine's OpenMP threads
    spin briefly between ops (``lessmem.cli`` gives the serve command the runtime's
    default wait policy back), which is what a step of many small ops needs."""
    import os

    from lessmem.base.cpu import usable_cores

    if os.environ.get("OMP_NUM_THREADS"):
        return None
    return max(1, usable_cores())


def run(args) -> int:
    import signal
    import threading

    if not hasattr(args, "config"):
        check(args)
    import uvicorn

    from lessmem.eval.generate_cli import load_model, set_threads
    from lessmem.eval.report import quiet_transformers
    from lessmem.serve import Engine
    from lessmem.serve.server import create_app

    sock = bind(args.host, args.port)
    try:
        set_threads(args.threads if args.threads is not None else serving_threads())
        quiet_transformers()
        model, tok = load_model(args.model, weights=args.weights)
        engine = Engine(model, tok, args.config, model_name=args.model_name)
    except BaseException:
        sock.close()
        raise
    what = describe(args)
    app = create_app(engine, tok, describe=what, owns_engine=False)
    ready = f"lessmem serve: {args.model_name} ({what}) ready at {url_of(sock)}"

    class Server(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets=sockets)
            if not self.should_exit:
                print(ready, file=sys.stderr, flush=True)

    # The engine steps on this thread, the one the model was loaded on (its OpenMP
    # threads: Engine.start's doc), and the HTTP server runs on another. SIGINT/SIGTERM
    # ask the server to stop: it stops accepting, requests in flight get up to 5 s (the
    # engine keeps stepping for them), then the engine closes and flushes its tiers.
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on",
                            timeout_graceful_shutdown=5)
    server = Server(config)
    http = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="lessmem-http", daemon=True)

    def ask_stop(signum, frame):
        server.should_exit = True

    previous = {s: signal.signal(s, ask_stop) for s in (signal.SIGINT, signal.SIGTERM)}
    # The engine thread holds the GIL between its thousands of small ops a step (most
    # torch CPU ops keep it) and the HTTP thread wants it for a moment per token sent:
    # with Python's 5 ms switch interval each hand-over could stall one side that long.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    try:
        http.start()
        engine.serve_forever(until=lambda: not http.is_alive())
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        server.should_exit = True
        http.join(timeout=10)
        sock.close()
        engine.close()
    print(f"lessmem serve: stopped ({args.model_name}: requests finished or aborted, "
          "the engine closed)", file=sys.stderr, flush=True)
    return 0
