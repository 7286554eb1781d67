"""Streaming OpenAI-compatible client: one request in, one RequestRecord (with its timings) out.

Works against tokenmill, vLLM and SGLang: `/v1/completions` (prompt as token ids or text) or
`/v1/chat/completions`, `stream: true` with `stream_options.include_usage`, `ignore_eos` + `max_tokens`
for exact output lengths, and an `x-tokenmill-class` header that other servers ignore.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import aiohttp

from tokenmill.bench.record import RequestRecord
from tokenmill.bench.session import Message, Session, Turn
from tokenmill.bench.tokenizer import PromptVocab
from tokenmill.cli import CLIError

REJECT_STATUSES = (429, 503)  # overload answers: counted as rejected, apart from failures


@dataclass(frozen=True)
class ClientConfig:
    target: str  # base URL: http://host:port (a trailing /v1 is fine)
    model: str
    endpoint: str = "completions"  # "completions" | "chat"
    prompt_format: str = "text"  # "tokens" (completions only) | "text"
    ignore_eos: bool = True
    request_timeout_s: float = 600.0
    api_key: str | None = None
    extra_body: dict = field(default_factory=dict)  # merged into every request body

    def __post_init__(self):
        if self.endpoint not in ("completions", "chat"):
            raise CLIError(f"--endpoint {self.endpoint!r}: choose completions or chat")
        if self.prompt_format not in ("tokens", "text"):
            raise CLIError(f"--prompt-format {self.prompt_format!r}: choose tokens or text")
        if self.prompt_format == "tokens" and self.endpoint == "chat":
            raise CLIError("--prompt-format tokens needs --endpoint completions (chat messages are text)")
        if not self.request_timeout_s > 0:
            raise CLIError("--request-timeout must be > 0")

    @property
    def url(self) -> str:
        path = "/v1/completions" if self.endpoint == "completions" else "/v1/chat/completions"
        return base_url(self.target) + path


def base_url(target: str) -> str:
    target = target.rstrip("/")
    return target[: -len("/v1")] if target.endswith("/v1") else target


class Clock:
    """Seconds since the start of a run (perf_counter based)."""

    def __init__(self):
        self.t0 = time.perf_counter()

    def __call__(self) -> float:
        return time.perf_counter() - self.t0


async def list_models(target: str, api_key: str | None = None, timeout_s: float = 10.0) -> list[dict]:
    """GET /v1/models: the served models (vLLM adds max_model_len)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    url = base_url(target) + "/v1/models"
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as http:
            async with http.get(url, headers=headers) as resp:
                if resp.status != 200:
                    raise CLIError(f"GET {url}: HTTP {resp.status} {(await resp.text())[:200]}")
                return list((await resp.json()).get("data") or [])
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as e:
        raise CLIError(f"cannot reach --target {target}: GET {url} failed ({type(e).__name__}: {e})") from None


class Client:
    """One aiohttp session for a whole run; use as `async with Client(...) as client`."""

    def __init__(self, config: ClientConfig, vocab: PromptVocab, clock: Clock):
        self.config = config
        self.vocab = vocab
        self.clock = clock
        self.http: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Client:
        connector = aiohttp.TCPConnector(limit=0, force_close=False)
        timeout = aiohttp.ClientTimeout(total=self.config.request_timeout_s)
        self.http = aiohttp.ClientSession(connector=connector, timeout=timeout)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.http.close()

    def body(self, turn: Turn, texts: dict[Message, str]) -> dict:
        cfg = self.config
        body: dict = {"model": cfg.model, "max_tokens": turn.max_tokens, "stream": True,
                      "stream_options": {"include_usage": True}, "temperature": 0.0}
        if cfg.ignore_eos:
            body["ignore_eos"] = True
        if cfg.endpoint == "chat":
            body["messages"] = [{"role": m.role, "content": self._text(m, texts)} for m in turn.messages]
        elif cfg.prompt_format == "tokens":
            body["prompt"] = turn.flat_tokens().tolist()
        else:
            body["prompt"] = "".join(self._text(m, texts) for m in turn.messages)
        body.update(cfg.extra_body)
        return body

    def _text(self, message: Message, texts: dict[Message, str]) -> str:
        if message not in texts:
            texts[message] = self.vocab.decode(message.tokens)
        return texts[message]

    async def send(self, session: Session, k: int, scheduled_s: float, texts: dict[Message, str]) -> RequestRecord:
        """Send turn k of `session`, stream the reply, and return what was measured. Never raises for
        server or network errors: those become status "rejected" or "failed" with the error."""
        turn = session.turns[k]
        body = self.body(turn, texts)
        headers = {"x-tokenmill-class": session.class_name}
        if self.config.api_key:
            headers["Authorization"] = f"Bearer {self.config.api_key}"
        rec = RequestRecord(f"{session.index}-{k}", session.class_name, session.index, k, turn.prompt_tokens,
                            turn.max_tokens, scheduled_s, sent_s=self.clock(), digest=turn.digest())
        try:
            async with self.http.post(self.config.url, json=body, headers=headers) as resp:
                rec.http_status = resp.status
                if resp.status != 200:
                    rec.status = "rejected" if resp.status in REJECT_STATUSES else "failed"
                    rec.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                else:
                    await self._read_stream(resp, rec)
        except asyncio.TimeoutError:
            rec.status, rec.error = "failed", f"timeout after {self.config.request_timeout_s:g} s"
        except (aiohttp.ClientError, json.JSONDecodeError, UnicodeDecodeError) as e:
            rec.status, rec.error = "failed", f"{type(e).__name__}: {e}"[:300]
        if rec.end_s is None:  # no [DONE] (or an error): the end of the body ends the stream
            rec.end_s = self.clock()
        if rec.ok and rec.first_token_s is None:
            rec.status, rec.error = "failed", "the stream carried no output"
        return rec

    async def _read_stream(self, resp: aiohttp.ClientResponse, rec: RequestRecord) -> None:
        chat = self.config.endpoint == "chat"
        chunks = 0
        async for raw in resp.content:  # one SSE line at a time; read to the end so the connection is reused
            line = raw.strip()
            if not line.startswith(b"data:") or rec.end_s is not None:
                continue
            data = line[5:].strip()
            t = self.clock()
            if data == b"[DONE]":
                rec.end_s = t
                continue
            event = json.loads(data)
            if event.get("error"):
                rec.status, rec.error = "failed", f"error event: {json.dumps(event['error'])[:300]}"
                rec.end_s = t
                continue
            if _has_output(event.get("choices"), chat):
                rec.chunk_s.append(t)
                if rec.first_token_s is None:
                    rec.first_token_s = t
                chunks += 1
            usage = event.get("usage")
            if usage:
                if usage.get("completion_tokens") is not None:
                    rec.output_tokens, rec.output_tokens_from_usage = int(usage["completion_tokens"]), True
                rec.usage_prompt_tokens = usage.get("prompt_tokens", rec.usage_prompt_tokens)
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
                if cached is not None:
                    rec.cached_tokens = int(cached)
        if not rec.output_tokens_from_usage:
            rec.output_tokens = chunks


def _has_output(choices: list | None, chat: bool) -> bool:
    """A chunk carries output when a choice has non-empty text (a role-only or usage-only chunk does not)."""
    for choice in choices or ():
        if chat:
            delta = choice.get("delta") or {}
            if delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls"):
                return True
        elif choice.get("text"):
            return True
    return False
