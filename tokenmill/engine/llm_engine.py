"""LLMEngine: step() = schedule -> execute -> postprocess. Synchronous and single-threaded by design;
the server runs it in its own thread, the simulator swaps the runner for a cost model."""

from __future__ import annotations

import logging
import time

import torch

from tokenmill.engine.config import EngineConfig, kv_storage_dtype
from tokenmill.engine.kv.kv_manager import KVCacheManager
from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.engine.outputs import EngineStats, RequestOutput
from tokenmill.engine.request import Request, RequestStatus
from tokenmill.engine.runner import ModelOutput, ModelRunner
from tokenmill.engine.sampler import SampleResult, Sampler
from tokenmill.engine.sampling_params import SamplingParams
from tokenmill.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from tokenmill.engine.step_budget import step_composition
from tokenmill.errors import EngineOverloadedError, InvalidRequestError, ModelLoadError
from tokenmill.model.config import ModelConfig
from tokenmill.model.linear import any_row_bits_kernels, small_bits_kernels
from tokenmill.hardware import capabilities
from tokenmill.model.loader import load_model, pick_device, pick_dtype, resolve_model_path
from tokenmill.model.tokenizer import Tokenizer

log = logging.getLogger("tokenmill.engine")

TIER_IDLE_WAIT_S = 0.005  # a step with only parked requests waits this long at most for a tier load


class LLMEngine:
    """`detokenize=False` (the core process of `tokenmill serve`): outputs carry token ids only, and stop
    strings are the caller's (its OutputProcessor finishes those requests and aborts them here)."""

    def __init__(self, config: EngineConfig | None = None, *, detokenize: bool = True, **kwargs):
        self.config = config or EngineConfig.from_kwargs(**kwargs)
        c = self.config
        if c.num_threads:
            torch.set_num_threads(c.num_threads)
        self.model_path = resolve_model_path(c.model)
        self.model_name = c.model
        self.model_config = cfg = ModelConfig.from_dir(self.model_path)
        self.tokenizer = Tokenizer(self.model_path)
        self.device = pick_device(c.device)
        self.dtype = pick_dtype(c.dtype, cfg, self.device)
        self.kv_dtype = kv_storage_dtype(c.kv_cache_dtype, self.dtype)
        block_bytes = ModelRunner.kv_bytes_per_block(cfg, c.block_size, self.kv_dtype)
        if c.spec_enabled and c.speculative_model != "ngram":  # a draft model's KV shares the blocks
            from tokenmill.engine.spec.proposers import draft_model_config

            block_bytes += ModelRunner.kv_bytes_per_block(draft_model_config(c.speculative_model, cfg)[1],
                                                          c.block_size, self.kv_dtype)
        num_blocks = c.kv_cache_bytes // block_bytes
        if num_blocks < 1:
            raise ModelLoadError(f"kv_cache_bytes={c.kv_cache_bytes} holds no block of {c.block_size} tokens "
                                 f"({block_bytes} bytes each)")
        self.kv_capacity_tokens = num_blocks * c.block_size
        if c.max_model_len is not None and c.max_model_len > cfg.max_position_embeddings:
            raise ModelLoadError(f"max_model_len={c.max_model_len} exceeds the model's max_position_embeddings="
                                 f"{cfg.max_position_embeddings}")
        self.max_model_len = min(c.max_model_len or cfg.max_position_embeddings, self.kv_capacity_tokens)
        if c.max_model_len and c.max_model_len > self.kv_capacity_tokens:
            raise ModelLoadError(f"max_model_len={c.max_model_len} does not fit the KV cache "
                                 f"({self.kv_capacity_tokens} tokens); raise kv_cache_bytes or lower max_model_len")
        model = load_model(self.model_path, cfg, self.device, self.dtype, max_positions=self.max_model_len,
                           quantization=c.quantization)
        window = cfg.sliding_window if cfg.sliding_window and cfg.sliding_window < self.max_model_len else None
        if c.cuda_graphs and self.device.type != "cuda":
            raise ModelLoadError(f"cuda_graphs (--cuda-graphs) needs a CUDA device; the engine is on {self.device}")
        self.runner = ModelRunner(model, cfg, self.device, self.dtype, num_blocks, c.block_size, window,
                                  kv_dtype=self.kv_dtype, scratch_block=c.cuda_graphs)
        cuda_tiles = self.device.type == "cuda" and c.batch_invariant in ("on", "strict")
        if cuda_tiles and (c.quantization != "none" or self.kv_dtype != self.dtype or c.cuda_graphs):
            why = (f"--quantization {c.quantization}" if c.quantization != "none" else
                   "--cuda-graphs (a captured decode step is not computed by fixed tiles)" if c.cuda_graphs else
                   f"--kv-cache-dtype {c.kv_cache_dtype}")
            raise ModelLoadError(
                f"batch_invariant={c.batch_invariant!r} (--batch-invariant) on CUDA computes every step by fixed "
                f"tiles in the model's own dtype (model/invariant.py); not with {why}. Use --batch-invariant off")
        if not cuda_tiles and c.batch_invariant in ("on", "strict") and not (
                self.device.type == "cpu" and small_bits_kernels(model)):
            why = (f"the engine is on {self.device.type}" if self.device.type != "cpu" else
                   f"--quantization {c.quantization}" if c.quantization != "none" else
                   "no C++ CPU kernels (TOKENMILL_CPU_KERNELS=0, or they did not build here)")
            raise ModelLoadError(
                f"batch_invariant={c.batch_invariant!r} (--batch-invariant) needs every linear on the engine's C++ CPU "
                f"kernels, unquantized fp32/bf16; here: {why}. Use --batch-invariant auto|off")
        self.batch_invariant = c.batch_invariant in ("on", "strict") or (
            c.batch_invariant == "auto" and self.device.type == "cpu" and any_row_bits_kernels(model))
        self.runner.batch_invariant = self.batch_invariant
        # on CUDA every row attends as a decode row (fixed tiles have no prefill kernel whose chunking is invariant)
        self.runner.invariant_attention = "strict" if c.batch_invariant == "strict" or cuda_tiles else "on"
        self.runner.tiles = cuda_tiles
        if c.cuda_graphs:
            from tokenmill.engine import graphs

            b = graphs.max_graph_batch(c.max_num_seqs, self.max_model_len)
            if b < 1:
                raise ModelLoadError(f"cuda_graphs (--cuda-graphs): a captured decode step gathers max_model_len "
                                     f"({self.max_model_len}) tokens per sequence per layer; lower --max-model-len "
                                     f"to at most {graphs.GATHER_TOKENS}")
            self.runner.enable_graphs(b, self.max_model_len)
        self.kv = KVCacheManager(num_blocks, c.block_size, c.enable_prefix_caching)
        self.scheduler = Scheduler(SchedulerConfig(c.max_num_batched_tokens, c.max_num_seqs, c.max_waiting_requests),
                                   self.kv)
        self.tiers = self._make_tiers(window) if c.kv_tiers_enabled else None
        self.spec = self._make_spec(num_blocks) if c.spec_enabled else None  # None: speculation off, step unchanged
        self.sampler = Sampler(c.seed)
        self.eos_token_ids = set(cfg.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self.output_processor = OutputProcessor(self.tokenizer) if detokenize else None  # text + stop strings
        self._gens: dict[str, torch.Generator] = {}
        self.num_steps = 0
        self.last_first_scheduled: list[str] = []  # ids the last step scheduled for the first time
        self.last_step_decodes = 0  # the last step's composition (for a step-time model)
        self.last_step_prefill_tokens = 0
        self.last_sched = None  # the last step's SchedulerOutput (diagnostics: the core's TOKENMILL_STEP_TRACE)
        self.prompt_tokens_total = 0  # prompt tokens of admitted requests
        self.generation_tokens_total = 0

    def _make_tiers(self, window):
        import os

        from tokenmill.engine.tiers.keys import model_fingerprint, weights_digest
        from tokenmill.engine.tiers.manager import KVTiers
        from tokenmill.engine.tiers.store import FileStore

        c = self.config
        fp = model_fingerprint(weights_digest(self.model_path), self.model_config.architecture,
                               str(self.dtype).replace("torch.", ""), str(self.kv_dtype).replace("torch.", ""),
                               c.block_size, c.quantization, self.runner.kv_block_layout(), window)
        stores = []
        specs = []
        if c.kv_host_bytes:
            specs.append(("host", c.kv_host_dir or "/dev/shm/tokenmill-kv", c.kv_host_bytes, False, "kv_host_dir"))
        if c.kv_disk_dir:
            specs.append(("disk", c.kv_disk_dir, c.kv_disk_bytes, c.kv_disk_fsync, "kv_disk_dir"))
        for name, path, cap, fsync, opt in specs:
            try:
                stores.append(FileStore(name, os.path.expanduser(path), cap, fsync=fsync))
            except OSError as e:
                raise ModelLoadError(f"{opt}={path!r}: cannot use it for the {name} KV tier: {e}") from None
        return KVTiers(stores, fp, self.runner, self.kv, load_timeout_s=c.kv_load_timeout_s)

    def _make_spec(self, num_blocks: int):
        from tokenmill.engine.spec.decoder import SpecDecoder
        from tokenmill.engine.spec.proposers import make_proposer

        c = self.config
        proposer = make_proposer(c, self.model_config, self.device, self.dtype, num_blocks, c.block_size,
                                 self.max_model_len, self.kv_dtype)
        return SpecDecoder(proposer, c.num_speculative_tokens, c.speculative_max_k, self.max_model_len)

    # -- requests -------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams | None = None,
                    priority: int = 0, ttft_deadline: float | None = None, tpot_slo_s: float | None = None,
                    rank: int = 0) -> None:
        """Queue a request. `ttft_deadline` (on the clock the caller passes to `step(now=...)`) orders waiting
        requests earliest-deadline-first within a priority level and demotes them once missed;
        `tpot_slo_s` lets the caller size steps (`tightest_tpot_slo_s`) so its decode keeps that pace; `rank`
        orders waiting requests within a priority level before their deadlines (lower first)."""
        params = params or SamplingParams()
        n = len(prompt_token_ids)
        if n == 0:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        vocab = self.model_config.vocab_size
        if any((not isinstance(t, int)) or t < 0 or t >= vocab for t in prompt_token_ids):
            raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab})", param="prompt")
        if n + params.max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{n + params.max_tokens} tokens ({n} in the prompt, {params.max_tokens} in the completion).",
                param="max_tokens")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise InvalidRequestError("priority must be an integer", param="priority")
        if request_id in self.scheduler.requests:
            raise InvalidRequestError(f"duplicate request id {request_id!r}", param="request_id")
        if self.scheduler.num_waiting >= self.config.max_waiting_requests:
            raise EngineOverloadedError(f"waiting queue is full ({self.config.max_waiting_requests} requests)")
        req = Request(request_id, list(prompt_token_ids), params, priority=priority, max_total_tokens=self.max_model_len,
                      ttft_deadline=float("inf") if ttft_deadline is None else ttft_deadline, tpot_slo_s=tpot_slo_s,
                      rank=rank)
        self.scheduler.add(req)
        if self.output_processor is not None:
            self.output_processor.add(request_id, params)
        if params.seed is not None:
            self._gens[request_id] = torch.Generator().manual_seed(params.seed)
        self.prompt_tokens_total += n

    def abort_request(self, request_id: str) -> None:
        req = self.scheduler.requests.get(request_id)
        if req is not None:
            self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
            self._forget(request_id)
        if self.output_processor is not None:
            self.output_processor.forget(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def cached_prefix_tokens(self, prompt_token_ids: list[int], hashes: list[int] | None = None) -> int:
        """Prompt tokens the prefix cache would serve now (an estimate; safe from another thread). `hashes`:
        a list the caller keeps per prompt, so a re-decided request is not hashed again."""
        return self.kv.cached_prefix_tokens(prompt_token_ids, hashes)

    def tightest_tpot_slo_s(self) -> float | None:
        """The least TPOT promised to a request decoding now (None: none promised)."""
        return self.scheduler.tightest_tpot_slo_s()

    def num_decoding(self) -> int:
        return self.scheduler.num_decoding()

    # -- the step -------------------------------------------------------------------------------
    def step(self, now: float | None = None, token_budget: int | None = None) -> list[RequestOutput]:
        """Schedule, execute, and make output. `now`: the caller's clock for TTFT deadlines (None: ignore
        them); `token_budget`: at most this many tokens in this step (default max_num_batched_tokens)."""
        outs = self._step(now, token_budget)
        if self.output_processor is None or not outs:
            return outs
        outs, stopped = self.output_processor.process_step(outs)
        for rid in stopped:  # a stop string ended it: finished now, as the core process does on the abort
            req = self.scheduler.requests.get(rid)
            if req is not None:
                self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED)
                self._forget(rid)
        return outs

    def _step(self, now: float | None, token_budget: int | None) -> list[RequestOutput]:
        if self.tiers is not None:
            self._tier_loads()
        spec = self.spec
        if spec is None:
            sched = self.scheduler.schedule(now, token_budget)
        else:
            sched = self.scheduler.schedule(now, token_budget, spec.plan(self.scheduler, token_budget))
        if self.tiers is not None and sched.preempted:
            self.tiers.preempted(sched.preempted)
        self.last_first_scheduled = sched.first_scheduled  # for callers that time the waiting phase
        self.last_step_decodes, self.last_step_prefill_tokens = step_composition(sched)
        self.last_sched = sched
        if sched.empty:
            if self.tiers is not None and self.tiers.loading:  # only parked requests: wait for a load, briefly
                self.tiers.wait(min(TIER_IDLE_WAIT_S, self.tiers.next_deadline() - time.perf_counter()))
            return []
        self.num_steps += 1
        try:
            if spec is not None:
                spec.propose(sched, self.scheduler.requests, self._gens)
            t0 = time.perf_counter()
            speculating = spec is not None and any(s.num_spec_slots for s in sched.seqs)
            # the sampler takes logits in the head's dtype; the verifier wants fp32 (a step where no sequence
            # speculates, e.g. auto chose k = 0 for all, is sampled exactly as with speculation off)
            # all-greedy steps without logprobs: the runner may return the tokens (lm_head fused with the argmax);
            # greedy verification needs only each row's argmax too (the same tokens: no [rows, vocab] fp32 logits)
            greedy = all(
                self.scheduler.requests[s.request_id].params.greedy
                and self.scheduler.requests[s.request_id].params.logprobs is None
                for s in sched.seqs if s.num_logits > 0)
            model_out = self.runner.execute(sched, float_logits=speculating, greedy=greedy)
            exec_s = time.perf_counter() - t0
        except Exception as e:  # noqa: BLE001 - fail the batch, not the engine
            log.exception("model execution failed")
            return self._fail_batch(sched, f"engine error: {type(e).__name__}: {e}")
        if self.tiers is not None:
            try:
                self.tiers.observe_step(exec_s, sched)
                self.tiers.store_computed(sched, self.scheduler.requests)  # write-through, before blocks are freed
            except Exception:  # noqa: BLE001
                log.exception("KV tier store failed")
        if spec is None:
            return self._postprocess(sched, model_out)
        outs = self._postprocess_spec(sched, model_out) if speculating else self._postprocess(sched, model_out)
        spec.observe_step(sched)  # the step's measured time feeds the auto policy's cost model
        return outs

    def _postprocess_spec(self, sched: SchedulerOutput, out: ModelOutput) -> list[RequestOutput]:
        """_postprocess with speculative sequences: each may emit several tokens (spec/decoder.py)."""
        from tokenmill.engine.spec.decoder import logprobs_for

        spec = self.spec
        plain = [(i, s) for i, s in enumerate(sched.seqs) if s.num_logits > 0 and not s.num_spec_slots]
        emitted: dict[str, tuple[list[int], list]] = {}
        argmax = out.tokens.tolist() if out.tokens is not None else None  # an all-greedy step: the rows' argmax
        if plain:
            reqs = [self.scheduler.requests[s.request_id] for _, s in plain]
            rows = [out.logit_offsets[i] + s.num_logits - 1 for i, s in plain]
            if argmax is not None:
                result = SampleResult([argmax[r] for r in rows], [None] * len(rows))
            else:
                result = self.sampler.sample(out.logits.index_select(0, torch.tensor(rows, device=out.logits.device)),
                                             [r.params for r in reqs], [self._gens.get(r.request_id) for r in reqs])
            for r, tok, lp in zip(reqs, result.token_ids, result.logprobs):
                emitted[r.request_id] = ([tok], [lp] if lp is not None else None)
        verified = {}
        for i, s in enumerate(sched.seqs):
            if not s.num_spec_slots:
                continue
            req = self.scheduler.requests[s.request_id]
            lo, hi = out.logit_offsets[i], out.logit_offsets[i] + s.num_logits
            if argmax is not None:
                toks, kept = spec.verify_argmax(req, argmax[lo:hi])
                emitted[s.request_id] = (toks, None)
            else:
                rows = out.logits[lo:hi]
                toks, kept = spec.verify(req, rows, self._gens.get(req.request_id), self.sampler.default_gen)
                emitted[s.request_id] = (toks, logprobs_for(rows, toks, req.params.logprobs))
            verified[s.request_id] = kept
        outputs = []
        for s in sched.seqs:
            if s.request_id not in emitted:
                continue
            req = self.scheduler.requests[s.request_id]
            toks, lps = emitted[s.request_id]
            status, new = None, []
            for tok in toks:
                req.append_output(tok)
                new.append(tok)
                self.generation_tokens_total += 1
                status = self._check_stop(req, tok)
                if status is not None:
                    break
            finished = status is not None
            if finished:
                self.scheduler.finish(req, status)
            elif req.request_id in verified:
                spec.rollback(self.scheduler, req, verified[req.request_id])
            outputs.append(RequestOutput(
                request_id=req.request_id, new_token_ids=new, new_text="", text="",
                output_token_ids=req.output_token_ids, num_prompt_tokens=req.num_prompt_tokens,
                num_cached_tokens=max(req.num_cached_tokens, 0), finished=finished,
                finish_reason=status.value if status else None, stop_reason=req.stop_reason,
                new_logprobs=lps[:len(new)] if lps is not None else None))
            if finished:
                self._forget(req.request_id)
        return outputs

    def _tier_loads(self) -> None:
        """Tier loads run beside the steps (engine/tiers/manager.py): see `tier_loads`."""
        # load deadlines are the engine's own, on its own clock: not the scheduler's
        tier_loads(self.tiers, self.scheduler, time.perf_counter())

    def _postprocess(self, sched: SchedulerOutput, out: ModelOutput) -> list[RequestOutput]:
        seqs = [(i, s) for i, s in enumerate(sched.seqs) if s.num_logits > 0]
        if not seqs:
            return []
        reqs = [self.scheduler.requests[s.request_id] for _, s in seqs]
        rows = [out.logit_offsets[i] + s.num_logits - 1 for i, s in seqs]
        if out.tokens is not None:  # the runner took the argmax already (an all-greedy step, no logprobs)
            all_tokens = out.tokens.tolist()
            result = SampleResult([all_tokens[r] for r in rows], [None] * len(rows))
        else:
            logits = out.logits
            if rows != list(range(logits.shape[0])):  # a pure decode step samples every row in order: no copy
                logits = logits.index_select(0, torch.tensor(rows, device=logits.device))
            result = self.sampler.sample(logits, [r.params for r in reqs],
                                         [self._gens.get(r.request_id) for r in reqs])
        outputs = []
        for req, tok, lp in zip(reqs, result.token_ids, result.logprobs):
            req.append_output(tok)
            self.generation_tokens_total += 1
            status = self._check_stop(req, tok)
            finished = status is not None
            if finished:
                self.scheduler.finish(req, status)
            outputs.append(RequestOutput(
                request_id=req.request_id, new_token_ids=[tok], new_text="", text="",
                output_token_ids=req.output_token_ids, num_prompt_tokens=req.num_prompt_tokens,
                num_cached_tokens=max(req.num_cached_tokens, 0), finished=finished,
                finish_reason=status.value if status else None, stop_reason=req.stop_reason,
                new_logprobs=[lp] if lp is not None else None))
            if finished:
                self._forget(req.request_id)
        return outputs

    def _check_stop(self, req: Request, tok: int) -> RequestStatus | None:
        """What needs no text: EOS, stop token ids, max_tokens, the context length (stop strings: the
        OutputProcessor's)."""
        p = req.params
        n_out = len(req.output_token_ids)
        if n_out >= p.min_tokens and ((tok in self.eos_token_ids and not p.ignore_eos) or tok in p.stop_token_ids):
            req.stop_reason = tok if tok in p.stop_token_ids else None
            return RequestStatus.FINISHED_STOPPED
        if n_out >= p.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _fail_batch(self, sched: SchedulerOutput, message: str) -> list[RequestOutput]:
        outputs = []
        for s in sched.seqs:
            req = self.scheduler.requests.get(s.request_id)
            if req is None:
                continue
            self.scheduler.finish(req, RequestStatus.FINISHED_ERROR)
            self._forget(req.request_id)
            outputs.append(RequestOutput(
                request_id=req.request_id, new_token_ids=[], new_text="", text="",
                output_token_ids=req.output_token_ids, num_prompt_tokens=req.num_prompt_tokens,
                num_cached_tokens=max(req.num_cached_tokens, 0), finished=True, finish_reason="error",
                error=message))
        self.kv.pool.reset_prefix_cache()  # blocks registered this step may hold no valid KV
        return outputs

    def _forget(self, request_id: str) -> None:
        if self.tiers is not None:
            self.tiers.forget(request_id)
        self._gens.pop(request_id, None)
        if self.spec is not None:
            self.spec.forget(request_id)

    # -- introspection --------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        s, pool = self.scheduler, self.kv.pool
        return EngineStats(
            num_running=s.num_running, num_waiting=s.num_waiting, num_preempted_total=s.num_preemptions,
            kv_blocks_total=pool.num_blocks, kv_blocks_used=pool.num_used, block_size=self.kv.block_size,
            waiting_uncached_prompt_tokens=s.waiting_uncached_prompt_tokens(),
            prefix_cache_queries_tokens=self.kv.prefix_queries_tokens,
            prefix_cache_hits_tokens=self.kv.prefix_hits_tokens,
            prompt_tokens_total=self.prompt_tokens_total, generation_tokens_total=self.generation_tokens_total,
            num_steps=self.num_steps, kv_tiers=self.tiers.stats() if self.tiers is not None else {},
            kv_tiers_engine=self.tiers.engine_stats() if self.tiers is not None else {},
            spec=self.spec.stats.copy() if self.spec is not None else None,
            kv_blocks_cached=len(pool.cached), kv_evictions_total=pool.num_evictions,
            batch_invariant=self.batch_invariant)

    def _weights_note(self) -> str:
        if self.model_config.quantization:
            kind = "fp8" if self.model_config.quantization.endswith("-fp8") else "int8"
            return f" with {kind} weights (W8A8, pre-quantized checkpoint)"
        q = self.config.quantization
        emulated = q == "fp8" and self.device.type != "cuda"  # no fp8 instructions on CPUs: _scaled_mm converts
        return "" if q == "none" else f" with {q} weights (W8A8{', emulated' if emulated else ''})"

    def _spec_note(self) -> str:
        c = self.config
        if self.spec is None:
            return ""
        return f"speculative decoding {c.speculative_model} k={c.num_speculative_tokens}; "

    def _graphs_note(self) -> str:
        g = self.runner.graphs
        return "" if g is None else f"CUDA graphs for decode steps of 1..{g.max_batch} sequences; "

    def describe(self) -> str:
        c, cfg = self.config, self.model_config
        return (f"model {self.model_name} ({cfg.architecture}, {cfg.num_params() / 1e6:.1f}M params) on "
                f"{self.device} in {str(self.dtype).replace('torch.', '')}"
                f"{self._weights_note()}; KV cache ({str(self.kv_dtype).replace('torch.', '')}) {self.kv.pool.num_blocks} "
                f"blocks x {c.block_size} = {self.kv_capacity_tokens} tokens; max_model_len {self.max_model_len}; "
                f"prefix caching {'on' if c.enable_prefix_caching else 'off'}; "
                f"{self._graphs_note()}"
                f"{self._spec_note()}"
                f"{self.tiers.describe() + '; ' if self.tiers is not None else ''}{capabilities().summary()}")


def tier_loads(tiers, scheduler, now: float) -> None:
    """Install the finished tier loads (their requests return to the waiting order), then queue reads for the
    next waiting requests (parked meanwhile). LLMEngine runs it before each schedule() on time.perf_counter();
    the simulator (sim/tiers.py) runs this same function on its virtual clock."""
    try:
        for rid in tiers.complete(now):
            scheduler.unpark(rid)
        waiting = sorted(scheduler.waiting_requests(include_parked=False), key=lambda r: r.waiting_key)
        for rid in tiers.prefetch(waiting, now):
            scheduler.park(rid)
    except Exception:  # noqa: BLE001 - a tier failure is a miss, never a failed step or a stuck request
        log.exception("KV tier load failed")
        try:
            for rid in tiers.cancel_all():
                scheduler.unpark(rid)
        except Exception:  # noqa: BLE001
            log.exception("KV tier cancel failed")
        for rid in list(scheduler.parked):
            scheduler.unpark(rid)
