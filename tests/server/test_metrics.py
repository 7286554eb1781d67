"""/metrics parses with prometheus_client, carries the vLLM names, and its counters move by the right amounts."""

from __future__ import annotations

import openai
from prometheus_client.parser import text_string_to_metric_families

VLLM = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:gpu_cache_usage_perc": "gauge",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:num_preemptions": "counter",
    "vllm:request_success": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:time_per_output_token_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram",
    "vllm:request_inference_time_seconds": "histogram",
}


def scrape(server) -> dict:
    """{(sample name, frozenset(labels)): value} and {family name: type}."""
    status, headers, text = server.get("/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    samples, types = {}, {}
    for fam in text_string_to_metric_families(text):
        types[fam.name] = fam.type
        for s in fam.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return samples, types


def value(samples, name, **labels):
    want = set(labels.items())
    return sum(v for (n, lab), v in samples.items() if n == name and want <= set(lab))


def test_vllm_names_and_types(fake_server):
    fake_server.post("/v1/completions", {"prompt": "x", "max_tokens": 2})
    samples, types = scrape(fake_server)
    for name, kind in VLLM.items():
        assert types.get(name) == kind, name
    assert value(samples, "vllm:num_requests_running", model_name="fake", engine="0") == 0
    assert ("vllm:request_success_total", frozenset({("model_name", "fake"), ("engine", "0"),
                                                     ("finished_reason", "length")})) in samples
    assert types.get("tokenmill_kv_usage_ratio") == "gauge"
    from tokenmill.hardware import capabilities

    hw = capabilities()
    assert value(samples, "tokenmill_hardware_info", cpu_flags=" ".join(hw.cpu_flags),
                 native_bf16=str(hw.native_bf16).lower()) == 1
    assert types.get("tokenmill_batch_invariant") == "gauge"  # the fake engine's stats: off
    assert value(samples, "tokenmill_batch_invariant", model_name="fake") == 0
    assert not any(n.endswith("_created") for n, _ in samples)


def test_counters_move_by_the_right_amounts(fake_server):
    c = openai.OpenAI(base_url=fake_server.url + "/v1", api_key="none", max_retries=0)
    before, _ = scrape(fake_server)
    r1 = c.completions.create(model="fake", prompt="the same prompt, long enough for some blocks", max_tokens=7)
    r2 = c.completions.create(model="fake", prompt="the same prompt, long enough for some blocks", max_tokens=5,
                              stop=["never"])
    chunks = list(c.completions.create(model="fake", prompt="stream", max_tokens=4, stream=True))
    after, _ = scrape(fake_server)

    def delta(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    prompt = r1.usage.prompt_tokens + r2.usage.prompt_tokens + len(fake_server.engine.tokenizer.encode("stream"))
    assert delta("vllm:prompt_tokens_total") == prompt
    assert delta("vllm:generation_tokens_total") == 7 + 5 + 4
    assert delta("vllm:request_success_total", finished_reason="length") == 3
    assert delta("vllm:prefix_cache_queries_total") == prompt
    assert r2.usage.prompt_tokens_details.cached_tokens > 0
    assert delta("vllm:prefix_cache_hits_total") == r2.usage.prompt_tokens_details.cached_tokens
    assert delta("vllm:time_to_first_token_seconds_count") == 3
    assert delta("vllm:e2e_request_latency_seconds_count") == 3
    assert delta("vllm:inter_token_latency_seconds_count") == (7 - 1) + (5 - 1) + (4 - 1)
    assert delta("vllm:request_generation_tokens_sum") == 16
    assert delta("tokenmill_generation_tokens_total") == 16
    assert len(chunks) == 4
    # the phases: waiting + running = e2e, prefill + decode = running, for every request
    for phase in ("queue", "prefill", "decode", "inference"):
        assert delta(f"vllm:request_{phase}_time_seconds_count") == 3, phase
    e2e = delta("vllm:e2e_request_latency_seconds_sum")
    queue, run = delta("vllm:request_queue_time_seconds_sum"), delta("vllm:request_inference_time_seconds_sum")
    assert abs(queue + run - e2e) < 1e-6 and run > 0 and queue >= 0
    prefill, decode = delta("vllm:request_prefill_time_seconds_sum"), delta("vllm:request_decode_time_seconds_sum")
    assert abs(prefill + decode - run) < 1e-6 and decode > 0


def test_cached_tokens_equals_engine_prefix_hit(fake_server):
    prompt = "a repeated prompt " * 8
    before = fake_server.state()["stats"]["prefix_cache_hits_tokens"]
    first = fake_server.post("/v1/completions", {"prompt": prompt, "max_tokens": 2})[2]
    mid = fake_server.state()["stats"]["prefix_cache_hits_tokens"]
    second = fake_server.post("/v1/completions", {"prompt": prompt, "max_tokens": 2})[2]
    after = fake_server.state()["stats"]["prefix_cache_hits_tokens"]
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == mid - before == 0
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == after - mid and cached > 0


def test_overload_and_invalid_are_counted(make_server):
    s = make_server()
    s.post("/v1/completions", {"prompt": "x", "max_tokens": 0})
    samples, _ = scrape(s)
    assert value(samples, "tokenmill_requests_rejected_total", reason="invalid") == 1
