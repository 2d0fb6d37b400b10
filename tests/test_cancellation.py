"""Cancellation and a bounded load check (the CI variant of scripts/soak.py),
on the tiny pair through Serve's HTTP proxy.

500 clients hang up at random points: in the middle of sending the body, right after
sending it, while the answer is being generated (non-streaming), after k streamed events,
some with a TCP reset instead of a close. Every request asks for 800-1500 tokens with
ignore_eos, so a request that kept running after its client left would hold its caches for
minutes: the draft and target caches must be back at their baseline (sequences and tokens)
within seconds of the last disconnect, the service must still answer, a seeded request must
give the text it gave before, and the replicas' memory must not have grown beyond a margin.
"""

from __future__ import annotations

import importlib.util
import json
import random
import socket
import struct
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlparse

import pytest
from ray import serve

pytestmark = pytest.mark.ray  # starts Ray (deselect with -m 'not ray')


APP = "tiny"  # serve_tiny_app: the tiny pair at route "/"
DISCONNECTS = 500
MODES = ("partial_body", "after_send", "during", "mid_stream", "reset")


def _soak_module():
    path = Path(__file__).resolve().parents[1] / "scripts" / "soak.py"
    spec = importlib.util.spec_from_file_location("soak", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["soak"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


soak = _soak_module()


@pytest.fixture(scope="module")
def base_url(ray_serve, serve_tiny_app):
    return ray_serve


def cache_usage(app: str = APP) -> dict:
    return {
        side: serve.get_deployment_handle(side, app_name=app).cache_usage.remote().result()
        for side in ("Draft", "Target")
    }


def _key(usage: dict) -> tuple:
    return tuple((usage[s]["sequences"], usage[s]["tokens"]) for s in ("Draft", "Target"))


def wait_for_baseline(baseline: dict, timeout_s: float) -> tuple[bool, float, dict]:
    started = time.monotonic()
    while True:
        now = cache_usage()
        if all(a <= b for a, b in zip(_flat(now), _flat(baseline))):
            return True, time.monotonic() - started, now
        if time.monotonic() - started > timeout_s:
            return False, time.monotonic() - started, now
        time.sleep(0.25)


def _flat(usage: dict) -> tuple:
    return tuple(x for pair in _key(usage) for x in pair)


def settle(timeout_s: float = 30) -> dict:
    """The caches once earlier tests' fire-and-forget releases have landed."""
    previous, deadline = None, time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        now = cache_usage()
        if now == previous and _flat(now)[0] == 0 and _flat(now)[2] == 0:
            break
        previous = now
        time.sleep(0.5)
    return cache_usage()


def _request_bytes(host: str, port: int, rng: random.Random, stream: bool) -> bytes:
    if rng.random() < 0.5:
        path, body = "/v1/completions", {"prompt": rng.choice(soak.PROMPTS)}
    else:
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": rng.choice(soak.PROMPTS)}]}
    body |= {"model": APP, "max_tokens": rng.randint(800, 1500), "ignore_eos": True,
             "temperature": rng.choice([0.0, 0.8]), "seed": rng.randrange(1 << 30), "stream": stream}
    data = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode()
    return head + data


def disconnect_once(host: str, port: int, seed: int) -> str:
    """One client that hangs up at a random point; returns what it did (mode, streamed)."""
    rng = random.Random(seed)
    mode = MODES[seed % len(MODES)]
    stream = rng.random() < 0.5 if mode != "mid_stream" else True
    request = _request_bytes(host, port, rng, stream)
    sock = socket.create_connection((host, port), timeout=60)
    try:
        if mode == "partial_body":
            sock.sendall(request[: rng.randint(len(request) // 3, len(request) - 1)])
            time.sleep(rng.random() * 0.05)
            return f"{mode}"
        sock.sendall(request)
        if mode == "after_send":
            return f"{mode}"
        if mode == "mid_stream":
            want, seen, buf = rng.randint(1, 8), 0, b""
            while seen < want:
                chunk = sock.recv(4096)
                if not chunk:
                    raise AssertionError(f"server closed the stream early: {buf[-300:]!r}")
                buf += chunk
                seen = buf.count(b"data:")
            return f"{mode}:{want}"
        time.sleep(rng.random() * 0.6)  # "during" and "reset": while the answer is generated
        if mode == "reset":  # SO_LINGER 0: close sends RST, not FIN
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        return f"{mode}:{'stream' if stream else 'whole'}"
    finally:
        sock.close()


def rss_of(app: str = APP) -> dict[str, float]:
    return {name: soak.rss_mib(pid) for name, pid in soak.replica_pids(app).items()}


def seeded_text(base_url: str) -> str:
    import urllib.request

    body = json.dumps({"model": APP, "prompt": "def add(a, b):", "max_tokens": 24, "temperature": 0.8,
                       "top_p": 0.95, "seed": 77, "ignore_eos": True}).encode()
    req = urllib.request.Request(base_url + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.load(resp)["choices"][0]["text"]


def test_random_disconnects_free_every_cache(base_url):
    url = urlparse(base_url)
    text_before = seeded_text(base_url)

    def storm(seeds) -> list[str]:
        with ThreadPoolExecutor(max_workers=8) as pool:
            return list(pool.map(lambda s: disconnect_once(url.hostname, url.port, s), seeds))

    storm(range(DISCONNECTS, DISCONNECTS + 50))  # warm-up: first-use allocations are no leak
    baseline = settle()
    rss_before = rss_of()
    started = time.monotonic()
    done = storm(range(DISCONNECTS))
    storm_s = time.monotonic() - started
    peak = cache_usage()
    freed, wait_s, after = wait_for_baseline(baseline, timeout_s=60)
    rss_after = rss_of()
    counts = {m: sum(d.startswith(m) for d in done) for m in MODES}
    print(f"{len(done)} disconnects in {storm_s:.1f}s {counts}; caches baseline {_key(baseline)}, "
          f"right after {_key(peak)}, back to {_key(after)} in {wait_s:.1f}s; "
          f"RSS MiB before {rss_before} after {rss_after}")
    assert len(done) == DISCONNECTS
    assert freed, f"caches not back to baseline: {_key(after)} vs {_key(baseline)}"
    # Unstopped requests would hold their caches for minutes (800-1500 tokens each).
    assert wait_s < 30, wait_s
    assert seeded_text(base_url) == text_before
    for name, before in rss_before.items():
        if name in rss_after and before and rss_after[name]:
            assert rss_after[name] - before < 100, (name, before, rss_after[name])


def test_bounded_load(base_url):
    """16 clients for 20 s: no error but 429/503 backpressure, replica memory flat."""
    result = soak.soak(base_url, APP, APP, clients=16, duration_s=20, rss_interval=2, warmup_s=6,
                       grace_s=30, max_tokens=(8, 48), timeout_s=60)
    summary = {k: result[k] for k in ("requests_sent", "ok", "statuses", "errors", "stream_errors",
                                      "throughput_req_s", "throughput_tok_s", "latency_s", "rss")}
    print("bounded load:", json.dumps(summary))
    assert result["ok"] > 0
    assert not result["errors"] and not result["stream_errors"], result["examples"]
    assert result["cut_at_deadline"] == 0
    for name, r in result["rss"].items():
        assert r["growth_after_warmup_mib"] < 64 + 0.1 * r["after_warmup_mib"], (name, r)
