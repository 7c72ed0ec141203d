"""Inductor's training compile with our own inner compile: AOTAutograd differentiates the whole Dynamo
graph once (Inductor's decompositions, joint passes and min-cut partitioner, checkpoint tags
honoured as plain Inductor honours them) and hands each graph it makes to `inner_compile`, which
compiles it (backend/joint.py: in pieces). `compile_fx(model, inputs, inner_compile=...)`,
`compile_fx_inner`, `TracingContext.report_output_strides`: 2.9.1-2.15 alike."""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch


def compile_joint(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], inner_compile: Callable,
                  config_patches: dict | None = None, opaque: set | frozenset = frozenset()) -> Callable:
    """Inductor's compile_fx of gm (as installed: torch_ext's workarounds wrap it) with `inner_compile`
    for the forward, backward or inference graph AOTAutograd makes, and Inductor's decompositions
    less those of the `opaque` overloads (splitting ops stay calls: 2.9.1 decomposes CPU flash
    attention). AOTAutograd's own cache is off for it: its key does not see inner_compile and would
    hand back plain Inductor's result."""
    from torch._inductor import compile_fx as compile_fx_module
    from torch._inductor.decomposition import select_decomp_table

    with torch._functorch.config.patch(enable_autograd_cache=False), \
            torch._inductor.config.patch(config_patches or {}):
        table = {op: fn for op, fn in select_decomp_table().items() if op not in opaque}  # as patched
        return compile_fx_module.compile_fx(gm, list(example_inputs), inner_compile=inner_compile,
                                            config_patches=config_patches or None, decompositions=table)


def compile_aten_graph(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], *, is_backward: bool,
                       is_inference: bool, cudagraphs: dict | None = None) -> tuple[Callable[[list], Any], list | None]:
    """Inductor's compile of one ATen graph inside an AOTAutograd compile (a piece of its forward or
    backward graph): the boxed callable, and the strides Inductor chose for its outputs (None where
    no tracing context asks). Inside its own stride report, so the enclosing graph's stays ours.
    `cudagraphs`: compile_fx_inner's CUDA-graph arguments (cudagraphs, static_input_idxs,
    boxed_forward_device_index, graph_id), as AOTAutograd hands them to Inductor's inner compile."""
    from torch._inductor.compile_fx import compile_fx_inner

    with torch._guards.TracingContext.report_output_strides() as strides:
        compiled = compile_fx_inner(gm, list(example_inputs), is_backward=is_backward, is_inference=is_inference,
                                    **(cudagraphs or {}))
    return compiled, (list(strides) if strides is not None else None)


def compile_whole_aten_graph(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], kwargs: dict) -> Callable:
    """What Inductor's own inner compile makes of a graph AOTAutograd handed us (its keyword arguments as given)."""
    from torch._inductor.compile_fx import compile_fx_inner

    return compile_fx_inner(gm, example_inputs, **kwargs)


def enclosing_output_strides() -> list | None:
    """The list AOTAutograd reads the forward graph's output strides from (None where it reads none)."""
    context = torch._guards.TracingContext.try_get()
    return context.output_strides if context is not None else None


def op_overloads(op: Any) -> list:
    """The OpOverloads a call of `op` may be: itself (an OpOverload), every overload of a packet, none
    for anything else (a Python function). `OpOverloadPacket.overloads()`, 2.9-2.15."""
    if isinstance(op, torch._ops.OpOverload):
        return [op]
    if isinstance(op, torch._ops.OpOverloadPacket):
        return [getattr(op, name) for name in op.overloads()]
    return []


def has_autograd_formula(op: Any) -> bool:
    """Whether AOTAutograd can differentiate a call of `op` (an OpOverload or packet): a custom op of
    torch.library.custom_op with register_autograd, or any op with an Autograd kernel of its own. A
    custom op without a formula fails only once backward reaches it in eager; AOTAutograd fails at
    compile time. `torch._library.custom_ops.OPDEFS`, 2.9-2.15."""
    from torch._library.custom_ops import OPDEFS

    packet = op.overloadpacket if isinstance(op, torch._ops.OpOverload) else op
    qualname = packet._qualified_op_name
    if qualname in OPDEFS:
        return OPDEFS[qualname]._backward_fn is not None
    return any(torch._C._dispatch_has_kernel_for_dispatch_key(o.name(), key) for o in op_overloads(packet)
               for key in ("Autograd", "AutogradCPU", "AutogradCUDA", "CompositeImplicitAutograd"))


def no_cudagraphs() -> Any:
    """compile_fx_inner's `cudagraphs` argument that keeps a graph off CUDA graphs whatever
    `triton.cudagraphs` says (a piece of a graph replayed whole). `BoxedBool`, 2.9.1-2.15."""
    from torch._inductor.utils import BoxedBool

    return BoxedBool(False)


def cudagraph_trees_whole(run: Callable[[list], Any], graph: torch.fx.GraphModule, *, static_input_idxs: Sequence[int],
                          mutated_input_idxs: Sequence[int], device_index: int, is_backward: bool,
                          is_inference: bool) -> Callable[[list], Any]:
    """`run` (boxed: the split graph's straight-line code) replayed by Inductor's CUDA-graph trees as
    one graph, as Inductor's post-compile wraps a compiled graph: warm-up, record, replay; inputs
    at `static_input_idxs` read in place, the rest copied in (or the trees' own outputs). Returns a
    boxed callable. `compile_fx.cudagraphify` and `cudagraph_utils.get_placeholder_info`: 2.9.1-2.15
    (2.15 adds keyword arguments with defaults)."""
    from torch._inductor.compile_fx import cudagraphify
    from torch._inductor.cudagraph_utils import get_placeholder_info

    outputs = graph.graph.output_node().args[0]
    count = len(outputs) if isinstance(outputs, (tuple, list)) else 1
    replayed = cudagraphify(run, static_input_idxs=tuple(static_input_idxs), device_index=device_index,
                            stack_traces=[None] * count, is_backward=is_backward, is_inference=is_inference,
                            placeholders=get_placeholder_info(graph.graph),
                            mutated_input_idxs=tuple(mutated_input_idxs))
    replayed._boxed_call = True  # AOTAutograd hands it a list, as Inductor's code
    return replayed
