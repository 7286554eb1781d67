"""The shipped demo models (scripts/train_demo.py): they load, have the promised shape and size, and tokenmill's
greedy generation on them equals HF transformers' on the same directory."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from tokenmill.model.loader import SHIPPED_MODELS_DIR, resolve_model_path
from tokenmill.model.tokenizer import SHIPPED_TOKENIZER_DIR
from tokenmill.testing.prompts import heldout_code_prompts

transformers = pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[2]
DEMO, DRAFT = SHIPPED_MODELS_DIR / "demo", SHIPPED_MODELS_DIR / "demo-draft"
FILES = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
         "training_summary.json"]
PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n\n\nclass Stack:\n    def __init__(self"]
# the repetition check (docs/demo_model.md): distinct 4-grams over 64 greedy tokens of train_demo.SAMPLE_PROMPTS (the
# README's three prompts and two more). The pair shipped since session 21 scores 0.94 mean, 0.79 the lowest (bf16 and
# fp32); the one before it (session 19) 0.73 mean with `def add(a, b):` at 0.54 (`# The cc is no c is no c is...`)
MIN_DISTINCT_MEAN, MIN_DISTINCT_EACH = 0.8, 0.6


def hf_model(path: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_shipped_names_resolve():
    assert resolve_model_path("demo") == DEMO
    assert resolve_model_path("demo-draft") == DRAFT


@pytest.mark.parametrize("path", [DEMO, DRAFT], ids=["demo", "demo-draft"])
def test_shipped_dir_is_complete_hf_llama_bf16(path):
    for name in FILES:
        assert (path / name).is_file(), f"{path / name} missing"
    for name in ("tokenizer.json", "tokenizer_config.json"):  # exactly the project's tokenizer
        assert (path / name).read_bytes() == (SHIPPED_TOKENIZER_DIR / name).read_bytes(), name
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    assert cfg["torch_dtype"] == "bfloat16" and cfg["vocab_size"] == 4096 and cfg["eos_token_id"] == 0
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}


def test_sizes_and_draft_ratio():
    total = sum(f.stat().st_size for d in (DEMO, DRAFT) for f in d.iterdir())
    assert total <= 25 * 2**20, f"shipped demo models take {total / 2**20:.1f} MiB (budget 25)"
    target, draft = hf_model(DEMO), hf_model(DRAFT)
    n_t = sum(p.numel() for p in target.parameters())
    n_d = sum(p.numel() for p in draft.parameters())
    assert 2e6 <= n_t <= 10e6, n_t
    assert 7 <= n_t / n_d <= 14, (n_t, n_d)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        assert target(ids).logits.shape == draft(ids).logits.shape == (1, 4, 4096)


def load_train_demo():
    spec = importlib.util.spec_from_file_location("train_demo", REPO / "scripts" / "train_demo.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_agreement_bar_in_summary_and_on_the_shipped_weights():
    # teacher-forced argmax agreement on held-out *source text* (the copying target shipped in session 19 is a
    # much better model of that text than the 9x smaller draft can be: 0.52, the pair before it 0.67); what
    # speculative decoding needs, acceptance on the target's own continuations, is the next test
    s = json.loads((DEMO / "training_summary.json").read_text())
    ev = s["heldout_eval"]
    assert ev["agreement"] >= 0.5, ev
    assert ev["target"]["loss"] < ev["draft"]["loss"]
    assert s["command"].startswith("python scripts/train_demo.py")
    # re-measure on 16 of the summary's held-out windows: the shipped weights are the ones measured
    td = load_train_demo()
    seq_len = s["hyperparameters"]["seq_len"]
    held = td.windows(td.load_stream("heldout"), seq_len)
    held = held[torch.linspace(0, len(held) - 1, ev["positions"] // seq_len).long()][::8]  # [16, S+1]
    got = td.evaluate(hf_model(DEMO), hf_model(DRAFT), held, batch_size=8)
    assert abs(got["agreement"] - ev["agreement"]) < 0.05, (got, ev)
    assert abs(got["target"]["loss"] - ev["target"]["loss"]) < 0.3, (got, ev)


def test_draft_acceptance_on_held_out_code():
    """Issue 13 item 6: the draft's acceptance in greedy speculative decoding (k = 2) on held-out code, as
    tokenmill serves the pair (bf16), the measurement of docs/demo_model.md (8 prompts x 128 tokens; 0.708 on
    the AMX machine of session 19). The bar here leaves room for another CPU's bf16 kernels to flip a few
    greedy near-ties; every output must equal speculation off."""
    from tokenmill import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    spec = LLM("demo", speculative_model="demo-draft", num_speculative_tokens=2, kv_cache_bytes="64MiB")
    prompts = heldout_code_prompts(spec.tokenizer, 8, 128)
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, params)]
    st = spec.engine.stats().spec
    assert st.acceptance_rate >= 0.66, st
    off = LLM("demo", kv_cache_bytes="64MiB")
    assert got == [o.outputs[0].token_ids for o in off.generate(prompts, params)]


def test_greedy_generation_matches_hf_generate():
    from tokenmill import LLM, SamplingParams

    hf = hf_model(DEMO)
    llm = LLM("demo", kv_cache_bytes="32MiB", dtype="float32")
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs):
        ids = llm.tokenizer.encode(prompt)
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                              pad_token_id=0)[0, len(ids):].tolist()
        assert out.outputs[0].token_ids == ref, prompt


def test_distinct_ngram_ratio():
    td = load_train_demo()
    assert td.distinct_ngram_ratio(list(range(64))) == 1.0
    assert td.distinct_ngram_ratio([1, 2, 3, 4] * 16) == 4 / 61  # a period-4 loop: 4 distinct of 61 4-grams
    assert td.distinct_ngram_ratio([7] * 64) == 1 / 61


def test_greedy_continuations_are_not_degenerate_repetition():
    """Issue 13 item 6: the demo target's greedy continuations of the README's prompts (and the other sample
    prompts) do not fall into a loop: distinct 4-grams over the first 64 greedy tokens, by tokenmill as served
    (bf16), and the training summary's HF fp32 figure, both over the bar. The first shipped pair scored 0.24 mean
    here (`import os` -> ` os.path.path.path...`: 0.05), session 19's 0.73 (`a string or a string or ...`)."""
    from tokenmill import LLM, SamplingParams

    td = load_train_demo()
    llm = LLM("demo", kv_cache_bytes="32MiB")
    outs = llm.generate(td.SAMPLE_PROMPTS, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    ratios = {p: td.distinct_ngram_ratio(o.outputs[0].token_ids) for p, o in zip(td.SAMPLE_PROMPTS, outs)}
    assert all(len(o.outputs[0].token_ids) == 64 for o in outs)
    assert sum(ratios.values()) / len(ratios) >= MIN_DISTINCT_MEAN, ratios
    assert min(ratios.values()) >= MIN_DISTINCT_EACH, ratios
    s = json.loads((DEMO / "training_summary.json").read_text())
    assert s["greedy_distinct_4gram_mean"] >= MIN_DISTINCT_MEAN, s["greedy_distinct_4gram_mean"]


def test_edit_windows_hold_the_code_twice_and_never_the_benchmarks_unseen_format():
    """scripts/train_demo.py --edit-frac: an edit window is code, a marker, and the same code again (renamed where
    the marker says so), cut to the window's length; benchmarks/spec_decode.py edit --format before-after uses an
    instruction the training markers never contain (its acceptance is the generalization check)."""
    import re

    td = load_train_demo()
    ed = td.EditWindows()
    code = "".join(f"    def method_{i}(self, value):\n        return self.table[value] + {i}\n" for i in range(40))
    window = torch.tensor(ed.tok.encode("x = 1\n" + code, add_special_tokens=False).ids[:513])
    seen_rename = seen_copy = False
    for seed in range(40):
        out = ed.make(window, seed)
        assert out.shape == window.shape and out.dtype == window.dtype
        text = ed.tok.decode(out.tolist(), skip_special_tokens=False)
        markers = [m for m in td.EDIT_MARKERS if m in text]
        renamed = re.search(r"# The same code, with (\w+) renamed to (\w+):\n", text)
        assert len(markers) + bool(renamed) == 1, text[:400]
        before, after = re.split(r"(?:" + "|".join(map(re.escape, td.EDIT_MARKERS)) + r"|# The same code, with \w+ "
                                 r"renamed to \w+:)\n", text)
        first = before[before.index("    def"):]  # the code block: whole lines after the window's first one
        if renamed:
            seen_rename = True
            first = re.sub(rf"\b{renamed.group(1)}\b", renamed.group(2), first.rstrip("\n") + "\n")
        else:
            seen_copy = True
        assert after.startswith(first.rstrip("\n")), (first[:200], after[:200])
    assert seen_rename and seen_copy
    spec = importlib.util.spec_from_file_location("spec_decode", REPO / "benchmarks" / "spec_decode.py")
    sd = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sd)
    head, marker = sd.EDIT_FORMATS["before-after"]
    assert not any(marker in m or head.strip() in m for m in td.EDIT_MARKERS + td.EDIT_HEADS + [td.RENAME_MARKER])


def test_induction_rows_repeat_their_span_and_vary_and_code_rows_come_from_the_training_windows():
    """scripts/train_demo.py --induction-mix / --induction-code-frac / --induction-vary: each row is a span shown
    twice; code rows are spans of the given windows; --induction-vary draws the step's span length from
    [len / 4, len]; the same seed gives the same rows."""
    td = load_train_demo()
    seen = []

    class Probe(torch.nn.Module):
        def forward(self, input_ids, use_cache=False):
            seen.append(input_ids.clone())
            return type("Out", (), {"logits": torch.zeros(*input_ids.shape, td.VOCAB, requires_grad=True)})()

    code = torch.randint(100, 4000, (5, 300), generator=torch.Generator().manual_seed(1))
    lengths = set()
    for seed in range(12):
        td.induction_loss(Probe(), 4, 64, seed, code, 0.5, vary=True)
        x = seen[-1]
        length = (x.shape[1] + 1) // 2
        lengths.add(length)
        assert 16 <= length <= 64
        full = torch.cat([x, x[:, -1:]], dim=1)  # the last token is a label only; rows are [s, s]
        assert torch.equal(full[:, :length - 1], full[:, length:2 * length - 1])
        for row in x[2:, :length].tolist():  # the last round(0.5 * 4) rows are code spans
            assert any(row == code[i, o:o + length].tolist() for i in range(5) for o in range(300 - length + 1))
    assert len(lengths) > 3
    td.induction_loss(Probe(), 4, 64, 7, code, 0.5, vary=True)
    td.induction_loss(Probe(), 4, 64, 7, code, 0.5, vary=True)
    assert torch.equal(seen[-1], seen[-2])
    td.induction_loss(Probe(), 4, 64, 7)
    assert seen[-1].shape == (4, 127)


def test_repeated_ngram_mask_exempts_prompt_ngrams_only_when_asked():
    """Sequence-level UL's candidates (hand-computed, n = 2): a continuation bigram that repeats inside the
    continuation is a loop; with exempt_prompt it is not penalized when the prompt holds it (a copy)."""
    td = load_train_demo()
    #          prompt: 1 2 3 | continuation: 1 2 9 1 2 9 7 7 7
    seq = torch.tensor([[1, 2, 3, 1, 2, 9, 1, 2, 9, 7, 7, 7]])
    plain = td.repeated_ngram_mask(seq, 3, n=2)[0].nonzero().flatten().tolist()
    exempt = td.repeated_ngram_mask(seq, 3, n=2, exempt_prompt=True)[0].nonzero().flatten().tolist()
    # continuation bigrams ending at t = 4..11: (1,2) (2,9) (9,1) (1,2)* (2,9)* (9,7) (7,7) (7,7)*
    assert plain == [7, 8, 11]
    assert exempt == [8, 11]  # (1, 2) is in the prompt: copying; (2, 9) and (7, 7) are not


def test_new_recipe_options_are_checked_and_bind_a_checkpoint():
    """--draft-induction-mix below 0 is a CLI error; both session-17 options change the math, so a checkpoint written
    with other values must not resume (they are among checkpoint_args)."""
    td = load_train_demo()
    with pytest.raises(SystemExit):
        td.parse_args(["--out", "x", "--draft-induction-mix", "-1"])
    a = td.parse_args(["--out", "x", "--draft-induction-mix", "8", "--seq-ul-edits"])
    assert td.checkpoint_args(a)["draft_induction_mix"] == 8 and td.checkpoint_args(a)["seq_ul_edits"] is True


def test_seq_ul_line_start_prompts_open_a_def_or_class_as_a_prompt_is_tokenized():
    """--seq-ul-line-starts (session 20): prefixes cut at `def`/`class` lines, each tokenized on its own (as a user's
    prompt), replace the mid-file half of a sequence-UL step's prefixes; the option binds a checkpoint."""
    from tokenizers import Tokenizer

    td = load_train_demo()
    tok = Tokenizer.from_file(str(SHIPPED_TOKENIZER_DIR / "tokenizer.json"))
    text = "import os\n\n\nclass Stack:\n    def __init__(self, items):\n        self.items = items\n\n" \
           "    def push(self, x):\n        self.items.append(x)\n\nx = 1\n" * 8
    ids = tok.encode(text, add_special_tokens=False).ids
    windows = torch.tensor([ids[:120], ids[40:160]])
    rows = td.line_start_prompts(windows, 6)
    assert rows.shape[1] == 6 and len(rows) >= 4
    starts = {tok.decode(r.tolist()) for r in rows}
    assert all(s.lstrip().startswith(("def ", "class ")) for s in starts), starts
    assert any(s.startswith("    def") for s in starts)  # an indented line keeps its indentation, as a prompt would
    assert rows[0].tolist() == tok.encode("class Stack:\n    def __init__", add_special_tokens=False).ids[:6]
    imports = {tok.decode(r.tolist()) for r in td.line_start_prompts(windows, 2, kinds=("import",))}
    assert imports == {"import os"}, imports
    with pytest.raises(ValueError, match="no def/class line"):
        td.line_start_prompts(torch.tensor([tok.encode("x = 1\ny = 2\n" * 20, add_special_tokens=False).ids]), 6)
    batch = torch.arange(4 * 40).reshape(4, 40)

    class _Data:
        def file_starts(self, length):
            return torch.full((3, length), 7)

    mixed = td.seq_ul_prefixes(_Data(), batch, step=3, max_len=6, line_starts=rows)
    assert mixed.shape == (4, 5) and (mixed[2:] == 7).all()
    assert all(r.tolist() in [x[:5].tolist() for x in rows] for r in mixed[:2])
    assert td.checkpoint_args(td.parse_args(["--out", "x", "--seq-ul-line-starts"]))["seq_ul_line_starts"] is True
