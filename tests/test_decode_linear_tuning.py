"""kernels/decode_linear_tuning.py: each decode_linear shape's kernel chosen by measurement, cuBLAS
among the candidates, kept on disk per GPU model; and what the rewrite does with the choice.

The timing itself needs a GPU (test_decode_linear_gpu.py); here a stand-in measure function says
which candidate is fastest, so the choice, the file and the graph can be checked on the CPU (where
the op runs F.linear)."""
from __future__ import annotations

import json
import logging
import os

import pytest
import torch

from torch_ext.backend.rewrite import decode_linear as rewrite
from torch_ext.backend.rewrite.decode_linear_fusion import fuse_into_decode_linear
from torch_ext.kernels import decode_linear_tuning as tuning
from test_decode_linear import _calls, _graph
from test_decode_linear_fusion import Layer

MMA = tuning.Choice("mma", (1, 8, 1, 2))
TRITON = tuning.Choice("triton", (4, 64, 64, 4))
CUBLAS = tuning.Choice("cublas")


class Measure:
    """Stand-in timings: `fastest` takes 1 us, every other candidate 2; counts the shapes measured."""

    def __init__(self, fastest: tuning.Choice):
        self.fastest, self.shapes = fastest, []

    def __call__(self, shape, choices, device):
        self.shapes.append(shape)
        return {c: 1.0 if c == self.fastest else 2.0 for c in choices}


def _tuner(directory, measure, fold=None):
    """fold: (folded us, separate us) every prologue measures, or a function of (shape, part, choice, device)."""
    return tuning.Tuner(directory, measure=measure, candidates=lambda shape, device: [CUBLAS, TRITON, MMA],
                        file_name=lambda device: "decode_linear-test-gpu.json",
                        measure_fold=fold if callable(fold) else lambda shape, part, choice, device: fold)


def _fused_merged_layer(tmp_path, fastest, fold, rows=1):
    """A Llama MLP block with merged gate/up, rewritten and fused with a stand-in tuner; its calls, and
    checked equal to eager's result (the CPU runs the op's reference)."""
    from test_decode_linear_fusion import MergedLayer

    gm, inputs = _graph(MergedLayer().to(torch.bfloat16).eval(), torch.randn(rows, 1, 64, dtype=torch.bfloat16))
    with torch.no_grad():
        eager = gm(*inputs)
    tuner = _tuner(str(tmp_path), Measure(fastest), fold)
    rewrite.use_decode_linear(gm, tuner)
    fuse_into_decode_linear(gm, tuner)
    with torch.no_grad():
        torch.testing.assert_close(gm(*inputs), eager, rtol=0, atol=0)
    return _calls(gm)


@pytest.fixture(autouse=True)
def fresh_memo(monkeypatch):
    monkeypatch.setattr(tuning.Tuner, "_memo", {})
    monkeypatch.setattr(tuning.Tuner, "_warned", set())
    monkeypatch.setattr(rewrite, "DEVICES", ("cpu",))


@pytest.mark.parametrize("fastest", [MMA, TRITON])
def test_the_fastest_kernel_is_written_into_each_call_and_results_equal_eager(tmp_path, fastest):
    gm, inputs = _graph(Layer().to(torch.bfloat16).eval(), torch.randn(1, 1, 64, dtype=torch.bfloat16))
    with torch.no_grad():
        expected = gm(*inputs)
    measure = Measure(fastest)
    assert rewrite.use_decode_linear(gm, _tuner(str(tmp_path), measure)) == 5
    assert [c.args[9] for c in _calls(gm)] == [fastest.encode()] * 5
    # Four distinct shapes (qkv and o are both 64 x 64, one with a bias), each measured once.
    assert sorted(s.key() for s in measure.shapes) == ["1,128,64,bfloat16,0", "1,64,128,bfloat16,0",
                                                        "1,64,64,bfloat16,0", "1,64,64,bfloat16,1"]
    with torch.no_grad():
        torch.testing.assert_close(gm(*inputs), expected, rtol=0, atol=0)


def test_where_cublas_is_fastest_the_linear_stays(tmp_path):
    gm, _ = _graph(Layer().to(torch.bfloat16).eval(), torch.randn(1, 1, 64, dtype=torch.bfloat16))
    assert rewrite.use_decode_linear(gm, _tuner(str(tmp_path), Measure(CUBLAS))) == 0
    assert not _calls(gm)


@pytest.mark.parametrize("fold", [(1.0, 2.0), (3.0, 2.0)])
def test_a_norm_or_gate_is_folded_into_a_tuned_call_only_where_that_measures_faster(tmp_path, fold):
    """The norms, gate and residual adds folded into a tuned call keep its config argument; a prologue
    measured slower folded (each block computes it again) stays an op of its own."""
    gm, inputs = _graph(Layer().to(torch.bfloat16).eval(), torch.randn(1, 1, 64, dtype=torch.bfloat16))
    with torch.no_grad():
        expected = gm(*inputs)
    tuner = _tuner(str(tmp_path), Measure(MMA), fold)
    rewrite.use_decode_linear(gm, tuner)
    fused = fuse_into_decode_linear(gm, tuner)
    calls = _calls(gm)
    assert all(len(c.args) == 10 and c.args[9] == MMA.encode() for c in calls)
    prologues = sum(c.args[4] is not None or c.args[6] is not None for c in calls)
    residuals = sum(c.args[7] is not None for c in calls)
    # Folded: norm1 into qkv, norm2 into gate and up, the gate into down (three patterns, four calls).
    folds = fold[0] < fold[1]
    assert residuals == 2 and prologues == (4 if folds else 0) and fused == (3 if folds else 0) + residuals
    with torch.no_grad():
        torch.testing.assert_close(gm(*inputs), expected)


def test_choices_are_kept_on_disk_and_a_damaged_file_is_measured_again(tmp_path, caplog):
    shape = tuning.Shape(1, 128, 64, torch.bfloat16, False)
    first = Measure(MMA)
    assert _tuner(str(tmp_path), first).choose(shape, torch.device("cpu")) == MMA
    (path,) = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path) for f in fs]
    assert json.load(open(path))["shapes"][shape.key()]["path"] == "mma"

    tuning.Tuner._memo.clear()  # a new process: the file answers, nothing is measured
    again = Measure(TRITON)
    assert _tuner(str(tmp_path), again).choose(shape, torch.device("cpu")) == MMA and again.shapes == []

    tuning.Tuner._memo.clear()
    with open(path, "w") as f:
        f.write('{"format": 1, "shapes": {')  # cut short
    caplog.set_level(logging.WARNING, logger="torch_ext")
    third = Measure(TRITON)
    assert _tuner(str(tmp_path), third).choose(shape, torch.device("cpu")) == TRITON and third.shapes == [shape]
    assert "damaged kernel tuning file" in caplog.text
    assert json.load(open(path))["shapes"][shape.key()]["path"] == "triton"  # rewritten whole


def test_a_stored_choice_this_code_cannot_run_is_measured_again(tmp_path):
    shape = tuning.Shape(1, 128, 64, torch.bfloat16, False)
    _tuner(str(tmp_path), Measure(MMA)).choose(shape, torch.device("cpu"))
    (path,) = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path) for f in fs]
    data = json.load(open(path))
    data["shapes"][shape.key()]["config"] = [9, 9, 9, 9]  # valid JSON, not a candidate
    json.dump(data, open(path, "w"))
    tuning.Tuner._memo.clear()
    measure = Measure(TRITON)
    assert _tuner(str(tmp_path), measure).choose(shape, torch.device("cpu")) == TRITON and measure.shapes == [shape]


def test_without_a_directory_choices_live_in_the_process(tmp_path):
    shape = tuning.Shape(4, 64, 64, torch.float16, True)
    measure = Measure(MMA)
    assert _tuner(None, measure).choose(shape, torch.device("cpu")) == MMA
    assert _tuner(None, measure).choose(shape, torch.device("cpu")) == MMA and len(measure.shapes) == 1
    assert not os.listdir(tmp_path)


@pytest.mark.parametrize("epilogue_pays,prologue_pays,expected", [
    (True, True, "epilogue"), (False, True, "prologue"), (False, False, "apart")])
def test_a_one_row_gate_goes_where_measured_fastest(tmp_path, epilogue_pays, prologue_pays, expected):
    """The gate/up projection's epilogue where it times faster than the gate's own kernel, else the down
    projection's prologue where that does, else the gate is left to Inductor; the results equal eager's."""
    parts = []

    def fold(shape, part, choice, device):
        parts.append(part)
        pays = {"gate_epilogue": epilogue_pays, "gate": prologue_pays}.get(part, True)
        return (1.0, 2.0) if pays else (2.0, 1.0)

    gate_up, down = _fused_merged_layer(tmp_path, TRITON, fold)
    gate = gate_up.args[8] if len(gate_up.args) > 8 else None
    up = down.args[6] if len(down.args) > 6 else None
    assert (gate is not None, up is not None) == {"epilogue": (True, False), "prologue": (False, True),
                                                   "apart": (False, False)}[expected]
    assert parts[0] == "gate_epilogue" and ("gate" in parts) == (not epilogue_pays)


@pytest.mark.parametrize("pays", [True, False])
@pytest.mark.parametrize("rows", [4, 16])
def test_tuned_the_gate_epilogue_goes_wherever_it_measures_faster(tmp_path, rows, pays):
    """Tuned, the CUDA path's gate epilogue is timed at every row count (4 rows: off by the untuned rule)."""
    gate_up = _fused_merged_layer(tmp_path, MMA, (1.0, 2.0) if pays else (2.0, 1.0), rows)[0]
    assert (len(gate_up.args) > 8 and gate_up.args[8] is not None) == pays


def test_a_one_row_gate_up_call_takes_the_cuda_path_where_its_gated_kernel_is_fastest(tmp_path):
    """Plain, the Triton GEMV is the fastest at one row; gated, the CUDA path beats it plus the gate's own kernel
    (the H200's times for Qwen2 0.5B's gate/up): the call then runs the CUDA path with the gate, equal to eager."""
    def fold(shape, part, choice, device):
        if part != "gate_epilogue":
            return (1.0, 2.0)
        return (12.4, 9.4) if choice == TRITON else (6.2, 9.0)

    gate_up, down = _fused_merged_layer(tmp_path, TRITON, fold)
    assert gate_up.args[8] == [0, 128, 128] and gate_up.args[9] == MMA.encode() and down.args[9] == TRITON.encode()
    # What was measured is kept: a new tuner on the same directory reads it instead of timing again.
    (path,) = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path) for f in fs]
    kept = [k for k in json.load(open(path))["shapes"] if "gate_epilogue" in k]
    assert len(kept) == 2  # the Triton and the CUDA path's gated kernels, timed once each

    def no_timing(*args):
        raise AssertionError("measured again")

    tuning.Tuner._memo.clear()  # a new process: only the file knows
    shape = tuning.Shape(1, 256, 64, torch.bfloat16, False)
    assert _tuner(str(tmp_path), Measure(TRITON), no_timing).gate_epilogue_choice(shape, TRITON, torch.device("cpu")) == MMA


def test_a_compile_counts_the_shapes_it_measured(monkeypatch, tmp_path):
    """counters.tuned_shapes: kernels and folds timed by a compile (none where the file answers)."""
    from torch_ext.backend import CompileConfig, counters
    from torch_ext.backend.rewrite.decode import decode_rewrites

    class StandIn(tuning.Tuner):  # the stand-in timings, as the rewrite constructs its tuner
        def __init__(self, directory):
            super().__init__(directory, measure=Measure(MMA), candidates=lambda shape, device: [CUBLAS, TRITON, MMA],
                             file_name=lambda device: "decode_linear-test-gpu.json",
                             measure_fold=lambda shape, part, choice, device: (1.0, 2.0))

    monkeypatch.setattr("torch_ext.backend.rewrite.decode.Tuner", StandIn)
    config = CompileConfig(cache_dir=str(tmp_path), decode_linear=True)
    for expected in (4 + 3, 0):  # 4 shapes and 3 folds (gate and up share a shape); then the file answers
        counters.reset()
        tuning.Tuner._memo.clear()
        gm, _ = _graph(Layer().to(torch.bfloat16).eval(), torch.randn(1, 1, 64, dtype=torch.bfloat16))
        decode_rewrites(gm, config, lambda node: False)
        assert counters.tuned_shapes == expected


def test_off_cuda_the_default_tuner_measures_nothing():
    """The real measure needs a GPU: elsewhere the op keeps its defaults (no config in the call)."""
    gm, _ = _graph(Layer().eval(), torch.randn(1, 1, 64))
    assert rewrite.use_decode_linear(gm, tuning.Tuner(None)) == 5
    assert all(len(c.args) == 4 for c in _calls(gm))


def test_a_config_naming_no_kernel_is_refused():
    x, w = torch.randn(1, 64), torch.randn(8, 64)
    with pytest.raises(ValueError, match="names no kernel path"):
        with torch._subclasses.fake_tensor.FakeTensorMode():
            torch.ops.torch_ext.decode_linear(torch.empty(1, 64), torch.empty(8, 64), None, False, config=[7, 1])
    # The reference (every device without the kernel) ignores the config: F.linear.
    torch.testing.assert_close(torch.ops.torch_ext.decode_linear(x, w, None, False, config=MMA.encode()),
                               torch.nn.functional.linear(x, w))


@pytest.mark.parametrize("k", [64, 320, 896, 2048, 4864, 14336])
def test_one_row_triton_candidates_are_launchable_configs_of_each_features_count(k):
    """At one row the Triton GEMV is timed at its default and at each TRITON_ALTERNATIVES features count;
    every config tiles K exactly (the kernel has no column mask) and loads a power of two >= a tile first."""
    from torch_ext.kernels import decode_linear as op

    configs = tuning.triton_configs(k)
    assert configs[0] == tuple(op.config(k).values())
    assert [c[0] for c in configs] == [op.config(k)["BLOCK_N"], *tuning.TRITON_ALTERNATIVES]
    for block_n, block_k, pre_k, warps in configs:
        assert k % block_k == 0 and pre_k % block_k == 0 and block_k <= pre_k <= k and pre_k & (pre_k - 1) == 0
        # no more registers before the wait than the default, but for the one tile it cannot go below
        assert block_n * pre_k <= configs[0][0] * configs[0][2] or pre_k == block_k
    if op.has_triton():  # float32: the CUDA path (16-bit only) would ask the GPU for its capability
        shape = tuning.Shape(1, 256, k, torch.float32, False)
        offered = [c.config for c in tuning.candidates(shape, torch.device("cpu")) if c.path == "triton"]
        assert offered == list(dict.fromkeys(configs))
        assert not any(c.path == "triton" for c in tuning.candidates(tuning.Shape(2, 256, k, torch.float32, False),
                                                                     torch.device("cpu")))


def test_a_tuner_offered_other_candidates_measures_among_its_own(tmp_path):
    """The process's memo is keyed by the candidates too: a tuner offered fewer (a bench column without the
    alternatives) does not take a choice made among more, and one offered the same reuses it."""
    shape, device = tuning.Shape(1, 128, 64, torch.bfloat16, False), torch.device("cpu")
    other = tuning.Choice("triton", (2, 64, 64, 4))
    every, fewer = [CUBLAS, TRITON, other, MMA], [CUBLAS, TRITON, MMA]

    def tuner(offered, measure):
        return tuning.Tuner(None, measure=measure, candidates=lambda shape, device: offered,
                            file_name=lambda device: "decode_linear-test-gpu.json")

    assert tuner(every, Measure(other)).choose(shape, device) == other
    assert tuner(fewer, Measure(MMA)).choose(shape, device) == MMA
    again = Measure(CUBLAS)
    assert tuner(every, again).choose(shape, device) == other and again.shapes == []


def test_a_fused_variant_that_fails_to_run_is_not_folded(tmp_path, caplog):
    """A prologue or gate whose fused kernel raises while timed (a config it cannot launch) stays a kernel
    of its own, said in the log, and the layer still equals eager."""
    def fold(shape, part, choice, device):
        raise RuntimeError("out of resources")

    with caplog.at_level(logging.INFO, logger="torch_ext.backend"):
        gate_up, down = _fused_merged_layer(tmp_path, TRITON, fold)
    assert len(gate_up.args) <= 8 or gate_up.args[8] is None  # no gate epilogue
    assert "failed (RuntimeError: out of resources); not folded" in caplog.text


def test_a_choice_a_shortage_of_memory_decided_is_not_written_and_is_measured_again(tmp_path, caplog):
    """A candidate that ran out of memory while timed (other tensors beside it) loses only in this process:
    the tuning file keeps no choice for the shape, so the next process measures it again."""
    shape = tuning.Shape(1, 128, 64, torch.bfloat16, False)

    def short_of_memory(shape, choices, device):
        return tuning.store.Times({c: 2.0 for c in choices if c != MMA}, transient="mma[1, 8, 1, 2] ran out of memory")

    with caplog.at_level(logging.INFO, logger="torch_ext.backend"):
        assert _tuner(str(tmp_path), short_of_memory).choose(shape, torch.device("cpu")) == CUBLAS
    assert "kept in this process only (mma[1, 8, 1, 2] ran out of memory)" in caplog.text
    assert not [f for _, _, fs in os.walk(tmp_path) for f in fs]  # nothing written
    again = Measure(MMA)
    assert _tuner(str(tmp_path), again).choose(shape, torch.device("cpu")) == CUBLAS and again.shapes == []  # memo

    tuning.Tuner._memo.clear()  # a new process measures the shape again, and keeps what it measured whole
    assert _tuner(str(tmp_path), again).choose(shape, torch.device("cpu")) == MMA and again.shapes == [shape]
    (path,) = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path) for f in fs]
    assert json.load(open(path))["shapes"][shape.key()]["path"] == "mma"


@pytest.mark.parametrize("error, written", [(torch.OutOfMemoryError("CUDA out of memory"), False),
                                            (RuntimeError("out of resources"), True)])
def test_a_fold_that_ran_out_of_memory_is_measured_again_by_the_next_process(tmp_path, error, written):
    """A fused variant that fails for lack of memory is not folded in this process only; one that cannot
    launch (its config) stays unfolded in the file, as a candidate that cannot run does."""
    shape = tuning.Shape(1, 128, 64, torch.bfloat16, False)

    def failing(shape, part, choice, device):
        raise error

    assert not _tuner(str(tmp_path), Measure(MMA), failing).fold_pays(shape, "norm", MMA, torch.device("cpu"))
    files = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path) for f in fs]
    stored = json.load(open(files[0]))["shapes"] if files else {}
    assert (f"{shape.key()}|norm|{MMA.label()}" in stored) == written
    tuning.Tuner._memo.clear()  # a new process, where the fused variant runs and is faster
    assert _tuner(str(tmp_path), Measure(MMA), (1.0, 2.0)).fold_pays(shape, "norm", MMA,
                                                                      torch.device("cpu")) == (not written)


def test_a_one_row_gate_is_timed_under_every_triton_config_and_the_fastest_gated_one_runs(tmp_path):
    """At one row each launch config of the Triton GEMV is timed with the gate in its epilogue, beside the
    call's choice and the CUDA path: a config that loses plain may win gated."""
    other = tuning.Choice("triton", (8, 64, 64, 4))
    shape = tuning.Shape(1, 256, 64, torch.bfloat16, False)
    timed = []

    def fold(shape, part, choice, device):
        timed.append(choice)
        return {TRITON: (9.0, 8.0), MMA: (8.5, 9.0), other: (5.0, 9.0)}[choice]

    tuner = tuning.Tuner(str(tmp_path), measure=Measure(TRITON),
                         candidates=lambda shape, device: [CUBLAS, TRITON, MMA, other],
                         file_name=lambda device: "decode_linear-test-gpu.json", measure_fold=fold)
    assert tuner.gate_epilogue_choice(shape, TRITON, torch.device("cpu")) == other
    assert timed == [TRITON, MMA, other]


@pytest.mark.parametrize("triton_us, chosen", [(0.97, MMA), (0.90, TRITON)])
def test_the_one_row_triton_gemv_wins_only_by_a_margin(tmp_path, triton_us, chosen):
    """Timed alone the Triton GEMV may edge out the CUDA path that it then loses to in a model (its head
    on Qwen2 0.5B): within TRITON_MARGIN of the fastest other candidate it gives way to that one."""
    shape = tuning.Shape(1, 256, 64, torch.bfloat16, False)

    def measure(shape, choices, device):
        return {CUBLAS: 2.0, TRITON: triton_us, MMA: 1.0}

    assert tuning.TRITON_MARGIN == 0.05
    assert _tuner(str(tmp_path), measure).choose(shape, torch.device("cpu")) == chosen
