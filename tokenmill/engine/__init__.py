"""The engine: LLMEngine.step() = schedule -> execute -> postprocess."""
