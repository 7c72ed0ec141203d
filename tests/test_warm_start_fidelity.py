"""A warm-started program is the program a cold process compiled: Hugging Face generate (static cache)
compiled with the decode rewrites on (put onto CPU tensors as the rewrites' own tests do), merged
projections and a CUDA-graph plan, then loaded by a second process: torch_ext.backend.describe()
(pieces and their fingerprints, torch_ext's ops in each, their Inductor options, merged groups, the
CUDA-graph runners and roles of their inputs, the decode ops left to their reference) reads the same.
The GPU side (the kernels each runs) is tests/test_warm_start_fidelity_gpu.py."""
from __future__ import annotations

import pytest

from torch_ext import compat

pytest.importorskip("transformers")
from test_warm_start_generate import run_worker, warm  # noqa: E402

pytestmark = [pytest.mark.skipif(not compat.HAS_AOT_COMPILE, reason="this torch has no AOT compile: no warm start"),
              pytest.mark.slow]  # two fresh processes, the first compiling with Inductor (~40 s on 2 cores)


def ops_of(description, op: str) -> int:
    return sum(p["torch_ext_ops"].get(op, 0) for graph in description for p in graph["pieces"])


@pytest.mark.parametrize("split, cudagraph, pieces", [("none", "full", "inductor"), ("sdpa", "piecewise", "fx")],
                         ids=["full graph, inductor", "piecewise, fx pieces"])
def test_warm_start_loads_the_program_the_cold_process_compiled(tmp_path, split, cudagraph, pieces):
    extra = ("--decode-ops", "--describe", "--split", split, "--cudagraph", cudagraph, "--guard-free",
             "--batch", "1", "--layers", "2" if pieces == "fx" else "1", "--generates", "2")
    extra += ("--fx-pieces",) if pieces == "fx" else ()
    cold = run_worker(tmp_path, *extra)
    again = run_worker(tmp_path, *extra)
    assert warm(cold["counters"]) == (0, 2, 0) and warm(again["counters"]) == (2, 0, 0)
    assert again["tokens"] == cold["tokens"]
    if pieces == "inductor":
        assert again["counters"]["inductor_compiles"] == 0
    described = cold["describe"]
    assert [g["kind"] for g in described] == ["inference", "inference"]  # prefill, decode
    # What the test is about: the rewrites ran in the cold process (the loaded graph carries them).
    assert ops_of(described, "torch_ext::decode_linear") > 0
    if split == "none":  # (SDPA as a splitting op is never rewritten)
        assert ops_of(described, "torch_ext::decode_attention") > 0
    assert all(g["merged_projections"] for g in described)
    decode_pieces = [p for g in described for p in g["pieces"] if p["torch_ext_ops"]]
    assert decode_pieces and all(p["inductor_options"].get("triton.enable_pdl") == "True" for p in decode_pieces)
    assert all(g["cudagraphs"]["mode"] == cudagraph and g["cudagraphs"]["runners"] for g in described)
    for loaded, compiled in zip(again["describe"], described, strict=True):
        assert loaded == compiled

