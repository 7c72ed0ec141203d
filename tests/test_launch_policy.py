"""kernels/launch_policy.py: the per-thread switch that has the decode ops run their reference where a
graph compiled for CUDA graphs runs without one, and the CUDA-graph runner that sets it (the GPU side,
kernels counted in a real model: test_decode_launch_policy_gpu.py)."""
from __future__ import annotations

import threading
import types

import pytest

from torch_ext.backend import CompileConfig
from torch_ext.backend.runtime.cudagraph.manager import CudaGraphManager
from torch_ext.backend.runtime.cudagraph.runner import CudaGraphRunner
from torch_ext.kernels.launch_policy import launched_from_host, runs_reference


def test_the_switch_nests_and_is_per_thread():
    assert not runs_reference("decode_linear")
    seen_elsewhere = []
    with launched_from_host(frozenset({"decode_linear"})):
        with launched_from_host(frozenset({"decode_attention"})):
            assert runs_reference("decode_linear") and runs_reference("decode_attention")
            other = threading.Thread(target=lambda: seen_elsewhere.append(runs_reference("decode_linear")))
            other.start()
            other.join()
        assert runs_reference("decode_linear") and not runs_reference("decode_attention")
    assert not runs_reference("decode_linear") and seen_elsewhere == [False]


@pytest.mark.parametrize("attention,linear,expected", [(None, None, {"decode_attention", "decode_linear"}),
                                                       (True, None, {"decode_linear"}),
                                                       (None, False, {"decode_attention"}), (True, True, set())])
def test_a_call_without_a_graph_has_the_defaulted_ops_run_their_reference(attention, linear, expected):
    """Ops left to their default (None) run their reference inside an uncaptured call; an op set to True
    keeps its kernel (False: the op is not in the graph at all). Outside the call nothing changes."""
    manager = CudaGraphManager(CompileConfig(cudagraph_mode="full", decode_attention=attention, decode_linear=linear,
                                             cache_dir=None))
    assert manager.reference_ops == expected
    seen = {}

    def runnable(x):
        seen.update({op: runs_reference(op) for op in ("decode_attention", "decode_linear")})
        return x + 1

    runner = types.SimpleNamespace(fallback=None, manager=manager, runnable=runnable)
    assert CudaGraphRunner._uncaptured(runner, (1,)) == 2
    assert {op for op, ref in seen.items() if ref} == expected
    assert not runs_reference("decode_attention") and not runs_reference("decode_linear")
