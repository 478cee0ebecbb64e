"""Fixes: candidates from an anomaly's evidence, the proposers by family and their registry, the loop
(propose, apply, revert, status, the job's acks) and the verdict on a fix's outcome.

    candidates.py   what a proposal is; history helpers; step-size and embedding proposers
    proposers.py    the other single-process rules' proposers, and their advice
    state.py        repair-first ranking once the optimizer's state or the weights are damaged
    distributed.py  the distributed rules' proposers
    registry.py     PROPOSERS: which proposer answers which kind, built in one place
    loop.py         propose / apply / revert / status / schedule / expire
    verdict.py      effective or not: the run's outcome against its own healthy stretch
"""

from .candidates import (ACK_INTERVALS, ACK_MIN_STEPS, IRREVERSIBLE, MITIGATIONS, Candidate,
                         embedding_scale_params, fault_step, lr_rise)
from .loop import _audit, apply, expire, propose, require_run_allow, revert, schedule, status
from .registry import PROPOSERS

__all__ = ["ACK_INTERVALS", "ACK_MIN_STEPS", "IRREVERSIBLE", "MITIGATIONS", "PROPOSERS", "Candidate", "_audit",
           "apply", "embedding_scale_params", "expire", "fault_step", "lr_rise", "propose", "require_run_allow",
           "revert", "schedule", "status"]
