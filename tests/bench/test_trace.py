"""Trace replay: Mooncake block sharing reproduced exactly, lengths and timestamps exact."""

import json
from pathlib import Path

import numpy as np
import pytest

from tokenmill.bench.runner import LoadConfig, schedule
from tokenmill.bench.tokenizer import PromptVocab, approximate_vocab
from tokenmill.bench.workloads import make_workload

TRACES = Path(__file__).resolve().parents[3] / "shared" / "traces"
MOONCAKE = TRACES / "mooncake_synthetic_trace.jsonl"
AZURE = TRACES / "AzureLLMInferenceTrace_code.csv"


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


def expected_shared(ids_a, ids_b, len_a, len_b) -> int:
    k = 0
    while k < min(len(ids_a), len(ids_b)) and ids_a[k] == ids_b[k]:
        k += 1
    if k < len(ids_a) and k < len(ids_b):
        return k * 512  # the ids diverge at block k: exactly k blocks are shared
    return min(len_a, len_b)  # one id list is a prefix of the other


def check_block_sharing(path: Path, rows: list[dict], vocab, root_slack: int = 0) -> None:
    """Prompts share exactly the blocks their ids share; unrelated prompts (different first id) may share
    up to root_slack tokens when there are more distinct first blocks than vocabulary entries."""
    w = make_workload(f"trace:{path}", vocab, 0)
    assert w.exact_sharing == (root_slack == 0)
    prompts = []
    for i, row in enumerate(rows):
        turn = w.session(i).turns[0]
        assert turn.prompt_tokens == row["input_length"] and turn.max_tokens == max(1, row["output_length"])
        prompts.append(turn.flat_tokens())
    pairs = 0
    for i in range(len(rows)):
        for j in range(i + 1, len(rows)):
            a, b = rows[i], rows[j]
            want = expected_shared(a["hash_ids"], b["hash_ids"], a["input_length"], b["input_length"])
            got = common_prefix(prompts[i], prompts[j])
            if a["hash_ids"][0] != b["hash_ids"][0]:
                assert got <= root_slack, (i, j)
            else:
                assert got == want, (i, j)
            pairs += want > 0
    assert pairs > 0  # the sample does share prefixes


def test_handmade_trace_shares_exactly_k_blocks(tmp_path):
    rows = [  # siblings, prefixes of each other, a last block cut short, an id of 0
        {"timestamp": 0, "input_length": 1500, "output_length": 3, "hash_ids": [700, 1, 2]},
        {"timestamp": 10, "input_length": 1100, "output_length": 0, "hash_ids": [700, 1, 5]},
        {"timestamp": 30, "input_length": 1024, "output_length": 4, "hash_ids": [700, 1]},
        {"timestamp": 30, "input_length": 700, "output_length": 4, "hash_ids": [700, 9]},
        {"timestamp": 45, "input_length": 300, "output_length": 4, "hash_ids": [0]},
        {"timestamp": 45, "input_length": 20, "output_length": 4, "hash_ids": [700]},
        {"timestamp": 46, "input_length": 1030, "output_length": 4, "hash_ids": [0, 3, 4]},
    ]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    check_block_sharing(path, rows, approximate_vocab())
    w = make_workload(f"trace:{path},time_scale=2", approximate_vocab(), 0)
    assert [s.start_s for s in w.sessions()] == [0, 0.02, 0.06, 0.06, 0.09, 0.09, 0.092]


@pytest.mark.skipif(not MOONCAKE.exists(), reason="shared traces not present")
def test_mooncake_sample_reproduces_block_sharing():
    rows = [json.loads(line) for line in MOONCAKE.read_text().splitlines()[:100]]
    # a real tokenizer's vocabulary (32k ids) exceeds the sample's 2,211 distinct first blocks: exact
    check_block_sharing(MOONCAKE, rows, PromptVocab(np.arange(100, 32100), exact=True, text_exact=False, source="ids"))
    # the 390-word approximation does not: unrelated prompts may share the first token, never a block
    check_block_sharing(MOONCAKE, rows, approximate_vocab(), root_slack=1)


@pytest.mark.skipif(not AZURE.exists(), reason="shared traces not present")
def test_azure_trace_lengths_and_times():
    w = make_workload(f"trace:{AZURE}", approximate_vocab(), 0)
    assert w.describe()["format"] == "azure" and w.describe()["requests"] == 8819
    first = [w.session(i) for i in range(3)]
    assert [(s.turns[0].prompt_tokens, s.turns[0].max_tokens) for s in first] == [(4808, 10), (3180, 8), (110, 27)]
    assert [s.start_s for s in first] == pytest.approx([0.0, 0.052, 0.098189], abs=1e-6)
    assert len({s.turns[0].digest() for s in first}) == 3


def test_trace_rate_rescales_timestamps(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"timestamp": 1000 * i, "input_length": 5, "output_length": 2,
                                        "hash_ids": [i]}) + "\n" for i in range(11)))
    w = make_workload(f"trace:{path}", approximate_vocab(), 0)
    assert w.native_rate == pytest.approx(1.0)
    as_recorded = [t for t, _ in schedule(w, LoadConfig("trace"), 0)]
    doubled = [t for t, _ in schedule(w, LoadConfig("rate", rate=2.0), 0)]
    cut = [t for t, _ in schedule(w, LoadConfig("trace", duration_s=4.5, num_requests=8), 0)]
    assert as_recorded == pytest.approx(list(range(11)))
    assert doubled == pytest.approx([i / 2 for i in range(11)])
    assert cut == pytest.approx([0, 1, 2, 3, 4])
