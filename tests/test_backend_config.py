"""CompileConfig validation, the splitting_op helper and how the backend is reached (no compiling)."""
from __future__ import annotations

import copy
import dataclasses
import os
import pickle
import subprocess
import sys

import pytest
import torch

import backend_models  # noqa: F401  (declares the torch_ext_test ops)
import torch_ext.backend
from torch_ext.backend import CompileConfig, ConfigError
from torch_ext.hops.splitting_op import declared_splitting_ops, splitting_op


@pytest.mark.parametrize("kwargs, field, hint", [
    (dict(splitting_ops=["torch_ext_test::no_such_op"]), "splitting_ops", "Define it"),
    (dict(splitting_ops=["attention"]), "splitting_ops", "namespace::name"),
    (dict(splitting_ops=["torch.nn.functional.no_such_function"]), "splitting_ops", "module.function"),
    (dict(splitting_ops=["torch.nn.functional.Tensor.shape"]), "splitting_ops", "can be imported"),
    (dict(splitting_ops="torch_ext_test::attention"), "splitting_ops", "sequence"),
    (dict(compile_sizes=[8, -1]), "compile_sizes", "positive"),
    (dict(compile_sizes=[8, 2.5]), "compile_sizes", "not an int"),
    (dict(compile_ranges_split_points=[32, 8]), "compile_ranges_split_points", "(8, 32)"),
    (dict(compile_ranges_split_points=[8, 8]), "compile_ranges_split_points", "strictly increasing"),
    (dict(compile_ranges_split_points=[0, 8]), "compile_ranges_split_points", "positive"),
    (dict(inductor_options={"max_autotun": True}), "inductor_options", "max_autotune"),
    (dict(inductor_options=[("max_autotune", True)]), "inductor_options", "dict"),
    (dict(cudagraph_mode="always"), "cudagraph_mode", "piecewise"),
    (dict(cudagraph_capture_sizes=[0]), "cudagraph_capture_sizes", "positive"),
    (dict(cudagraph_num_warmup=-1), "cudagraph_num_warmup", ">= 0"),
    (dict(dedup="yes"), "dedup", "True or False"),
    (dict(hop_split="outline"), "hop_split", "inline"),
    (dict(post_grad_passes=[42]), "post_grad_passes", "not callable"),
])
def test_bad_fields_name_the_field_and_the_fix(kwargs, field, hint):
    with pytest.raises(ConfigError) as info:
        CompileConfig(**kwargs)
    assert f"CompileConfig.{field}" in str(info.value)
    assert hint in str(info.value)


def test_fields_are_normalized():
    cfg = CompileConfig(splitting_ops=[backend_models.attention, "torch_ext_test::attention",
                                       torch.ops.torch_ext_test.attention_fn],
                        compile_sizes=[32, 8, 8], cudagraph_capture_sizes=[4, 1],
                        cache_dir="~/somewhere", inductor_options={"max_autotune": False})
    assert cfg.splitting_ops == ("torch_ext_test::attention", "torch_ext_test::attention_fn")
    function = CompileConfig(splitting_ops=[torch.nn.functional.multi_head_attention_forward])
    assert function.splitting_ops == ("torch.nn.functional.multi_head_attention_forward",)
    assert cfg.compile_sizes == (8, 32)
    assert cfg.cudagraph_capture_sizes == (1, 4)
    assert cfg.cache_dir == os.path.join(os.path.expanduser("~"), "somewhere")
    with pytest.raises(TypeError, match="frozen"):
        cfg.inductor_options["max_autotune"] = True  # read-only: the config is frozen
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.dedup = False
    assert pickle.loads(pickle.dumps(cfg)) == cfg == copy.deepcopy(cfg)
    assert dataclasses.replace(cfg, dedup=False).dedup is False


def test_cache_dir_default_and_off(monkeypatch, tmp_path):
    monkeypatch.delenv("TORCH_EXT_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert CompileConfig().cache_dir == str(tmp_path / "torch_ext")
    monkeypatch.setenv("TORCH_EXT_CACHE_DIR", str(tmp_path / "mine"))
    assert CompileConfig().cache_dir == str(tmp_path / "mine")
    assert CompileConfig(cache_dir=None).cache_dir is None
    assert CompileConfig(cache_dir="").cache_dir is None


def test_compile_ranges():
    assert CompileConfig().compile_ranges() == ((1, None),)
    assert CompileConfig(compile_ranges_split_points=[8, 32]).compile_ranges() == ((1, 8), (8, 32), (32, None))
    assert CompileConfig(compile_ranges_split_points=[1, 4]).compile_ranges() == ((1, 4), (4, None))


def test_artifact_hash_tracks_what_changes_code():
    base = CompileConfig(cache_dir=None)
    assert base.artifact_hash() == CompileConfig(cache_dir="/elsewhere", dedup=False).artifact_hash()
    assert base.artifact_hash() != CompileConfig(inductor_options={"max_autotune": True}).artifact_hash()
    assert base.artifact_hash() != CompileConfig(splitting_ops=["torch_ext_test::attention"]).artifact_hash()


def test_splitting_op_declares_a_working_op():
    assert "torch_ext_test::attention" in declared_splitting_ops()
    q, k, v = torch.randn(3, 4, 8).unbind(0)
    cache = torch.zeros(6, 8)
    out = torch.ops.torch_ext_test.attention(q, k, v, cache)
    assert torch.equal(cache[:4], k)
    assert out.shape == q.shape
    # The None-returning op got a default fake implementation.
    with torch._subclasses.FakeTensorMode() as mode:
        fq = mode.from_tensor(q)
        assert torch.ops.torch_ext_test.attention_out(fq, fq, fq, mode.from_tensor(cache), fq) is None


def test_inference_only_splitting_op_is_a_dispatcher_op_that_guards_gradients():
    from backend_models import attention_out_inference as op

    assert isinstance(op, torch._ops.OpOverloadPacket) and "torch_ext_test::attention_out_inference" in \
        declared_splitting_ops()
    assert CompileConfig(splitting_ops=[op], cache_dir=None).splitting_ops == ("torch_ext_test::attention_out_inference",)
    q, k, v = torch.randn(3, 4, 8).unbind(0)
    cache, out = torch.zeros(6, 8), torch.empty(4, 8)
    versions = cache._version, out._version
    op(q, k, v, cache, out)
    expected = torch.empty(4, 8)
    torch.ops.torch_ext_test.attention_out(q, k, v, torch.zeros(6, 8), expected)
    assert torch.equal(cache[:4], k) and torch.equal(out, expected)
    assert cache._version > versions[0] and out._version > versions[1]  # autograd sees the writes
    with torch._subclasses.FakeTensorMode() as mode:
        fq = mode.from_tensor(q)
        assert op(fq, fq, fq, mode.from_tensor(cache), fq) is None
    w = q.clone().requires_grad_()
    with pytest.raises(RuntimeError, match=r"autograd=False.*requires grad.*register_autograd"):
        op(w, k, v, cache, out)
    with torch.no_grad():
        op(w, k, v, cache, out)
    with torch.inference_mode():
        op(q.clone(), k.clone(), v.clone(), torch.zeros(6, 8), torch.empty(4, 8))


def test_inference_only_splitting_op_checks_tensors_inside_lists():
    @splitting_op("torch_ext_test::sum_into", mutates_args=("outs",), autograd=False)
    def sum_into(xs: list[torch.Tensor], outs: list[torch.Tensor]) -> None:
        for x, out in zip(xs, outs):
            out.copy_(x.sum(0))

    xs, outs = [torch.randn(3, 4), torch.randn(3, 4)], [torch.empty(4), torch.empty(4)]
    versions = [o._version for o in outs]
    sum_into(xs, outs)
    assert all(torch.equal(o, x.sum(0)) for o, x in zip(outs, xs))
    assert all(o._version > v for o, v in zip(outs, versions))
    with pytest.raises(RuntimeError, match="requires grad"):  # a list element needing grad is no exception
        sum_into([xs[0], xs[1].clone().requires_grad_()], outs)


def test_splitting_op_errors():
    with pytest.raises(ValueError, match="namespace::name"):
        splitting_op("attention")
    with pytest.raises(TypeError, match="tuple of argument names"):
        splitting_op("torch_ext_test::x", mutates_args="cache")
    with pytest.raises(TypeError, match="fake="):
        @splitting_op("torch_ext_test::needs_fake")
        def needs_fake(x: torch.Tensor) -> torch.Tensor:
            return x.clone()
    with pytest.raises(ValueError, match="does not take"):
        @splitting_op("torch_ext_test::bad_mutation", mutates_args=("cache",))
        def bad_mutation(x: torch.Tensor) -> None:
            pass


def test_backend_entry_points():
    cfg = CompileConfig(cache_dir=None)
    backend = torch_ext.backend.make_backend(cfg)
    assert backend.config is cfg
    assert torch_ext.backend(cfg).config is cfg  # the package is callable, like make_backend
    assert torch._dynamo.lookup_backend("torch_ext") is torch_ext.backend.torch_ext_backend


def test_public_names_resolve_from_a_fresh_import():
    code = ("import torch_ext; cfg = torch_ext.CompileConfig(cache_dir=None); "
            "print(type(torch_ext.backend(cfg)).__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "TorchExtBackend"
