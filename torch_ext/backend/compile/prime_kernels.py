"""Our ops' kernels made ready before a program's first call, where the compile thread builds the program.

Inductor compiles its own kernels with the graph, but torch_ext's ops (torch_ext::decode_attention and
the like) launch Triton kernels that Triton compiles at their first launch, on the thread that calls
the program: with background compile that is the first call after the switch, a visible stall in the
token stream (about 1.3 s on an H200 cold: Triton compiling the decode-attention kernel; 0.14 s warm:
loading it and the imports its first launch makes). The compile thread runs each distinct call of our ops
once on zeros of the traced shapes, dtypes and strides, so Triton compiles (or loads) the same
specializations there. The results are thrown away; a call that fails costs the stall only.
"""
from __future__ import annotations

import contextlib
import logging

import torch
import torch.fx as fx

from torch_ext import process_lock
from torch_ext.backend.counters import counters

log = logging.getLogger("torch_ext.backend")

MAX_BYTES = 1 << 30  # a call whose inputs are larger is not primed (its zeros would be allocated for it)


def prime_kernels(gm: fx.GraphModule, devices: tuple[str, ...] = ("cuda",)) -> int:
    """Run each distinct call of a torch_ext op in gm (and its subgraphs) once on zeros shaped like its
    traced arguments, on tensors of `devices`; the number run."""
    calls = {}
    for module in gm.modules():
        if not isinstance(module, fx.GraphModule):
            continue
        for node in module.graph.nodes:
            if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) \
                    and node.target.namespace == "torch_ext":
                signature = _signature((node.args, node.kwargs), devices)
                if signature is not None and signature[1] <= MAX_BYTES:
                    calls.setdefault((node.target, signature[0]), node)
    if not calls:
        return 0
    primed = 0
    # Under the process lock where it comes (no call of the program queues work beside these), on a
    # stream of its own: a capture on another thread is neither joined nor broken.
    with process_lock.quiet(), torch.no_grad():
        stream = torch.cuda.Stream() if "cuda" in devices and torch.cuda.is_available() else None
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for (op, _), node in calls.items():
                try:
                    args, kwargs = _zeros((node.args, node.kwargs))
                    op(*args, **kwargs)
                    primed += 1
                except Exception as e:  # the first call of the program compiles it instead
                    log.debug("torch_ext: priming %s failed (%s: %s)", op, type(e).__name__, e)
        if stream is not None:
            stream.synchronize()
    counters.kernels_primed += primed
    log.info("torch_ext: %d calls of torch_ext ops run once on the compile thread (their kernels compiled "
             "or loaded before the program's first call)", primed)
    return primed


def _value(node: fx.Node):
    return node.meta.get("example_value", node.meta.get("val"))


def _hint(size) -> int | None:
    if isinstance(size, int):
        return size
    hint = getattr(getattr(size, "node", None), "hint", None)
    return int(hint) if hint is not None else None


def _signature(value, devices) -> tuple[tuple, int] | None:
    """(a hashable description of the arguments, the bytes their zeros take), or None where one cannot be
    made (a tensor without a traced value, on another device, or with a size without a hint)."""
    if isinstance(value, (list, tuple)):
        parts, total = [], 0
        for item in value:
            part = _signature(item, devices)
            if part is None:
                return None
            parts.append(part[0])
            total += part[1]
        return tuple(parts), total
    if isinstance(value, dict):
        return _signature(tuple(value.items()), devices)
    if isinstance(value, fx.Node):
        traced = _value(value)
        if isinstance(traced, torch.Tensor):
            shape = [_hint(s) for s in traced.shape]
            stride = [_hint(s) for s in traced.stride()]
            if traced.device.type not in devices or None in shape or None in stride:
                return None
            extent = 1 + sum((n - 1) * s for n, s in zip(shape, stride)) if all(shape) else 0
            return ("tensor", tuple(shape), tuple(stride), traced.dtype, str(traced.device)), \
                extent * traced.element_size()
        hint = _hint(traced) if isinstance(traced, (int, torch.SymInt)) else None
        return (("int", hint), 0) if hint is not None else None
    try:
        hash(value)
    except TypeError:
        return None
    return value, 0


def _zeros(value):
    if isinstance(value, tuple):
        return tuple(_zeros(v) for v in value)
    if isinstance(value, list):
        return [_zeros(v) for v in value]
    if isinstance(value, dict):
        return {k: _zeros(v) for k, v in value.items()}
    if isinstance(value, fx.Node):
        traced = _value(value)
        if isinstance(traced, torch.Tensor):
            shape = [_hint(s) for s in traced.shape]
            stride = [_hint(s) for s in traced.stride()]
            extent = 1 + sum((n - 1) * s for n, s in zip(shape, stride)) if all(shape) else 0
            # One zeroed storage viewed with the traced strides (an expanded input keeps its 0 strides)
            return torch.zeros(extent, dtype=traced.dtype, device=traced.device).as_strided(shape, stride)
        return _hint(traced)
    return value
