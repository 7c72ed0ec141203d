"""AOTAutograd's RNG-state HOPs called without their dispatch, where nothing needs it.

A training graph that saves or replays a random op's RNG state (checkpoint regions, and ops tagged
nondeterministic_seeded such as memory-efficient SDPA) calls `run_and_save_rng_state(op, ...)` and,
in the backward's recompute, `run_with_rng_state(state, op, ...)`. Through HigherOrderOperator's
Python dispatch (key extraction, the Autograd "not implemented" layer, BackendSelect) each call
costs 30-45 us of host time on a CPU thread where the op itself takes 4 (bench/dev/host_cost.py);
Inductor's own output code pays the same. The CPU and CUDA kernels of both HOPs are three lines
each (torch/_prims/rng_prims.py, unchanged from 2.9.1 through 2.15): they are run here directly
when the call needs no other layer: no mode, autocast or functorch transform, plain tensors on one
device (cpu or cuda, found as the HOP finds it: the first tensor argument), no `device` keyword,
and nothing that records autograd. Any other call goes through the HOP as before.
"""
from __future__ import annotations

from typing import Callable

import torch

from torch_ext.compat.runtime import no_modes_or_autocast_active

# The HOPs AOTAutograd runs a random op in with the RNG state saved (forward) or restored (recompute),
# by name. The graph-safe one (2.9.1-2.15: the partitioner's choice on one CUDA device unless
# fallback_random) takes a generator that a CUDA graph registers, so a capture replays it; the other
# two read and set the generator's state from Python, which a replay would not repeat.
GRAPH_SAFE_RNG_STATE_HOP = "graphsafe_run_with_rng_state"
RNG_STATE_HOPS = ("run_and_save_rng_state", "run_with_rng_state", GRAPH_SAFE_RNG_STATE_HOP)


def is_rng_state_hop(node) -> bool:
    """Whether an FX node calls one of RNG_STATE_HOPS."""
    return node.op == "call_function" and getattr(node.target, "__name__", None) in RNG_STATE_HOPS


def _device_of_plain(args, kwargs) -> str | None:
    """'cpu' or 'cuda' where every tensor argument is a plain tensor on that device type and no
    gradient would be recorded; else None (the HOP decides)."""
    if "device" in kwargs or not no_modes_or_autocast_active():
        return None
    device = None
    grad = torch.is_grad_enabled()
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            if type(a) is not torch.Tensor or (grad and a.requires_grad):
                return None
            if device is None:
                device = a.device.type
            elif a.device.type != device:
                return None
        elif isinstance(a, (list, tuple, torch.device)):
            return None  # tensors inside lists, or a device argument: the HOP's own rules
    return device if device in ("cpu", "cuda") else None


def _direct_save(hop):
    def run_and_save_rng_state(op, *args, **kwargs):
        device = _device_of_plain(args, kwargs)
        if device == "cuda":
            return torch.cuda.get_rng_state(), op(*args, **kwargs)
        if device == "cpu":
            return torch.get_rng_state(), op(*args, **kwargs)
        return hop(op, *args, **kwargs)
    return run_and_save_rng_state


def _direct_with(hop):
    def run_with_rng_state(rng_state, op, *args, **kwargs):
        device = _device_of_plain(args, kwargs)
        if device == "cuda":
            current = torch.cuda.get_rng_state()
            torch.cuda.set_rng_state(rng_state.cpu())
            try:
                return op(*args, **kwargs)
            finally:
                torch.cuda.set_rng_state(current)
        if device == "cpu":
            current = torch.get_rng_state()
            torch.set_rng_state(rng_state)
            try:
                return op(*args, **kwargs)
            finally:
                torch.set_rng_state(current)
        return hop(rng_state, op, *args, **kwargs)
    return run_with_rng_state


def _table() -> dict:
    try:
        from torch._prims.rng_prims import run_and_save_rng_state, run_with_rng_state
    except ImportError:  # a torch without them: nothing to replace
        return {}
    return {run_and_save_rng_state: _direct_save(run_and_save_rng_state),
            run_with_rng_state: _direct_with(run_with_rng_state)}


_DIRECT: dict | None = None


def direct_hop_call(target: Callable) -> Callable:
    """What generated code should call for `target`: the direct form of an RNG-state HOP, else target."""
    global _DIRECT
    if _DIRECT is None:
        _DIRECT = _table()
    return _DIRECT.get(target, target)
