"""Early dependent launch for Inductor's kernels in decode pieces (compat.early_dependent_launch,
backend/compile/decode_options.py): the trigger moves to right after a kernel's first wait, only inside
the context, and the FX-graph cache key tells the two orders apart. The GPU side (kernels that start
before the one before them ends; results equal eager's) runs in the GPU suite and bench/inference_floor.py."""
from __future__ import annotations

import contextlib

import pytest

from torch_ext import compat
from torch_ext.backend.compile import decode_options

pytestmark = pytest.mark.skipif(not compat.has_inductor_pdl(), reason="Inductor without triton.enable_pdl (< 2.11)")


def _body():
    from torch._inductor.codegen.triton import TritonKernel
    from torch._inductor.utils import IndentedBuffer

    code = IndentedBuffer()
    for line in ("x0 = xindex", "tmp0 = tl.load(in_ptr0 + x0)", TritonKernel.GDC_WAIT, "tmp1 = tl.load(in_ptr1 + x0)",
                 TritonKernel.GDC_WAIT, TritonKernel.GDC_LAUNCH, "tl.store(out_ptr0 + x0, tmp0 + tmp1)"):
        code.writeline(line)
    return code


def _filtered(kernel_cls, early: bool) -> list[str]:
    """Inductor's own filter (first wait, last trigger kept), as a kernel's codegen calls it."""
    code = _body()
    kernel = object.__new__(kernel_cls)  # _filter_pdl reads the class's constants only
    if early:
        with compat.early_dependent_launch():
            kernel._filter_pdl(code)
    else:
        kernel._filter_pdl(code)
    return [line.strip() for line in code._lines]


def test_the_trigger_follows_the_first_wait_inside_the_context_only():
    from torch._inductor.codegen.triton import TritonKernel as K

    with compat.early_dependent_launch():
        pass  # installed now: outside the context Inductor's order must stay
    late = _filtered(K, early=False)
    assert late == ["x0 = xindex", "tmp0 = tl.load(in_ptr0 + x0)", K.GDC_WAIT, "tmp1 = tl.load(in_ptr1 + x0)",
                    K.GDC_LAUNCH, "tl.store(out_ptr0 + x0, tmp0 + tmp1)"]
    early = _filtered(K, early=True)
    assert early == ["x0 = xindex", "tmp0 = tl.load(in_ptr0 + x0)", K.GDC_WAIT, K.GDC_LAUNCH,
                     "tmp1 = tl.load(in_ptr1 + x0)", "tl.store(out_ptr0 + x0, tmp0 + tmp1)"]


def test_a_trigger_with_no_wait_before_it_is_left_alone():
    lines = ["launch()", "x = 1", "wait()"]
    assert not compat.move_launch_after_first_wait(lines, "wait()", "launch()")
    assert lines == ["launch()", "x = 1", "wait()"]


def test_pieces_with_pdl_compile_early_and_key_the_cache_by_it(monkeypatch):
    pdl = {decode_options.PDL_OPTION: True}

    class Passes:
        def uuid(self):
            return "passes-1"

    keyed = decode_options.keyed_post_pass(pdl, None)
    assert keyed is not None and keyed.uuid() == "early-dependent-launch|"
    assert decode_options.keyed_post_pass(pdl, Passes()).uuid() == "early-dependent-launch|passes-1"
    plain = Passes()
    assert decode_options.keyed_post_pass({}, plain) is plain and decode_options.keyed_post_pass({}, None) is None
    assert isinstance(decode_options.decode_launch_order({}), contextlib.nullcontext)
    monkeypatch.setattr(decode_options, "EARLY_LAUNCH", False)
    assert decode_options.keyed_post_pass(pdl, plain) is plain


@pytest.mark.parametrize("early", [True, False])
def test_a_piece_calling_the_op_compiles_inside_the_early_launch_context(monkeypatch, early):
    """The wiring: a piece that calls decode_linear (on a "CUDA device with PDL", patched onto the CPU)
    compiles inside compat.early_dependent_launch, unless EARLY_LAUNCH is off; results equal eager's."""
    import torch

    import torch_ext
    from torch_ext.backend import CompileConfig
    from torch_ext.backend.rewrite import decode_linear as rewrite

    entered = []

    @contextlib.contextmanager
    def recording():
        entered.append(True)
        yield

    monkeypatch.setattr(rewrite, "DEVICES", ("cpu",))
    monkeypatch.setattr(decode_options, "_has_cuda", lambda: True)
    monkeypatch.setattr(decode_options, "_gpu_has_pdl", lambda: True)
    monkeypatch.setattr(decode_options, "EARLY_LAUNCH", early)
    monkeypatch.setattr(compat, "early_dependent_launch", recording)
    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64)).eval()
    compiled = torch_ext.compile(model, CompileConfig(cache_dir=None, decode_linear=True), dynamic=False)
    x = torch.randn(1, 64)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x))
    assert bool(entered) == early


def test_a_users_own_post_grad_pass_still_runs_in_an_early_launch_piece(monkeypatch):
    """inductor_options' post_grad_custom_post_pass is kept (wrapped for the cache key) where torch_ext
    adds no passes of its own: the early-launch key must not replace it."""
    import torch

    import torch_ext
    from torch_ext.backend import CompileConfig
    from torch_ext.backend.rewrite import decode_linear as rewrite

    seen = []

    def user_pass(graph):  # a plain callable: no uuid, so Inductor's cache is bypassed
        seen.append(len(graph.nodes))

    monkeypatch.setattr(rewrite, "DEVICES", ("cpu",))
    monkeypatch.setattr(decode_options, "_has_cuda", lambda: True)
    monkeypatch.setattr(decode_options, "_gpu_has_pdl", lambda: True)
    assert decode_options.keyed_post_pass({decode_options.PDL_OPTION: True}, user_pass).uuid() is None
    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64)).eval()
    config = CompileConfig(cache_dir=None, decode_linear=True, unfuse_output_addmm=False,  # no passes of ours
                           inductor_options={"post_grad_custom_post_pass": user_pass})
    compiled = torch_ext.compile(model, config, dynamic=False)
    x = torch.randn(1, 64)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x))
    assert seen
