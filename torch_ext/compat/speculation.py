"""Dynamo's SpeculationLog, through which torch_ext lets torch's own HOP tracing go first.

Dynamo records one SpeculationEntry per speculation point of a frame and keeps the log across the
frame's restarts (RestartAnalysis); a restart traces the frame again from its first instruction, so
whatever the abandoned attempt did (graph nodes, side effects, VTs mutated in place) is gone. The
class, `InstructionTranslatorBase.speculate()` and `SpeculationRestartAnalysis` are the same on 2.9.1
through 2.15.
"""
from __future__ import annotations

from torch._dynamo import exc as _exc

# Marks an entry whose HOP call torch refused: on the next attempt torch_ext's own tracing runs.
_OWN_PATH = "_torch_ext_own_path"


def speculation_entry(tx):
    """This point of the frame's trace (the HOP call), the same entry on every restart."""
    return tx.speculate()


def took_own_path(entry) -> bool:
    return getattr(entry, _OWN_PATH, False)


def take_own_path(tx, entry) -> None:
    """From now on (this attempt and every restart) torch_ext's own path runs at `entry`. Entries an
    earlier attempt recorded after it (inside a body torch traced, or not at all where torch reused
    a subgraph) are dropped: this attempt records its own."""
    setattr(entry, _OWN_PATH, True)
    log = tx.speculation_log
    index = next(i for i, e in enumerate(log.entries) if e is entry)
    del log.entries[index + 1:]


def restart_taking_own_path(tx, entry, reason: str):
    """Trace the frame again (nothing torch's refused attempt did survives); at `entry` torch_ext's
    own path runs."""
    take_own_path(tx, entry)
    raise _exc.SpeculationRestartAnalysis(restart_reason=reason)


def is_torch_refusal(error: Exception) -> bool:
    """Whether an error from torch's own HOP tracing means it refused the call: a graph break or hard
    error (Unsupported, UncapturedHigherOrderOpError), or an internal error on a body output it cannot
    represent (2.9.1 raises NotImplementedError from `as_proxy` of a user object). Dynamo's own control
    flow (restarts, skipping the frame) is never a refusal."""
    return not isinstance(error, (_exc.RestartAnalysis, _exc.SkipFrame))
