"""What a decode layer runs around its projections of a few rows, folded into torch_ext::decode_linear calls
(the gate into the gate/up projection's epilogue where GATE_EPILOGUE_ROWS says, else into the next call's
prologue up to GATE_PROLOGUE_MAX_ROWS rows; the norm into the next call's prologue up to NORM_PROLOGUE_MAX_ROWS
rows; the residual add at every row count).

After rewrite/decode_linear.py a Llama-style layer (HF's RMSNorm, a gated MLP, residual adds) reads

    h1 = h + decode_linear(attn, Wo)                                  # residual add
    y  = g * (h1f * rsqrt(h1f.pow(2).mean(-1, keepdim=True) + eps)).to(dt)   # RMSNorm, h1f = h1.to(float32)
    gate, up = split(decode_linear(y, Wgu))
    h2 = h1 + decode_linear(silu(gate) * up, Wdown)

and Inductor runs each norm, the gate and each add as a kernel of its own: it cannot fuse into our op.
Here, where the graph has exactly these forms (kernels/decode_linear.py computes them as eager does):
  - norm: a call whose input is such an RMSNorm's output, used by decode_linear calls alone, takes h1,
    g and eps instead (norm_weight=, eps=);
  - gate: a call whose input is silu(a) * b, used by decode_linear calls alone, takes a and up=b;
  - gate epilogue (first; where kernels are tuned, at any row count where measured faster, else at
    GATE_EPILOGUE_ROWS rows, 9-32): silu(a) * b
    where a and b are equal-width slices (split / chunk along the last dim) of one call's output, used
    only there, becomes that call with gate=[a's start, b's start, width];
  - residual: an add of a call's output (used by that add alone) and a tensor of the output's shape
    and dtype becomes the call with residual= (no broadcasting add).
The nodes of a norm or gate left without users are erased. Fusing moves reads (the call reads the
norm's or gate's inputs; a fused call runs where the add was): nothing that may write a tensor may lie
between the two places. Anything else is left as it was.
"""
from __future__ import annotations

import logging
import numbers
import operator

import torch
import torch.fx as fx

from torch_ext.backend.rewrite.decode_attention import example_value
from torch_ext.backend.rewrite.decode_linear import computed_in_graph, op_name
from torch_ext.backend.rewrite.writes import writes_between
from torch_ext.kernels import decode_linear as op_module
from torch_ext.kernels import decode_linear_tuning as tuning

log = logging.getLogger("torch_ext.backend")

_CONVERSIONS = {"to", "float", "type_as", "half", "bfloat16"}
# decode_linear's arguments by position: (x, weight, bias, prefetch, norm_weight, eps, up, residual, gate, config)
_X, _PREFETCH, _NORM_WEIGHT, _EPS, _UP, _RESIDUAL, _GATE, _CONFIG = 0, 3, 4, 5, 6, 7, 8, 9


def _op():
    return torch.ops.torch_ext.decode_linear.default


def _full_args(call: fx.Node) -> list:
    """The call's arguments, all ten by position (the optional ones' defaults from the op's schema)."""
    optional = _op()._schema.arguments[_NORM_WEIGHT:]
    args = list(call.args) + [a.default_value for a in optional][len(call.args) - _NORM_WEIGHT:]
    for i, a in enumerate(optional, start=_NORM_WEIGHT):
        if a.name in call.kwargs:
            args[i] = call.kwargs[a.name]
    return args


def _is_call(node) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target is _op()


def _is_plain_call(node) -> bool:
    """A decode_linear call with nothing fused yet."""
    return _takes_prologue(node) and _full_args(node)[_GATE] is None


def _takes_prologue(node) -> bool:
    """A decode_linear call with no prologue or residual fused yet (a gate epilogue may be in it: the
    one-row kernel computes both)."""
    if not _is_call(node):
        return False
    args = _full_args(node)
    return all(args[i] is None for i in (_NORM_WEIGHT, _UP, _RESIDUAL))


def _tensor(node):
    value = example_value(node) if isinstance(node, fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def _binary(node: fx.Node, name: str):
    """(a, b) of a two-operand call `name` (operator, torch function or method) without extra options."""
    if node.op not in ("call_function", "call_method") or op_name(node) != name:
        return None
    if len(node.args) != 2 or node.kwargs:
        return None
    return node.args


def _conversion_source(node) -> fx.Node | None:
    """x for a node that only changes x's dtype (x.to(dtype), x.float(), ...)."""
    if not isinstance(node, fx.Node) or op_name(node) not in _CONVERSIONS or not node.args:
        return None
    src, out = node.args[0], _tensor(node)
    before = _tensor(src)
    if before is None or out is None or before.shape != out.shape or before.device != out.device:
        return None
    return src


def _last_dim(dim, ndim: int) -> bool:
    if isinstance(dim, (list, tuple)) and len(dim) == 1:
        dim = dim[0]
    return isinstance(dim, int) and dim in (-1, ndim - 1)


def match_rms_norm(y: fx.Node):
    """(h, g, eps, nodes) where y = g * (hf * rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)
    with hf = h.to(float32) (or h itself in float32); nodes: the norm's own nodes, last first."""
    operands = _binary(y, "mul")
    out = _tensor(y)
    if operands is None or out is None:
        return None
    for g, c in (operands, operands[::-1]):
        gv = _tensor(g)
        if gv is None or gv.dim() != 1 or gv.shape[0] != out.shape[-1] or gv.dtype != out.dtype:
            continue
        n = _conversion_source(c) or c
        found = _norm_core(n)
        if found is None or _tensor(c).dtype != out.dtype:
            continue
        h, hf, eps, core = found
        hv = _tensor(h)
        if hv is None or hv.dtype != out.dtype or hv.shape != out.shape:
            continue
        nodes = ([c] if c is not n else []) + core + ([hf] if hf is not h else [])
        return h, g, eps, nodes
    return None


def _norm_core(n):
    """(h, hf, eps, [n, r, s, var, p]) for n = hf * rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)."""
    operands = _binary(n, "mul") if isinstance(n, fx.Node) else None
    if operands is None:
        return None
    for hf, r in (operands, operands[::-1]):
        if not (isinstance(r, fx.Node) and op_name(r) == "rsqrt" and len(r.args) == 1 and not r.kwargs):
            continue
        s = r.args[0]
        added = _binary(s, "add") if isinstance(s, fx.Node) else None
        if added is None:
            continue
        var, eps = added if isinstance(added[1], numbers.Real) else added[::-1]
        if not isinstance(eps, numbers.Real) or isinstance(eps, bool) or not isinstance(var, fx.Node):
            continue
        if op_name(var) != "mean" or not var.args:
            continue
        dim = var.args[1] if len(var.args) > 1 else var.kwargs.get("dim")
        keepdim = var.args[2] if len(var.args) > 2 else var.kwargs.get("keepdim", False)
        if keepdim is not True or set(var.kwargs) - {"dim", "keepdim"} or len(var.args) > 3:
            continue
        p = var.args[0]
        powed = _binary(p, "pow") if isinstance(p, fx.Node) else None
        if powed is None or powed[0] is not hf or powed[1] not in (2, 2.0):
            continue
        hfv = _tensor(hf)
        if hfv is None or hfv.dtype != torch.float32 or not _last_dim(dim, hfv.dim()):
            continue
        h = _conversion_source(hf) or hf
        return h, hf, float(eps), [n, r, s, var, p]
    return None


def match_gate(x: fx.Node):
    """(a, b, silu_node) where x = silu(a) * b (either order), a and b of x's shape and dtype."""
    operands = _binary(x, "mul")
    out = _tensor(x)
    if operands is None or out is None:
        return None
    for s, b in (operands, operands[::-1]):
        if not (isinstance(s, fx.Node) and op_name(s) == "silu" and len(s.args) == 1):
            continue
        if s.kwargs.get("inplace", False):
            continue
        a = s.args[0]
        if all(_tensor(t) is not None and _tensor(t).shape == out.shape and _tensor(t).dtype == out.dtype
               for t in (a, b)):
            return a, b, s
    return None


def _prologue_rows(node: fx.Node, part: str) -> bool:
    """A value of a row count and dtype the rewrite folds this prologue (norm or gate) in for."""
    value = _tensor(node)
    return (value is not None and value.dim() >= 1 and value.shape[-1] > 0
            and op_module.serves_prologue(value.numel() // value.shape[-1], value.dtype, value.device, part))


def _only_read_as_input(node: fx.Node, part: str) -> bool:
    """Every user of node is a plain decode_linear call reading it as x, of rows the prologue serves."""
    return bool(node.users) and _prologue_rows(node, part) and all(
        _takes_prologue(u) and u.args[_X] is node and sum(a is node for a in u.all_input_nodes) == 1
        for u in node.users)


def _private(nodes: list, owner: fx.Node) -> bool:
    """The pattern's nodes are used only inside it (owner is its output)."""
    inside = set(nodes) | {owner}
    return all(set(n.users) <= inside for n in nodes)


def _first(nodes: list, order: dict) -> fx.Node:
    return min(nodes, key=order.__getitem__)


def _still_safe(args: list) -> tuple:
    """The call's arguments with prefetch kept only where a kernel of the graph still runs before it:
    the norm or gate kernel that made its input is gone (rewrite/decode_linear.py: why that matters)."""
    inputs = [args[_X], args[_UP], args[_RESIDUAL]]
    args[_PREFETCH] = args[_PREFETCH] and any(isinstance(t, fx.Node) and computed_in_graph(t) for t in inputs)
    return _positional(args)


def _positional(args: list) -> tuple:
    """The arguments, without a gate and config left unset (graphs without them print as before they
    existed)."""
    if args[_CONFIG] is not None:
        return tuple(args)
    return tuple(args[:_GATE] if args[_GATE] is None else args[:_CONFIG])


def _erase(gm: fx.GraphModule, nodes: list) -> None:
    for node in nodes:  # last first: each has no users once those after it are gone
        if not node.users:
            gm.graph.erase_node(node)


def _folds_pay(calls, part: str, tuner) -> bool:
    """Whether `part` (the "norm" or "gate" prologue, the "gate_epilogue") is measured faster folded into each
    of calls (their kernels as the tuner chose them) than left to a kernel of its own; True without a tuner or
    a choice (the built-in rules, serves_prologue and serves_gate, decide alone)."""
    if tuner is None:
        return True
    for call in calls:
        choice = tuning.decode(_full_args(call)[_CONFIG])
        x, w = _tensor(call.args[_X]), _tensor(call.args[1])
        if choice is None or x is None or w is None:
            continue
        if not tuner.fold_pays(tuning.Shape.of(x, w, call.args[2] is not None), part, choice, x.device):
            return False
    return True


def fuse_into_decode_linear(gm: fx.GraphModule, tuner: tuning.Tuner | None = None) -> int:
    """Fold norms, gates and residual adds into gm's decode_linear calls (in place); returns how many.
    With a tuner, a norm or gate is folded only where that measures faster (_folds_pay)."""
    fused = 0
    # The gate epilogue first: where it takes a gate (nothing computed twice), the down projection's
    # prologue need not (that would redo silu(gate) * up in every program).
    for node in list(gm.graph.nodes):
        if node.op in ("call_function", "call_method"):
            fused += _fuse_gate_epilogue(gm, node, tuner)
    order = {node: i for i, node in enumerate(gm.graph.nodes)}  # erasing keeps the others' order
    for node in list(gm.graph.nodes):
        if node.op not in ("call_function", "call_method"):
            continue
        norm = match_rms_norm(node) if _only_read_as_input(node, "norm") else None
        if (norm is not None and _private(norm[3], node)
                and not any(writes_between(_first(norm[3], order), call) for call in node.users)
                and _folds_pay(node.users, "norm", tuner)):
            h, g, eps, nodes = norm
            for call in list(node.users):
                args = _full_args(call)
                args[_X], args[_NORM_WEIGHT], args[_EPS] = h, g, eps
                call.args, call.kwargs = _still_safe(args), {}
            _erase(gm, [node] + nodes)
            fused += 1
            continue
        gate = match_gate(node) if _only_read_as_input(node, "gate") else None
        if (gate is not None and set(gate[2].users) == {node}
                and not any(writes_between(_first([gate[2], node], order), call) for call in node.users)
                and _folds_pay(node.users, "gate", tuner)):
            a, b, silu = gate
            for call in list(node.users):
                args = _full_args(call)
                args[_X], args[_UP] = a, b
                call.args, call.kwargs = _still_safe(args), {}
            _erase(gm, [node, silu])
            fused += 1
    for node in list(gm.graph.nodes):
        fused += _fuse_residual(gm, node)
    if fused:
        gm.graph.lint()
        gm.recompile()
        log.debug("torch_ext: %d norms, gates and residual adds run inside torch_ext::decode_linear", fused)
    return fused


def _fuse_residual(gm: fx.GraphModule, add: fx.Node) -> int:
    operands = _binary(add, "add") if add.op == "call_function" else None
    out = _tensor(add)
    if operands is None or out is None:
        return 0
    for call, residual in (operands, operands[::-1]):
        if not _is_call(call) or _full_args(call)[_RESIDUAL] is not None or len(call.users) != 1 or residual is call:
            continue
        cv, rv = _tensor(call), _tensor(residual)
        if cv is None or rv is None or not (cv.shape == rv.shape == out.shape and cv.dtype == rv.dtype == out.dtype):
            continue
        if writes_between(call, add):  # the fused call runs at the add
            continue
        args = _full_args(call)
        args[_RESIDUAL] = residual
        with gm.graph.inserting_before(add):
            new = gm.graph.call_function(_op(), _positional(args))
        new.meta = dict(add.meta)
        add.replace_all_uses_with(new)
        gm.graph.erase_node(add)
        gm.graph.erase_node(call)
        return 1
    return 0


def _column_slice(node) -> tuple[fx.Node, int, int] | None:
    """(call, start, width) where node is piece i of a split or chunk of a decode_linear call's output
    along its last dim: the output's columns start..start + width."""
    if not (isinstance(node, fx.Node) and node.op == "call_function" and node.target is operator.getitem):
        return None
    parts, index = node.args
    if not (isinstance(parts, fx.Node) and op_name(parts) in ("split", "chunk", "split_with_sizes")
            and isinstance(index, int) and parts.args and _is_call(parts.args[0])):
        return None
    call = parts.args[0]
    dim = parts.args[2] if len(parts.args) > 2 else parts.kwargs.get("dim", 0)
    value, pieces = _tensor(call), example_value(parts)
    if value is None or not isinstance(pieces, (list, tuple)) or not _last_dim(dim, value.dim()):
        return None
    widths = [piece.shape[-1] if isinstance(piece, torch.Tensor) else None for piece in pieces]
    index = index + len(widths) if index < 0 else index
    if not 0 <= index < len(widths) or not all(isinstance(w, int) for w in widths[:index + 1]):
        return None
    return call, sum(widths[:index]), widths[index]


def _fuse_gate_epilogue(gm: fx.GraphModule, mul: fx.Node, tuner=None) -> int:
    """silu(a) * b over two slices of one plain call's output -> that call with gate= (module docstring).
    Where the tuner chose the call's kernel: at any row count, where a gated kernel measures faster than the
    call plus the gate's own kernel (that kernel then serves the call); else at GATE_EPILOGUE_ROWS."""
    gate = match_gate(mul)
    if gate is None:
        return 0
    a, b, silu = gate
    slice_a, slice_b = _column_slice(a), _column_slice(b)
    if slice_a is None or slice_b is None or a is b or slice_a[0] is not slice_b[0] or slice_a[2] != slice_b[2]:
        return 0
    call, parts = slice_a[0], a.args[0]
    value = _tensor(call)
    if not (_is_plain_call(call) and value is not None and value.dim() >= 1):
        return 0
    rows, choice = value.numel() // value.shape[-1], tuning.decode(_full_args(call)[_CONFIG])
    tuned = tuner is not None and choice is not None  # the tuner decides (else the built-in rows)
    if not op_module.serves_gate(rows, value.dtype, value.device, tuned):
        return 0
    # Every intermediate is private to the pattern (erased below) and nothing writes before the mul.
    if not (set(call.users) == {parts} and set(parts.users) == {a, b} and set(a.users) == {silu}
            and set(silu.users) == {mul} and set(b.users) == {mul} and not writes_between(call, mul)):
        return 0
    args = _full_args(call)
    if tuned:  # the gated kernel measured fastest, where it beats the call plus the gate's own kernel
        x, w = _tensor(call.args[_X]), _tensor(call.args[1])
        gated = tuner.gate_epilogue_choice(tuning.Shape.of(x, w, call.args[2] is not None), choice, x.device)
        if gated is None:
            return 0
        args[_CONFIG] = gated.encode()
    args[_GATE] = [slice_a[1], slice_b[1], slice_a[2]]
    with gm.graph.inserting_before(mul):
        new = gm.graph.call_function(_op(), _positional(args))
    new.meta = dict(mul.meta)
    mul.replace_all_uses_with(new)
    _erase(gm, [mul, silu, b, a, parts, call])
    return 1
