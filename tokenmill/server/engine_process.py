"""EngineProcess: the front-end's handle on an engine core running in a child process.

    handle = EngineProcess(engine_config)     # spawns `python -m tokenmill.server.engine_core`, waits for
    handle.start()                            # the model to load (ModelLoadError: the core's message)
    app = create_app(handle, ...)             # AsyncEngine talks to it over handle.sock

The handle carries what the front-end needs without the engine: the model's name and limits, a tokenizer
of its own (tokenization and chat templates stay in the front-end), and the PrefixMirror the admission
control looks prompts up in (`cached_prefix_tokens`, kept current by the core's KV events). torch is not
imported in the front-end.
"""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
from types import SimpleNamespace

from tokenmill.engine.step_budget import StepBudgetConfig
from tokenmill.errors import ModelLoadError
from tokenmill.server.engine_core import CoreFailed, CoreHello, CoreSetup, frame, recv_frame
from tokenmill.server.prefix_mirror import PrefixMirror

log = logging.getLogger("tokenmill.server")


class EngineProcess:
    in_process = False  # AsyncEngine: talk to a core process, not a local engine

    def __init__(self, engine_config, step_budget: StepBudgetConfig | None = None, log_level: str = "WARNING"):
        self.engine_config = engine_config
        self.step_budget = step_budget or StepBudgetConfig()
        self.log_level = log_level
        self.proc: subprocess.Popen | None = None
        self.sock: socket.socket | None = None
        self.hello: CoreHello | None = None

    def start(self) -> None:
        """Spawn the core and wait until its model is loaded (blocking)."""
        mine, theirs = socket.socketpair()
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tokenmill.server.engine_core", "--fd", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),), close_fds=True)
        finally:
            theirs.close()  # only the child holds it now: its exit is our EOF
        self.sock = mine
        mine.sendall(frame(CoreSetup(self.engine_config, self.step_budget, True, self.log_level)))
        try:
            hello = recv_frame(mine)
        except (ConnectionError, OSError):
            hello = None
        if not isinstance(hello, CoreHello):
            code = self.proc.wait()
            mine.close()
            if isinstance(hello, CoreFailed):
                raise ModelLoadError(hello.message)
            raise ModelLoadError(f"the engine core process exited with code {code} while starting")
        self.hello = hello
        from tokenmill.model.tokenizer import Tokenizer

        self.tokenizer = Tokenizer(hello.model_path)
        self.mirror = PrefixMirror(hello.block_size, hello.enable_prefix_caching)
        log.info("engine core process %d ready", hello.pid)

    # -- what the front-end reads -------------------------------------------------------------------
    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def model_name(self) -> str:
        return self.hello.model_name

    @property
    def max_model_len(self) -> int:
        return self.hello.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.hello.vocab_size

    @property
    def kv_capacity_tokens(self) -> int:
        return self.hello.kv_capacity_tokens

    @property
    def config(self):  # the admission control reads the step's token budget
        return SimpleNamespace(max_num_batched_tokens=self.hello.max_num_batched_tokens)

    def describe(self) -> str:
        return f"{self.hello.description}; engine core in process {self.hello.pid}"

    def cached_prefix_tokens(self, token_ids: list[int], hashes: list[int] | None = None) -> int:
        return self.mirror.cached_prefix_tokens(token_ids, hashes)

    def exit_code(self) -> int | None:
        return self.proc.poll() if self.proc is not None else None

    def wait(self, timeout: float) -> int | None:
        """Wait for the core to exit; kill it after `timeout`. Its exit code."""
        if self.proc is None:
            return None
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("engine core process %d did not stop in %.0f s; killing it", self.proc.pid, timeout)
            self.proc.kill()
            return self.proc.wait()

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
