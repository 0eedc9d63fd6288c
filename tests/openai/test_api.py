"""The OpenAI-compatible HTTP API, through the official `openai` Python client, against a
real `mlaserve serve` on the CPU backend with the bundled model.

    python tests/openai/test_api.py [MLASERVE_BINARY]     (default: target/debug/mlaserve)

Run by `.ci/run` with the venv of tools/ci/install-openai.sh. Starts the server on free
ports, runs every check (each asserts the response, not only that a call returned),
stops the server, and exits non-zero on the first failure.
"""

import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import openai

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = "mla-tiny-code"


_TAKEN = set()


def free_port():
    """A free port below Linux's ephemeral range (32768-60999), never the same twice:
    `serve` binds its own worker on an ephemeral port before it listens on these, and an
    ephemeral port picked here could be handed to that worker first."""
    while True:
        port = random.randrange(20000, 32000)
        if port in _TAKEN:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            _TAKEN.add(port)
            return port


def get(url):
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError:
        return None, ""


def kv_in_use(metrics_url):
    """The group's fraction of KV blocks in use, from the router's /metrics."""
    _, text = get(metrics_url)
    for line in text.splitlines():
        if line.startswith("mlaserve_kv_cache_usage_ratio{"):
            return float(line.split()[-1])
    raise AssertionError("no mlaserve_kv_cache_usage_ratio in /metrics")


def counter(metrics_url, name):
    """A counter without labels from the router's /metrics."""
    _, text = get(metrics_url)
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.split()[-1])
    raise AssertionError(f"no {name} in /metrics")


def expect_error(cls, param, call):
    try:
        call()
    except cls as e:
        body = e.body if isinstance(e.body, dict) else {}
        got = body.get("param")
        assert got == param, f"{cls.__name__}: param {got!r}, want {param!r} ({e})"
        return e
    raise AssertionError(f"expected {cls.__name__} naming {param!r}")


def checks(client, http, metrics):
    # /health, /ready, /v1/models.
    assert get(f"{http}/health") == (200, "ok")
    assert get(f"{http}/ready")[0] == 200
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL], models

    # Completions, greedy: deterministic, exactly max_tokens, usage adds up.
    a = client.completions.create(model=MODEL, prompt="def add(a, b):", max_tokens=16, temperature=0,
                                  extra_body={"ignore_eos": True})
    b = client.completions.create(model=MODEL, prompt="def add(a, b):", max_tokens=16, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert a.object == "text_completion" and a.choices[0].text, a
    assert a.choices[0].text == b.choices[0].text, (a, b)
    assert a.choices[0].finish_reason == "length", a
    u = a.usage
    assert u.completion_tokens == 16 and u.prompt_tokens > 0 and u.total_tokens == u.prompt_tokens + 16, u

    # Streaming completions give the same text, then a usage chunk when asked.
    chunks = list(client.completions.create(model=MODEL, prompt="def add(a, b):", max_tokens=16, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == a.choices[0].text, (text, a.choices[0].text)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 16, chunks[-1]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"

    # Token-id prompts.
    ids = client.completions.create(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=4, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert ids.usage.prompt_tokens == 4 and ids.usage.completion_tokens == 4, ids.usage

    # Stop strings: the text ends before the match, finish_reason "stop".
    cut = a.choices[0].text[: max(2, len(a.choices[0].text) // 2)][-2:]
    s = client.completions.create(model=MODEL, prompt="def add(a, b):", max_tokens=16, temperature=0, stop=[cut])
    assert s.choices[0].finish_reason == "stop", s
    assert cut not in s.choices[0].text and a.choices[0].text.startswith(s.choices[0].text), (cut, s)

    # A seed makes sampling repeatable.
    x = [client.completions.create(model=MODEL, prompt="import", max_tokens=12, temperature=1.0, seed=7).choices[0].text
         for _ in range(2)]
    assert x[0] == x[1], x

    # Chat, through the bundled model's template; streamed deltas add up to the message.
    msgs = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def fib(n):"}]
    c = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, temperature=0)
    assert c.object == "chat.completion" and c.choices[0].message.role == "assistant", c
    assert c.choices[0].message.content, c
    stream = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    parts = list(stream)
    assert parts[0].choices[0].delta.role == "assistant", parts[0]
    content = "".join(p.choices[0].delta.content or "" for p in parts if p.choices)
    assert content == c.choices[0].message.content, (content, c.choices[0].message.content)
    assert parts[-1].usage.prompt_tokens == c.usage.prompt_tokens, (parts[-1].usage, c.usage)

    # The prefix cache: the same long system prompt again is found cached.
    long_sys = [{"role": "system", "content": "You write Python. " * 60}, {"role": "user", "content": "def f():"}]
    first = client.chat.completions.create(model=MODEL, messages=long_sys, max_tokens=4, temperature=0)
    again = client.chat.completions.create(model=MODEL, messages=long_sys, max_tokens=4, temperature=0)
    assert first.usage.prompt_tokens > 128, first.usage
    assert again.usage.prompt_tokens_details.cached_tokens >= 128, again.usage
    assert again.choices[0].message.content == first.choices[0].message.content

    # n choices: indices 0..n, the completions summed in usage, seeds seed + i; the
    # later choices reuse the first one's prompt blocks (the router's cached-token count).
    before = counter(metrics, "mlaserve_cached_prompt_tokens_total")
    prompt = "def main():\n" + "    x = compute(x)\n" * 40
    n3 = client.completions.create(model=MODEL, prompt=prompt, n=3, max_tokens=8, temperature=1.0, seed=11,
                                   extra_body={"ignore_eos": True})
    assert sorted(c.index for c in n3.choices) == [0, 1, 2], n3
    assert n3.usage.completion_tokens == 24, n3.usage
    assert counter(metrics, "mlaserve_cached_prompt_tokens_total") - before >= 2 * 128, "choices 1, 2 reuse the prompt"
    again = client.completions.create(model=MODEL, prompt=prompt, n=3, max_tokens=8, temperature=1.0, seed=11,
                                      extra_body={"ignore_eos": True})
    assert [c.text for c in sorted(again.choices, key=lambda c: c.index)] == \
        [c.text for c in sorted(n3.choices, key=lambda c: c.index)], "seeded choices repeat"
    one = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=1.0, seed=12,
                                    extra_body={"ignore_eos": True})
    assert one.choices[0].text == [c.text for c in n3.choices if c.index == 1][0], "choice i samples with seed + i"
    g = client.chat.completions.create(model=MODEL, messages=msgs, n=2, max_tokens=8, temperature=0)
    assert len(g.choices) == 2 and g.choices[0].message.content == g.choices[1].message.content, g
    streamed = {}
    for p in client.chat.completions.create(model=MODEL, messages=msgs, n=2, max_tokens=8, temperature=0,
                                            stream=True):
        for ch in p.choices:
            streamed[ch.index] = streamed.get(ch.index, "") + (ch.delta.content or "")
    assert streamed == {0: g.choices[0].message.content, 1: g.choices[1].message.content}, streamed

    sampling_surface_checks(client)

    # Tools: accepted and given to the template; this model writes no tool call, so the
    # answer comes back as content.
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    t = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0, tools=tools)
    assert t.choices[0].message.tool_calls is None and t.choices[0].finish_reason == "length", t
    assert t.choices[0].message.content == client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=8, temperature=0).choices[0].message.content
    expect_error(openai.BadRequestError, "tool_choice",
                 lambda: client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, tools=tools,
                                                        tool_choice="required"))

    # Bad input: 400 naming the parameter, 404 for another model; the server goes on.
    expect_error(openai.BadRequestError, "top_p",
                 lambda: client.completions.create(model=MODEL, prompt="x", top_p=2.0, max_tokens=2))
    expect_error(openai.BadRequestError, "temperature",
                 lambda: client.completions.create(model=MODEL, prompt="x", temperature=-1, max_tokens=2))
    expect_error(openai.BadRequestError, "max_tokens",
                 lambda: client.completions.create(model=MODEL, prompt="x", max_tokens=0))
    expect_error(openai.BadRequestError, "max_tokens",
                 lambda: client.completions.create(model=MODEL, prompt="x", max_tokens=100000))
    expect_error(openai.BadRequestError, "prompt",
                 lambda: client.completions.create(model=MODEL, prompt=[999999], max_tokens=2))
    expect_error(openai.BadRequestError, "prompt",
                 lambda: client.completions.create(model=MODEL, prompt="", max_tokens=2))
    expect_error(openai.BadRequestError, "messages",
                 lambda: client.chat.completions.create(model=MODEL, messages=[], max_tokens=2))
    expect_error(openai.BadRequestError, "messages",
                 lambda: client.chat.completions.create(model=MODEL, messages=[{"role": "robot", "content": "x"}],
                                                        max_tokens=2))
    expect_error(openai.BadRequestError, "stop",
                 lambda: client.completions.create(model=MODEL, prompt="x", stop=[""], max_tokens=2))
    expect_error(openai.BadRequestError, "n",
                 lambda: client.completions.create(model=MODEL, prompt="x", n=0, max_tokens=2))
    expect_error(openai.BadRequestError, "n",
                 lambda: client.completions.create(model=MODEL, prompt="x", n=17, max_tokens=2))
    expect_error(openai.BadRequestError, "presence_penalty",
                 lambda: client.completions.create(model=MODEL, prompt="x", presence_penalty=2.5, max_tokens=2))
    expect_error(openai.BadRequestError, "frequency_penalty",
                 lambda: client.completions.create(model=MODEL, prompt="x", frequency_penalty=-3, max_tokens=2))
    expect_error(openai.BadRequestError, "repetition_penalty",
                 lambda: client.completions.create(model=MODEL, prompt="x", max_tokens=2,
                                                   extra_body={"repetition_penalty": 0}))
    expect_error(openai.BadRequestError, "min_p",
                 lambda: client.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body={"min_p": 1.5}))
    expect_error(openai.BadRequestError, "logit_bias",
                 lambda: client.completions.create(model=MODEL, prompt="x", max_tokens=2, logit_bias={"5": 150}))
    expect_error(openai.BadRequestError, "logit_bias",
                 lambda: client.completions.create(model=MODEL, prompt="x", max_tokens=2, logit_bias={"99999999": 1}))
    expect_error(openai.BadRequestError, "logprobs",
                 lambda: client.completions.create(model=MODEL, prompt="x", max_tokens=2, logprobs=21))
    expect_error(openai.BadRequestError, "top_logprobs",
                 lambda: client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                                        max_tokens=2, top_logprobs=3))
    expect_error(openai.BadRequestError, "top_logprobs",
                 lambda: client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                                        max_tokens=2, logprobs=True, top_logprobs=21))
    expect_error(openai.BadRequestError, "echo",
                 lambda: client.completions.create(model=MODEL, prompt="x", echo=True, max_tokens=2))
    try:
        client.completions.create(model=MODEL, prompt="x" * (5 << 20), max_tokens=2)
        raise AssertionError("a 5 MiB body must be refused")
    except openai.APIStatusError as e:
        assert e.status_code == 413 and e.body.get("code") == "request_too_large", (e.status_code, e.body)
        # The unread rest of the body ends the connection; the client must not reuse it.
        assert e.response.headers.get("connection") == "close", dict(e.response.headers)
    expect_error(openai.NotFoundError, "model",
                 lambda: client.completions.create(model="gpt-4", prompt="x", max_tokens=2))
    ok = client.completions.create(model=MODEL, prompt="x", max_tokens=2)
    assert ok.usage.completion_tokens >= 1

    # A client that disconnects mid-stream: the request is aborted and its blocks freed.
    raw = urllib.request.urlopen(urllib.request.Request(
        f"{http}/v1/completions", method="POST", headers={"content-type": "application/json"},
        data=json.dumps({"model": MODEL, "prompt": "def main():", "max_tokens": 900, "temperature": 0,
                         "ignore_eos": True, "stream": True}).encode()), timeout=30)
    for _ in range(3):
        assert raw.readline()
    assert kv_in_use(metrics) > 0, "the long stream holds blocks"
    raw.close()
    deadline = time.time() + 10
    while kv_in_use(metrics) > 0:
        assert time.time() < deadline, "blocks still in use 10 s after the client went away"
        time.sleep(0.1)
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=2).choices[0].text is not None


def byte_level_key(data):
    """A token's bytes as the byte-level BPE vocabulary spells them (GPT-2's byte map)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return "".join(table[b] for b in bytes(data))


def token_id(data):
    """The bundled model's id of the token whose bytes are `data`."""
    with open(os.path.join(REPO, "models", MODEL, "tokenizer.json")) as f:
        vocab = json.load(f)["model"]["vocab"]
    key = byte_level_key(data)
    assert key in vocab, f"no token {key!r} in the vocabulary"
    return vocab[key]


def sampling_surface_checks(client):
    """logprobs (chat and completions, streamed and not), penalties, logit_bias, min_p."""
    msgs = [{"role": "user", "content": "def fib(n):"}]
    c = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0, logprobs=True,
                                       top_logprobs=3)
    content = c.choices[0].logprobs.content
    assert len(content) == c.usage.completion_tokens == 8, c
    for e in content:
        assert e.logprob <= 0 and len(e.top_logprobs) == 3, e
        tops = [t.logprob for t in e.top_logprobs]
        assert tops == sorted(tops, reverse=True), tops
        # Greedy: the chosen token is the most likely one.
        assert abs(e.logprob - tops[0]) < 1e-6 and e.token == e.top_logprobs[0].token, e
        assert bytes(e.bytes).decode("utf-8", "replace") == e.token
    assert "".join(e.token for e in content) == c.choices[0].message.content
    streamed = []
    for p in client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0, logprobs=True,
                                            top_logprobs=3, stream=True):
        for ch in p.choices:
            if ch.logprobs and ch.logprobs.content:
                streamed.extend((e.token, round(e.logprob, 5)) for e in ch.logprobs.content)
    assert streamed == [(e.token, round(e.logprob, 5)) for e in content], (streamed, content)
    none = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, temperature=0)
    assert none.choices[0].logprobs is None

    cp = client.completions.create(model=MODEL, prompt="def main():", max_tokens=6, temperature=0, logprobs=2)
    lp = cp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6, lp
    assert "".join(lp.tokens) == cp.choices[0].text and lp.text_offset[0] == 0
    assert all(len(t) <= 2 and max(t.values()) >= l - 1e-6 for t, l in zip(lp.top_logprobs, lp.token_logprobs)), lp

    # logit_bias: -100 on the greedy choice's first token moves it; +100 on a token forces it.
    first = content[0]
    banned = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, temperature=0, logprobs=True,
                                            logit_bias={str(token_id(first.bytes)): -100})
    assert banned.choices[0].logprobs.content[0].token != first.token, (first, banned)
    forced = client.completions.create(model=MODEL, prompt="def main():", max_tokens=3, temperature=0.8, seed=3,
                                       logit_bias={"300": 100}, logprobs=0)
    toks = forced.choices[0].logprobs.tokens
    assert len(toks) == 3 and len(set(toks)) == 1 and token_id(toks[0].encode()) == 300, toks
    # Penalties: a strong presence penalty stops the greedy output repeating tokens it
    # repeats without one.
    p = "# a b a b a b a b"
    plain = client.completions.create(model=MODEL, prompt=p, max_tokens=16, temperature=0, logprobs=0)
    pen = client.completions.create(model=MODEL, prompt=p, max_tokens=16, temperature=0, logprobs=0,
                                    presence_penalty=2.0, frequency_penalty=2.0)
    assert pen.choices[0].text != plain.choices[0].text, "penalties changed nothing"
    t = pen.choices[0].logprobs.tokens
    assert len(set(t)) >= len(set(plain.choices[0].logprobs.tokens)), (t, plain.choices[0].logprobs.tokens)
    # min_p: with min_p = 1 only the most likely token survives, so sampling is greedy.
    mp = client.completions.create(model=MODEL, prompt="def main():", max_tokens=6, temperature=1.5, seed=9,
                                   extra_body={"min_p": 1.0})
    assert mp.choices[0].text == client.completions.create(model=MODEL, prompt="def main():", max_tokens=6,
                                                           temperature=0).choices[0].text


def thinking_checks(client):
    """A template that opens a thinking block: the output up to </think> (all of it,
    with this model, which never writes the tag) is reasoning_content, streamed as its
    own deltas."""
    msgs = [{"role": "user", "content": "def fib(n):"}]
    c = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, temperature=0)
    m = c.choices[0].message
    reasoning = m.model_extra.get("reasoning_content") if m.model_extra else None
    assert reasoning and m.content == "", m
    parts = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, temperature=0,
                                                stream=True))
    streamed = "".join((p.choices[0].delta.model_extra or {}).get("reasoning_content") or "" for p in parts)
    content = "".join(p.choices[0].delta.content or "" for p in parts)
    assert streamed == reasoning and content == "", (streamed, reasoning, content)


class Server:
    """`mlaserve serve` on free ports, for the model in `model_dir`."""

    def __init__(self, binary, model_dir):
        grpc, http_port, metrics_port = free_port(), free_port(), free_port()
        self.http = f"http://127.0.0.1:{http_port}"
        self.metrics = f"http://127.0.0.1:{metrics_port}/metrics"
        self.proc = subprocess.Popen(
            [binary, "serve", "--model", model_dir, "--listen", f"127.0.0.1:{grpc}",
             "--http-listen", f"127.0.0.1:{http_port}", "--metrics-listen", f"127.0.0.1:{metrics_port}"],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def __enter__(self):
        deadline = time.time() + 120
        while get(f"{self.http}/ready")[0] != 200:
            assert self.proc.poll() is None, f"serve exited: {self.proc.stdout.read()}"
            assert time.time() < deadline, "serve not ready after 120 s"
            time.sleep(0.2)
        return self

    def client(self):
        return openai.OpenAI(base_url=f"{self.http}/v1", api_key="unused", max_retries=0, timeout=60)

    def __exit__(self, *exc):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def main():
    binary = sys.argv[1] if len(sys.argv) > 1 else os.path.join(REPO, "target/debug/mlaserve")
    model = os.path.join(REPO, "models", MODEL)
    with Server(binary, model) as s:
        checks(s.client(), s.http, s.metrics)
    # The same model with a template whose generation prompt opens a thinking block.
    with tempfile.TemporaryDirectory() as d:
        thinking = os.path.join(d, MODEL)
        os.mkdir(thinking)
        for f in os.listdir(model):
            if f != "tokenizer_config.json":
                os.symlink(os.path.join(model, f), os.path.join(thinking, f))
        with open(os.path.join(model, "tokenizer_config.json")) as f:
            cfg = json.load(f)
        cfg["chat_template"] = cfg["chat_template"].replace("# Assistant:\n{% endif %}", "# Assistant:\n<think>\n{% endif %}")
        assert "<think>" in cfg["chat_template"], "the bundled template changed: update this test"
        with open(os.path.join(thinking, "tokenizer_config.json"), "w") as f:
            json.dump(cfg, f)
        with Server(binary, thinking) as s:
            thinking_checks(s.client())
    print(f"openai {openai.__version__}: every check of tests/openai/test_api.py passed")


if __name__ == "__main__":
    main()
