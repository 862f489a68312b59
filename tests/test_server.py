"""The OpenAI-compatible server as clients see it: real `unmask serve` processes on loopback ports,
driven by the official `openai` client (and httpx where a client library would hide the wire).

The model is the tiny SDAR checkpoint with its output head restricted to plain-text tokens (letters,
digits, space; scaled up so they dominate), so that outputs are random but non-empty printable text:
stop strings, text equality between paths and logprob tokens can be checked. Nothing here asserts
on meaning.
"""
from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import socket
import string
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
from safetensors.torch import load_file, save_file

from tiny_checkpoints import FAMILIES
from unmask.allocator import find_jemalloc

KEYS = ("key-a", "key-b")
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say something."}]
PLACEHOLDER = "░"


def make_text_checkpoint(out: Path) -> Path:
    from tokenizers import Tokenizer

    path = FAMILIES["sdar"](out)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    allowed = set(string.ascii_letters + string.digits + " ")
    keep = [i for i in range(tok.get_vocab_size()) if (s := tok.decode([i])) and set(s) <= allowed]
    tensors = load_file(path / "model.safetensors")
    head = tensors["lm_head.weight"]
    text_head = torch.zeros_like(head)
    text_head[keep] = head[keep] * 100.0
    tensors["lm_head.weight"] = text_head
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One `python -m unmask.cli serve` subprocess; `health_seen` records /health answers until ready."""

    def __init__(self, model: Path, log: Path, *flags: str, env: dict[str, str] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        cmd = [sys.executable, "-m", "unmask.cli", "serve", "--model", str(model), "--port", str(self.port),
               "--log-level", "warning", *flags]
        full_env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", **(env or {})}
        self.proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=full_env)
        self.health_seen: list[int | None] = []

    def wait_ready(self, timeout: float = 120) -> Server:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"server exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            try:
                status = httpx.get(f"{self.url}/health", timeout=2).status_code
            except httpx.TransportError:
                status = None
            self.health_seen.append(status)
            if status == 200:
                return self
            time.sleep(0.05)
        pytest.fail(f"server not ready after {timeout} s:\n{self.log.read_text()[-3000:]}")

    def client(self, key: str = "unused", **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, timeout=60, **kw)

    def metrics(self, key: str | None = None) -> dict[str, float]:
        """Samples of /metrics summed over labels, by sample name."""
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        r = httpx.get(f"{self.url}/metrics", headers=headers, timeout=10)
        r.raise_for_status()
        out: dict[str, float] = {}
        for line in r.text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                name = name.split("{")[0]
                out[name] = out.get(name, 0.0) + float(value)
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


TEMPLATE = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant] "


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_text_checkpoint(tmp_path_factory.mktemp("model") / "tiny-sdar")


@pytest.fixture(scope="module")
def servers(model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("server")
    main = Server(model_dir, root / "main.log")
    (root / "template.jinja").write_text(TEMPLATE)
    # flags through the environment on purpose (typer envvar=); two keys in one variable
    restricted = Server(model_dir, root / "restricted.log", "--max-num-seqs", "1", "--max-body-bytes", "4000",
                        "--cors-origin", "http://allowed.example", "--served-model-name", "restricted",
                        "--chat-template", str(root / "template.jinja"),
                        env={"UNMASK_API_KEY": " ".join(KEYS), "UNMASK_MAX_QUEUE": "1",
                             "UNMASK_MAX_PROMPT_TOKENS": "64", "UNMASK_ALLOCATOR": "glibc"})
    yield {"main": main, "restricted": restricted}
    main.stop()
    restricted.stop()


@pytest.fixture(scope="module")
def server(servers) -> Server:
    return servers["main"].wait_ready()


@pytest.fixture(scope="module")
def restricted(servers) -> Server:
    return servers["restricted"].wait_ready()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server.client()


def chat(client, **kw):
    args = {"model": "tiny-sdar", "messages": CHAT, "max_tokens": 24, "temperature": 0.0}
    return client.chat.completions.create(**{**args, **kw})


def stream_chat(client, **kw) -> tuple[str, list, list]:
    """(content, finish reasons seen, all chunks) of a streamed chat completion."""
    chunks = list(chat(client, stream=True, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    return text, finishes, chunks


def raw_post(server: Server, path: str, body: bytes | dict, key: str | None = None) -> httpx.Response:
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{server.url}{path}", content=content, headers=headers, timeout=60)


def assert_envelope(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


# ---------------------------------------------------------------------------------------- basics
def test_health_is_503_while_loading_then_200(server):
    seen = [s for s in server.health_seen if s is not None]
    assert seen[-1] == 200 and 503 in seen, server.health_seen


@pytest.mark.skipif(find_jemalloc() is None or not sys.platform.startswith("linux"),
                    reason="libjemalloc2 is not installed (make setup installs it as root)")
def test_the_server_runs_under_jemalloc_unless_told_glibc(server, restricted):
    """`unmask serve` re-executes itself with jemalloc preloaded (allocator.py): under glibc a server's heap
    fragments and its RSS keeps growing; UNMASK_ALLOCATOR=glibc keeps glibc."""
    def maps(proc):
        return Path(f"/proc/{proc.pid}/maps").read_text()

    assert "libjemalloc" in maps(server.proc)           # the same pid: the re-execution is an execve
    assert "libjemalloc" not in maps(restricted.proc)


def test_models(client):
    assert [m.id for m in client.models.list().data] == ["tiny-sdar"]
    assert client.models.retrieve("tiny-sdar").id == "tiny-sdar"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other-model")
    with pytest.raises(openai.NotFoundError):
        chat(client, model="other-model")


def test_chat_non_streamed_and_streamed_agree(client):
    r = chat(client)
    choice = r.choices[0]
    assert r.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.message.content and choice.finish_reason == "length"
    assert r.usage.completion_tokens == 24 and r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens

    text, finishes, chunks = stream_chat(client, stream_options={"include_usage": True})
    assert chunks[0].choices[0].delta.role == "assistant"
    assert text == choice.message.content and finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage == r.usage
    assert all(c.usage is None for c in chunks[:-1])

    text, finishes, chunks = stream_chat(client)  # no include_usage: no usage chunk
    assert text == choice.message.content and all(c.choices for c in chunks)


def test_completions_non_streamed_and_streamed_agree(client):
    args = {"model": "tiny-sdar", "prompt": "Once upon a time", "max_tokens": 20, "temperature": 0.0}
    r = client.completions.create(**args)
    assert r.object == "text_completion" and r.choices[0].text and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 20
    chunks = list(client.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].usage == r.usage
    echo = client.completions.create(**args, echo=True)
    assert echo.choices[0].text == "Once upon a time" + r.choices[0].text
    tokens = client.completions.create(**{**args, "prompt": [40, 41, 42, 43]})
    assert tokens.usage.prompt_tokens == 4 and tokens.choices[0].text


def test_logit_bias_and_penalties(client):
    args = {"model": "tiny-sdar", "prompt": [40, 41, 42, 43], "max_tokens": 6, "temperature": 0.0,
            "extra_body": {"ignore_eos": True}}
    forced = client.completions.create(**args, logit_bias={"45": 100}, logprobs=1)
    assert forced.choices[0].logprobs.tokens and all(t == forced.choices[0].logprobs.tokens[0]
                                                     for t in forced.choices[0].logprobs.tokens)
    assert len(forced.choices[0].logprobs.tokens) == 6
    plain = client.completions.create(**args)
    penalised = client.completions.create(**args, presence_penalty=2.0, frequency_penalty=2.0)
    assert penalised.usage.completion_tokens == plain.usage.completion_tokens == 6
    # vLLM's extra parameter: a prompt of the forced token, penalised hard enough, bans that token
    rep_args = {**args, "prompt": [45, 45, 45, 45], "logit_bias": {"45": 100}, "logprobs": 1}
    favoured = client.completions.create(**rep_args).choices[0].logprobs.tokens
    repelled = client.completions.create(**{**rep_args, "extra_body": {"ignore_eos": True, "repetition_penalty": 10}})
    assert favoured == [favoured[0]] * 6 and favoured[0] not in repelled.choices[0].logprobs.tokens
    # llama.cpp's DRY (multiplier 10, base 10, allowed length 1): continuing a repeat of 1 token costs 10, of 2
    # tokens 100, more than the bias of 50. It applies at the first open position (its left context is all
    # committed): so the prompt's run is not continued, and with block size 1 (every position the first open
    # one) the output never holds three forced tokens in a row
    dry = {"ignore_eos": True, "dry_multiplier": 10, "dry_base": 10, "dry_allowed_length": 1, "dry_sequence_breakers": []}
    dry_args = {**rep_args, "logit_bias": {"45": 50}}
    first = client.completions.create(**{**dry_args, "extra_body": dry}).choices[0].logprobs.tokens
    each = client.completions.create(**{**dry_args, "extra_body": {**dry, "block_size": 1}}).choices[0].logprobs.tokens
    assert first[0] != favoured[0] and each[0] != favoured[0] and favoured[0] in each
    assert not any(each[i:i + 3] == [favoured[0]] * 3 for i in range(len(each)))


def test_stop_strings(client):
    full = chat(client, max_tokens=40).choices[0].message.content
    stop = full[12:15]
    expected = full[:full.index(stop)]
    r = chat(client, max_tokens=40, stop=stop)
    assert r.choices[0].message.content == expected and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < 40
    text, finishes, _ = stream_chat(client, max_tokens=40, stop=["never-in-output", stop])
    assert text == expected and finishes == ["stop"]


def test_n_choices_match_single_requests_with_successive_seeds(client):
    r = chat(client, n=3, temperature=1.0, seed=7)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert r.usage.completion_tokens == 3 * 24
    for j, c in enumerate(r.choices):
        assert c.message.content == chat(client, temperature=1.0, seed=7 + j).choices[0].message.content
    chunks = list(chat(client, n=2, stream=True, temperature=1.0, seed=7))
    for j in range(2):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == j]
        assert "".join(ch.delta.content or "" for ch in mine) == r.choices[j].message.content
        assert [ch.finish_reason for ch in mine if ch.finish_reason] == ["length"]


def test_seed_reproducibility(client):
    a = chat(client, temperature=1.0, seed=1234).choices[0].message.content
    b = chat(client, temperature=1.0, seed=1234).choices[0].message.content
    c = chat(client, temperature=1.0, seed=4321).choices[0].message.content
    assert a == b and a != c


def test_streamed_logprobs_cover_every_token_held_back_by_a_stop_string(server, client):
    """A step can commit tokens whose text is held back (it may begin a stop string): their logprobs still
    stream, without top_logprobs too, so the stream carries one entry per completion token."""
    stop = ["zzzz-never"]   # every text ending in a prefix of it ("z", "zz", ...) is held until it cannot match
    chunks = list(chat(client, max_tokens=16, logprobs=True, stop=stop, stream=True,
                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert len(entries) == chunks[-1].usage.completion_tokens == 16
    whole = chat(client, max_tokens=16, logprobs=True, stop=stop, extra_body={"ignore_eos": True})
    assert [e.token for e in entries] == [e.token for e in whole.choices[0].logprobs.content]
    streamed = list(client.completions.create(model="tiny-sdar", prompt="Once", max_tokens=16, logprobs=0,
                                              stop=stop, stream=True, extra_body={"ignore_eos": True}))
    assert sum(len(c.choices[0].logprobs.tokens) for c in streamed if c.choices and c.choices[0].logprobs) == 16


def test_null_means_the_default(server, client):
    """Clients send null for arguments a caller passed as None; OpenAI reads that as the default."""
    r = raw_post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "n": None, "logprobs": None,
                                                  "stream": None, "ignore_eos": None, "diffusing": None,
                                                  "temperature": None})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 1 and r.json()["choices"][0]["logprobs"] is None
    r = raw_post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "echo": None, "n": None,
                                             "stream": True, "stream_options": {"include_usage": None}})
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]") and '"usage":{' not in r.text
    assert_envelope(raw_post(server, "/v1/chat/completions", {"messages": None}), 400, "messages")  # required


def test_openai_error_shapes(server):
    # unknown model: 404 with OpenAI's type and code
    err = assert_envelope(raw_post(server, "/v1/chat/completions", {"model": "nope", "messages": CHAT}), 404, "model")
    assert err["type"] == "invalid_request_error" and err["code"] == "model_not_found"
    # the field the client sent is the one named
    for body, param in (({"max_completion_tokens": -1}, "max_completion_tokens"),
                        ({"max_completion_tokens": 10**6}, "max_completion_tokens"),
                        ({"max_tokens": -1}, "max_tokens")):
        err = assert_envelope(raw_post(server, "/v1/chat/completions", {"messages": CHAT, **body}), 400, param)
        assert param in err["message"]
    err = assert_envelope(raw_post(server, "/v1/chat/completions", {"messages": CHAT, "stream_options":
                                                                    {"include_usage": True}}), 400, "stream_options")
    assert "stream" in err["message"]
    assert_envelope(raw_post(server, "/v1/completions", {"prompt": "hi", "stream_options": {}}), 400, "stream_options")
    # the deprecated function-calling fields would be answered in a shape the client does not read
    fn = {"name": "f", "parameters": {"type": "object"}}
    assert_envelope(raw_post(server, "/v1/chat/completions", {"messages": CHAT, "functions": [fn]}), 400, "functions")
    assert_envelope(raw_post(server, "/v1/chat/completions", {"messages": CHAT, "function_call": "auto"}), 400,
                    "function_call")
    # `curl -d` without a JSON content type: the cause, not a pydantic message
    r = httpx.post(f"{server.url}/v1/chat/completions", content=json.dumps({"messages": CHAT}),
                   headers={"Content-Type": "application/x-www-form-urlencoded"})
    err = assert_envelope(r, 400)
    assert err["code"] == "invalid_content_type" and "application/x-www-form-urlencoded" in err["message"]


def test_assistant_refusal_parts_are_read_as_text(client):
    history = [*CHAT, {"role": "assistant", "content": [{"type": "refusal", "refusal": "I cannot."}]},
               {"role": "user", "content": [{"type": "text", "text": "Why not?"}]}]
    assert chat(client, messages=history, max_tokens=2).usage.completion_tokens == 2


def test_logprobs(client):
    r = chat(client, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:  # greedy: the committed token is the most likely one
        assert t.logprob <= 0 and len(t.top_logprobs) == 3
        assert t.top_logprobs[0].token == t.token and t.top_logprobs[0].logprob == pytest.approx(t.logprob, abs=1e-5)
        lps = [x.logprob for x in t.top_logprobs]
        assert lps == sorted(lps, reverse=True) and sum(math.exp(x) for x in lps) <= 1 + 1e-5
    one = chat(client, logprobs=True).choices[0].logprobs.content  # top_logprobs left out: no alternatives
    assert all(t.top_logprobs == [] for t in one)
    done = client.completions.create(model="tiny-sdar", prompt="Once upon a time", max_tokens=6, logprobs=2,
                                     temperature=0.0)
    lp = done.choices[0].logprobs
    assert all(len(top) <= 2 and top.get(tok) == pytest.approx(v, abs=1e-5)
               for tok, v, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs))
    _, _, chunks = stream_chat(client, logprobs=True)
    streamed = [t.logprob for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert streamed == pytest.approx([t.logprob for t in content])
    comp = client.completions.create(model="tiny-sdar", prompt="abc", max_tokens=8, temperature=0.0, logprobs=1)
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == 8
    assert "".join(lp.tokens) == comp.choices[0].text and list(lp.top_logprobs[0]) == [lp.tokens[0]]
    assert lp.top_logprobs[0][lp.tokens[0]] == pytest.approx(lp.token_logprobs[0], abs=1e-5)


def test_diffusing_frames_are_marked_and_not_billed(client):
    plain = chat(client, max_tokens=16)
    chunks = list(chat(client, max_tokens=16, stream=True, stream_options={"include_usage": True},
                       extra_body={"diffusing": True}))
    frames = [c for c in chunks if getattr(c, "diffusing", None)]
    assert frames and all(c.choices == [] for c in frames)
    content, seen_prefix_ok = "", True
    for c in chunks:
        if c.choices:
            content += c.choices[0].delta.content or ""
        elif getattr(c, "diffusing", None):
            frame = c.diffusing
            assert frame["index"] == 0 and frame["masked"] == frame["text"].count(PLACEHOLDER)
            seen_prefix_ok &= frame["text"].startswith(content)
    assert any(f.diffusing["masked"] > 0 for f in frames)
    assert seen_prefix_ok and content == plain.choices[0].message.content
    last = frames[-1].diffusing
    assert {k: last[k] for k in ("index", "text", "masked")} == {"index": 0, "text": content, "masked": 0}
    counts = [f.diffusing["forwards"] for f in frames]   # one frame per step the choice took part in
    assert all(b > a for a, b in zip(counts, counts[1:])) and counts[-1] >= len(frames)
    assert chunks[-1].usage == plain.usage


def test_chat_template_override(restricted, model_dir):
    from tokenizers import Tokenizer

    r = chat(restricted.client(KEYS[0]), model="restricted", max_tokens=4)
    rendered = "[system] Be brief.\n[user] Say something.\n[assistant] "
    assert r.usage.prompt_tokens == len(Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(rendered).ids)


def test_diffusion_controls(client):
    for extra in ({"reasoning_effort": "instant"}, {"reasoning_effort": "high"},
                  {"policy": "low_confidence", "steps": 2, "block_size": 8}, {"threshold": 0.5}):
        r = chat(client, max_tokens=16, extra_body=extra)
        assert r.choices[0].message.content and r.usage.completion_tokens == 16


def test_topk_tokens_per_step_and_factor_reach_the_policy(server, client):
    """`tokens_per_step` fixes how many tokens the topk policy commits per forward; `factor` tunes its policy."""
    def tokens_per_forward(extra):
        before = server.metrics()
        r = chat(client, max_tokens=16, extra_body={"ignore_eos": True, **extra})
        after = server.metrics()
        assert r.usage.completion_tokens == 16
        return after["unmask:tokens_per_forward_sum"] - before["unmask:tokens_per_forward_sum"]

    one, four = tokens_per_forward({"policy": "topk"}), tokens_per_forward({"policy": "topk", "tokens_per_step": 4})
    assert one <= 1.0 and four > 2.5
    # the factor rule commits more per step as f grows (f = 1000: every row of the block qualifies)
    assert tokens_per_forward({"policy": "factor", "factor": 1000.0}) > 2.5 >= tokens_per_forward(
        {"policy": "factor", "factor": 1e-6})
    # the credit policy's fusion knobs: weight 0 is the plain threshold rule; a decisive credit commits blocks whole
    assert tokens_per_forward({"policy": "credit", "credit_weight": 1000.0, "credit_gamma": 0.05}) > 2.5 >= \
        tokens_per_forward({"policy": "credit", "credit_weight": 0.0})


# ---------------------------------------------------------------------------------------- batching, cancellation
def test_sixteen_concurrent_streams_match_sequential_requests(server, client):
    prompts = [f"Prompt number {i}: tell me about topic {i * 7}." for i in range(16)]
    refs = [chat(client, messages=[{"role": "user", "content": p}]).choices[0].message.content for p in prompts]
    before = server.metrics()

    async def one(aclient, prompt):
        messages = [{"role": "user", "content": prompt}]
        stream = await aclient.chat.completions.create(model="tiny-sdar", messages=messages, max_tokens=24,
                                                       temperature=0.0, stream=True)
        text, finishes = "", []
        async for c in stream:
            if c.choices:
                text += c.choices[0].delta.content or ""
                finishes += [c.choices[0].finish_reason] if c.choices[0].finish_reason else []
        return text, finishes

    async def all_at_once():
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as aclient:
            return await asyncio.gather(*(one(aclient, p) for p in prompts))

    results = asyncio.run(all_at_once())
    assert [t for t, _ in results] == refs
    assert all(f == ["length"] for _, f in results)
    after = server.metrics()
    steps = after["unmask:step_batch_size_count"] - before["unmask:step_batch_size_count"]
    batched = after["unmask:step_batch_size_sum"] - before["unmask:step_batch_size_sum"]
    assert batched / steps > 2  # requests really shared forwards


def wait_for(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_disconnect_mid_stream_frees_the_slot(server, client):
    before = server.metrics()["unmask:request_cancellations_total"]
    stream = chat(client, max_tokens=3000, stream=True)
    got = [c for _, c in zip(range(4), stream)]
    assert len(got) == 4 and server.metrics()["unmask:num_requests_running"] == 1
    stream.close()
    assert wait_for(lambda: server.metrics()["unmask:request_cancellations_total"] == before + 1)
    assert wait_for(lambda: server.metrics()["unmask:num_requests_running"] == 0)


def test_disconnect_while_waiting_non_streamed_cancels(server):
    before = server.metrics()["unmask:request_cancellations_total"]
    body = {"model": "tiny-sdar", "messages": CHAT, "max_tokens": 3000}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=httpx.Timeout(60, read=1.0))
    assert wait_for(lambda: server.metrics()["unmask:request_cancellations_total"] == before + 1)
    assert wait_for(lambda: server.metrics()["unmask:num_requests_running"] == 0)


def test_queue_overflow_answers_429_at_once(restricted):
    body = {"messages": CHAT, "max_tokens": 3000, "stream": True}
    headers = {"Authorization": f"Bearer {KEYS[0]}"}
    with httpx.Client(base_url=restricted.url, headers=headers, timeout=60) as http:
        with http.stream("POST", "/v1/chat/completions", json=body) as running, \
                http.stream("POST", "/v1/chat/completions", json=body) as queued:
            assert running.status_code == queued.status_code == 200
            t0 = time.monotonic()
            r = http.post("/v1/chat/completions", json={**body, "stream": False})
            assert time.monotonic() - t0 < 5
            err = assert_envelope(r, 429)
            assert err["type"] == "rate_limit_error" and int(r.headers["retry-after"]) >= 1
            with pytest.raises(openai.RateLimitError):
                chat(restricted.client(KEYS[1]), model="restricted", max_tokens=4)
        assert wait_for(lambda: restricted.metrics(KEYS[0])["unmask:num_requests_running"] == 0)
        assert wait_for(lambda: restricted.metrics(KEYS[0])["unmask:num_requests_waiting"] == 0)
    assert chat(restricted.client(KEYS[1]), model="restricted", max_tokens=4).choices[0].finish_reason == "length"


# ---------------------------------------------------------------------------------------- security and errors
def test_api_keys(restricted, server):
    assert httpx.get(f"{restricted.url}/health").status_code == 200
    head = httpx.head(f"{restricted.url}/health")  # load balancers probe with HEAD too
    assert head.status_code == 200 and head.content == b""
    for key in (None, "wrong-key"):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        for path in ("/v1/models", "/metrics", "/v1/models/restricted", "/nope"):
            assert_envelope(httpx.get(f"{restricted.url}{path}", headers=headers), 401)
        assert_envelope(raw_post(restricted, "/v1/chat/completions", {"messages": CHAT}, key), 401)
        for path, body in (("/v1/responses", {"input": "hi"}), ("/tokenize", {"prompt": "hi"}),
                           ("/detokenize", {"tokens": [1]})):
            assert_envelope(raw_post(restricted, path, body, key), 401)
    assert raw_post(restricted, "/tokenize", {"prompt": "hi"}, KEYS[0]).json()["count"] > 0
    with pytest.raises(openai.AuthenticationError):
        restricted.client("wrong-key").models.list()
    for key in KEYS:
        assert [m.id for m in restricted.client(key).models.list().data] == ["restricted"]
    assert "unmask:request_errors_total" in restricted.metrics(KEYS[1])
    assert httpx.get(f"{server.url}/metrics").status_code == 200  # no keys configured: open


def test_body_and_prompt_limits(restricted):
    big = {"messages": [{"role": "user", "content": "x" * 5000}], "max_tokens": 4}
    err = assert_envelope(raw_post(restricted, "/v1/chat/completions", big, KEYS[0]), 413)
    assert "4000" in err["message"] and err["type"] == "invalid_request_error"
    long_prompt = {"prompt": "word " * 200, "max_tokens": 4}
    err = assert_envelope(raw_post(restricted, "/v1/completions", long_prompt, KEYS[0]), 400, "prompt")
    assert "64" in err["message"]
    long_input = {"input": "word " * 200, "max_output_tokens": 4}
    err = assert_envelope(raw_post(restricted, "/v1/responses", long_input, KEYS[0]), 400, "input")
    assert "64" in err["message"] and err["code"] == "context_length_exceeded"
    # capacity 2 (one running, one queued): a batch of 3 prompts is refused naming `prompt`, n = 3 naming `n`
    err = assert_envelope(raw_post(restricted, "/v1/completions", {"prompt": ["a", "b", "c"], "max_tokens": 2},
                                   KEYS[0]), 400, "prompt")
    assert "3 choices" in err["message"]
    assert_envelope(raw_post(restricted, "/v1/completions", {"prompt": "a", "n": 3, "max_tokens": 2}, KEYS[0]),
                    400, "n")


def test_cors(restricted, server):
    preflight = {"Origin": "http://allowed.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    r = httpx.options(f"{restricted.url}/v1/chat/completions", headers=preflight)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://allowed.example"
    # the OpenAI SDKs' own headers (openai-node sends x-stainless-*) pass the preflight
    sdk = {**preflight, "Access-Control-Request-Headers": "authorization,content-type,x-stainless-os,x-stainless-lang"}
    r = httpx.options(f"{restricted.url}/v1/chat/completions", headers=sdk)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://allowed.example"
    r = httpx.options(f"{restricted.url}/v1/chat/completions", headers={**preflight, "Origin": "http://evil.example"})
    assert "access-control-allow-origin" not in r.headers
    r = httpx.get(f"{server.url}/v1/models", headers={"Origin": "http://allowed.example"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers  # closed by default


@pytest.mark.parametrize("body, param", [
    (b'{"messages": [', None),
    (b"not json at all", None),
    (b"[1, 2]", None),
    ({"messages": "hello"}, "messages"),
    ({"messages": CHAT, "max_tokens": "8"}, "max_tokens"),
    ({"messages": CHAT, "temperature": "hot"}, "temperature"),
    ({"messages": CHAT, "stream": "yes"}, "stream"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages.0.content.0.type"),
    ({"messages": CHAT, "temperature": 5}, "temperature"),
    ({"messages": CHAT, "top_p": 0}, "top_p"),
    ({"messages": CHAT, "n": 0}, "n"),
    ({"messages": CHAT, "max_tokens": 0}, "max_tokens"),
    ({"messages": CHAT, "max_tokens": 10**6}, "max_tokens"),
    ({"messages": CHAT, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"messages": CHAT, "policy": "no-such-policy"}, "policy"),
    ({"messages": CHAT, "policy": "factor", "factor": 0}, "factor"),
    ({"messages": CHAT, "policy": "topk", "tokens_per_step": 0}, "tokens_per_step"),
    ({"messages": CHAT, "policy": "maskgit_plus", "alg_temp": -1}, "alg_temp"),
    ({"messages": CHAT, "policy": "credit", "credit_decay": 1.5}, "credit_decay"),
    ({"messages": CHAT, "policy": "credit", "credit_gamma": 0}, "credit_gamma"),
    ({"messages": CHAT, "policy": "credit", "credit_weight": -1}, "credit_weight"),
    ({"messages": CHAT, "threshold": 1.5}, "threshold"),
    ({"messages": CHAT, "reasoning_effort": "extreme"}, "reasoning_effort"),
    ({"messages": CHAT, "logit_bias": {"abc": 1}}, "logit_bias"),
    ({"messages": CHAT, "logit_bias": {"5": 101}}, "logit_bias"),
    ({"messages": CHAT, "logit_bias": {"99999999": 1}}, "logit_bias"),
    ({"messages": CHAT, "presence_penalty": 2.5}, "presence_penalty"),
    ({"messages": CHAT, "repetition_penalty": 0}, "repetition_penalty"),
    ({"messages": CHAT, "dry_multiplier": 11}, "dry_multiplier"),
    ({"messages": CHAT, "dry_sequence_breakers": [""]}, "dry_sequence_breakers"),
    ({"messages": CHAT, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"not": {}}}}],
      "tool_choice": "required"}, "tools[0].function.parameters"),
    ({"messages": CHAT, "response_format": {"type": "yaml"}}, "response_format"),
    ({"messages": []}, "messages"),
])
def test_invalid_requests_get_400_envelopes(server, body, param):
    assert_envelope(raw_post(server, "/v1/chat/completions", body), 400, param)


def test_unknown_fields_are_ignored(server, client):
    r = chat(client, max_tokens=4, extra_body={"some_future_field": {"x": 1}, "min_p": 0.1},
             frequency_penalty=0.0, user="someone")
    assert r.choices[0].finish_reason == "length"
    assert_envelope(raw_post(server, "/v1/completions", {"prompt": "a", "suffix": "b"}), 400, "suffix")
    assert_envelope(raw_post(server, "/v1/completions", {"prompt": []}), 400, "prompt")


def test_errors_are_counted(server):
    before = server.metrics().get("unmask:request_errors_total", 0.0)
    raw_post(server, "/v1/chat/completions", b"{")
    assert server.metrics()["unmask:request_errors_total"] == before + 1


def stub_serving(model_dir: Path, engine, generation_config: dict | None = None, **cfg):
    """In-process serving layer over a stand-in engine (no model, no HTTP)."""
    from types import SimpleNamespace

    from unmask.server.metrics import Metrics
    from unmask.server.serving import OpenAIServing, ServingConfig
    from unmask.tokenizer import Tokenizer

    spec = SimpleNamespace(max_context=4096, mask_id=151669, arch=SimpleNamespace(vocab_size=151936),
                           generation_config=generation_config or {})
    llm = SimpleNamespace(tokenizer=Tokenizer(model_dir), spec=spec)
    return OpenAIServing(llm, engine, Metrics(), ServingConfig(model_name="m", **cfg))


def step(request_id, prompt_ids, text="A"):
    from unmask.engine.outputs import StepOutput

    return StepOutput(request_id, [40] * len(text), text, False, None, len(prompt_ids), len(text), 1)


def test_engine_error_mid_stream_is_an_error_frame_then_done(model_dir):
    from unmask.engine.async_engine import EngineDeadError
    from unmask.server.protocol import ChatCompletionRequest

    class FailingEngine:
        async def generate(self, prompt_ids, params, request_id=None):
            yield step(request_id, prompt_ids, "AB")
            raise EngineDeadError("engine step failed: RuntimeError: boom")

    serving = stub_serving(model_dir, FailingEngine())

    async def frames():
        stream = await serving.chat(ChatCompletionRequest(messages=CHAT, max_tokens=8, stream=True))
        return [f async for f in stream]

    data = [f.removeprefix("data: ").strip() for f in asyncio.run(frames())]
    assert data[-1] == "[DONE]" and serving.inflight == 0
    role, content, error = (json.loads(d) for d in data[:-1])
    assert role["choices"][0]["delta"]["role"] == "assistant" and content["choices"][0]["delta"]["content"] == "AB"
    assert error["error"]["type"] == "service_unavailable_error" and "boom" in error["error"]["message"]


def test_dropped_streams_release_their_slot(model_dir, caplog):
    """A stream the web layer never reads (client gone before the first byte), or stops reading, is
    closed by the event loop's async-generator finalizer: its slot is released and its engine request ends."""
    import gc

    from unmask.server.protocol import APIError, ChatCompletionRequest

    closed = []

    class EndlessEngine:
        async def generate(self, prompt_ids, params, request_id=None):
            try:
                while True:
                    await asyncio.sleep(0.01)
                    yield step(request_id, prompt_ids)
            finally:
                closed.append(request_id)

    serving = stub_serving(model_dir, EndlessEngine(), max_num_seqs=1, max_queue=0)
    req = ChatCompletionRequest(messages=CHAT, stream=True)

    async def scenario():
        stream = await serving.chat(req)
        with pytest.raises(APIError) as full:
            await serving.chat(req)
        assert full.value.status == 429 and serving.inflight == 1
        del stream  # never iterated by the web layer
        gc.collect()
        await asyncio.sleep(0.05)
        assert serving.inflight == 0
        stream = await serving.chat(req)
        assert json.loads((await anext(stream))[6:])["choices"][0]["delta"]["role"] == "assistant"
        await anext(stream)  # a content chunk: the engine request is running
        del stream
        gc.collect()
        await asyncio.sleep(0.05)
        assert serving.inflight == 0 and len(closed) == 1

    with caplog.at_level("INFO", logger="unmask.server"):
        asyncio.run(scenario())
    assert any(r.getMessage().startswith("aborted request ") and "client went away" in r.getMessage()
               for r in caplog.records)   # as vLLM logs its aborts


def test_edit_on_a_model_that_cannot_infill_names_messages(server):
    from test_infill import NEXT_EDIT

    err = assert_envelope(raw_post(server, "/v1/edit/completions",
                                   {"messages": [{"role": "user", "content": NEXT_EDIT}], "max_tokens": 8}),
                          400, "messages")
    assert "fill in the middle" in err["message"] or "fill-in-the-middle" in err["message"]


def test_requests_past_the_drain_timeout_end_with_a_503(model_dir, tmp_path):
    """When --drain-timeout runs out, open requests are aborted by the engine before uvicorn would cancel them:
    a stream ends with an error frame and [DONE], a plain request gets the 503 envelope (not a cut connection
    and a bare 500)."""
    from concurrent.futures import ThreadPoolExecutor

    srv = Server(model_dir, tmp_path / "drain.log", "--drain-timeout", "0.5").wait_ready()
    body = {"model": "tiny-sdar", "messages": CHAT, "max_tokens": 3000, "ignore_eos": True}
    url = f"{srv.url}/v1/chat/completions"
    try:
        with ThreadPoolExecutor(1) as pool, httpx.stream("POST", url, json={**body, "stream": True},
                                                         timeout=60) as streamed:
            lines = (line for line in streamed.iter_lines() if line.startswith("data: "))
            assert json.loads(next(lines)[6:])["choices"][0]["delta"]["role"] == "assistant"
            plain = pool.submit(httpx.post, url, json=body, timeout=60)
            time.sleep(0.5)
            srv.proc.send_signal(signal.SIGTERM)
            rest = list(lines)
            answer = plain.result()
        assert rest[-1] == "data: [DONE]"
        assert "shutting down" in json.loads(rest[-2][6:])["error"]["message"]
        assert answer.status_code == 503 and "shutting down" in answer.json()["error"]["message"]
        assert srv.proc.wait(30) in (0, -signal.SIGTERM)
    finally:
        srv.stop()


# ------------------------------------------------------------------------------ shutdown (last: stops the server)
def test_graceful_shutdown_drains_running_streams(server, client):
    stream = chat(client, max_tokens=120, stream=True, stream_options={"include_usage": True})
    first = next(iter(stream))
    assert first.choices[0].delta.role == "assistant"
    server.proc.send_signal(signal.SIGTERM)
    rest = list(stream)
    assert [c.choices[0].finish_reason for c in rest if c.choices and c.choices[0].finish_reason] == ["length"]
    assert rest[-1].usage.completion_tokens == 120
    assert server.proc.wait(30) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal it handled


def test_chat_requests_take_the_models_chat_defaults_and_completions_do_not(model_dir):
    from unmask.engine.outputs import StepOutput
    from unmask.server.protocol import ChatCompletionRequest, CompletionRequest

    seen = []

    class RecordingEngine:
        async def generate(self, prompt_ids, params, request_id=None):
            seen.append(params)
            yield StepOutput(request_id, [40], "A", True, "stop", len(prompt_ids), 1, 1)

    gen = {"repetition_penalty": 1.1, "chat_defaults": {"frequency_penalty": 0.3}}
    serving = stub_serving(model_dir, RecordingEngine(), generation_config=gen)
    asyncio.run(serving.chat(ChatCompletionRequest(messages=CHAT, max_tokens=4)))
    asyncio.run(serving.completion(CompletionRequest(prompt="hi", max_tokens=4)))
    asyncio.run(serving.chat(ChatCompletionRequest(messages=CHAT, max_tokens=4, frequency_penalty=0.0)))
    assert [(p.frequency_penalty, p.repetition_penalty) for p in seen] == [(0.3, 1.1), (0.0, 1.1), (0.0, 1.1)]



def test_the_chat_template_is_loaded_before_the_server_says_ready(family_dirs, monkeypatch):
    """Rendering a template loads the tokenizer that carries it (0.9 s with the built-in model on 2 cores):
    the loader does it before publishing the engine, not the first chat request. A template that refuses the
    warm-up conversation is logged and the server still loads."""
    import unmask.tokenizer
    from unmask.server.app import ServerArgs, create_app, load_serving

    calls = []
    original = unmask.tokenizer.Tokenizer.apply_chat_template
    monkeypatch.setattr(unmask.tokenizer.Tokenizer, "apply_chat_template",
                        lambda self, messages, *a, **kw: calls.append(messages) or original(self, messages, *a, **kw))
    for template in (None, "{{ raise_exception('a system message is required') }}"):
        calls.clear()
        args = ServerArgs(model=family_dirs["sdar"], served_model_name="m", chat_template=template)
        app = create_app(args)
        load_serving(app, args)  # what the lifespan's loader thread runs
        assert app.state.load_error is None and app.state.serving is not None
        assert calls == [[{"role": "user", "content": "warm-up"}]]
