"""Two `tokenmill serve` processes sharing a host KV tier and a disk directory: a prompt served by one is a
tier hit on the other (same tokens); with every tier file corrupted both keep serving the same tokens,
count the corrupt blocks in /metrics, and report the tiers' capacity at start-up."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n" * 4


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from tokenmill.model.make import make_model

    return str(make_model("tiny", tmp_path_factory.mktemp("tiny"), seed=0))


def serve(tiny_dir, host, disk):
    p = subprocess.Popen([sys.executable, "-m", "tokenmill", "serve", "--model", tiny_dir, "--port", "0",
                          "--kv-cache-bytes", "16MiB", "--max-model-len", "512", "--dtype", "float32",
                          "--kv-host-bytes", "8MiB", "--kv-host-dir", host, "--kv-disk-dir", disk,
                          "--kv-disk-bytes", "8MiB"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = [p.stdout.readline(), p.stdout.readline()]
    m = re.search(r"http://[\d.]+:\d+", lines[0])
    assert m, lines
    assert re.search(r"host tier .* \d+ tokens", lines[1]) and re.search(r"disk tier .* \d+ tokens", lines[1]), lines
    p.url = m.group(0)
    p.client = openai.OpenAI(base_url=p.url + "/v1", api_key="none", max_retries=0)
    return p


def tier_metric(p, name, tier):
    text = urllib.request.urlopen(p.url + "/metrics", timeout=10).read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and s.labels.get("tier") == tier)


def engine_metric(p, name):
    text = urllib.request.urlopen(p.url + "/metrics", timeout=10).read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def wait_written(p, min_stores=1, timeout_s=10.0):
    """Until p's tier writer has no block queued (and has stored at least min_stores blocks)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (engine_metric(p, "tokenmill_kv_tier_pending_writes") == 0
                and tier_metric(p, "tokenmill_kv_tier_stores_total", "host") >= min_stores):
            return
        time.sleep(0.02)
    raise AssertionError("the tier writes were not done in time")


def complete(p, prompt):
    r = p.client.completions.create(model=p.client.models.list().data[0].id, prompt=prompt, max_tokens=8,
                                    temperature=0, extra_body={"ignore_eos": True})
    return r.choices[0].text, r.usage.prompt_tokens_details.cached_tokens, r.usage.prompt_tokens


@pytest.mark.slow
def test_two_servers_share_tiers_and_survive_corruption(tiny_dir, tmp_path):
    host, disk = str(tmp_path / "host"), str(tmp_path / "disk")
    a = serve(tiny_dir, host, disk)
    b = None
    try:
        b = serve(tiny_dir, host, disk)
        text_a, cached_a, n = complete(a, PROMPT)
        assert cached_a == 0
        wait_written(a)  # write-through runs on a's writer thread: b can hit once the queue is empty
        text_b, cached_b, _ = complete(b, PROMPT)  # b's pool has never seen it: the shared tier has
        assert text_b == text_a and cached_b == (n - 1) // 16 * 16 > 0
        assert tier_metric(b, "tokenmill_kv_tier_hits_total", "host") > 0

        ref, _, _ = complete(a, PROMPT + "# more\n")
        wait_written(a)
        wait_written(b, min_stores=0)
        for d in (host, disk):  # every stored block damaged: each is a miss, recomputed
            for f in os.listdir(d):
                if f.endswith(".kv"):
                    path = os.path.join(d, f)
                    data = bytearray(open(path, "rb").read())
                    data[-1] ^= 0xFF
                    open(path, "wb").write(bytes(data))
        c = serve(tiny_dir, host, disk)  # a fresh worker (empty pool) on the damaged tiers
        try:
            text_c, cached_c, _ = complete(c, PROMPT + "# more\n")
            assert text_c == ref and cached_c == 0
            assert tier_metric(c, "tokenmill_kv_tier_corrupt_blocks_total", "host") > 0
            assert complete(c, PROMPT + "# more\n")[0] == ref  # still serving, now from its pool
        finally:
            c.send_signal(signal.SIGINT)
            assert c.wait(20) == 0
    finally:
        for p in (a, b):
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGINT)
                try:
                    p.wait(20)
                except subprocess.TimeoutExpired:
                    p.kill()
