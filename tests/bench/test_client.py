"""The streaming client against a scripted server with known TTFT and TPOT."""

import socket

import numpy as np
import pytest

from tokenmill.cli import main

from .fake_server import Script
from .helpers import run_bench

BATCH = "batch:prompt=16,output=6,spread=0"


def test_measures_scripted_ttft_tpot_itl(fake_server, tmp_path):
    server = fake_server(Script(ttft_s=0.08, tpot_s=0.02))
    rc, result, rows = run_bench(server.url, tmp_path, "--workload", BATCH, "--concurrency", "1",
                                 "--num-requests", "4")
    assert rc == 0 and len(rows) == 4
    for row in rows:
        assert row["status"] == "ok" and row["output_tokens"] == 6 and row["output_tokens_from_usage"]
        assert row["ttft_s"] >= 0.08  # the server sleeps that long after receiving the request
        assert len(row["itl_s"]) == 5
        assert row["tpot_s"] == pytest.approx((row["e2e_s"] - row["ttft_s"]) / 5)
    # medians: a shared 2-core machine stalls a chunk now and then
    slack = 0.03
    assert 0.08 <= np.median([r["ttft_s"] for r in rows]) <= 0.08 + slack
    assert 0.018 <= np.median([r["tpot_s"] for r in rows]) <= 0.02 + slack
    assert 0.018 <= np.median([g for r in rows for g in r["itl_s"]]) <= 0.02 + slack
    s = result["summary"]
    assert s["completed"] == 4 and s["output_tokens"] == 24 and s["prompt_tokens"] == 64
    assert s["ttft_ms"]["p50"] == pytest.approx(1000 * float(np.median([r["ttft_s"] for r in rows])))
    assert s["tpot_ms"]["mean"] == pytest.approx(1000 * float(np.mean([r["tpot_s"] for r in rows])))


def test_output_tokens_from_usage_else_chunks(fake_server, tmp_path):
    with_usage = fake_server(Script(tokens_per_chunk=3))
    without = fake_server(Script(tokens_per_chunk=3, send_usage=False))
    _, _, rows = run_bench(with_usage.url, tmp_path / "a", "--workload", BATCH, "--concurrency", "1",
                           "--num-requests", "2")
    assert [(r["output_tokens"], r["output_tokens_from_usage"]) for r in rows] == [(6, True)] * 2
    _, _, rows = run_bench(without.url, tmp_path / "b", "--workload", BATCH, "--concurrency", "1",
                           "--num-requests", "2")
    assert [(r["output_tokens"], r["output_tokens_from_usage"]) for r in rows] == [(2, False)] * 2


def test_rejections_counted_apart_from_failures(fake_server, tmp_path):
    server = fake_server(Script(reject_every=3, fail_every=5))  # 429 for #3, #6, #9; 500 for #5, #10
    rc, result, rows = run_bench(server.url, tmp_path, "--workload", BATCH, "--concurrency", "1",
                                 "--num-requests", "10")
    s = result["summary"]
    assert (s["requests"], s["completed"], s["rejected"], s["failed"], s["good"]) == (10, 5, 3, 2, 5)
    assert s["slo_attainment"] == pytest.approx(0.5)
    assert sorted(r["http_status"] for r in rows if r["status"] == "rejected") == [429] * 3
    assert any("boom" in w for w in result["warnings"])


def test_request_body_token_ids_and_class_header(fake_server, tmp_path, tokenizer_dir):
    server = fake_server()
    _, result, rows = run_bench(server.url, tmp_path, "--workload", "batch:prompt=40,output=3",
                                "--tokenizer", str(tokenizer_dir), "--concurrency", "1", "--num-requests", "3")
    assert result["target"]["prompt_format"] == "tokens" and result["tokenizer"]["kind"] == "exact"
    by_digest = {r["digest"]: r for r in rows}
    for seen in server.seen:
        body = seen.body
        assert body["stream"] and body["stream_options"] == {"include_usage": True} and body["ignore_eos"]
        assert body["model"] == "fake-model" and seen.headers["x-tokenmill-class"] == "batch"
        assert all(isinstance(t, int) for t in body["prompt"])
    assert [len(s.body["prompt"]) for s in server.seen] == [r["prompt_tokens"] for r in rows]
    assert [s.body["max_tokens"] for s in server.seen] == [r["max_tokens"] for r in rows]
    assert len(by_digest) == 3


def test_chat_role_chunk_is_not_the_first_token(fake_server, tmp_path):
    server = fake_server(Script(ttft_s=0.1, role_chunk=True))
    _, result, rows = run_bench(server.url, tmp_path, "--workload", "chat:think_s=0,turns_min=2,turns_max=2",
                                "--endpoint", "chat", "--concurrency", "1", "--num-requests", "2")
    assert all(r["ttft_s"] >= 0.1 for r in rows)
    roles = [[m["role"] for m in s.body["messages"]] for s in server.seen]
    assert roles == [["user"], ["user", "assistant", "user"]]
    assert server.seen[1].body["messages"][0] == server.seen[0].body["messages"][0]


def test_prefix_cache_hit_rate_from_usage(fake_server, tmp_path):
    server = fake_server(Script(cached_tokens=4))
    _, result, _ = run_bench(server.url, tmp_path, "--workload", BATCH, "--concurrency", "2", "--num-requests", "4")
    s = result["summary"]
    assert s["cached_tokens"] == 16 and s["usage_prompt_tokens"] == 64
    assert s["prefix_cache_hit_rate"] == pytest.approx(0.25)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("args, message", [
    (["--workload", "nope", "--rate", "1"], "unknown workload"),
    (["--workload", "chat:turns=3", "--rate", "1"], "unknown parameter 'turns'"),
    (["--workload", "chat:prompt=abc", "--rate", "1"], "not a valid int"),
    (["--workload", "chat:turns_min=4,turns_max=2", "--rate", "1"], "turns_min"),
    (["--workload", "trace:/no/such/file.jsonl"], "not found"),
    (["--workload", "chat"], "give the load"),
    (["--rate", "0"], "--rate must be > 0"),
    (["--rate", "1", "--slo", "interactive:ttft=fast"], "not a number"),
    (["--rate", "1", "--slo", "interactive:latency=5"], "KEY one of ttft, tpot, e2e"),
    (["--sweep", "--concurrency", "2"], "cannot be combined"),
    (["--rate", "1", "--model", "other"], "is not served"),
    (["--rate", "1", "--tokenizer", "/nonexistent"], "no tokenizer.json"),
])
def test_bad_input_is_one_line_error(fake_server, tmp_path, capsys, args, message):
    server = fake_server()
    rc = main(["bench", "--target", server.url, "--out", str(tmp_path), "--no-progress", *args])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("tokenmill bench: error:") and message in err and "\n" not in err


def test_unreachable_target_is_one_line_error(tmp_path, capsys):
    rc = main(["bench", "--target", f"http://127.0.0.1:{_closed_port()}", "--rate", "1", "--out", str(tmp_path)])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "cannot reach --target" in err and "\n" not in err
