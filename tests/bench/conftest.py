from pathlib import Path

import pytest

from .fake_server import FakeServer, Script


@pytest.fixture
def fake_server():
    """fake_server(Script(...)) -> a running FakeServer, stopped at the end of the test."""
    servers = []

    def start(script: Script | None = None) -> FakeServer:
        server = FakeServer(script or Script()).__enter__()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.__exit__(None, None, None)


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    """A small byte-level BPE tokenizer.json trained on English words (like a real model's)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from tokenmill.bench.tokenizer import COMMON_WORDS

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=800, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = [" ".join(COMMON_WORDS[i:] + COMMON_WORDS[:i]) for i in range(0, len(COMMON_WORDS), 7)]
    tok.train_from_iterator(corpus, trainer)
    out = tmp_path_factory.mktemp("tok")
    tok.save(str(out / "tokenizer.json"))
    return out
