"""`chat`: short conversations of 2-3 turns; each turn resends the conversation so far plus a new question."""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.bench.session import Message, Session, Turn
from tokenmill.bench.workloads.registry import Workload, check, length, register_workload


@dataclass(frozen=True)
class ChatParams:
    turns_min: int = 2
    turns_max: int = 3
    prompt: int = 128  # mean tokens of a user message
    output: int = 128  # mean tokens of a reply
    system: int = 0  # tokens of a system prompt shared by every conversation
    think_s: float = 1.0  # mean (exponential) time the user takes before the next turn
    spread: float = 0.5  # lognormal sigma of the lengths; 0 = fixed lengths
    class_name: str = "interactive"

    def __post_init__(self):
        check(1 <= self.turns_min <= self.turns_max, "need 1 <= turns_min <= turns_max")
        check(self.prompt >= 1 and self.output >= 1 and self.system >= 0, "lengths must be positive")
        check(self.think_s >= 0 and self.spread >= 0, "think_s and spread must be >= 0")


@register_workload("chat")
class Chat(Workload):
    Params = ChatParams

    @property
    def mean_turns(self) -> float:
        return (self.params.turns_min + self.params.turns_max) / 2

    def session(self, index: int) -> Session:
        p: ChatParams = self.params
        rng = self.rng("session", index)
        context: tuple[Message, ...] = ()
        if p.system:
            context = (self.message("system", p.system, "system"),)
        turns = []
        for k in range(int(rng.integers(p.turns_min, p.turns_max + 1))):
            question = self.message("user", length(rng, p.prompt, p.spread), "user", index, k)
            reply_len = length(rng, p.output, p.spread)
            think = float(rng.exponential(p.think_s)) if k and p.think_s else 0.0
            context = (*context, question)
            turns.append(Turn(context, reply_len, think))
            # the next turn resends this reply as planned (the server's own text is not fed back)
            context = (*context, self.message("assistant", reply_len, "assistant", index, k))
        return Session(index, p.class_name, tuple(turns))
