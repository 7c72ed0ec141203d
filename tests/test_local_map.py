"""local_map over DTensors under torch.compile: with torch_ext installed, each local_map call is one
`local_map_hop` call whose body is traced with wrap semantics (torch 2.9.1: torch_ext's HOP; 2.10+:
torch's), matching eager outputs and gradients. CPU only, on a fake process group of 2 ranks."""
import dataclasses
import subprocess
import sys

import pytest
import torch
import torch._dynamo
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.experimental import local_map
from torch.distributed.tensor.experimental._func_map import _local_map_wrapped
from torch.testing._internal.distributed.fake_pg import FakeStore

import torch_ext
from torch_ext import compat
from torch_ext.hops.local_map import local_map_hop
from torch_ext.testing import assert_graph_snapshot, check_matches_eager

# HOP tracing is where torch versions differ most: these run on every CI torch, never sharded.
pytestmark = pytest.mark.every_version


@pytest.fixture(scope="module")
def mesh():
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield init_device_mesh("cpu", (2,))
    if created:
        dist.destroy_process_group()


def _hop_nodes(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is local_map_hop]


def _dtensor(mesh, shape, placements, seed, requires_grad=True):
    """A DTensor leaf of this rank's deterministic local values, made without communication (a
    fake process group leaves the results of collectives, e.g. distribute_tensor's, uninitialized)."""
    gen = torch.Generator().manual_seed(seed)
    local_shape = list(shape)
    for dim, placement in enumerate(placements):
        if isinstance(placement, Shard):
            local_shape[placement.dim] //= mesh.size(dim)
    local = torch.randn(local_shape, generator=gen)
    return DTensor.from_local(local, mesh, placements, run_check=False).requires_grad_(requires_grad)


# --- programs: bodies returning objects torch cannot put in a graph ------------------------

@dataclasses.dataclass
class Stats:
    y: torch.Tensor
    norm: torch.Tensor
    scale: float


def _stats_body(x, w):
    y = torch.tanh(x @ w)
    return Stats(y, y.pow(2).sum(-1, keepdim=True), 0.5)


class KVCache:
    def __init__(self, k, v):
        self.k = k
        self.v = v

    def combined(self):
        return self.k * self.v


def _kv_body(x, w):
    h = x @ w
    return h.relu(), KVCache(h.sin(), h.cos() + 1)


def dataclass_output(mesh):
    """The body returns a dataclass (a pytree leaf of local tensors, so out_placements=None)."""
    lm = local_map(_stats_body, out_placements=None, in_placements=([Shard(0)], [Replicate()]),
                   device_mesh=mesh)

    def fn(x, w):
        s = lm(x, w)
        return s.y * s.norm * s.scale

    return fn, (_dtensor(mesh, (8, 4), [Shard(0)], 0), _dtensor(mesh, (4, 4), [Replicate()], 1))


def user_object_beside_dtensor(mesh):
    """One output becomes a DTensor (Shard(0)); a user object with a method rides beside it."""
    lm = local_map(_kv_body, out_placements=([Shard(0)], None), in_placements=([Shard(0)], [Replicate()]),
                   device_mesh=mesh)

    def fn(x, w):
        h, cache = lm(x, w)
        assert isinstance(h, DTensor)
        return h.to_local() + cache.combined(), cache.k

    return fn, (_dtensor(mesh, (8, 4), [Shard(0)], 2), _dtensor(mesh, (4, 4), [Replicate()], 3))


def built_in_graph(mesh):
    """local_map called inside the compiled function: mesh inferred, in_grad_placements, a kwarg."""
    def fn(x, w, bias):
        lm = local_map(lambda x, w, *, bias: Stats(x @ w + bias, (x * x).sum(), 2.0), out_placements=None,
                       in_placements=([Shard(0)], [Replicate()]),
                       in_grad_placements=([Shard(0)], [Replicate()]))
        s = lm(x, w, bias=bias)
        return s.y * s.scale + s.norm

    bias = torch.randn(4, requires_grad=True)
    return fn, (_dtensor(mesh, (8, 4), [Shard(0)], 4), _dtensor(mesh, (4, 4), [Replicate()], 5), bias)


PROGRAMS = {
    "dataclass_output": dataclass_output,
    "user_object_beside_dtensor": user_object_beside_dtensor,
    "built_in_graph": built_in_graph,
}


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_program_matches_eager(installed, mesh, name):
    fn, inputs = PROGRAMS[name](mesh)
    results = check_matches_eager(fn, *inputs, backends=("eager", "aot_eager"))
    for compiled in results.values():
        assert compiled.frame_count == 1
        (gm,) = compiled.graphs
        (node,) = _hop_nodes(gm)
        body = getattr(gm, node.args[0].target)
        assert not _hop_nodes(body)
        assert tuple(body.meta["local_map_kwargs"]["in_placements"][0]) == (Shard(0),)
    if name == "dataclass_output":
        assert_graph_snapshot("local_map.dataclass_output", results["eager"].graphs[0])


def test_inductor_matches_eager(installed, mesh):
    fn, inputs = dataclass_output(mesh)
    check_matches_eager(fn, *inputs, backends=("inductor",))


def test_dynamic_shapes_match_eager(installed, mesh):
    fn, inputs = dataclass_output(mesh)
    results = check_matches_eager(fn, *inputs, backends=("aot_eager",), dynamic=True)
    (gm,) = results["aot_eager"].graphs
    assert len(_hop_nodes(gm)) == 1


class Block(torch.nn.Module):
    """DTensor parameters passed through local_map with their placements; the body returns a dataclass."""

    def __init__(self, mesh):
        super().__init__()
        self.w = torch.nn.Parameter(_dtensor(mesh, (4, 4), [Replicate()], 11, requires_grad=False))
        self.b = torch.nn.Parameter(_dtensor(mesh, (4,), [Replicate()], 12, requires_grad=False))
        self.body = local_map(self._body, out_placements=None,
                              in_placements=([Shard(0)], [Replicate()], [Replicate()]), device_mesh=mesh)

    @staticmethod
    def _body(x, w, b):
        y = torch.nn.functional.gelu(x @ w + b)
        return Stats(y, y.abs().mean(), 3.0)

    def forward(self, x):
        s = self.body(x, self.w, self.b)
        return s.y * s.scale - s.norm


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_module_parameter_gradients_match_eager(installed, mesh, backend):
    def run(compiled):
        torch.manual_seed(0)
        block = Block(mesh)
        x = _dtensor(mesh, (8, 4), [Shard(0)], 6)
        fn = torch.compile(block, backend=backend, fullgraph=True) if compiled else block
        out = fn(x)
        out.backward(torch.ones_like(out))
        return [out, x.grad.to_local(), block.w.grad.to_local(), block.b.grad.to_local()]

    torch._dynamo.reset()
    torch.testing.assert_close(run(True), run(False))


def test_local_map_inside_checkpoint_nests_the_hop(installed, mesh):
    fn, inputs = dataclass_output(mesh)

    def ckpt(x, w):
        return torch.utils.checkpoint.checkpoint(fn, x, w, use_reentrant=False) * 3

    (gm,) = check_matches_eager(ckpt, *inputs, backends=("aot_eager",))["aot_eager"].graphs
    (ckpt_node,) = [n for n in gm.graph.nodes if n.op == "call_function" and "checkpoint" in str(n.target)]
    assert len(_hop_nodes(getattr(gm, ckpt_node.args[0].target))) == 1


def test_graph_break_in_the_body_falls_back_like_torch(installed, mesh):
    def body(x, w):
        y = x @ w
        torch._dynamo.graph_break()
        return Stats(y.sin(), y.sum(), 1.0)

    lm = local_map(body, out_placements=None, in_placements=([Shard(0)], [Replicate()]), device_mesh=mesh)
    x, w = _dtensor(mesh, (8, 4), [Shard(0)], 13), _dtensor(mesh, (4, 4), [Replicate()], 14)
    with pytest.raises(compat.Unsupported, match="graph_break"):
        torch.compile(lambda x, w: lm(x, w).y, backend="eager", fullgraph=True)(x, w)
    results = check_matches_eager(lambda x, w: lm(x, w).y * 2, x, w, backends=("eager",), fullgraph=False)
    assert not any(_hop_nodes(gm) for gm in results["eager"].graphs)


# --- vanilla torch beside torch_ext ---------------------------------------------------------

def test_vanilla_torch_inlines_local_map_torch_ext_traces_one_hop(mesh):
    fn, inputs = dataclass_output(mesh)
    # Vanilla torch (both versions) inlines local_map's Python: no region survives in the graph.
    (gm,) = check_matches_eager(fn, *inputs, backends=("eager",))["eager"].graphs
    assert not _hop_nodes(gm)
    with torch_ext.installed():
        (gm,) = check_matches_eager(fn, *inputs, backends=("eager",))["eager"].graphs
        assert len(_hop_nodes(gm)) == 1
    (gm,) = check_matches_eager(fn, *inputs, backends=("eager",))["eager"].graphs
    assert not _hop_nodes(gm)  # uninstall() brings vanilla tracing back


@pytest.mark.skipif(compat.TORCH_VERSION < (2, 10), reason="torch 2.9.1 has no local_map HOP of its own")
@pytest.mark.parametrize("with_torch_ext", [False, True])
def test_torch_own_local_map_tracing_fails_on_dtensors_and_is_left_alone(mesh, with_torch_ext):
    # torch 2.10+'s own local_map tracing (for Autoparallel, behind enable()) refuses DTensors; with
    # torch_ext installed, enable() still selects torch's path, unchanged.
    lm = local_map(lambda x: x.sin(), out_placements=([Shard(0)],), in_placements=([Shard(0)],),
                   device_mesh=mesh)
    x = _dtensor(mesh, (8, 4), [Shard(0)], 7)
    with torch_ext.installed() if with_torch_ext else _nullcontext():
        with compat.LocalMapHigherOrderVariableBase.enable():
            with pytest.raises(Exception, match="No subclasses support"):
                torch.compile(lambda x: lm(x), backend="eager", fullgraph=True)(x)


def _nullcontext():
    import contextlib

    return contextlib.nullcontext()


# --- install / uninstall --------------------------------------------------------------------

def test_install_maps_local_map_wrapped_and_uninstall_restores_exactly():
    table = compat.builder_id_dispatch()
    before = dict(table)
    torch_ext.install()
    torch_ext.install()
    assert id(_local_map_wrapped) in table and id(_local_map_wrapped) not in before
    torch_ext.uninstall()
    torch_ext.uninstall()
    assert table == before


def test_importing_patches_nothing():
    code = (
        "from torch._dynamo.variables.builder import VariableBuilder as B\n"
        "from torch._dynamo.variables import higher_order_ops as h\n"
        "ids = dict(B._id_dispatch()); hops = dict(h._hop_name_to_variable_class)\n"
        "import torch_ext.hops.local_map, torch_ext.variables.local_map\n"
        "assert dict(B._id_dispatch()) == ids and dict(h._hop_name_to_variable_class) == hops\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# --- errors ---------------------------------------------------------------------------------

def test_dtensor_closed_over_by_the_body_is_a_clear_error(installed, mesh):
    w = _dtensor(mesh, (4, 4), [Replicate()], 8)
    lm = local_map(lambda x: x @ w.to_local(), out_placements=None, in_placements=([Shard(0)],),
                   device_mesh=mesh)
    x = _dtensor(mesh, (8, 4), [Shard(0)], 9)
    lm(x)  # eager runs it
    with pytest.raises(compat.Unsupported, match=r"local_map_hop(.|\n)*DTensor(.|\n)*in_placements"):
        torch.compile(lambda x: lm(x), backend="eager", fullgraph=True)(x)


def test_body_mutating_an_input_is_a_clear_error(installed, mesh):
    def body(x):
        x.mul_(2)
        return Stats(x.sin(), x.sum(), 1.0)

    lm = local_map(body, out_placements=None, in_placements=([Shard(0)],), device_mesh=mesh)
    x = _dtensor(mesh, (8, 4), [Shard(0)], 10, requires_grad=False)
    with pytest.raises(compat.Unsupported, match=r"local_map_hop(.|\n)*in place"):
        torch.compile(lambda x: lm(x).y, backend="eager", fullgraph=True)(x)


def test_body_returning_a_view_of_its_input_matches_eager(installed, mesh):
    # torch refuses this for its HOPs; torch_ext replays the view in the caller, outside the HOP.
    lm = local_map(lambda x: Stats(x.t(), x.sum(), 1.0), out_placements=None, in_placements=([Shard(0)],),
                   device_mesh=mesh)
    x = _dtensor(mesh, (8, 4), [Shard(0)], 10)
    (gm,) = check_matches_eager(lambda x: lm(x).y * 2, x, backends=("aot_eager",))["aot_eager"].graphs
    (node,) = _hop_nodes(gm)
    body = getattr(gm, node.args[0].target)
    assert all(n.target != "t" for n in body.graph.find_nodes(op="output")[0].all_input_nodes)


def test_calling_the_hop_directly_is_a_clear_error(installed):
    gm = torch.fx.symbolic_trace(lambda x: (x.sin(),))
    with pytest.raises(compat.Unsupported, match=r"local_map_hop(.|\n)*called directly"):
        torch.compile(lambda x: local_map_hop(gm, x), backend="eager", fullgraph=True)(torch.randn(3))


# --- the HOP's own implementations ----------------------------------------------------------

def _body_gm():
    def body(a, b):
        c = a.clone()
        c.add_(1)  # functionalization rewrites this inside the body
        return (c.sin() * b, a.cos())

    gm = torch.fx.symbolic_trace(body)
    gm.meta["local_map_kwargs"] = {"in_placements": None, "out_placements": None, "in_grad_placements": None}
    return body, gm


def test_hop_eager_autograd_and_fake():
    body, gm = _body_gm()
    a, b = torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)
    out, ref = local_map_hop(gm, a, b), body(a, b)
    torch.testing.assert_close(out, ref)
    grads = torch.autograd.grad(sum(o.sum() for o in out), (a, b))
    torch.testing.assert_close(grads, torch.autograd.grad(sum(o.sum() for o in ref), (a, b)))
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake = local_map_hop(gm, mode.from_tensor(a), mode.from_tensor(b))
    assert [t.shape for t in fake] == [torch.Size([3])] * 2


@pytest.mark.skipif(compat.torch_local_map_hop() is not None, reason="torch ships its own local_map_hop")
@pytest.mark.parametrize("functionalize", [False, True])
def test_hop_proxy_mode_and_functionalization_below_autograd(functionalize):
    from torch.fx.experimental.proxy_tensor import make_fx

    body, gm = _body_gm()
    a, b = torch.randn(3), torch.randn(3)

    def f(a, b):
        with torch._C._AutoDispatchBelowAutograd():
            return local_map_hop(gm, a, b)

    traced = make_fx(torch.func.functionalize(f) if functionalize else f, tracing_mode="symbolic")(a, b)
    (node,) = _hop_nodes(traced)
    assert node.meta["local_map_kwargs"] == gm.meta["local_map_kwargs"]
    inner = getattr(traced, node.args[0].target)
    targets = {n.target for n in inner.graph.nodes if n.op == "call_function"}
    assert (torch.ops.aten.add.Tensor in targets) == functionalize
    assert (torch.ops.aten.add_.Tensor in targets) != functionalize
    torch.testing.assert_close(traced(a, b), body(a, b))
