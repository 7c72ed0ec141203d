"""rewrite/decode_linear_fusion.py: the RMSNorm and gate before a projection of a few rows and the
residual add after it, folded into its torch_ext::decode_linear call; everything that differs from those forms
left alone. The rewrite fires on CUDA inputs only; here it is let onto the CPU, where the op runs its
reference (eager's formulation), so a fused graph must give eager's results exactly."""
from __future__ import annotations

import pytest
import torch

from torch_ext.backend.rewrite import decode_linear as rewrite
from torch_ext.backend.rewrite.decode_linear_fusion import fuse_into_decode_linear
from test_decode_linear import _calls, _graph

DIM, HIDDEN = 64, 128


class RMSNorm(torch.nn.Module):
    """HF's LlamaRMSNorm, as written there."""

    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.rand(dim) + 0.5)
        self.eps = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.eps)
        return self.weight * hidden_states.to(input_dtype)


class Layer(torch.nn.Module):
    """A Llama decoder layer's projections and what runs between them (attention left out)."""

    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = RMSNorm(DIM), RMSNorm(DIM)
        self.qkv = torch.nn.Linear(DIM, DIM, bias=False)
        self.o = torch.nn.Linear(DIM, DIM, bias=True)
        self.gate, self.up = torch.nn.Linear(DIM, HIDDEN, bias=False), torch.nn.Linear(DIM, HIDDEN, bias=False)
        self.down = torch.nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x):
        h = torch.tanh(x)  # a kernel of the graph before the first projection
        h = h + self.o(self.qkv(self.norm1(h)))
        y = self.norm2(h)
        return h + self.down(torch.nn.functional.silu(self.gate(y)) * self.up(y))


def _rewritten(model, x):
    gm, inputs = _graph(model, x)
    with torch.no_grad():
        expected = gm(*inputs)
    rewrite.use_decode_linear(gm)
    fused = fuse_into_decode_linear(gm)
    with torch.no_grad():
        out = gm(*inputs)
    return gm, fused, out, expected


def _fused_parts(call):
    args = list(call.args) + [None] * (8 - len(call.args))
    return {name for name, i in (("norm", 4), ("up", 6), ("residual", 7)) if args[i] is not None}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_llama_layer_runs_its_norms_gate_and_residual_adds_inside_the_projections(monkeypatch, dtype):
    monkeypatch.setattr(rewrite, "DEVICES", ("cpu",))
    gm, fused, out, expected = _rewritten(Layer().to(dtype).eval(), torch.randn(1, 1, DIM, dtype=dtype))
    assert fused == 5  # two norms, the gate, two residual adds
    qkv, o, gate, up, down = _calls(gm)
    assert [_fused_parts(c) for c in (qkv, o, gate, up, down)] == [
        {"norm"}, {"residual"}, {"norm"}, {"norm"}, {"up", "residual"}]
    names = {getattr(n.target, "__name__", str(n.target)) for n in gm.graph.nodes}
    assert not names & {"rsqrt", "silu", "pow", "mean"}  # the norms' and the gate's nodes are gone
    torch.testing.assert_close(out, expected, rtol=0, atol=0)  # eager's formulation, rounding as eager does


def test_prefetch_is_dropped_where_the_fused_norm_leaves_no_kernel_before_the_call(monkeypatch):
    """The norm's kernel was the graph's own kernel before the projection; fused away, the projection
    reading the graph input directly may follow the caller's weight.copy_(): no early weight load."""
    monkeypatch.setattr(rewrite, "DEVICES", ("cpu",))
    norm, lin = RMSNorm(DIM), torch.nn.Linear(DIM, DIM, bias=False)
    gm, fused, out, expected = _rewritten(lambda x: lin(norm(x)), torch.randn(1, DIM))
    (call,) = _calls(gm)
    assert fused == 1 and _fused_parts(call) == {"norm"} and call.args[3] is False
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    gm, fused, _, _ = _rewritten(lambda x: lin(norm(x.tanh())), torch.randn(1, DIM))
    (call,) = _calls(gm)
    assert fused == 1 and call.args[3] is True


class Unfusable(torch.nn.Module):
    """Near misses of each form: a norm whose output another op reads, a mean over another dim, a
    gate whose up broadcasts, an add that broadcasts."""

    def __init__(self):
        super().__init__()
        self.norm = RMSNorm(DIM)
        self.a, self.b, self.c = (torch.nn.Linear(DIM, DIM, bias=False) for _ in range(3))
        self.bias = torch.nn.Parameter(torch.randn(DIM))

    def forward(self, x):
        x = x.tanh()
        y = self.norm(x)
        h = self.a(y) + y.sum()  # y read by a non-projection too
        hf = h.float()
        z = (hf * torch.rsqrt(hf.pow(2).mean(0, keepdim=True) + 1e-6)) * self.norm.weight  # mean over dim 0
        g = torch.nn.functional.silu(self.b(z)) * self.bias  # up broadcasts over the rows
        return self.c(g) + self.bias  # a broadcasting add


def test_near_misses_are_left_alone(monkeypatch):
    monkeypatch.setattr(rewrite, "DEVICES", ("cpu",))
    gm, fused, out, expected = _rewritten(Unfusable().eval(), torch.randn(1, DIM))
    assert fused == 0 and all(not _fused_parts(c) for c in _calls(gm))
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_torch_rms_norm_is_left_to_inductor(monkeypatch):
    """torch.nn.RMSNorm rounds once, at its end, unlike HF's norm: not taken (the op computes HF's)."""
    monkeypatch.setattr(rewrite, "DEVICES", ("cpu",))
    norm, lin = torch.nn.RMSNorm(DIM), torch.nn.Linear(DIM, DIM, bias=False)
    gm, fused, out, expected = _rewritten(lambda x: lin(norm(x.tanh())), torch.randn(1, DIM, dtype=torch.float32))
    assert fused == 0
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def _norm_then_write(norm, lin):
    def forward(x):
        h = x.tanh()
        y = norm(h)
        h.mul_(2)  # written after the norm read it: a fused call would read the new h
        return lin(y) + h

    return forward


def _gate_then_write(lin):
    def forward(a, b):
        a, b = a.tanh(), b.tanh()
        g = torch.nn.functional.silu(a) * b
        b.add_(1)
        return lin(g) + b

    return forward


def _call_then_write(lin):
    def forward(x, r):
        x = x.tanh()
        y = lin(x)
        x.mul_(3)  # a residual fusion moves the call to the add, after this write
        return (y + r) * x

    return forward


@pytest.mark.parametrize("form", ["norm", "gate", "residual"])
def test_nothing_is_fused_across_an_in_place_write(monkeypatch, form):
    """Fusing moves a read: the norm's and the gate's inputs are read by the call, the call runs where
    the residual add was. A write between the two places would change what is read: not fused."""
    monkeypatch.setattr(rewrite, "DEVICES", ("cpu",))
    norm, lin = RMSNorm(DIM), torch.nn.Linear(DIM, DIM, bias=False)
    x, r = torch.randn(1, DIM), torch.randn(1, DIM)
    model, inputs = {"norm": (_norm_then_write(norm, lin), (x,)), "gate": (_gate_then_write(lin), (x, r)),
                     "residual": (_call_then_write(lin), (x, r))}[form]
    gm, inputs = _graph(model, *inputs)
    with torch.no_grad():
        expected = gm(*[t.clone() for t in inputs])
    rewrite.use_decode_linear(gm)
    assert len(_calls(gm)) == 1
    fuse_into_decode_linear(gm)
    (call,) = _calls(gm)
    assert {"norm": "norm", "gate": "up", "residual": "residual"}[form] not in _fused_parts(call)
    with torch.no_grad():
        torch.testing.assert_close(gm(*[t.clone() for t in inputs]), expected, rtol=0, atol=0)


def test_several_rows_of_a_16_bit_model_fold_their_residual_adds_and_float32_rows_stay_linear(monkeypatch):
    """Up to MAX_ROWS rows of float16 / bfloat16 run the op's CUDA path (kernels/decode_linear_mma.py): their
    residual adds fold into it; the norm and gate only up to NORM_ / GATE_PROLOGUE_MAX_ROWS (raised: all five, as at
    one row). Several float32 rows are left to F.linear (cuBLAS beats every kernel of ours there). The
    Triton kernel itself takes one row only; the op routes several rows elsewhere."""
    from torch_ext.kernels import decode_linear as op

    monkeypatch.setattr(rewrite, "DEVICES", ("cpu",))
    x = torch.randn(4, 1, DIM, dtype=torch.bfloat16)
    gm, fused, out, expected = _rewritten(Layer().to(torch.bfloat16).eval(), x)
    assert fused == 2
    assert [_fused_parts(c) for c in _calls(gm)] == [set(), {"residual"}, set(), set(), {"residual"}]
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    monkeypatch.setattr(op, "NORM_PROLOGUE_MAX_ROWS", 4)
    gm, fused, out, expected = _rewritten(Layer().to(torch.bfloat16).eval(), x)
    assert fused == 4  # the norms alone: the gate stays Inductor's
    assert [_fused_parts(c) for c in _calls(gm)] == [{"norm"}, {"residual"}, {"norm"}, {"norm"}, {"residual"}]
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    monkeypatch.setattr(op, "GATE_PROLOGUE_MAX_ROWS", 4)
    gm, fused, out, expected = _rewritten(Layer().to(torch.bfloat16).eval(), x)
    assert fused == 5
    assert [_fused_parts(c) for c in _calls(gm)] == [{"norm"}, {"residual"}, {"norm"}, {"norm"}, {"up", "residual"}]
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    gm, fused, out, expected = _rewritten(Layer().eval(), torch.randn(4, 1, DIM))
    assert fused == 0 and not _calls(gm)
    gm, fused, _, _ = _rewritten(Layer().to(torch.bfloat16).eval(),
                                 torch.randn(op.MAX_ROWS + 1, 1, DIM, dtype=torch.bfloat16))
    assert fused == 0 and not _calls(gm)
    x, w, g = torch.randn(4, DIM), torch.randn(DIM, DIM), torch.randn(DIM)
    assert not op.kernel_takes(x, w, None) and not op.kernel_takes(x, w, None, norm_weight=g)
    assert op.kernel_takes(x[:1], w, None, norm_weight=g, up=x[:1], residual=torch.randn(1, DIM))


def test_a_dynamic_graph_runs_the_op_at_batch_one(monkeypatch):
    """A graph compiled with a dynamic batch (a server's, or decode.py's) has symbolic rows, which the
    rewrite leaves alone; a call at batch 1 gets a piece compiled for that size (rewrite/per_size.py),
    where the rows are known: every projection runs the op with its norm, gate and residual inside.
    Other sizes keep the general compile. Results equal eager's at each size."""
    import torch_ext
    from torch_ext.backend import CompileConfig, counters

    monkeypatch.setattr(rewrite, "DEVICES", ("cpu",))
    model = Layer().eval()
    compiled = torch_ext.compile(model, CompileConfig(cache_dir=None, guard_free_dispatch=True, decode_linear=True))
    first = torch.randn(4, 1, DIM)
    torch._dynamo.mark_dynamic(first, 0)
    with torch.no_grad():
        for batch in (4, 1, 3, 1):
            x = first if batch == 4 else torch.randn(batch, 1, DIM)
            torch.testing.assert_close(compiled(x), model(x), msg=lambda m: f"batch {batch}: {m}")
            # gate and up merged into one projection: 4 calls; two norms, the gate, two residual adds
            assert (counters.decode_linear_calls, counters.decode_linear_fusions) == ((0, 0) if batch == 4 else (4, 5))
    assert counters.graphs_seen == 1 and counters.compiles_by_variant["size=1"] == 1


def test_a_dynamic_graph_without_linears_gets_no_extra_compile_at_batch_one():
    """The size-1 variant is for decode_linear: a piece with no linear call keeps its general compile."""
    import torch_ext
    from torch_ext.backend import CompileConfig, counters

    model = RMSNorm(DIM).eval()
    compiled = torch_ext.compile(model, CompileConfig(cache_dir=None, guard_free_dispatch=True, decode_linear=True))
    first = torch.randn(4, 1, DIM)
    torch._dynamo.mark_dynamic(first, 0)
    with torch.no_grad():
        for x in (first, torch.randn(1, 1, DIM)):
            torch.testing.assert_close(compiled(x), model(x))
    assert counters.graphs_seen == 1 and counters.compiles_by_variant["size=1"] == 0
    assert counters.compiles_by_variant["general"] == 1


class GatedMLP(torch.nn.Module):
    """A gated MLP whose gate and up come from one projection (as merging makes it, or a model writes
    it), split in the ways models write; the forms "rows", "two_calls" and "gate_read_twice" are near
    misses the gate epilogue must not take."""

    def __init__(self, form="chunk"):
        super().__init__()
        self.form = form
        self.gate_up = torch.nn.Linear(DIM, 2 * HIDDEN, bias=True)
        self.other = torch.nn.Linear(DIM, 2 * HIDDEN, bias=False)
        self.down = torch.nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x):
        x = x.tanh()
        y = self.gate_up(x)
        extra = 0
        if self.form == "chunk":
            gate, up = y.chunk(2, dim=-1)
        elif self.form == "split":
            gate, up = torch.split(y, [HIDDEN, HIDDEN], dim=-1)
        elif self.form == "up_first":
            up, gate = y.split(HIDDEN, dim=-1)
        elif self.form == "rows":  # near miss: halves of the rows, not of the features
            gate, up = y.chunk(2, dim=0)
            return self.down(torch.nn.functional.silu(gate[..., :HIDDEN]) * up[..., :HIDDEN])
        elif self.form == "two_calls":  # near miss: gate and up from different projections
            gate, up = y.chunk(2, dim=-1)[0], self.other(x).chunk(2, dim=-1)[1]
        elif self.form == "gate_read_twice":  # near miss: the gate's slice is read elsewhere too
            gate, up = y.chunk(2, dim=-1)
            extra = gate.sum()
        return self.down(torch.nn.functional.silu(gate) * up) + extra


def _gate_of(call):
    return call.args[8] if len(call.args) > 8 else None


@pytest.mark.parametrize("form,gate", [("chunk", [0, HIDDEN, HIDDEN]), ("split", [0, HIDDEN, HIDDEN]),
                                       ("up_first", [HIDDEN, 0, HIDDEN])])
def test_above_the_prologue_rows_the_gate_runs_in_the_gate_up_projections_epilogue(monkeypatch, form, gate):
    """At GATE_EPILOGUE_ROWS rows (here 2..MAX_ROWS: the CUDA path) silu(gate) * up over two slices of one
    projection's output becomes that projection's call with gate=[gate's start, up's start, width]: no
    kernel of its own. With one row left out of them the down projection's prologue takes the gate instead.
    Outside them (the default at 4 rows: slower in HF Llama, kernels/decode_linear.py) the gate is left to Inductor."""
    from torch_ext.kernels import decode_linear as op

    monkeypatch.setattr(rewrite, "DEVICES", ("cpu",))
    model = GatedMLP(form).to(torch.bfloat16).eval()
    x = torch.randn(4, 1, DIM, dtype=torch.bfloat16)
    gm, fused, out, expected = _rewritten(model, x)
    assert fused == 0 and all(_gate_of(c) is None for c in _calls(gm))
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    monkeypatch.setattr(op, "GATE_EPILOGUE_ROWS", range(2, op.MAX_ROWS + 1))
    gm, fused, out, expected = _rewritten(model, x)
    gate_up, down = _calls(gm)
    assert fused == 1 and _gate_of(gate_up) == gate and not _fused_parts(down)
    names = {getattr(n.target, "__name__", str(n.target)) for n in gm.graph.nodes}
    assert not names & {"silu", "chunk", "split"}
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    gm, fused, out, expected = _rewritten(model, torch.randn(1, 1, DIM, dtype=torch.bfloat16))
    gate_up, down = _calls(gm)
    assert fused == 1 and _gate_of(gate_up) is None and _fused_parts(down) == {"up"}
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


@pytest.mark.parametrize("rows", [1, 2, 8, 9, 16, 17, 32, 33])
def test_untuned_the_gate_epilogue_serves_9_to_32_rows(monkeypatch, rows):
    """Where it measured faster in HF Llama and bench/decode.py (batches 12-32; slower at 8; past 32 rows
    the op runs F.linear); not at one row, where the one-row Triton epilogue timed slower (the down
    projection's prologue takes the gate there)."""
    monkeypatch.setattr(rewrite, "DEVICES", ("cpu",))
    gm, fused, out, expected = _rewritten(GatedMLP("chunk").to(torch.bfloat16).eval(),
                                          torch.randn(rows, 1, DIM, dtype=torch.bfloat16))
    gates = [_gate_of(c) for c in _calls(gm)]
    if rows > 32:
        assert not gates  # past MAX_ROWS the projections stay F.linear, the gate Inductor's
    else:
        assert (gates[0] is not None) == (9 <= rows <= 32) and gates[1] is None
        assert ("up" in _fused_parts(_calls(gm)[1])) == (rows == 1)  # one row: the down projection's prologue
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


class MergedLayer(torch.nn.Module):
    """A Llama MLP block with gate and up merged into one projection (as rewrite/merge_projections.py leaves it)."""

    def __init__(self):
        super().__init__()
        self.norm = RMSNorm(DIM)
        self.gate_up = torch.nn.Linear(DIM, 2 * HIDDEN, bias=False)
        self.down = torch.nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x):
        h = torch.tanh(x)
        gate, up = self.gate_up(self.norm(h)).chunk(2, dim=-1)
        return h + self.down(torch.nn.functional.silu(gate) * up)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_at_one_row_the_gate_goes_into_the_gate_up_call_beside_its_norm(monkeypatch, dtype):
    """Where the epilogue serves one row (here by GATE_EPILOGUE_ROWS; tuned, where it measures faster) it takes
    the gate before the down projection's prologue could (which would compute silu(gate) * up again in every
    program), and the norm still folds into the same call."""
    from torch_ext.kernels import decode_linear as op

    monkeypatch.setattr(op, "GATE_EPILOGUE_ROWS", range(1, op.MAX_ROWS + 1))
    monkeypatch.setattr(rewrite, "DEVICES", ("cpu",))
    gm, fused, out, expected = _rewritten(MergedLayer().to(dtype).eval(), torch.randn(1, 1, DIM, dtype=dtype))
    gate_up, down = _calls(gm)
    assert fused == 3 and _gate_of(gate_up) == [0, HIDDEN, HIDDEN]
    assert _fused_parts(gate_up) == {"norm"} and _fused_parts(down) == {"residual"}
    names = {getattr(n.target, "__name__", str(n.target)) for n in gm.graph.nodes}
    assert not names & {"silu", "chunk", "rsqrt"}
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


@pytest.mark.parametrize("form", ["rows", "two_calls", "gate_read_twice"])
def test_gate_epilogue_near_misses_are_left_alone(monkeypatch, form):
    from torch_ext.kernels import decode_linear as op

    monkeypatch.setattr(op, "GATE_EPILOGUE_ROWS", range(2, op.MAX_ROWS + 1))
    monkeypatch.setattr(rewrite, "DEVICES", ("cpu",))
    gm, fused, out, expected = _rewritten(GatedMLP(form).to(torch.bfloat16).eval(),
                                          torch.randn(4, 1, DIM, dtype=torch.bfloat16))
    assert fused == 0 and all(_gate_of(c) is None for c in _calls(gm))
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_the_gate_runs_as_eager_computes_it_and_a_bad_gate_is_refused():
    """The op's reference (what every kernel must match): eager's silu over one slice times the other,
    each rounded as eager rounds; a gate outside the projection is an error, not a short slice."""
    from torch_ext.kernels.decode_linear import decode_linear_reference

    x, w, b = (torch.randn(3, DIM, dtype=torch.bfloat16), torch.randn(2 * HIDDEN, DIM, dtype=torch.bfloat16),
               torch.randn(2 * HIDDEN, dtype=torch.bfloat16))
    y = torch.nn.functional.linear(x, w, b)
    expected = torch.nn.functional.silu(y[:, HIDDEN:]) * y[:, :HIDDEN]
    out = torch.ops.torch_ext.decode_linear(x, w, b, False, gate=[HIDDEN, 0, HIDDEN])
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"not \[gate_start, up_start, width\]"):
        decode_linear_reference(x, w, b, gate=[2 * HIDDEN - 8, 0, 16])


def test_hf_llama_at_batch_four_runs_each_layers_gate_in_its_gate_up_projection(monkeypatch):
    """HF Llama in bfloat16, a decode step at batch 4 through torch_ext.compile, the gate epilogue on: q/k/v and
    gate/up merged, every projection runs the op; per layer the gate (in gate/up's epilogue) and both
    residual adds fold in, the norms stay Inductor's (NORM_PROLOGUE_MAX_ROWS); logits close to eager's over
    several steps."""
    import torch_ext
    from torch_ext.backend import CompileConfig, counters
    from torch_ext.kernels import decode_linear as op
    import hf_models as hf

    monkeypatch.setattr(op, "GATE_EPILOGUE_ROWS", range(2, op.MAX_ROWS + 1))
    monkeypatch.setattr(rewrite, "DEVICES", ("cpu",))
    model = hf.build("llama").to(torch.bfloat16).eval()
    compiled = torch_ext.compile(model, CompileConfig(cache_dir=None, guard_free_dispatch=True, decode_linear=True),
                                 dynamic=False)
    hf.decode_steps_match(model, compiled, batch=4, steps=3, tol=3e-2)
    layers = model.config.num_hidden_layers
    graphs = counters.graphs_seen  # the first decode token is a strided slice of the prompt: two graphs
    assert graphs >= 1 and counters.decode_linear_calls == graphs * (4 * layers + 1)
    assert counters.decode_linear_fusions == graphs * 3 * layers
