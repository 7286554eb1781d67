"""`tokenmill serve`: an OpenAI-compatible HTTP server (aiohttp) over the engine, with SSE streaming,
cached-token usage, Prometheus metrics (vLLM-compatible names) and OpenAI-style errors.

    cli.py           the `serve` subcommand (flags -> EngineConfig -> LLMEngine -> app)
    app.py           routes and middlewares (auth, errors); create_app(engine), serve(app, host, port)
    protocol.py      request bodies -> typed GenerateRequest; APIError -> {"error": {...}}
    async_engine.py  the engine in its own thread; commands in, outputs out to per-request queues
    metrics.py       the Prometheus registry: engine-state collector + latency histograms
"""
