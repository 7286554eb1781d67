"""tokenmill: a goodput-first LLM serving stack."""

__version__ = "0.1.0"


def __getattr__(name):  # lazy: `import tokenmill` must not import torch
    if name == "LLM":
        from tokenmill.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from tokenmill.engine.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "__version__"]
