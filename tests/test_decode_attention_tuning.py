"""kernels/decode_attention_tuning.py: each decode_attention shape's launch chosen by measurement, SDPA
among the candidates, kept on disk per GPU model; what the rewrite does with the choice; and that every
launch the tuner may choose computes attention (the Triton interpreter).

The timing needs a GPU (test_decode_attention_gpu.py); here a stand-in measure says which candidate is
fastest, so the choice, the file and the graph are checked on the CPU (where the op runs SDPA)."""
from __future__ import annotations

import json
import logging
import os

import pytest
import torch

from torch_ext.backend import CompileConfig, counters
from torch_ext.kernels import decode_attention as op, decode_attention_tuning as tuning
from torch_ext.testing import capture_graphs
from test_decode_linear_tuning import Measure  # stand-in timings: the fastest 1 us, the others 2
from triton_interpreter import run_in_interpreter

TABLE = tuning.Choice("triton", (1, 64, 4, 2, 264))
WIDE = tuning.Choice("triton", (1, 128, 8, 2, 264))
SDPA = tuning.Choice("sdpa")
SHAPE = tuning.Shape(2, 4, 2, 10, 16, torch.float32, "bool", False)


class StandIn(tuning.Tuner):
    """The tuner the rewrite constructs, with stand-in timings (`fastest` set by each test)."""
    fastest = TABLE
    measures: list = []

    def __init__(self, directory):
        measure = Measure(StandIn.fastest)
        StandIn.measures.append(measure)
        super().__init__(directory, measure=measure, candidates=lambda shape, device: [TABLE, SDPA, WIDE],
                         file_name=lambda device: "decode_attention-test-gpu.json")


@pytest.fixture(autouse=True)
def fresh_memo(monkeypatch):
    monkeypatch.setattr(tuning.Tuner, "_memo", {})
    monkeypatch.setattr(tuning.Tuner, "_warned", set())
    monkeypatch.setattr(StandIn, "measures", [])
    monkeypatch.setattr("torch_ext.backend.rewrite.decode.AttentionTuner", StandIn)


def _attend(q, k, v, mask):
    """A decode layer's attention as HF writes it: kv heads repeated, a bool mask."""
    k = k[:, :, None].expand(2, 2, 2, 10, 16).reshape(2, 4, 10, 16)
    v = v[:, :, None].expand(2, 2, 2, 10, 16).reshape(2, 4, 10, 16)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask) * 2


def _compiled_calls(directory, fastest):
    """(the op's calls in the compiled piece, SDPA calls left, outputs, eager outputs)."""
    StandIn.fastest = fastest
    torch.manual_seed(0)
    args = (torch.randn(2, 4, 1, 16), torch.randn(2, 2, 10, 16), torch.randn(2, 2, 10, 16), torch.rand(2, 1, 1, 10) > 0.3)
    config = CompileConfig(cache_dir=directory, decode_attention=True, kernel_tuning=True)
    with torch.no_grad():
        out = capture_graphs(_attend, *args, backend_config=config)
        expected = _attend(*args)
    nodes = [n for gm in out.pieces[0].values() for n in gm.graph.nodes]
    calls = [n for n in nodes if n.target is torch.ops.torch_ext.decode_attention.default]
    sdpa = [n for n in nodes if "scaled_dot_product_attention" in str(n.target)]
    return calls, sdpa, out.outputs, expected


@pytest.mark.parametrize("fastest", [TABLE, WIDE])
def test_the_fastest_launch_is_written_into_the_call_and_results_equal_eager(tmp_path, fastest):
    counters.reset()
    (call,), sdpa, actual, expected = _compiled_calls(str(tmp_path), fastest)
    assert call.args[5] == fastest.encode() and not sdpa
    torch.testing.assert_close(actual, expected)
    assert [m.shapes for m in StandIn.measures if m.shapes] == [[SHAPE]] and counters.tuned_shapes == 1
    stored = json.load(open(tmp_path / "tuning" / "decode_attention-test-gpu.json"))["shapes"][SHAPE.key()]
    assert stored["path"] == "triton" and stored["config"] == list(fastest.config) and len(stored["us"]) == 3


@pytest.mark.parametrize("wide_us,chosen", [(0.97, TABLE), (0.9, WIDE)])
def test_the_table_holds_unless_another_launch_beats_it_by_the_margin(tmp_path, wide_us, chosen):
    """Near-equal launches are told apart by noise: the table's launch stays unless one is 5% faster."""
    tuner = tuning.Tuner(str(tmp_path), measure=lambda shape, choices, device: {TABLE: 1.0, SDPA: 2.0, WIDE: wide_us},
                         candidates=lambda shape, device: [TABLE, SDPA, WIDE], file_name=lambda device: "t.json")
    assert tuner.choose(SHAPE, torch.device("cpu")) == chosen


def test_where_sdpa_is_fastest_the_call_stays_sdpa(tmp_path):
    counters.reset()
    calls, sdpa, actual, expected = _compiled_calls(str(tmp_path), SDPA)
    assert not calls and len(sdpa) == 1 and counters.decode_attention_calls == 0
    torch.testing.assert_close(actual, expected)


def test_a_new_process_reads_the_file_and_a_damaged_one_is_measured_again(tmp_path, caplog):
    _compiled_calls(str(tmp_path), WIDE)
    tuning.Tuner._memo.clear()  # a new process: the file answers, nothing is measured
    counters.reset()
    (call,), *_ = _compiled_calls(str(tmp_path), TABLE)
    assert call.args[5] == WIDE.encode() and counters.tuned_shapes == 0
    path = tmp_path / "tuning" / "decode_attention-test-gpu.json"
    path.write_text("{not json")
    tuning.Tuner._memo.clear()
    with caplog.at_level(logging.WARNING, logger="torch_ext.backend"):
        (call,), *_ = _compiled_calls(str(tmp_path), TABLE)
    assert call.args[5] == TABLE.encode() and "damaged kernel tuning file" in caplog.text
    assert json.load(open(path))["shapes"][SHAPE.key()]["config"] == list(TABLE.config)  # rewritten whole


@pytest.mark.parametrize("stored", [{"path": "triton", "config": [1, 63, 4, 2, 264]},  # no kernel launches it
                                    {"path": "triton", "config": [1, 32, 4, 2, 264]},  # not a candidate now
                                    {"path": "flash", "config": []}, ["triton"]])
def test_a_stored_choice_this_code_would_not_run_is_measured_again(tmp_path, stored):
    os.makedirs(tmp_path / "tuning")
    (tmp_path / "tuning" / "decode_attention-test-gpu.json").write_text(
        json.dumps({"format": 1, "shapes": {SHAPE.key(): stored}}))
    counters.reset()
    (call,), *_ = _compiled_calls(str(tmp_path), WIDE)
    assert call.args[5] == WIDE.encode() and counters.tuned_shapes == 1


def test_without_tuning_or_off_cuda_the_call_takes_the_table():
    q, k = torch.empty(2, 4, 1, 16), torch.empty(2, 2, 10, 16)
    assert tuning.Tuner(None).choose(tuning.Shape.of(q, k, None), torch.device("cpu")) is None
    config = CompileConfig(cache_dir=None, decode_attention=True, kernel_tuning=False)
    with torch.no_grad():
        out = capture_graphs(_attend, torch.randn(2, 4, 1, 16), torch.randn(2, 2, 10, 16), torch.randn(2, 2, 10, 16),
                             None, backend_config=config)
    (call,) = [n for gm in out.pieces[0].values() for n in gm.graph.nodes
               if n.target is torch.ops.torch_ext.decode_attention.default]
    assert len(call.args) == 5 and not StandIn.measures


def test_a_shape_key_tells_masks_and_symbolic_sizes_apart():
    q, k = torch.empty(2, 4, 1, 16), torch.empty(2, 2, 10, 16)
    keys = {tuning.Shape.of(q, k, m).key() for m in (None, torch.empty(2, 1, 1, 10, dtype=torch.bool),
                                                      torch.empty(2, 1, 1, 10), torch.empty(2, 4, 1, 10))}
    assert keys == {"2,4,2,10,16,float32,none", "2,4,2,10,16,float32,bool", "2,4,2,10,16,float32,float",
                    "2,4,2,10,16,float32,float-heads"}
    from types import SimpleNamespace

    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    length = ShapeEnv().create_unbacked_symint()  # a cache length dynamic=True left symbolic
    assert tuning.Shape.of(q, SimpleNamespace(shape=(2, 2, length, 16)), None) is None  # no one shape to time


@pytest.mark.parametrize("config", [[2, 64, 4, 2, 264], [1, 48, 4, 2, 264], [1, 64, 3, 2, 264], [1, 64, 4, 0, 264],
                                    [1, 64, 4, 2, 0], [1, 64, 4, 2]])
def test_a_config_no_kernel_launches_is_refused_at_compile_time(config):
    with pytest.raises(ValueError, match="decode_attention: config"):
        with torch._subclasses.fake_tensor.FakeTensorMode():
            torch.ops.torch_ext.decode_attention(torch.empty(1, 4, 1, 16), torch.empty(1, 2, 8, 16),
                                                 torch.empty(1, 2, 8, 16), None, 0.25, config)
    q, k = torch.randn(1, 4, 1, 16), torch.randn(1, 2, 8, 16)  # the reference (no kernel) computes SDPA
    torch.testing.assert_close(torch.ops.torch_ext.decode_attention(q, k, k, None, 0.25, TABLE.encode()),
                               op.decode_attention_reference(q, k, k, None, 0.25))


LAUNCH_CHECK = r'''
import torch
from torch_ext.kernels import decode_attention as op, decode_attention_tuning as tuning
torch.manual_seed(0)
# Every launch the tuner may time, on grouped heads and MHA (the per-head kernel on both), split or not.
launches = [*tuning.GROUPED_ALTERNATIVES, *tuning.PER_HEAD_ALTERNATIVES]
for b, h, hkv, L, d in [(2, 8, 2, 300, 32), (2, 4, 4, 130, 16), (1, 8, 1, 70, 16)]:
    q, k, v = torch.randn(b, h, 1, d), torch.randn(b, hkv, L, d), torch.randn(b, hkv, L, d)
    mask = torch.rand(b, 1, 1, L) > 0.3
    expected = op.decode_attention_reference(q.double(), k.double(), v.double(), mask, d ** -0.5)
    for launch in launches:
        for programs in (1, 8, 264):  # one split (the kernel writes the output), a few, many
            out = op.decode_attention_triton(q, k, v, mask, d ** -0.5, op.checked_config([*launch, programs]))
            err = ((out.double() - expected).norm() / expected.norm()).item()
            assert err < 1e-5, (b, h, hkv, L, d, launch, programs, err)
print("WORST 0")
'''


@pytest.mark.slow
def test_every_candidate_launch_computes_attention_in_the_interpreter():
    run_in_interpreter(LAUNCH_CHECK)
