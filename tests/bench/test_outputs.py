"""result.json keeps its documented fields; the plan is deterministic for a seed; plots are written."""

import pytest

from .fake_server import Script
from .helpers import run_bench

TOP = {"schema_version", "command", "target", "tokenizer", "workload", "seed", "slos", "load", "plan_digest",
       "summary", "classes", "sweep", "warnings", "environment"}
SUMMARY = {"requests", "completed", "rejected", "failed", "good", "slo_attainment", "duration_s",
           "request_throughput", "input_throughput", "output_throughput", "goodput", "goodput_output_throughput",
           "prompt_tokens", "output_tokens", "usage_prompt_tokens", "cached_tokens", "prefix_cache_hit_rate",
           "ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "send_lag_ms"}
DIST = {"count", "mean", "p50", "p90", "p99", "max"}


@pytest.mark.slow
def test_result_schema_plots_and_determinism(fake_server, tmp_path):
    server = fake_server(Script(ttft_s=0.005, cached_tokens=2))
    args = ["--workload", "chat:think_s=0.01,output=8@1", "--workload", "batch:output=8@1", "--rate", "40",
            "--num-requests", "12",
            "--slo", "interactive:ttft=500,tpot=50", "--slo", "batch:e2e=9000"]
    rc, a, rows_a = run_bench(server.url, tmp_path / "a", *args, "--seed", "1", plots=True)
    _, b, rows_b = run_bench(server.url, tmp_path / "b", *args, "--seed", "1")
    _, c, _ = run_bench(server.url, tmp_path / "c", *args, "--seed", "2")
    assert rc == 0
    assert set(a) == TOP and a["schema_version"] == 1 and a["sweep"] is None
    assert set(a["summary"]) == SUMMARY and set(a["summary"]["ttft_ms"]) == DIST
    assert set(a["classes"]) == {"interactive", "batch"}
    assert {"cpu_model", "cpu_flags", "native_bf16", "native_int8"} <= set(a["environment"]["client"])
    assert a["slos"]["interactive"] == {"ttft_ms": 500.0, "tpot_ms": 50.0, "e2e_ms": None}
    assert a["slos"]["batch"] == {"ttft_ms": None, "tpot_ms": None, "e2e_ms": 9000.0}
    assert a["load"] == {"mode": "rate", "rate": 40.0, "concurrency": None, "arrival": "poisson",
                         "burstiness": 1.0, "duration_s": None, "num_requests": 12}
    # same seed: the same requests at the same times; another seed: others
    assert a["plan_digest"] == b["plan_digest"] != c["plan_digest"]
    key = lambda r: (r["request_id"], r["digest"], r["scheduled_s"] if r["turn"] == 0 else None)  # noqa: E731
    assert sorted(map(key, rows_a)) == sorted(map(key, rows_b))
    for name in ["latency_cdf.png", "ttft_over_time.png"]:
        assert (tmp_path / "a" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (tmp_path / "a" / "summary.md").read_text()
    assert "| interactive | 500 / 50 |" in md and "approximate" in md and "Goodput" in md


def test_warns_when_planned_requests_exceed_the_servers_max_model_len(fake_server, tmp_path):
    server = fake_server(Script(max_model_len=100))
    # chat prompts of ~64 tokens + 48 output: all over 100; the fake server answers them anyway
    rc, res, rows = run_bench(server.url, tmp_path / "a", "--workload", "chat:prompt=64,output=48",
                              "--rate", "50", "--num-requests", "6")
    over = [w for w in res["warnings"] if "max_model_len 100" in w]
    n_over = sum(r["prompt_tokens"] + r["max_tokens"] > 100 for r in rows)
    assert n_over > 0 and over and over[0].split(": ", 1)[1].startswith(f"{n_over} of 6 requests"), res["warnings"]
    rc, res, _ = run_bench(fake_server(Script(max_model_len=100_000)).url, tmp_path / "b", "--workload",
                           "chat:prompt=64,output=48", "--rate", "50", "--num-requests", "6")
    assert not [w for w in res["warnings"] if "max_model_len" in w]


def test_a_missing_plotting_library_never_loses_the_results(fake_server, tmp_path, monkeypatch, capsys):
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.split(".")[0] == "matplotlib":
            raise ModuleNotFoundError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    rc, res, rows = run_bench(fake_server(Script()).url, tmp_path / "a", "--workload", "chat:output=8",
                              "--rate", "50", "--num-requests", "4", plots=True)
    assert rc == 0 and res["summary"]["completed"] == 4 and len(rows) == 4
    assert (tmp_path / "a" / "summary.md").is_file() and not (tmp_path / "a" / "latency_cdf.png").exists()
    assert "plots skipped (No module named 'matplotlib')" in capsys.readouterr().err
