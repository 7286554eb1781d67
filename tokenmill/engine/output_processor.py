"""OutputProcessor: token ids -> text, stop strings, and the request's final output, for every request in flight.

The engine core decides what needs no text (EOS, stop token ids, max_tokens, the context length); this
class decides what does, from the core's per-step outputs (`new_token_ids`, empty `text`/`new_text`):

    process_step(core outputs) -> (outputs with text, request ids it finished that the core has not)

- text: each request's tokens are detokenized incrementally (engine/detokenizer.py), one token at a time
  so a stop string is found at the token that completes it, wherever the string's pieces fell (several
  tokens, several steps, several tokens of one step under speculative decoding);
- stop strings: once `min_tokens` tokens exist, the first stop string found ends the request:
  finish_reason "stop", stop_reason the string, the text cut before it (never included), `new_token_ids`
  and `new_logprobs` cut after the token that completed it. While streaming, text that could still turn
  into a stop string is held back until it cannot (IncrementalDetokenizer.take);
- token counts: `output_token_ids` (and so `usage.completion_tokens`) are the tokens generated up to and
  including the one that completed the stop string (vLLM's count); tokens the core generated after it are
  dropped. A token that finished the request in the core (EOS, a stop token id) is counted, not detokenized.

One class, two places: LLMEngine uses it in its own step() (offline `LLM`, and the server's thread mode),
and finishes the requests it stops at once; under `tokenmill serve`'s core process the front-end uses it
(server/async_engine.py) and sends the core an abort for each request it stopped, in its next command
frame (the core's KV blocks are freed before the step after; outputs the core made meanwhile are dropped).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.engine.outputs import RequestOutput
from tokenmill.engine.sampling_params import SamplingParams
from tokenmill.model.tokenizer import Tokenizer


@dataclass
class _RequestText:
    detok: IncrementalDetokenizer
    min_tokens: int
    token_ids: list[int] = field(default_factory=list)  # every output token so far (the live list)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._reqs: dict[str, _RequestText] = {}

    def add(self, request_id: str, params: SamplingParams) -> None:
        self._reqs[request_id] = _RequestText(IncrementalDetokenizer(self.tokenizer, params.stop), params.min_tokens)

    def forget(self, request_id: str) -> None:
        """The request is gone (aborted, failed to add): its later outputs, if any, are dropped."""
        self._reqs.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._reqs

    def __len__(self) -> int:
        return len(self._reqs)

    def process_step(self, outputs: list[RequestOutput]) -> tuple[list[RequestOutput], list[str]]:
        """The outputs of one core step, with text; outputs of requests not (or no longer) here are dropped.
        Also returns the ids of the requests a stop string finished while the core still runs them."""
        done, stopped = [], []
        for out in outputs:
            st = self._reqs.get(out.request_id)
            if st is None:
                continue
            res = self._process(st, out)
            if res.finished:
                del self._reqs[out.request_id]
                if not out.finished:
                    stopped.append(out.request_id)
            done.append(res)
        return done, stopped

    def _process(self, st: _RequestText, out: RequestOutput) -> RequestOutput:
        detok = st.detok
        if out.finished and out.finish_reason not in ("stop", "length"):  # error / abort: no text to make
            st.token_ids.extend(out.new_token_ids)
            return RequestOutput(out.request_id, out.new_token_ids, "", detok.text, st.token_ids,
                                 out.num_prompt_tokens, out.num_cached_tokens, True, out.finish_reason,
                                 out.stop_reason, out.new_logprobs, out.error)
        toks = out.new_token_ids
        last = len(toks) - 1
        core_stop_token = out.finished and out.finish_reason == "stop"  # EOS / a stop token id: no text
        hit, taken = None, len(toks)
        for i, tok in enumerate(toks):
            st.token_ids.append(tok)
            if core_stop_token and i == last:
                break
            check = len(st.token_ids) >= st.min_tokens
            hit = detok.add(tok, check_stop=check)
            if hit is not None:
                taken = i + 1
                break
        if hit is not None:
            finished, reason, stop_reason = True, "stop", hit
        else:
            finished, reason, stop_reason = out.finished, out.finish_reason, out.stop_reason
        lps = out.new_logprobs
        return RequestOutput(
            out.request_id, toks if taken == len(toks) else toks[:taken], detok.take(finished), detok.text,
            st.token_ids, out.num_prompt_tokens, out.num_cached_tokens, finished, reason, stop_reason,
            lps if lps is None or taken >= len(lps) else lps[:taken], out.error)
