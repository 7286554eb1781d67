"""`agent`: coding-agent sessions. Each turn resends the whole growing context (system prompt, repository
files, the task, earlier replies and tool outputs) plus the new tool output, waits for the reply, then
"runs the tool" (think time) and goes on. Contexts grow long; many sessions run at once."""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.bench.session import Message, Session, Turn
from tokenmill.bench.workloads.registry import Workload, check, length, register_workload


@dataclass(frozen=True)
class AgentParams:
    system: int = 2048  # tokens of the agent's system prompt, identical in every session
    repo: int = 4096  # mean tokens of repository files read at the start of a session
    repos: int = 0  # distinct repositories sessions draw from (0: every session its own)
    task: int = 128  # tokens of the user's task
    tool: int = 512  # mean tokens of one tool output (file read, test log, diff)
    output: int = 256  # mean tokens of one reply (reasoning + tool call)
    turns_min: int = 4
    turns_max: int = 12
    think_s: float = 2.0  # mean (exponential) tool-execution time between a reply and the next turn
    max_context: int = 32768  # a session ends before a turn whose prompt + output would exceed this
    spread: float = 0.5
    class_name: str = "agent"

    def __post_init__(self):
        check(1 <= self.turns_min <= self.turns_max, "need 1 <= turns_min <= turns_max")
        check(min(self.task, self.tool, self.output) >= 1 and min(self.system, self.repo, self.repos) >= 0,
              "lengths must be positive")
        check(self.think_s >= 0 and self.spread >= 0, "think_s and spread must be >= 0")
        check(self.max_context > self.system + self.task + 8 * self.output,
              "max_context must exceed system + task + 8 * output (the longest reply)")


@register_workload("agent")
class Agent(Workload):
    Params = AgentParams

    @property
    def mean_turns(self) -> float:
        return (self.params.turns_min + self.params.turns_max) / 2

    def session(self, index: int) -> Session:
        p: AgentParams = self.params
        rng = self.rng("session", index)
        repo_id = int(rng.integers(p.repos)) if p.repos else p.repos + index  # ids >= repos never collide
        room = p.max_context - p.system - p.task - 8 * p.output  # the first turn always fits
        repo_len = min(length(self.rng("repo-len", repo_id), p.repo, p.spread), room) if p.repo else 0
        context: tuple[Message, ...] = (
            self.message("system", p.system, "system"),
            self.message("user", repo_len, "repo", repo_id),
            self.message("user", p.task, "task", index),
        )
        turns = []
        for k in range(int(rng.integers(p.turns_min, p.turns_max + 1))):
            if k:
                context = (*context, self.message("user", length(rng, p.tool, p.spread), "tool", index, k))
            reply_len = length(rng, p.output, p.spread)
            think = float(rng.exponential(p.think_s)) if k and p.think_s else 0.0
            turn = Turn(context, reply_len, think)
            if turn.prompt_tokens + reply_len > p.max_context:
                break
            turns.append(turn)
            context = (*context, self.message("assistant", reply_len, "reply", index, k))
        return Session(index, p.class_name, tuple(turns))
