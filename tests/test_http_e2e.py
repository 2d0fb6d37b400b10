"""The OpenAI-compatible HTTP API of the running Serve application (tiny pair), with the
official `openai` client as the peer."""

from __future__ import annotations

import json
import socket
import time
from urllib.parse import urlparse

import openai
import pytest
from ray import serve

from test_openai_api import assert_chat_body, assert_completion_body

pytestmark = pytest.mark.ray  # starts Ray (deselect with -m 'not ray')



@pytest.fixture(scope="module")
def base_url(ray_serve, serve_tiny_app):
    return ray_serve


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


def test_completion_and_seed_over_http(client):
    kwargs = dict(model="tiny", prompt="def add(a, b):", max_tokens=12, temperature=0.7, seed=5)
    first = client.completions.create(**kwargs)
    second = client.completions.create(**kwargs)
    assert first.choices[0].text == second.choices[0].text
    body = first.model_dump()
    assert_completion_body(body, "tiny")
    assert body["seed"] == 5 and body["speculation"]["proposed"] > 0
    assert first.usage.completion_tokens <= 12


def test_the_default_mode_gives_a_seed_its_target_only_text(client):
    """The deployment's default (drafter-invariant): a seeded sampled completion is the
    target-only completion of its seed; asking for standard sampling changes some texts."""
    def texts(**extra):
        return [client.completions.create(
            model="tiny", prompt="def add(a, b):", max_tokens=12, temperature=1.0, seed=seed,
            extra_body={"ignore_eos": True, **extra}).choices[0].text for seed in range(4)]

    target_only = texts(num_speculative_tokens=0)
    assert texts() == target_only
    assert texts(drafter_invariant=False) != target_only


def test_chat_completion(client):
    reply = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Write a haiku about caches."}],
        max_tokens=10,
        temperature=0,
    )
    assert_chat_body(reply.model_dump(), "tiny")
    assert reply.choices[0].message.role == "assistant"


def test_streaming_completion_and_chat_match_non_streaming(client):
    kwargs = dict(model="tiny", prompt="import numpy as np", max_tokens=10, temperature=0.9, seed=11)
    whole = client.completions.create(**kwargs).choices[0].text
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens <= 10

    messages = [{"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, seed=3, temperature=1.0)
    streamed = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=8, seed=3, temperature=1.0, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == chat.choices[0].message.content


def test_errors_are_openai_shaped_4xx(client):
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="tiny", prompt="x", top_p=3.0)
    assert "top_p" in str(bad.value)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x")
    with pytest.raises(openai.BadRequestError) as long:
        client.completions.create(model="tiny", prompt="x", max_tokens=10**7)
    assert "context" in str(long.value)


def cache_sequences(app: str = "tiny") -> tuple[int, int]:
    draft = serve.get_deployment_handle("Draft", app_name=app).cache_usage.remote().result()
    target = serve.get_deployment_handle("Target", app_name=app).cache_usage.remote().result()
    return draft["sequences"], target["sequences"]


def test_disconnect_cancels_and_frees_the_caches(base_url):
    """Clients that hang up mid-stream: their requests stop and both pools drop them."""
    baseline = cache_sequences()
    url = urlparse(base_url)
    body = json.dumps({"model": "tiny", "prompt": "def long_function():", "max_tokens": 400,
                       "ignore_eos": True, "stream": True}).encode()
    request = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {url.hostname}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    for _ in range(5):
        with socket.create_connection((url.hostname, url.port), timeout=30) as sock:
            sock.sendall(request)
            received = b""
            while b"data:" not in received:  # wait until streaming has started
                chunk = sock.recv(4096)
                assert chunk, "the server closed the stream"
                received += chunk
            time.sleep(0.2)
        # closing the socket mid-stream is the disconnect
    def freed() -> bool:
        return all(now <= before for now, before in zip(cache_sequences(), baseline))

    deadline = time.time() + 30
    while not freed() and time.time() < deadline:
        time.sleep(0.5)
    assert freed(), (cache_sequences(), baseline)
