"""Wrong results of torch itself that torch_ext users can meet, and how torch_ext avoids each.

`install()` applies them (and `uninstall()` takes them back); the backend applies the Inductor one
to every piece it compiles. Each is pinned with a vanilla program in tests/test_torch_bugs.py as a
strict xfail, so a torch release that fixes one shows up there.

1. Inductor reuses, or writes in place into, buffers that an `invoke_subgraph` call still needs
   (its outputs alias its inputs or each other: saved activations, gradients of `h + residual`):
   wrong gradients from chained or repeated `nested_compile_region` calls. Avoided by compiling
   graphs that call `invoke_subgraph` with `allow_buffer_reuse=False, inplace_buffers=False`.
2. torch 2.9.1 caches an `invoke_subgraph` backward graph by tangent shapes alone; traced once
   with two tangents that are the same tensor, it reads only one of them when reused for distinct
   ones (`f(f(x)[0])` on aot_eager/inductor). Avoided by handing it distinct tangents (views).
3. Not a wrong result, a crash (before 2.14): `invoke_subgraph`'s autograd needs fake tensors, so a
   region needing gradients fails under `backend="eager"`. At run time a region just runs its
   body, so outside of tracing the body runs with ordinary autograd.
4. An activation checkpoint that runs outside of tracing (`backend="eager"`, Dynamo only, as one
   debugs) recomputes its body in backward with `preserve_rng_state=False` (what AOTAutograd needs
   while tracing): dropout draws a new mask, **wrong gradients** (2.13, 2.14.1; with a `context_fn`
   also 2.9.1). Avoided: on real tensors outside of tracing the body is checkpointed as eager
   `checkpoint` does it (the user's `preserve_rng_state`, default True, and `context_fn`).
5. Not a wrong result, a crash (2.9.1): a region inside another HOP's body fails AOTAutograd when
   gradients are needed. Avoided in torch_ext's region tracing (variables/invoke_subgraph.py): such
   an inner region is traced inline.
6. Not a wrong result, a crash (2.9.1): Inductor fails on an activation checkpoint whose body
   draws random numbers, with dynamic shapes, in training (AOTAutograd's partitioner). Avoided by
   compiling graphs with a checkpoint and dynamic shapes with `fallback_random=True` (eager's RNG
   ops: same masks as eager for the same seed; other graphs are untouched).
7. torch's subgraph reuse (2.12+) stamps out the second and later calls of a `nested_compile_region`
   as a plain tuple, whatever the body returned: a namedtuple or a list of tensors comes back as a
   tuple, so `isinstance(out, NT)` is False (**silently another branch**) and `out.a` fails. Avoided:
   only a result that is a tensor or a plain tuple is reused; other calls are traced as the first was
   (the same body, installed once).
"""
from __future__ import annotations

import functools
import importlib
import inspect
import logging

import torch
import torch.fx as fx

from torch_ext import compat
from torch_ext.patch_on_import import patch_when_imported

log = logging.getLogger(__name__)

NO_REGION_BUFFER_REUSE = {"allow_buffer_reuse": False, "inplace_buffers": False}


def calls_invoke_subgraph(gm: fx.GraphModule) -> bool:
    """Whether gm, or a subgraph of it, calls invoke_subgraph."""
    hop = torch._higher_order_ops.invoke_subgraph
    return any(
        node.target is hop
        for module in gm.modules() if isinstance(module, fx.GraphModule)
        for node in module.graph.find_nodes(op="call_function", target=hop)
    )


def _calls_regions(gm) -> bool:
    return isinstance(gm, fx.GraphModule) and calls_invoke_subgraph(gm)


def _region_patches() -> dict:
    """The Inductor config a graph calling regions needs (bug 1), minus what is in force already:
    compile_fx applies its patches and calls itself again."""
    if not compat.INDUCTOR_REUSES_REGION_BUFFERS:
        return {}
    patches = {key: value for key, value in NO_REGION_BUFFER_REUSE.items()
               if getattr(torch._inductor.config, key) != value}
    if patches:
        _say_once("torch_ext: compiling a graph that calls nested_compile_region regions with Inductor's "
                  "allow_buffer_reuse=False, inplace_buffers=False (torch %s reuses buffers of region calls "
                  "and computes wrong gradients otherwise)", torch.__version__)
    return patches


def _checkpoint_rng_patches(gm) -> dict:
    """fallback_random for a graph with an activation checkpoint and dynamic shapes (bug 6); whether
    the body draws random numbers does not matter: the option changes only random ops."""
    if not (compat.PARTITIONER_FAILS_ON_DYNAMIC_CHECKPOINTED_RNG and isinstance(gm, fx.GraphModule)
            and not torch._inductor.config.fallback_random and _calls_checkpoint(gm) and _has_symbols(gm)):
        return {}
    _say_once("torch_ext: compiling a graph with an activation checkpoint and dynamic shapes with Inductor's "
              "fallback_random=True (torch %s fails to partition checkpointed random ops otherwise)",
              torch.__version__)
    return {"fallback_random": True}


def _calls_checkpoint(gm: fx.GraphModule) -> bool:
    hop = torch._higher_order_ops.tag_activation_checkpoint
    return any(node.target is hop for module in gm.modules() if isinstance(module, fx.GraphModule)
               for node in module.graph.find_nodes(op="call_function", target=hop))


def _has_symbols(gm: fx.GraphModule) -> bool:
    for node in gm.graph.find_nodes(op="placeholder"):
        value = node.meta.get("example_value", node.meta.get("val"))
        sizes = value.shape if isinstance(value, torch.Tensor) else (value,)
        if any(isinstance(size, torch.SymInt) for size in sizes):
            return True
    return False


def inductor_patches(gm) -> dict:
    """The Inductor config `gm` needs to compile, and to right results (bugs 1 and 6); {} for most graphs."""
    return {**(_region_patches() if _calls_regions(gm) else {}), **_checkpoint_rng_patches(gm)}


@functools.lru_cache(maxsize=None)
def _say_once(message: str, *args) -> None:
    log.info(message, *args)


def _compile_fx_avoiding_bugs(compile_fx):
    """Inductor's compile_fx, with the patches each graph needs merged over the caller's own."""
    signature = inspect.signature(compile_fx)

    @functools.wraps(compile_fx)
    def wrapper(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        model = bound.arguments.get("model_")
        patches = inductor_patches(model)
        if patches:
            bound.arguments["config_patches"] = {**(bound.arguments.get("config_patches") or {}), **patches}
        if not _calls_regions(model):
            return compile_fx(*bound.args, **bound.kwargs)
        if compat.BACKWARD_CACHE_IGNORES_TANGENT_ALIASING:
            # AOTAutograd's cache keys on the Dynamo graph: it cannot tell artifacts traced with
            # bug 2 from ours. The per-graph Inductor cache still applies.
            with torch._functorch.config.patch(enable_autograd_cache=False):
                return compile_fx(*bound.args, **bound.kwargs)
        return compile_fx(*bound.args, **bound.kwargs)

    wrapper.__torch_ext_original__ = compile_fx
    return wrapper


def _distinct_tangents(backward):
    """torch 2.9.1's invoke_subgraph backward, given a view of each tangent that repeats an earlier
    one, so the backward graph it traces and caches reads every tangent on its own (bug 2)."""

    @functools.wraps(backward)
    def wrapper(ctx, *grad_outs):
        seen, distinct = set(), []
        for grad in grad_outs:
            if isinstance(grad, torch.Tensor):
                if id(grad) in seen:
                    grad = torch.ops.aten.alias.default(grad)
                seen.add(id(grad))
            distinct.append(grad)
        return backward(ctx, *distinct)

    return staticmethod(wrapper)


def _run_body_when_eager(autograd_kernel):
    """invoke_subgraph's Autograd kernel that, on real tensors outside any tracing, runs the body
    with ordinary autograd (bug 3); under tracing, torch's own kernel."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    @functools.wraps(autograd_kernel)
    def kernel(subgraph, identifier, *operands):
        tensors = [t for t in operands if isinstance(t, torch.Tensor)]
        eager = (_get_current_dispatch_mode() is None and not getattr(subgraph, "_boxed_call", False)
                 and all(type(t) in (torch.Tensor, torch.nn.Parameter) for t in tensors))
        if eager:
            return tuple(subgraph(*operands))
        return autograd_kernel(subgraph, identifier, *operands)

    kernel.__torch_ext_original__ = autograd_kernel
    return kernel


def _checkpoint_like_eager(call):
    """TagActivationCheckpoint.__call__ that, on real tensors outside any tracing, checkpoints the
    body as eager `torch.utils.checkpoint.checkpoint` does (bug 4); under tracing, torch's own."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode
    from torch.utils.checkpoint import checkpoint

    @functools.wraps(call)
    def __call__(self, gmod, *args, **kwargs):
        tensors = [t for t in args if isinstance(t, torch.Tensor)]
        if _get_current_dispatch_mode() is not None or not all(type(t) in (torch.Tensor, torch.nn.Parameter)
                                                                for t in tensors):
            return call(self, gmod, *args, **kwargs)
        checkpoint_kwargs, body_kwargs = self.divide_kwargs(kwargs)
        checkpoint_kwargs["use_reentrant"] = False  # what Dynamo traced; the reentrant form takes no kwargs
        context_fn = gmod.meta.get("_checkpoint_context_fn")
        if context_fn is not None:  # Dynamo keeps it on the body, not in the call
            checkpoint_kwargs["context_fn"] = context_fn
        return checkpoint(gmod, *args, **checkpoint_kwargs, **body_kwargs)

    return __call__


def _reuse_only_plain_outputs(is_reuse_eligible):
    """Dynamo's reuse check, refusing results a stamped-out call would not give back as returned (bug 7)."""

    @functools.wraps(is_reuse_eligible)
    def wrapper(tx, body_r, *args, **kwargs):
        if not compat.plain_sequence_output(body_r):
            return False
        return is_reuse_eligible(tx, body_r, *args, **kwargs)

    return wrapper


def _patch_points():
    """(owner, attribute, wrap) for every patch this torch version needs now (Inductor's: _INDUCTOR_PATCH)."""
    invoke_subgraph_module = importlib.import_module("torch._higher_order_ops.invoke_subgraph")
    wrap_module = importlib.import_module("torch._higher_order_ops.wrap")
    points = [(wrap_module.TagActivationCheckpoint, "__call__", _checkpoint_like_eager)]
    if compat.BACKWARD_CACHE_IGNORES_TANGENT_ALIASING:
        points.append((invoke_subgraph_module.InvokeSubgraphAutogradOp, "backward", _distinct_tangents))
    reuse_check = compat.region_reuse_eligibility() if compat.REGION_REUSE_FLATTENS_OUTPUT_TYPE else None
    if reuse_check is not None:
        points.append((*reuse_check, _reuse_only_plain_outputs))
    return points


# Inductor's compile_fx is wrapped when its module is first imported, not at install(): importing it costs
# 0.8 s on a 2-core CPU, paid before a background-compiling process's first eager token (the compile
# thread imports it instead).
_INDUCTOR_PATCH = ("torch._inductor.compile_fx", "compile_fx", _compile_fx_avoiding_bugs)


def _inductor_patch_needed() -> bool:
    return (compat.INDUCTOR_REUSES_REGION_BUFFERS or compat.BACKWARD_CACHE_IGNORES_TANGENT_ALIASING
            or compat.PARTITIONER_FAILS_ON_DYNAMIC_CHECKPOINTED_RNG)


def apply() -> list:
    """Apply every workaround; returns what `restore` needs to undo them exactly."""
    points = _patch_points()
    undo = [(owner, name, inspect.getattr_static(owner, name)) for owner, name, _ in points]
    for owner, name, wrap in points:
        setattr(owner, name, wrap(getattr(owner, name)))
    if _inductor_patch_needed():
        undo.append(patch_when_imported(*_INDUCTOR_PATCH))
    if compat.EAGER_REGION_BACKWARD_NEEDS_FAKE_MODE:
        hop = torch._higher_order_ops.invoke_subgraph
        key = torch._C.DispatchKey.Autograd
        undo.append((hop.py_kernels, key, hop.py_kernels[key]))
        hop.py_kernels[key] = _run_body_when_eager(hop.py_kernels[key])
        hop._dispatch_cache.clear()
    return undo


def restore(undo: list) -> None:
    for entry in reversed(undo):
        if callable(entry):  # a patch made (or still waiting) on import
            entry()
            continue
        owner, name, original = entry
        if isinstance(owner, dict):
            owner[name] = original
        else:
            setattr(owner, name, original)
    torch._higher_order_ops.invoke_subgraph._dispatch_cache.clear()
