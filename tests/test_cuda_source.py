"""decode_linear's CUDA kernel (kernels/decode_linear_mma_source.py) through NVRTC and ptxas for sm_90, on the CPU:
every variant the op can build compiles, and the ones its default configs launch keep every value in
registers (a spill to local memory would put the weights' stream behind stack traffic). The GPU tests
run the kernel; this catches a broken source where no GPU is (CI). NVRTC comes with torch's CUDA wheels
(nvidia-cuda-nvrtc); without it the test skips."""
from __future__ import annotations

import ctypes
import itertools
import re

import pytest
import torch

from torch_ext.kernels.decode_linear_mma import MMA_MAX_ROWS, X_SLOTS, default_config
from torch_ext.kernels.decode_linear_mma_source import build_source


def _nvrtc():
    try:
        from torch.cuda._utils import _get_nvrtc_library

        return _get_nvrtc_library()
    except Exception as e:  # a CPU build of torch, or no libnvrtc
        pytest.skip(f"NVRTC is not available here: {type(e).__name__}: {e}")


def _compile(lib, defines: dict, dtype: str, arch: str = "sm_90") -> tuple[int, str]:
    code = build_source(dtype, defines)
    program = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(program), code.encode(), b"decode_linear_mma.cu", 0, None, None) == 0
    options = [f"--gpu-architecture={arch}".encode(), b"-Xptxas=-v"]
    status = lib.nvrtcCompileProgram(program, len(options), (ctypes.c_char_p * len(options))(*options))
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(program, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(program, log)
    lib.nvrtcDestroyProgram(ctypes.byref(program))
    return status, log.value.decode(errors="replace")


def _default_configs(rows_of=range(2, MMA_MAX_ROWS + 1), features=(2048, 6144, 11264, 32000)) -> set[tuple[int, tuple[int, ...]]]:
    """(n-tiles, config) of every launch the op's defaults make on a 132-SM GPU (H100, H200), for these row
    counts and projection widths."""
    props = type("Props", (), {"multi_processor_count": 132, "shared_memory_per_block_optin": 232448})()
    original = torch.cuda.get_device_properties
    torch.cuda.get_device_properties = lambda index: props
    try:
        default_config.cache_clear()
        return {((rows + 7) // 8, default_config(n, 0, rows)) for rows in rows_of for n in features}
    finally:
        torch.cuda.get_device_properties = original
        default_config.cache_clear()


def test_every_variant_compiles_and_the_default_ones_do_not_spill():
    lib = _nvrtc()
    launched = _default_configs()
    assert {config[1] for _, config in launched} == {16, 8, 4}  # the table: warps by shape and rows
    failures, spills = [], []
    for nt, (mt, warps, unroll, xpf) in sorted(launched):
        for norm, gated, gate_epilogue in itertools.product((0, 1), repeat=3):
            if gated and gate_epilogue:
                continue  # the op never asks for both (a gate/up projection's input is not gated)
            defines = dict(MT=mt, NT=nt, WARPS=warps, U=unroll, NORM=norm, GATED=gated,
                           GATE_EPILOGUE=gate_epilogue, XPF=xpf, XS=X_SLOTS)
            status, log = _compile(lib, defines, "bf16")
            if status != 0:
                failures.append((defines, log[-600:]))
                continue
            spilled = [int(b) for b in re.findall(r"(\d+) bytes spill stores", log)]
            if not (norm or gated or gate_epilogue) and any(spilled):
                spills.append((defines, spilled))
    assert not failures, failures[0]
    assert not spills, spills


@pytest.mark.parametrize("xpf", [2, 3])
@pytest.mark.parametrize("nt,warps,unroll", [(4, 4, 1), (4, 8, 1), (4, 16, 1), (2, 8, 2), (1, 16, 1)])
def test_the_ordered_pipeline_compiles_with_every_prologue(nt, warps, unroll, xpf):
    """x modes 2 and 3 (kernels/decode_linear_mma_pipelines.py: Stage; x in registers, or through shared
    memory) for the tile shapes the defaults use; mode 3 without a spill."""
    lib = _nvrtc()
    for norm, gated, gate_epilogue in ((0, 0, 0), (1, 0, 0), (0, 1, 0), (0, 0, 1), (1, 0, 1)):
        defines = dict(MT=1, NT=nt, WARPS=warps, U=unroll, NORM=norm, GATED=gated, GATE_EPILOGUE=gate_epilogue,
                       XPF=xpf, XS=X_SLOTS)
        status, log = _compile(lib, defines, "bf16")
        assert status == 0, (defines, log[-600:])
        if xpf == 3 and not (norm or gated or gate_epilogue):
            assert not any(int(b) for b in re.findall(r"(\d+) bytes spill stores", log)), (defines, log)


@pytest.mark.parametrize("dtype,arch", [("f16", "sm_90"), ("bf16", "sm_80")])
def test_float16_and_pre_hopper_builds(dtype, arch):
    """float16 operands, and sm_80 (mma.sync and cp.async without griddepcontrol: the PDL guard compiles it
    out); x a round ahead, and through shared memory (an A100 has the shared memory for mode 3)."""
    for nt, warps, xpf in ((2, 8, 1), (4, 16, 3)):
        defines = dict(MT=1, NT=nt, WARPS=warps, U=1, NORM=1, GATED=0, GATE_EPILOGUE=0, XPF=xpf, XS=X_SLOTS)
        status, log = _compile(_nvrtc(), defines, dtype, arch)
        assert status == 0, (defines, log[-600:])


def test_a_config_names_only_the_x_modes_the_source_has():
    """A fourth config entry the source does not know would compile as mode 1 without a word."""
    from torch_ext.kernels.decode_linear_mma import _full

    assert _full((1, 8, 2)) == (1, 8, 2, 0) and _full((1, 16, 1, 2)) == (1, 16, 1, 2)
    assert _full((1, 16, 1, 3)) == (1, 16, 1, 3)
    with pytest.raises(ValueError, match="x mode 4 is not 0, 1, 2 or 3"):
        _full((1, 8, 1, 4))


@pytest.mark.parametrize("optin,mode", [(232448, 3), (166912, 3), (101376, 1), (0, 1)])
def test_x_through_shared_memory_only_where_a_block_may_have_it(monkeypatch, optin, mode):
    """x mode 3 at 17-32 rows needs ~160 KB of shared memory a block: an H100 (227 KB) or A100 (163 KB)
    has it; an sm_86 / sm_89 card (99 KB) gets x a round ahead in registers rather than a failed launch
    setup and F.linear."""
    props = type("Props", (), {"multi_processor_count": 132, "shared_memory_per_block_optin": optin})()
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    default_config.cache_clear()
    try:
        assert default_config(2048, 0, 32) == (1, 16, 1, mode)
        assert default_config(2048, 0, 16) == (1, 16, 1, 2)  # no shared memory for x up to 16 rows
    finally:
        default_config.cache_clear()


def test_the_gate_epilogue_costs_no_blocks_an_sm():
    """A gate/up projection with the gate epilogue launches as many blocks as without it; where its kernel
    held more registers than the plain one (110 against 80 at 4 warps), an SM held 4 blocks instead of
    6, gate/up's 704 blocks at 32 rows took two waves, and the fused gate lost to Inductor's kernel. For
    each variant the defaults launch at any row count (tuned, the epilogue may serve every one): the gated
    kernel's registers, rounded to the allocation unit of 8, are no more than the plain kernel's."""
    from torch_ext.kernels.decode_linear import MAX_ROWS

    lib = _nvrtc()
    gated_rows = set(range(1, MAX_ROWS + 1))
    launched = {c for c in _default_configs(rows_of=gated_rows, features=(11264,))}
    assert launched
    for nt, (mt, warps, unroll, xpf) in sorted(launched):
        used = {}
        for gate_epilogue in (0, 1):
            defines = dict(MT=mt, NT=nt, WARPS=warps, U=unroll, NORM=0, GATED=0, GATE_EPILOGUE=gate_epilogue, XPF=xpf,
                           XS=X_SLOTS)
            status, log = _compile(lib, defines, "bf16")
            assert status == 0, (defines, log[-600:])
            used[gate_epilogue] = -(-int(re.search(r"Used (\d+) registers", log).group(1)) // 8) * 8
        assert used[1] <= used[0], (nt, (mt, warps, unroll, xpf), used)
