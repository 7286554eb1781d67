import pytest

from tokenmill.model.make import make_model

ARCH_PRESETS = ["tiny", "tiny-llama3", "tiny-mistral", "tiny-qwen2", "tiny-qwen3"]


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """model_dir(preset) -> path of a random-init model made once per test session."""
    cache = {}

    def make(preset: str = "tiny", seed: int = 0):
        key = (preset, seed)
        if key not in cache:
            cache[key] = make_model(preset, tmp_path_factory.mktemp(f"{preset}-{seed}"), seed=seed)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_dir(model_dir):
    return model_dir("tiny")
