"""The part every wrap-semantics HOP VariableTracker shares: torch's own tracing first, then ours.

Under install(), a HOP call is first traced by torch's own VT (the class ours derives from): where
torch compiles a program, it compiles it exactly as torch does (same graph, same side-effect
handling, same subgraph reuse). Where torch refuses it, the frame is traced again (a Dynamo restart,
so nothing the refused attempt did survives) and at this call torch_ext's wrap-semantics tracing
runs instead. Calls torch is known to get wrong (`torch_gets_wrong`) skip torch's attempt.
"""
from __future__ import annotations

import torch
from torch._dynamo.variables.constant import ConstantVariable
from torch._dynamo.variables.dicts import ConstDictVariable
from torch._dynamo.variables.lists import BaseListVariable
from torch._dynamo.variables.tensor import SymNodeVariable, TensorVariable

from torch_ext import compat

from .speculate import BodyOptions, Speculation, speculate


# HOP name -> the VariableTracker class torch's own table held before install() (BASE_HOP: its fallback
# for BaseHOPs). install() fills it and uninstall() empties it.
BASE_HOP = "<BaseHOP>"
_torch_vts: dict[str, type] = {}


def remember_torch_vts(classes: dict[str, type]) -> None:
    _torch_vts.clear()
    _torch_vts.update(classes)


def _plain(vt) -> bool:
    """Tensors, SymInts, constants, and tuples, lists and dicts of them."""
    if isinstance(vt, (TensorVariable, SymNodeVariable, ConstantVariable)):
        return True
    if isinstance(vt, BaseListVariable):
        return all(_plain(item) for item in vt.items)
    if isinstance(vt, ConstDictVariable):
        return all(_plain(value) for value in vt.items.values())
    return False


def _reads_item(tx, installed_before: set) -> bool:
    """Whether a body torch just installed calls `.item()` (at any depth)."""
    for name in set(tx.output.nn_modules) - installed_before:
        body = tx.output.nn_modules[name]
        if isinstance(body, torch.fx.GraphModule) and any(
            node.op == "call_method" and node.target == "item"
            for module in body.modules() if isinstance(module, torch.fx.GraphModule)
            for node in module.graph.nodes
        ):
            return True
    return False


class WrapSemanticsMixin:
    """Mixed into subclasses of torch's own HOP VTs, whose subgraph installation (naming, and
    deduplication for invoke_subgraph) we keep; only speculation and the call are ours."""

    # How our own tracing constrains the body (torch's VT reads its own supports_* attributes).
    body_supports_input_mutation = True
    body_supports_aliasing = True
    try_torch_first = True

    def body_options(self, tx) -> BodyOptions:
        return BodyOptions(
            hop_name=self.value.__name__,
            supports_input_mutation=self.body_supports_input_mutation,
            supports_aliasing=self.body_supports_aliasing,
        )

    def torch_gets_wrong(self, tx, args, kwargs) -> bool:
        """Calls torch's own VT traces without complaint but wrongly (a known torch bug); every HOP
        while floats are being specialized (their reads inside bodies are only ours to replace)."""
        return compat.floats_being_specialized()

    def torch_vt(self):
        """torch's own VT for this HOP (the class its table held before install()), or None."""
        cls = _torch_vts.get(self.value.__name__) or _torch_vts.get(BASE_HOP if self.is_base_hop else "")
        return cls(self.value, self.source) if cls is not None else None

    is_base_hop = False

    def call_torch_vt(self, tx, args, kwargs):
        return self.torch_vt()._call_function(tx, args, kwargs)

    def _call_function(self, tx, args, kwargs):
        # The speculation entry is taken on every attempt, whichever path runs, so the log stays aligned.
        entry = compat.speculation_entry(tx) if self.try_torch_first and self.torch_vt() is not None else None
        if entry is not None and not compat.took_own_path(entry):
            if self.torch_gets_wrong(tx, args, kwargs):
                compat.take_own_path(tx, entry)
            else:
                return self._torch_first(tx, args, kwargs, entry)
        return self.call_with_wrap_semantics(tx, args, kwargs)

    def _torch_first(self, tx, args, kwargs, entry):
        installed_before = set(tx.output.nn_modules)
        try:
            result = self.call_torch_vt(tx, args, kwargs)
        except Exception as refusal:
            if not compat.is_torch_refusal(refusal):
                raise
            first_line = str(refusal).strip().splitlines()[0] if str(refusal).strip() else ""
            compat.restart_taking_own_path(
                tx, entry, f"torch_ext: torch refused {self.value.__name__} ({first_line}); "
                "tracing it with wrap semantics")
        if _reads_item(tx, installed_before):
            # A Python float read in the body (`.item()` of the 0-d tensor Dynamo passes it as): torch
            # leaves it symbolic there, where the backend's float specialization cannot reach it.
            compat.restart_taking_own_path(
                tx, entry, f"torch_ext: {self.value.__name__} body reads .item(); tracing it with torch_ext's")
        if compat.TORCH_WRAP_SEMANTICS_UNRELIABLE and not _plain(result):
            compat.restart_taking_own_path(
                tx, entry, f"torch_ext: {self.value.__name__} returns {type(result).__name__}, which this "
                "torch's own wrap semantics gets wrong; tracing it with torch_ext's")
        return result

    def call_with_wrap_semantics(self, tx, args, kwargs):
        raise NotImplementedError

    def trace_body(self, tx, fn_vt, args, kwargs, *, subgraph_name: str):
        """Speculate the body and install it as a submodule; returns (spec, body_gmod, body_name,
        proxy args of the call: the body's get_attr node, then the lifted inputs)."""
        spec: Speculation = speculate(tx, self.value, fn_vt, list(args), dict(kwargs), self.body_options(tx))
        body_gmod = torch.fx.GraphModule(tx.output.nn_modules, spec.graph)
        body_name = self.install_subgraph_in_output_graph(
            tx, fn_vt, list(args), kwargs, body_gmod, attr_name=subgraph_name
        )
        body_node = compat.make_attr(tx, body_name)
        return spec, body_gmod, body_name, (body_node, *spec.lifted_freevars.keys())
