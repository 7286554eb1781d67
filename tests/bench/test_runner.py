"""Load drivers against the scripted server: sessions wait for replies, closed loops cap concurrency."""

import asyncio

from tokenmill.bench.client import Client, ClientConfig, Clock
from tokenmill.bench.progress import Progress
from tokenmill.bench.runner import LoadConfig, run_load, schedule
from tokenmill.bench.tokenizer import approximate_vocab
from tokenmill.bench.workloads import make_workload

from .fake_server import Script


def drive(url, spec, load, seed=0):
    vocab = approximate_vocab()
    workload = make_workload(spec, vocab, seed)

    async def go():
        async with Client(ClientConfig(url, "fake-model"), vocab, Clock()) as client:
            return await run_load(client, schedule(workload, load, seed), load, Progress(None, None, enabled=False))

    return workload, asyncio.run(go())


def test_session_turn_waits_for_reply_plus_think_time(fake_server):
    server = fake_server(Script(ttft_s=0.03, tpot_s=0.005))
    spec = "agent:system=32,repo=64,task=8,tool=16,output=4,turns_min=3,turns_max=3,think_s=0.05"
    workload, records = drive(server.url, spec, LoadConfig("rate", rate=30.0, num_requests=12))
    by_id = {r.request_id: r for r in records}
    assert len(records) == 12 and all(r.ok for r in records)
    for rec in records:
        if rec.turn:
            prev = by_id[f"{rec.session}-{rec.turn - 1}"]
            think = workload.session(rec.session).turns[rec.turn].think_s
            assert rec.sent_s >= prev.end_s + think - 1e-3
            assert rec.scheduled_s >= prev.end_s + think - 1e-3


def test_a_rejected_turn_ends_its_session(fake_server):
    server = fake_server(Script(reject_every=2))
    _, records = drive(server.url, "chat:turns_min=3,turns_max=3,think_s=0", LoadConfig("concurrency", concurrency=1,
                                                                                         num_requests=9))
    by_session: dict[int, list] = {}
    for rec in records:
        by_session.setdefault(rec.session, []).append(rec)
    for recs in by_session.values():
        statuses = [r.status for r in sorted(recs, key=lambda r: r.turn)]
        assert "rejected" not in statuses[:-1]  # nothing is sent after a rejection
    assert any(len(recs) < 3 for recs in by_session.values())


def test_closed_loop_keeps_concurrency_sessions_in_flight(fake_server):
    server = fake_server(Script(ttft_s=0.02, tpot_s=0.002))
    _, records = drive(server.url, "batch:prompt=8,output=4,spread=0", LoadConfig("concurrency", concurrency=4,
                                                                                  num_requests=24))
    assert len(records) == 24 and server.state.max_inflight == 4


def test_duration_stops_sending(fake_server):
    server = fake_server()
    _, records = drive(server.url, "batch:prompt=8,output=2", LoadConfig("rate", rate=40.0, duration_s=0.5,
                                                                        arrival="constant"))
    assert len(records) == 20 and all(r.scheduled_s < 0.5 for r in records)  # 0, 0.025, ..., 0.475
