"""The vocabulary prompts are drawn from, with or without the target model's tokenizer.

With a tokenizer (`--tokenizer DIR`, or `--model` naming a local model directory), prompt ids are real
token ids: words that are one token each and round-trip (decode then encode gives the id back), so a
prompt of n ids is exactly n tokens, sent as ids or as text. Without one, ids index a list of common
English words, sent as text; most BPE tokenizers encode each as one token, so lengths are approximate
and the report says so.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tokenmill.cli import CLIError

_COMMON_WORDS = """
the of and to in is that for it as was with be by on not he this are or his from at which but have an
they you were her she there one all we their been has when who will more if no out so said what up its
about into than them can only other new some could time these two may then do first any my now such like
our over man me even most made after also did many before must through back years where much your way
well down should because each just those people how too little state good very make world still own see
men work long get here between both life being under never day same another know while last might us
great old year off come since against go came right used take three states himself few house use during
without again place american around however home small found thought went say part once general high
upon school every does got united left number course war until always away something fact though water
less public put think almost hand enough far took head yet government system better set told nothing
night end why called didn find look asked later knew point city next program give group toward young
days let room president side social present given several order national second possible rather per
face among form often important things looked early white case john become large big need four within
felt along children saw best church ever least power development light thing seemed family interest
want members mind country area others although turned done open god service certain kind problem began
different door thus help sense means whole matter perhaps itself york times law human line above name
example action company hands local show whether five history gave today either act feet across taken
past quite anything seen having death week experience body word half really field am car words already
themselves information tell together college shall money period held keep sure probably free real seems
behind cannot miss political air question making office brought whose special heard major problems
ago became federal moment study available known result street economic boy position reason change south
board individual job areas society west close turn love community true court force full seem am
""".split()
COMMON_WORDS: tuple[str, ...] = tuple(dict.fromkeys(w for w in _COMMON_WORDS if w.isalpha()))

_WORD = re.compile(r" [A-Za-z]{2,16}")
_MIN_WORDS = 64  # below this many whole-word tokens, fall back to every round-tripping token


@dataclass(frozen=True)
class PromptVocab:
    """Ids prompts are drawn from and how to turn them into text.

    exact: ids are token ids of the target's tokenizer (a prompt of n ids is n tokens).
    text_exact: decoding a sequence and encoding it again gives the same ids (checked on a sample).
    """

    ids: np.ndarray  # [V] candidate ids
    exact: bool
    text_exact: bool
    source: str  # tokenizer path, or "approximate"
    _tokenizer: object | None = None  # tokenizers.Tokenizer when exact

    @property
    def size(self) -> int:
        return len(self.ids)

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return self.ids[rng.integers(0, len(self.ids), size=n)]

    def decode(self, ids: np.ndarray) -> str:
        if self._tokenizer is None:
            return "".join(" " + COMMON_WORDS[i] for i in ids.tolist())
        return self._tokenizer.decode(ids.tolist(), skip_special_tokens=False)

    def encode(self, text: str) -> np.ndarray:
        """`text` as the target's token ids (exact vocabularies only: without a tokenizer there are no token ids)."""
        if self._tokenizer is None:
            raise ValueError("PromptVocab.encode needs the target's tokenizer")
        return np.asarray(self._tokenizer.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    def count(self, text: str) -> int:
        """Tokens in `text` (without special tokens); approximate: words."""
        if self._tokenizer is None:
            return len(text.split())
        return len(self._tokenizer.encode(text, add_special_tokens=False).ids)

    def describe(self) -> dict:
        if not self.exact:
            note = (
                "approximate: no tokenizer given (--tokenizer DIR); prompts are common English words, "
                "counted as one token each"
            )
        elif self.text_exact:
            note = "exact: prompt ids are token ids of the target tokenizer and round-trip through text"
        else:
            note = "exact as token ids; text prompts re-tokenize to slightly different lengths"
        return {"kind": "exact" if self.exact else "approximate", "source": self.source,
                "vocab_size": self.size, "text_exact": self.text_exact, "note": note}


def approximate_vocab() -> PromptVocab:
    return PromptVocab(np.arange(len(COMMON_WORDS)), exact=False, text_exact=False, source="approximate")


def find_tokenizer(tokenizer_dir: str | None, model: str | None) -> Path | None:
    """`--tokenizer DIR` (must hold tokenizer.json), else the model name if it is a local model directory."""
    if tokenizer_dir is not None:
        path = Path(tokenizer_dir)
        path = path if path.is_file() else path / "tokenizer.json"
        if not path.is_file():
            raise CLIError(f"--tokenizer {tokenizer_dir}: no tokenizer.json there")
        return path
    if model and (Path(model) / "tokenizer.json").is_file():
        return Path(model) / "tokenizer.json"
    return None


def load_vocab(path: Path | None, seed: int = 0) -> PromptVocab:
    if path is None:
        return approximate_vocab()
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # the tokenizers library raises a bare Exception for bad files
        raise CLIError(f"cannot load tokenizer {path}: {e}") from None
    special = {int(i) for i in tok.get_added_tokens_decoder()}
    candidates = [i for i in range(tok.get_vocab_size(with_added_tokens=False)) if i not in special]
    texts = tok.decode_batch([[i] for i in candidates], skip_special_tokens=False)
    words = [i for i, t in zip(candidates, texts) if _WORD.fullmatch(t)]
    pool = words if len(words) >= _MIN_WORDS else candidates
    pool_texts = tok.decode_batch([[i] for i in pool], skip_special_tokens=False)
    encoded = tok.encode_batch(pool_texts, add_special_tokens=False)
    ids = np.array([i for i, e in zip(pool, encoded) if e.ids == [i]], dtype=np.int64)
    if len(ids) == 0:
        raise CLIError(f"tokenizer {path}: no token round-trips through text; cannot build prompts")
    sample = ids[np.random.default_rng(seed).integers(0, len(ids), size=512)]
    text_exact = tok.encode(tok.decode(sample.tolist()), add_special_tokens=False).ids == sample.tolist()
    return PromptVocab(ids, exact=True, text_exact=text_exact, source=str(path), _tokenizer=tok)
