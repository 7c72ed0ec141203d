"""torch_ext avoids the wrong results of torch pinned in test_torch_bugs.py (torch_ext/workarounds.py),
and says clearly which torch versions it supports.

Each program here is one that vanilla torch gets wrong or crashes on (see test_torch_bugs.py for the
vanilla side); with install() it matches eager on eager, aot_eager and inductor, outputs and
gradients of every input (weights are inputs, so their gradients are checked too).
"""
import importlib
import warnings

import pytest
import torch

import torch_ext
from torch_ext import compat, workarounds
from torch_ext.testing import capture_graphs, check_matches_eager

from test_torch_bugs import (Pair, branches_on_list_type, branches_on_pair_type, checkpoint_grad_error, checkpointed_dropout, checkpointed_dropout_rows, chained_calls,
                             dropout_body, dropout_mask_error,
                             nested_regions, per_instance_regions, selectively_checkpointed_dropout, two_calls_product)

# HOP tracing is where torch versions differ most: these run on every CI torch, never sharded.
pytestmark = pytest.mark.every_version

BACKENDS = ("eager", "aot_eager", "inductor")


@torch.compiler.nested_compile_region
def residual_block(h, residual, w):
    r = h + residual
    return torch.relu(r @ w), r


@torch.compiler.nested_compile_region
def mlp_block(h, w):
    return torch.tanh(h @ w) + h


def multi_output_chain(x, *weights):
    h, residual = x, torch.zeros_like(x)
    for w in weights:
        h, residual = residual_block(h, residual, w)
    return h + residual


def single_output_chain(x, *weights):
    for w in weights:
        x = mlp_block(x, w)
    return x * 2


def _inputs(length: int):
    x = torch.randn(4, 8, requires_grad=True)
    weights = [(torch.randn(8, 8) / 3).requires_grad_() for _ in range(length)]
    return x, *weights


@pytest.mark.parametrize("chain", [multi_output_chain, single_output_chain])
@pytest.mark.parametrize("length", [2, 4, 8])
def test_region_chains_match_eager(installed, chain, length):
    check_matches_eager(chain, *_inputs(length), backends=BACKENDS, atol=1e-4, rtol=1e-4)


def test_regions_bound_per_instance_match_eager(installed):
    """torch_ext lifts each call's own parameters (torch 2.13+ alone reuses the first instance's)."""
    check_matches_eager(per_instance_regions(3), torch.randn(2, 8, requires_grad=True), backends=("eager", "aot_eager"))


@pytest.mark.parametrize("program", [branches_on_pair_type, branches_on_list_type])
def test_reused_regions_keep_their_output_type(installed, program):
    """Vanilla 2.12+ returns the second call as a plain tuple (test_torch_bugs.py): another branch."""
    check_matches_eager(program, torch.randn(4, 3, requires_grad=True), backends=BACKENDS)


def test_reused_region_namedtuple_fields_read(installed):
    """`out.first` of a namedtuple region's second call: vanilla 2.15 fails ('GetAttrVariable(TupleVariable)
    does not implement python_type()'); the body is still installed once."""
    def twice(x):
        a, b = _pair_region(x), _pair_region(x * 2)
        return a.first * b.second + b.first

    check_matches_eager(twice, torch.randn(5, requires_grad=True), backends=BACKENDS)
    gm = capture_graphs(twice, torch.randn(5)).graphs[0]
    bodies = {node.args[0].target for node in gm.graph.nodes
              if node.target is torch._higher_order_ops.invoke_subgraph}
    assert len(bodies) == 1


def _pair(x):
    return Pair(torch.cos(x), torch.sin(x) * 2)


_pair_region = torch.compiler.nested_compile_region(_pair)


@pytest.mark.parametrize("program", [two_calls_product, chained_calls, nested_regions])
def test_pinned_programs_match_eager(installed, program):
    check_matches_eager(program, torch.randn(4, requires_grad=True), backends=BACKENDS)


def test_regions_needing_grad_run_under_eager_backend(installed):
    """Vanilla: 'fake_mode should be enabled for HOPs' (test_torch_bugs.py); a region just runs its
    body at run time, so with ordinary autograd."""
    x, w = torch.randn(4, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
    out = torch.compile(multi_output_chain, backend="eager", fullgraph=True)(x, w, w)
    grads = torch.autograd.grad(out.sum(), (x, w))
    expected = torch.autograd.grad(multi_output_chain(x, w, w).sum(), (x, w))
    torch.testing.assert_close(grads, expected)


@pytest.mark.parametrize("program", [checkpointed_dropout, selectively_checkpointed_dropout])
def test_checkpoints_under_eager_backend_recompute_with_the_forward_rng_state(installed, program):
    """Vanilla: dropout draws a new mask in the recompute (test_torch_bugs.py); torch_ext checkpoints
    such a call as eager does."""
    assert checkpoint_grad_error(program) < 1e-5


def test_checkpoint_under_eager_backend_keeps_body_kwargs_and_still_recomputes(installed):
    """Body kwargs reach the body, and the call stays a checkpoint: backward runs the body's matmul
    again (3 matmuls in backward: the recompute and the two gradients)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountMatmuls(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += func.overloadpacket is torch.ops.aten.mm
            return func(*args, **(kwargs or {}))

    def body(x, w, *, scale):
        return dropout_body(x, w) * scale

    def program(x, w):
        return torch.utils.checkpoint.checkpoint(body, x, w, use_reentrant=False, scale=3.0).sum(-1)

    x, w = torch.randn(4, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
    torch.manual_seed(0)
    out = torch.compile(program, backend="eager", fullgraph=True)(x, w)
    torch.manual_seed(0)
    expected = program(x, w)
    torch.testing.assert_close(out, expected)
    with CountMatmuls() as counted:
        grads = torch.autograd.grad(out.sum(), (x, w))
    torch.testing.assert_close(grads, torch.autograd.grad(expected.sum(), (x, w)))
    assert counted.count == 3


def test_checkpointed_dropout_trains_under_inductor_with_dynamic_shapes(installed):
    """Vanilla 2.9.1 and 2.12.1 fail to compile it (test_torch_bugs.py); torch_ext compiles such graphs
    with fallback_random there. Gradients follow the mask the forward drew, on every version."""
    torch._dynamo.reset()
    graphs = []
    compiled = torch.compile(checkpointed_dropout_rows, dynamic=True, fullgraph=True)
    assert dropout_mask_error(compiled) < 1e-4
    torch.compile(checkpointed_dropout_rows, backend=lambda gm, _: graphs.append(gm) or gm, dynamic=True,
                  fullgraph=True)(torch.randn(4, 8), torch.randn(8, 8))
    patches = workarounds.inductor_patches(graphs[0])
    assert patches.get("fallback_random", False) == compat.PARTITIONER_FAILS_ON_DYNAMIC_CHECKPOINTED_RNG


def test_inductor_patches_only_for_region_graphs():
    plain = torch.fx.symbolic_trace(lambda x: x + 1)
    assert workarounds.inductor_patches(plain) == {}
    graphs = []
    torch.compile(single_output_chain, backend=lambda gm, _: graphs.append(gm) or gm, fullgraph=True)(
        *_inputs(2))
    assert workarounds.calls_invoke_subgraph(graphs[0])
    assert workarounds.inductor_patches(graphs[0]) == workarounds.NO_REGION_BUFFER_REUSE
    with torch._inductor.config.patch(workarounds.NO_REGION_BUFFER_REUSE):
        assert workarounds.inductor_patches(graphs[0]) == {}  # already in force: nothing to add


def test_uninstall_restores_what_install_patched():
    compile_fx_module = importlib.import_module("torch._inductor.compile_fx")
    hop = torch._higher_order_ops.invoke_subgraph
    key = torch._C.DispatchKey.Autograd
    checkpoint_call = torch._higher_order_ops.wrap.TagActivationCheckpoint.__dict__["__call__"]
    before = (compile_fx_module.compile_fx, hop.py_kernels[key], checkpoint_call)
    torch_ext.install()
    torch_ext.install()  # idempotent: wraps once
    assert compile_fx_module.compile_fx.__torch_ext_original__ is before[0]
    if compat.EAGER_REGION_BACKWARD_NEEDS_FAKE_MODE:
        assert hop.py_kernels[key].__torch_ext_original__ is before[1]
    assert torch._higher_order_ops.wrap.TagActivationCheckpoint.__call__.__wrapped__ is checkpoint_call
    torch_ext.uninstall()
    after = torch._higher_order_ops.wrap.TagActivationCheckpoint.__dict__["__call__"]
    assert (compile_fx_module.compile_fx, hop.py_kernels[key], after) == before


def test_older_torch_is_refused_with_the_versions_named():
    with pytest.raises(ImportError, match=r"needs torch >= 2\.9\.1 \(tested: 2\.9\.1, 2\.11\.0, 2\.13\.0, 2\.14\.1, 2\.15\.0\); "
                                          r"this is torch 2\.8\.0"):
        compat.check_torch_version((2, 8, 0))
    compat.check_torch_version((2, 9, 1))


def test_newer_torch_warns_once_on_install(monkeypatch):
    assert compat.warn_if_untested(compat.NEWEST_TESTED_TORCH) is False
    monkeypatch.setattr(compat.versions, "TORCH_RELEASE", (2, 99, 0))
    install_module = importlib.import_module("torch_ext.install")  # torch_ext.install is the function
    install_module._warn_once_if_untested.cache_clear()
    try:
        with pytest.warns(UserWarning, match=r"tested with torch 2\.9\.1, 2\.11\.0, 2\.13\.0, 2\.14\.1, 2\.15\.0; this is torch \S+, newer"):
            torch_ext.install()
        torch_ext.uninstall()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            torch_ext.install()  # said once per process
    finally:
        install_module._warn_once_if_untested.cache_clear()
