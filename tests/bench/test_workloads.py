"""Workloads plan deterministic sessions with the documented shapes and exact lengths."""

import numpy as np
import pytest

from tokenmill.bench.tokenizer import approximate_vocab, find_tokenizer, load_vocab
from tokenmill.bench.workloads import make_workload

SPECS = ["chat", "agent", "batch", "shared-prefix:groups=3,prompts=2", "mix:chat=0.5,agent=0.2,batch=0.3"]


@pytest.fixture(scope="module")
def vocab(tokenizer_dir):
    return load_vocab(find_tokenizer(str(tokenizer_dir), None))


def digests(workload, n=20):
    return [[t.digest() for t in workload.session(i).turns] for i in range(n)]


@pytest.mark.parametrize("spec", SPECS)
def test_deterministic_for_a_seed(spec):
    v = approximate_vocab()
    a, b, c = make_workload(spec, v, 7), make_workload(spec, v, 7), make_workload(spec, v, 8)
    assert digests(a) == digests(b)
    assert digests(a) != digests(c)
    assert [t.think_s for t in a.session(3).turns] == [t.think_s for t in b.session(3).turns]
    # session i does not depend on which sessions were planned before it
    assert [t.digest() for t in make_workload(spec, v, 7).session(15).turns] == digests(a)[15]


def test_prompt_lengths_exact_with_tokenizer(vocab):
    assert vocab.exact and vocab.text_exact
    tok = vocab._tokenizer
    small = ["chat", "agent:system=64,repo=256,tool=64,output=32", "batch:prompt=128,output=8",
             "shared-prefix:groups=3,prompts=2,system=128,question=16"]
    for spec in small:
        w = make_workload(spec, vocab, 0)
        for i in range(3):
            for turn in w.session(i).turns:
                text = "".join(vocab.decode(m.tokens) for m in turn.messages)
                assert tok.encode(text, add_special_tokens=False).ids == turn.flat_tokens().tolist()
                assert vocab.count(text) == turn.prompt_tokens


def is_prefix(a, b):
    return len(a) <= len(b) and np.array_equal(a, b[: len(a)])


def test_chat_turns_resend_the_conversation():
    w = make_workload("chat:think_s=2", approximate_vocab(), 0)
    for i in range(10):
        s = w.session(i)
        assert s.class_name == "interactive" and 2 <= len(s.turns) <= 3
        assert s.turns[0].think_s == 0 and all(t.think_s > 0 for t in s.turns[1:])
        for prev, cur in zip(s.turns, s.turns[1:]):
            # the next prompt = previous prompt + the planned reply (max_tokens long) + a new question
            assert cur.messages[: len(prev.messages)] == prev.messages
            assert cur.messages[len(prev.messages)].role == "assistant"
            assert len(cur.messages[len(prev.messages)]) == prev.max_tokens


def test_agent_context_grows_and_shares_the_system_prompt():
    w = make_workload("agent:repos=2,max_context=20000", approximate_vocab(), 0)
    sessions = [w.session(i) for i in range(12)]
    systems = {m.tokens.tobytes() for s in sessions for m in [s.turns[0].messages[0]]}
    repos = {s.turns[0].messages[1].tokens.tobytes() for s in sessions}
    assert len(systems) == 1 and len(repos) == 2
    for s in sessions:
        assert s.class_name == "agent" and len(s.turns) >= 1
        for prev, cur in zip(s.turns, s.turns[1:]):
            assert is_prefix(prev.flat_tokens(), cur.flat_tokens())
            assert cur.prompt_tokens > prev.prompt_tokens + prev.max_tokens
            assert cur.think_s >= 0
        assert all(t.prompt_tokens + t.max_tokens <= 20000 for t in s.turns)
    assert max(len(s.turns) for s in sessions) > 4  # multi-turn, long contexts
    assert max(t.prompt_tokens for s in sessions for t in s.turns) > 8000


def test_shared_prefix_groups():
    g, p = 4, 3
    w = make_workload(f"shared-prefix:groups={g},prompts={p},system=100,question=10,output=5", approximate_vocab(), 0)
    first = [w.session(i).turns[0] for i in range(g * p)]
    systems = {t.messages[0].tokens.tobytes() for t in first}
    assert len(systems) == g
    assert len({t.flat_tokens().tobytes() for t in first}) == g * p  # every prompt once per cycle
    for system in systems:
        assert sum(t.messages[0].tokens.tobytes() == system for t in first) == p
    assert all(t.prompt_tokens == 110 and t.max_tokens == 5 for t in first)
    assert w.session(g * p).turns[0].digest() == w.session(0).turns[0].digest()  # then it cycles
    groups_in_order = [systems_index for t in first for systems_index in [t.messages[0].tokens.tobytes()]]
    assert groups_in_order != sorted(groups_in_order, key=groups_in_order.index)  # shuffled, not group by group


def test_mix_draws_classes_by_weight():
    w = make_workload("mix:chat=0.7,batch=0.3", approximate_vocab(), 0)
    assert w.classes == {"interactive", "batch"}
    classes = [w.session(i).class_name for i in range(600)]
    assert classes.count("batch") / 600 == pytest.approx(0.3, abs=0.05)
    assert w.mean_turns == pytest.approx(0.7 * 2.5 + 0.3 * 1)


def test_lengths_have_the_configured_mean():
    w = make_workload("batch:prompt=300,output=200", approximate_vocab(), 0)
    turns = [w.session(i).turns[0] for i in range(1500)]
    assert np.mean([t.prompt_tokens for t in turns]) == pytest.approx(300, rel=0.05)
    assert np.mean([t.max_tokens for t in turns]) == pytest.approx(200, rel=0.05)
    fixed = make_workload("batch:prompt=300,output=200,spread=0", approximate_vocab(), 0)
    assert {(fixed.session(i).turns[0].prompt_tokens, fixed.session(i).turns[0].max_tokens)
            for i in range(20)} == {(300, 200)}


def test_shared_prefix_zipf_popularity():
    """zipf=S: group k (rank k+1) is drawn with probability ∝ 1 / (k+1)**S; the system prompts are the same
    as without zipf (only the popularity changes)."""
    spec = "shared-prefix:groups=8,prompts=4,system=50,question=10,output=5"
    uniform, skewed = (make_workload(spec + z, approximate_vocab(), 0) for z in ("", ",zipf=1.2"))
    systems = [uniform.message("system", 50, "system", g).tokens.tobytes() for g in range(8)]
    counts = np.zeros(8)
    for i in range(4000):
        counts[systems.index(skewed.session(i).turns[0].messages[0].tokens.tobytes())] += 1
    expected = 1 / np.arange(1, 9) ** 1.2
    assert np.allclose(counts / 4000, expected / expected.sum(), atol=0.02)
    assert skewed.session(7).turns[0].digest() == make_workload(spec + ",zipf=1.2", approximate_vocab(), 0).session(7).turns[0].digest()
    with pytest.raises(Exception, match="zipf"):
        make_workload(spec + ",zipf=-1", approximate_vocab(), 0)


def test_code_prompts_are_windows_of_held_out_source_text(vocab):
    """`code`: each prompt is `prompt` consecutive tokens of one held-out stdlib file, as the target's tokenizer
    encodes it (so the decoded prompt is a substring of that file), deterministic in the seed, with the requested
    output length; without a tokenizer it is a clear error, and so is a prompt longer than every file."""
    from tokenmill.cli import CLIError
    from tokenmill.model.tokenizer import stdlib_sources

    w = make_workload("code:prompt=64,output=32", vocab, 0)
    texts = [f.read_text(errors="replace") for f in stdlib_sources(held_out_every=10, split="heldout")]
    for i in range(6):
        (turn,) = w.session(i).turns
        assert turn.prompt_tokens == 64 and turn.max_tokens == 32
        ids = turn.flat_tokens()
        # the window's ids come from one held-out file's encoding
        hits = [t for t in texts if vocab._tokenizer.decode(ids.tolist()) in t]
        assert hits, vocab._tokenizer.decode(ids.tolist())
    assert digests(w, 6) == digests(make_workload("code:prompt=64,output=32", vocab, 0), 6)
    assert digests(w, 6) != digests(make_workload("code:prompt=64,output=32", vocab, 1), 6)
    with pytest.raises(CLIError, match="needs the target's tokenizer"):
        make_workload("code", approximate_vocab(), 0)
    with pytest.raises(CLIError, match="longer than every held-out source file"):
        make_workload("code:prompt=10000000", vocab, 0).session(0)
