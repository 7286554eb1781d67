"""Tokenizer: `tokenizer.json` (HF `tokenizers`) + `tokenizer_config.json` (chat template, special tokens).

Also trains the project's byte-level BPE (`train_bpe`) on the Python standard library, the corpus that is
present on every machine that builds this project.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from tokenmill.errors import InvalidRequestError, ModelLoadError

# ChatML, as Qwen uses it. Special tokens are single ids in the shipped tokenizer.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")


def _token_str(v) -> str | None:
    if isinstance(v, dict):  # {"content": "<s>", ...} (AddedToken form)
        return v.get("content")
    return v


class Tokenizer:
    """Encode/decode with special tokens and chat template from an HF model directory."""

    def __init__(self, path: str | os.PathLike):
        from tokenizers import Tokenizer as _HFTokenizer

        path = Path(path)
        tj = path / "tokenizer.json"
        if not tj.is_file():
            raise ModelLoadError(f"{tj}: missing (an HF-format model directory needs tokenizer.json)")
        try:
            self._tok = _HFTokenizer.from_file(str(tj))
        except Exception as e:  # noqa: BLE001 - the library raises plain Exception
            raise ModelLoadError(f"{tj}: cannot be read: {e}") from e
        cfg_path = path / "tokenizer_config.json"
        self.config: dict = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.chat_template: str | None = self.config.get("chat_template")
        if isinstance(self.chat_template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in self.chat_template}
            self.chat_template = named.get("default") or next(iter(named.values()), None)
        self.bos_token = _token_str(self.config.get("bos_token"))
        self.eos_token = _token_str(self.config.get("eos_token"))
        self.add_bos = bool(self.config.get("add_bos_token", False)) and self.bos_token is not None
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self._template = None

    # -- text <-> ids ---------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    # -- chat -----------------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not isinstance(messages, list) or not messages:
            raise InvalidRequestError("messages must be a non-empty list", param="messages")
        for i, m in enumerate(messages):
            if not isinstance(m, dict):
                raise InvalidRequestError(f"messages[{i}] must be an object", param="messages")
            if m.get("role") not in CHAT_ROLES:
                raise InvalidRequestError(
                    f"messages[{i}].role must be one of {list(CHAT_ROLES)}, got {m.get('role')!r}", param="messages"
                )
            content = m.get("content")
            if isinstance(content, list):  # OpenAI content parts: keep the text ones
                if any(not isinstance(p, dict) or p.get("type") != "text" for p in content):
                    raise InvalidRequestError(f"messages[{i}].content: only text parts are supported", "messages")
                m["content"] = "".join(str(p.get("text", "")) for p in content)
            elif content is None:
                m["content"] = ""
            elif not isinstance(content, str):
                raise InvalidRequestError(f"messages[{i}].content must be a string", param="messages")
        if self._template is None:
            import jinja2

            env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)

            def raise_exception(msg):
                raise InvalidRequestError(f"chat template: {msg}", param="messages")

            env.globals["raise_exception"] = raise_exception
            self._template = env.from_string(self.chat_template or CHATML_TEMPLATE)
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )


# -- training -----------------------------------------------------------------------------------
def stdlib_sources(held_out_every: int = 0, split: str = "train") -> list[Path]:
    """The standard library's .py files (tests excluded), sorted. With held_out_every=N, every N-th file
    (by sorted path) is the held-out split and the rest is train."""
    root = Path(os.__file__).parent
    files = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root).parts
        if "site-packages" in rel or "dist-packages" in rel:
            continue
        if any(part in ("test", "tests", "idle_test", "__pycache__") or part.startswith("test_") for part in rel):
            continue
        files.append(p)
    if held_out_every:
        files = [f for i, f in enumerate(files) if (i % held_out_every == 0) == (split == "heldout")]
    return files


def train_bpe(out_dir: str | os.PathLike, vocab_size: int = 4096, files: list[Path] | None = None) -> Path:
    """Train a byte-level BPE on the stdlib; write tokenizer.json + tokenizer_config.json to out_dir."""
    from tokenizers import Tokenizer as _HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    files = files if files is not None else stdlib_sources(held_out_every=10, split="train")
    tok = _HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )

    def texts():
        for f in files:
            yield f.read_text(encoding="utf-8", errors="replace")

    tok.train_from_iterator(texts(), trainer=trainer)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    write_tokenizer_config(out)
    return out


def write_tokenizer_config(out: Path) -> None:
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHATML_TEMPLATE,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
    }
    (Path(out) / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")


SHIPPED_TOKENIZER_DIR = Path(__file__).parent / "assets" / "tokenizer"

if __name__ == "__main__":  # python -m tokenmill.model.tokenizer OUT_DIR [VOCAB]
    train_bpe(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 4096)
