"""Replace a multi-output pattern match by hand.

Inductor's pattern matcher cannot replace multi-output matches safely by itself (pytorch issue
137280): it inserts the replacement before the earliest matched output, where an input the other
outputs need may not be defined yet. `MultiOutputMatch` does the replacement in the order that is
always valid:

1. new nodes go after the last matched node in graph order (`match.nodes` is not in graph order),
   so every input of the match is already defined;
2. users of the replaced outputs are rebound to the new nodes; users that sat between matched nodes
   (now before their new definition) are moved, with their own dependents, after the new nodes;
3. matched nodes left without users are erased.

Every created node gets `meta["val"]` (a FakeTensor, or a tuple of them), computed by running its
target on the inputs' FakeTensors: Inductor's re-inplacing and de-functionalization read it.

Mutating custom ops go in as `torch.ops.higher_order.auto_functionalized` (v1), which the post-grad
graph may hold on every supported torch: `reinplace_inplaceable_ops` decides which mutated inputs
need a clone and `decompose_auto_functionalized` turns it back into the in-place call (both handle v1
and v2 on 2.9.1 and 2.13). v1 is the one whose arguments are the op's own: v2 adds view-base
bookkeeping (`_all_bases`, `_<arg>_base_index`) that a pass would have to rebuild.
"""
from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.fx
from torch.utils import _pytree as pytree

if TYPE_CHECKING:
    from torch._inductor.pattern_matcher import Match

__all__ = ["MultiOutputMatch"]

_COMPUTE = object()  # insert(val=...) default: run the target on FakeTensors


class MultiOutputMatch:
    """The nodes of one match and the tools to replace them.

        m = MultiOutputMatch.from_match(match)
        af = m.insert_auto_functionalized(torch.ops.lib.op.default, x=x, out=buf)
        (new_out,) = m.insert_getitems(af, [1])
        m.replace({old_out: new_out})
    """

    def __init__(self, nodes: Iterable[torch.fx.Node], graph: torch.fx.Graph | None = None):
        self.nodes: list[torch.fx.Node] = list(dict.fromkeys(nodes))
        if not self.nodes:
            raise ValueError("MultiOutputMatch needs at least one matched node")
        self.graph = graph if graph is not None else self.nodes[0].graph
        for n in self.nodes:
            if n.graph is not self.graph:
                raise ValueError(f"matched node {n.name} is not in the graph of the match")
            if n.op in ("placeholder", "output"):
                raise ValueError(f"a match cannot contain the {n.op} node {n.name}")
        self._node_set = set(self.nodes)
        self._created: list[torch.fx.Node] = []
        self._cursor: torch.fx.Node | None = None
        self._stack_trace: str | None = None
        self._replaced = False

    @classmethod
    def from_match(cls, match: Match) -> MultiOutputMatch:
        return cls(match.nodes, match.graph)

    # -- positions ---------------------------------------------------------------------------

    def nodes_in_graph_order(self) -> list[torch.fx.Node]:
        return [n for n in self.graph.nodes if n in self._node_set]

    def last_node(self) -> torch.fx.Node:
        for n in reversed(self.graph.nodes):
            if n in self._node_set:
                return n
        raise ValueError("none of the matched nodes is in the graph (erased already?)")

    # -- inserting ---------------------------------------------------------------------------

    def insert(
        self,
        target: Callable[..., Any],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        *,
        val: Any = _COMPUTE,
    ) -> torch.fx.Node:
        """Insert `target(*args, **kwargs)` after the match (after earlier inserts, in order).

        `meta["val"]` is `val` when given (None included), else computed by running `target` on the FakeTensors of
        the node arguments under their fake mode.
        """
        if self._replaced:
            raise RuntimeError("this match was replaced already; make a new MultiOutputMatch")
        kwargs = dict(kwargs or {})
        if val is _COMPUTE:
            val = _fake_run(target, args, kwargs)  # before touching the graph: may raise
        if self._cursor is None:
            self._cursor = self.last_node()
            self._stack_trace = self._cursor.meta.get("stack_trace")
        with self.graph.inserting_after(self._cursor):
            node = self.graph.call_function(target, tuple(args), kwargs)
        self._cursor = node
        self._created.append(node)
        node.meta["val"] = val
        if self._stack_trace is not None:
            node.meta["stack_trace"] = self._stack_trace  # debug output points at the model code
        return node

    def insert_getitems(
        self, tuple_node: torch.fx.Node, indices: Iterable[int]
    ) -> tuple[torch.fx.Node, ...]:
        """`operator.getitem(tuple_node, i)` for each index, each with its element's meta val."""
        if "val" not in tuple_node.meta:
            raise ValueError(f"{tuple_node.name} has no meta['val'] to take items from")
        tuple_val = tuple_node.meta["val"]
        return tuple(
            self.insert(operator.getitem, (tuple_node, i), val=tuple_val[i]) for i in indices
        )

    def insert_auto_functionalized(
        self, op: torch._ops.OpOverload, **kwargs: Any
    ) -> torch.fx.Node:
        """Insert the functional form of a mutating custom op.

        Returns the `auto_functionalized` node; its value is `(op_output, *new values of the
        mutated args in schema order)`, so for an op returning None item 1 is the first mutated arg.
        """
        from torch._higher_order_ops.auto_functionalize import (
            auto_functionalized,
            can_auto_functionalize,
        )

        if not isinstance(op, torch._ops.OpOverload):
            raise TypeError(f"expected an OpOverload (e.g. torch.ops.ns.op.default), got {op!r}")
        if not can_auto_functionalize(op):
            raise ValueError(
                f"{op} cannot be auto-functionalized (it must mutate some args, return no "
                "aliases of its inputs, and have a schema auto_functionalized supports)"
            )
        schema_args = [a.name for a in op._schema.arguments]
        unknown = sorted(set(kwargs) - set(schema_args))
        if unknown:
            raise ValueError(f"{op} has no arguments {unknown}; its arguments are {schema_args}")
        missing = [
            a.name
            for a in op._schema.arguments
            if a.name not in kwargs and (a.alias_info is not None or not a.has_default_value())
        ]
        if missing:
            raise ValueError(f"{op}: pass {missing} (auto_functionalized takes the op's args by name)")
        return self.insert(auto_functionalized, (op,), kwargs)

    # -- replacing ---------------------------------------------------------------------------

    def replace(self, replacements: Mapping[torch.fx.Node, torch.fx.Node]) -> None:
        """Point users of each matched output at its replacement, fix the order, erase dead nodes.

        Everything is checked before the graph changes: an impossible replacement raises and
        leaves the graph as it was, apart from the inserted (unused) nodes.
        """
        if self._replaced:
            raise RuntimeError("this match was replaced already")
        for old, new in replacements.items():
            if old not in self._node_set:
                raise ValueError(f"{old.name} is not a node of this match")
            if new.graph is not self.graph:
                raise ValueError(f"replacement {new.name} is not in the graph of the match")
        created = set(self._created)
        # Matched nodes die with the match; created nodes may read old values on purpose.
        rebind = {
            old: [u for u in old.users if u not in self._node_set and u not in created]
            for old in replacements
        }
        order = self.nodes_in_graph_order()
        moved = self._early_users({u for us in rebind.values() for u in us}, order[0])
        erased = _dead_after_rebind(order, rebind)
        for n in [*self._created, *(m for m in order if m not in erased)]:
            stale = [i.name for i in n.all_input_nodes if i in moved]
            if stale:
                raise RuntimeError(
                    f"cannot replace the match: {n.name} reads {stale}, which read the replaced "
                    "outputs; after the replacement it would be used before it is defined"
                )

        for old, new in replacements.items():
            for user in rebind[old]:
                user.replace_input_with(old, new)
        anchor = self._created[-1] if self._created else order[-1]
        for n in moved:
            anchor.append(n)  # moves n: it is in the graph already
            anchor = n
        for n in reversed(order):
            if n in erased:
                self.graph.erase_node(n)
        self._replaced = True

    def _early_users(self, rebound: set[torch.fx.Node], first: torch.fx.Node) -> list[torch.fx.Node]:
        """Nodes before the inserted ones that will read them: rebound users and their dependents,
        in graph order."""
        if not self._created:
            return []
        moved: list[torch.fx.Node] = []
        moved_set: set[torch.fx.Node] = set()
        n = first  # a rebound user comes after the matched output it reads
        while n is not self._created[0]:
            if n not in self._node_set and (
                n in rebound or any(i in moved_set for i in n.all_input_nodes)
            ):
                moved.append(n)
                moved_set.add(n)
            n = n.next
        return moved


def _dead_after_rebind(
    order: list[torch.fx.Node], rebind: Mapping[torch.fx.Node, list[torch.fx.Node]]
) -> set[torch.fx.Node]:
    """Matched nodes that will have no users once `rebind` is done (reverse graph order)."""
    dead: set[torch.fx.Node] = set()
    for n in reversed(order):
        gone = set(rebind.get(n, ()))
        if all(u in dead or u in gone for u in n.users):
            dead.add(n)
    return dead


def _fake_run(target: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
    from torch._guards import detect_fake_mode

    def val_of(n: torch.fx.Node) -> Any:
        if "val" not in n.meta:
            raise ValueError(
                f"{n.name} has no meta['val']; MultiOutputMatch needs FakeTensor values on the "
                "inputs of the nodes it creates (post-grad graphs have them)"
            )
        return n.meta["val"]

    fake_args, fake_kwargs = torch.fx.node.map_arg((tuple(args), dict(kwargs)), val_of)
    fake_mode = detect_fake_mode(pytree.tree_leaves((fake_args, fake_kwargs)))
    if fake_mode is None:
        raise ValueError(f"no FakeTensor among the inputs of {target}; cannot compute meta['val']")
    with fake_mode:
        return target(*fake_args, **fake_kwargs)
