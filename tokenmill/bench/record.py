"""What the client measured for one request. Times are seconds since the start of the run."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class RequestRecord:
    request_id: str  # "<session>-<turn>"
    class_name: str
    session: int
    turn: int
    prompt_tokens: int  # as planned (exact with a tokenizer and token-id prompts)
    max_tokens: int
    scheduled_s: float  # when it was due (arrival time, or previous reply + think time)
    sent_s: float  # when the HTTP request was issued
    digest: str = ""  # of the planned prompt and max_tokens: equal plans send equal requests
    status: str = "ok"  # "ok" | "rejected" (HTTP 429/503) | "failed" (anything else)
    http_status: int | None = None
    error: str | None = None
    first_token_s: float | None = None  # first chunk that carries output text
    end_s: float | None = None  # stream finished ([DONE] or end of body)
    chunk_s: list[float] = field(default_factory=list)  # arrival of every output-carrying chunk
    output_tokens: int = 0  # usage.completion_tokens when reported, else the number of output chunks
    output_tokens_from_usage: bool = False
    usage_prompt_tokens: int | None = None  # usage.prompt_tokens as the server counted them
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, when reported

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.sent_s

    @property
    def e2e_s(self) -> float | None:
        return None if self.end_s is None else self.end_s - self.sent_s

    @property
    def tpot_s(self) -> float | None:
        """(e2e - ttft) / (output_tokens - 1); undefined for fewer than 2 output tokens."""
        if not self.ok or self.output_tokens < 2 or self.ttft_s is None or self.e2e_s is None:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    @property
    def itl_s(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_s, self.chunk_s[1:])]

    def to_json(self) -> dict:
        row = asdict(self)
        del row["chunk_s"]
        row.update(ttft_s=self.ttft_s, tpot_s=self.tpot_s, e2e_s=self.e2e_s, itl_s=self.itl_s)
        return row
