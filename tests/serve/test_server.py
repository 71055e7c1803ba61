"""``lessmem serve`` end to end: a real server process on loopback, the ``openai`` client.

One server of the built-in model (``smollm2-135m``, best-4 KV under a budget, a disk tier)
is shared by the module; the kill -9 test restarts it on the same disk tier, the tests
after it use the restarted one, and the last one stops it with SIGTERM. The "no chat
template" error is shown by the app as a library, under uvicorn in the test process, with
a tiny random model. Greedy requests (temperature 0)
make the texts comparable: streamed against whole, concurrent against alone, before a
restart against after.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

SRC = Path(__file__).resolve().parents[2] / "src"
READY = re.compile(r"ready at (http://\S+)/v1")
PROMPT = "The three primary colors are"
CHUNK = 64  # --chunk-tokens: prefix snapshots every 64 prompt tokens
# about 300 tokens: several chunks, so its prefix is snapshotted (and persisted)
LONG = ("Serving many requests at once means that their key-value caches share one memory "
        "budget. A request that arrives later may reuse the cache of an earlier one when both "
        "start with the same system prompt, which saves the work of prefilling it again. ") * 6


class ServeProc:
    """``python -m lessmem serve ARGS --port 0`` in a child process; ``url`` once ready."""

    def __init__(self, root: Path, *args: str):
        self.root, self.args = root, list(args)
        self.proc, self.url, self.starts = None, None, 0
        root.mkdir(parents=True, exist_ok=True)

    def start(self, timeout: float = 180) -> ServeProc:
        self.starts += 1
        self.log = self.root / f"stderr-{self.starts}.log"
        env = {**os.environ, "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
        env.pop("LESSMEM_DEBUG", None)
        with open(self.log, "w") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", "lessmem", "serve", *self.args, "--port", "0"],
                                         stdout=subprocess.DEVNULL, stderr=err, env=env, cwd=self.root)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = READY.search(self.log.read_text())
            if m:
                self.url = m.group(1)
                break
            if self.proc.poll() is not None:
                pytest.fail(f"lessmem serve exited with {self.proc.returncode}:\n{self.log.read_text()}")
            time.sleep(0.1)
        else:
            self.kill9()
            pytest.fail(f"lessmem serve was not ready in {timeout} s:\n{self.log.read_text()}")
        while time.monotonic() < deadline:  # the ready line comes once it listens: /health answers
            try:
                if get(self.url + "/health")[0] == 200:
                    return self
            except OSError:
                time.sleep(0.1)
        pytest.fail("/health did not answer")

    def client(self, **kw):
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=120, **kw)

    def metrics(self) -> dict:
        """{(name, labels as a sorted tuple): value} from /metrics, parsed by prometheus_client."""
        status, text = get(self.url + "/metrics")
        assert status == 200
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for fam in text_string_to_metric_families(text) for s in fam.samples}

    def kill9(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)

    def stop(self) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.kill9()
            return None


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def post(url: str, body: bytes | str | dict) -> tuple[int, dict]:
    data = json.dumps(body).encode() if isinstance(body, dict) else (body.encode() if isinstance(body, str) else body)
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def metric(m: dict, name: str, **labels) -> float:
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    srv = ServeProc(root, "smollm2-135m", "--kv", "best-4", "--kv-budget", "64MiB",
                    "--offload", f"disk:{root / 'kv'}", "--chunk-tokens", str(CHUNK), "--max-running", "8")
    srv.start()
    yield srv
    srv.stop()


def complete(srv, prompt=PROMPT, **kw) -> object:
    kw.setdefault("max_tokens", 6)
    kw.setdefault("temperature", 0)
    return srv.client().completions.create(model="smollm2-135m", prompt=prompt, **kw)


def assert_still_serves(srv):
    r = complete(srv, max_tokens=1)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 1


# ----------------------------------------------------------------------------- routes

def test_health_models_and_metrics(server):
    status, body = get(server.url + "/health")
    assert status == 200 and json.loads(body)["status"] == "ok"
    models = server.client().models.list()
    assert [m.id for m in models.data] == ["smollm2-135m"]
    m = server.metrics()
    for name in ("lessmem_requests_running", "lessmem_requests_waiting", "lessmem_requests_swapped",
                 "lessmem_prefix_hits_total", "lessmem_prefix_queries_total", "lessmem_generation_tokens_total"):
        assert any(k[0] == name for k in m), name
    assert ("lessmem_kv_bytes", (("tier", "device"),)) in m and ("lessmem_kv_bytes", (("tier", "disk"),)) in m
    assert ("lessmem_kv_format_bytes", (("format", "codes"),)) in m
    assert metric(m, "lessmem_kv_budget_bytes") == 64 * 2**20


def test_completion_whole_and_streamed_agree(server):
    before = server.metrics()
    whole = complete(server)
    text = whole.choices[0].text
    assert text.strip() and whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 6
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + 6
    chunks = list(complete(server, stream=True, stream_options={"include_usage": True}))
    pieces = [c.choices[0].text for c in chunks if c.choices]
    assert len([p for p in pieces if p]) >= 2  # more than one piece of text: it streamed
    assert "".join(pieces) == text  # greedy: the same text streamed and whole
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    ids = complete(server, [504, 1123, 314, 260], max_tokens=2)  # a prompt of token ids
    assert ids.usage.prompt_tokens == 4 and ids.usage.completion_tokens == 2
    after = server.metrics()
    assert metric(after, "lessmem_generation_tokens_total") - metric(before, "lessmem_generation_tokens_total") == 14
    assert metric(after, "lessmem_requests_finished_total", finish_reason="length") \
        - metric(before, "lessmem_requests_finished_total", finish_reason="length") == 3
    assert metric(after, "lessmem_time_to_first_token_seconds_count") \
        - metric(before, "lessmem_time_to_first_token_seconds_count") == 3


def test_stop_string(server):
    text = complete(server, max_tokens=8).choices[0].text
    words = text.split()
    assert len(words) >= 3, text
    stop = words[2]
    cut = complete(server, max_tokens=8, stop=[stop, "\u2603never"])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[:text.index(stop)]


def test_seed(server):
    a, b = (complete(server, max_tokens=3, temperature=1.0, seed=1234).choices[0].text for _ in range(2))
    assert a == b  # one seed, one text


def test_chat_whole_and_streamed(server):
    client = server.client()
    msgs = [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "What color is the sky?"}]
    whole = client.chat.completions.create(model="smollm2-135m", messages=msgs, max_tokens=4, temperature=0)
    msg = whole.choices[0].message
    assert msg.role == "assistant" and msg.content.strip()
    assert whole.object == "chat.completion" and whole.usage.completion_tokens <= 4
    chunks = list(client.chat.completions.create(model="smollm2-135m", messages=msgs, max_tokens=4, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == msg.content
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    # the template wraps the two messages: more prompt tokens than their words
    assert whole.usage.prompt_tokens > len(" ".join(m["content"] for m in msgs).split()) + 4


def test_concurrent_requests_match_each_alone(server):
    prompts = [PROMPT, "Once upon a time", "def fibonacci(n):"]
    alone = [complete(server, p, max_tokens=5).choices[0].text for p in prompts]
    out, errors = [None] * len(prompts), []
    barrier = threading.Barrier(len(prompts))

    def one(i):
        try:
            barrier.wait(30)
            out[i] = complete(server, prompts[i], max_tokens=5).choices[0].text
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert out == alone  # batched with the others, each greedy text is the one it had alone
    assert metric(server.metrics(), "lessmem_requests_running_peak") >= 2  # they did run together


def wait_for_abort(server, before) -> dict:
    """The server's metrics once one more request has finished with "abort" (60 s at most)."""
    deadline, m = time.monotonic() + 60, {}
    while time.monotonic() < deadline:
        m = server.metrics()
        if metric(m, "lessmem_requests_finished_total", finish_reason="abort") \
                > metric(before, "lessmem_requests_finished_total", finish_reason="abort"):
            return m
        time.sleep(0.1)
    pytest.fail(f"the request was not aborted: {m}")


def test_client_gone_mid_stream_aborts_and_frees(server):
    before = server.metrics()
    stream = complete(server, "Write a very long story about a dragon.", max_tokens=400, stream=True,
                      extra_body={"ignore_eos": True})
    got = 0
    for chunk in stream:
        got += bool(chunk.choices and chunk.choices[0].text)
        if got >= 2:
            break
    stream.close()  # the connection goes away with the request unfinished
    m = wait_for_abort(server, before)
    assert metric(m, "lessmem_requests_running") == 0 and metric(m, "lessmem_requests_waiting") == 0
    assert metric(m, "lessmem_requests_finished_total", finish_reason="length") \
        == metric(before, "lessmem_requests_finished_total", finish_reason="length")
    generated = metric(m, "lessmem_generation_tokens_total") - metric(before, "lessmem_generation_tokens_total")
    assert 2 <= generated < 400
    # its blocks are freed: the device holds what it held before (a short prompt leaves no snapshot)
    assert metric(m, "lessmem_kv_bytes", tier="device") == metric(before, "lessmem_kv_bytes", tier="device")
    assert_still_serves(server)


def test_client_gone_before_a_whole_answer_aborts(server):
    """A non-streaming request whose client hangs up is aborted too (not run to max_tokens)."""
    before = server.metrics()
    host, port = server.url.split("//")[1].split(":")
    body = json.dumps({"model": "smollm2-135m", "prompt": "Tell me about the sea.", "max_tokens": 400,
                       "ignore_eos": True}).encode()
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and metric(server.metrics(), "lessmem_generation_tokens_total") \
                - metric(before, "lessmem_generation_tokens_total") < 2:
            time.sleep(0.05)
    m = wait_for_abort(server, before)
    assert metric(m, "lessmem_requests_running") == 0
    assert metric(m, "lessmem_generation_tokens_total") - metric(before, "lessmem_generation_tokens_total") < 400


# ----------------------------------------------------------------------------- errors

BAD = [  # (route, body, status, param or None, words the message must hold)
    ("completions", "{not json", 400, None, "not valid JSON"),
    ("completions", "", 400, None, "empty"),
    ("completions", "[1, 2]", 400, None, "JSON object"),
    ("completions", '{"prompt": "hi", "max_tokens": NaN}', 400, None, "not valid JSON"),
    ("completions", {"model": "gpt-9", "prompt": "hi"}, 404, "model", "does not exist"),
    ("completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens", ">= 1"),
    ("completions", {"prompt": "hi", "max_tokens": -5}, 400, "max_tokens", ">= 1"),
    ("completions", {"prompt": "hi", "max_tokens": "5"}, 400, "max_tokens", "integer"),
    ("completions", {"prompt": "hi", "max_tokens": 1.5}, 400, "max_tokens", "integer"),
    ("completions", {"prompt": "hi", "max_tokens": True}, 400, "max_tokens", "integer"),
    ("completions", {"prompt": "hi " * 9000, "max_tokens": 4}, 400, "prompt", "context"),
    ("completions", {"prompt": list(range(8192)), "max_tokens": 1}, 400, "prompt", "context"),
    ("completions", {"prompt": "hi", "max_tokens": 8192}, 400, "max_tokens", "8,192"),
    ("completions", {"prompt": 5}, 400, "prompt", "token ids"),
    ("completions", {"prompt": ""}, 400, "prompt", "non-empty"),
    ("completions", {"prompt": ["a", "b"]}, 400, "prompt", "one prompt"),
    ("completions", {"prompt": [1, 10**9]}, 400, "prompt", "token ids in"),
    ("completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature", "number"),
    ("completions", {"prompt": "hi", "temperature": -1}, 400, "temperature", "number in"),
    ("completions", {"prompt": "hi", "temperature": 3}, 400, "temperature", "[0, 2]"),
    ("completions", {"prompt": "hi", "top_p": 0}, 400, "top_p", "(0, 1]"),
    ("completions", {"prompt": "hi", "stop": 3}, 400, "stop", "string"),
    ("completions", {"prompt": "hi", "stop": [""]}, 400, "stop", "non-empty"),
    ("completions", {"prompt": "hi", "seed": "x"}, 400, "seed", "integer"),
    ("completions", {"prompt": "hi", "n": 2}, 400, "n", "one choice per request"),
    ("completions", {"prompt": "hi", "stream": "yes"}, 400, "stream", "true or false"),
    ("completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options", "stream"),
    ("completions", {"prompt": "hi", "logprobs": 5}, 400, "logprobs", "not implement"),
    ("completions", {"prompt": "hi", "max_token": 5}, 400, "max_token", "unrecognized"),
    ("completions", {"max_tokens": 5}, 400, "prompt", "required"),
    ("chat/completions", {"messages": "hi"}, 400, "messages", "list"),
    ("chat/completions", {"messages": []}, 400, "messages", "non-empty"),
    ("chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role", "user"),
    ("chat/completions", {"messages": [{"role": "user", "content": 7}]}, 400, "messages[0].content", "string"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400,
     "max_tokens", ">= 1"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi " * 9000}], "max_tokens": 4}, 400,
     "messages", "context"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8190}, 400,
     "max_tokens", "context"),
    ("chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "hi"}]}, 404, "model",
     "does not exist"),
]


@pytest.mark.parametrize("route, body, status, param, words", BAD,
                         ids=[f"{r}:{json.dumps(b)[:40]}" for r, b, *_ in BAD])
def test_bad_requests_get_openai_errors(server, route, body, status, param, words):
    before = metric(server.metrics(), "lessmem_requests_accepted_total")
    code, reply = post(f"{server.url}/v1/{route}", body)
    assert code == status, reply
    err = reply["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert words in err["message"], err["message"]
    assert metric(server.metrics(), "lessmem_requests_accepted_total") == before  # nothing was queued


def test_errors_through_the_openai_client_then_it_still_serves(server):
    client = server.client()
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4o", prompt="hi", max_tokens=2)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="smollm2-135m", prompt="hi", max_tokens=0)
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="smollm2-135m", max_tokens=2,
                                       messages=[{"role": "user", "content": "word " * 9000}])
    assert e.value.body["code"] == "context_length_exceeded"
    status, reply = get(server.url + "/v1/nothing")
    assert status == 404 and "allowed" in json.loads(reply)["error"]["message"]
    assert_still_serves(server)
    assert metric(server.metrics(), "lessmem_requests_rejected_total", status="400") >= 2


def test_no_chat_template_is_a_clear_400():
    """The app as a library (``create_app``) under uvicorn in this process: a tiny random
    Llama with the byte tokenizer, which has no chat template."""
    import uvicorn

    from lessmem.models import tiny_random, tiny_tokenizer
    from lessmem.serve import Engine, EngineConfig
    from lessmem.serve.server import create_app

    engine = Engine(tiny_random("llama"), tiny_tokenizer(), EngineConfig(kv="int4", chunk_tokens=64), "tiny")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        srv = uvicorn.Server(uvicorn.Config(create_app(engine, tiny_tokenizer()), log_level="warning"))
        thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        try:
            while not srv.started:
                time.sleep(0.02)
            port = sock.getsockname()[1]
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
            with pytest.raises(openai.BadRequestError) as e:
                client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=2)
            assert e.value.body["code"] == "no_chat_template" and "/v1/completions" in e.value.body["message"]
            r = client.completions.create(model="tiny", prompt="hello", max_tokens=3, temperature=0)
            assert r.usage.prompt_tokens == len(b"hello") and r.usage.completion_tokens <= 3  # a token a byte
        finally:
            srv.should_exit = True
            thread.join(30)
    assert not thread.is_alive()


# ----------------------------------------------------------------------------- restart

def test_kv_bytes_per_tier_count_the_disk_tier(server):
    complete(server, LONG[:len(LONG) // 2], max_tokens=1)  # more than one chunk: a snapshot persisted
    m = server.metrics()
    assert metric(m, "lessmem_prefix_entries") >= 1
    assert metric(m, "lessmem_kv_bytes", tier="disk") > 0



def test_kill9_restart_same_disk_tier_prefix_still_hits(server):
    first = complete(server, LONG, max_tokens=4)  # its prefix snapshots are written as it is prefilled
    assert first.usage.prompt_tokens > 3 * CHUNK
    assert metric(server.metrics(), "lessmem_prefix_tier_hits_total") == 0
    server.kill9()
    assert server.proc.returncode == -signal.SIGKILL
    server.start()  # the same command line: the same disk directory
    m0 = server.metrics()
    assert metric(m0, "lessmem_prefix_hits_total") == 0  # a new process: nothing in memory
    again = complete(server, LONG, max_tokens=4)
    m = server.metrics()
    assert metric(m, "lessmem_prefix_tier_hits_total") >= 1 and metric(m, "lessmem_prefix_hits_total") >= 1
    assert again.usage.prompt_tokens_details.cached_tokens >= 3 * CHUNK
    assert metric(m, "lessmem_prompt_tokens_computed_total") < again.usage.prompt_tokens
    assert again.choices[0].text == first.choices[0].text  # the reused prefix gives the same answer
    assert_still_serves(server)


# ----------------------------------------------------------------------------- the command line

def test_port_in_use_fails_before_the_model_loads(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "lessmem", "serve", "--port", str(port)], capture_output=True,
                           text=True, timeout=120, env=env, cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lessmem serve: error: --port") and "in use" in lines[0]
    assert "ready at" not in r.stderr and time.monotonic() - t0 < 60


def test_sigterm_stops_cleanly(server):
    """Last in the module: it stops the module's server."""
    assert server.stop() in (0, -signal.SIGTERM)  # uvicorn re-raises the signal it handled
    log = server.log.read_text()
    assert "lessmem serve: stopped" in log and "Traceback" not in log, log
    with pytest.raises(OSError):
        get(server.url + "/health")
