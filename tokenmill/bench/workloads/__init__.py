"""Workloads, registered by name: chat, agent, batch, code, shared-prefix, trace:FILE, mix:NAME=W,..."""

from tokenmill.bench.workloads import agent, batch, chat, code, mix, shared_prefix, trace  # noqa: F401  (register)
from tokenmill.bench.workloads.registry import (
    WORKLOADS,
    Workload,
    make_workload,
    register_workload,
    workload_class,
)

__all__ = ["WORKLOADS", "Workload", "make_workload", "register_workload", "workload_class"]
