"""bench/inference_floor.py's experimental columns: what each changes in torch_ext while the column
compiles and captures its graphs (full CUDA graphs keep the launches they captured). The module
docstring of inference_floor.py says what each column measures."""
from __future__ import annotations

import contextlib

import torch

# The columns this module knows, in the order the table lists them (ext-row-* come after, sorted).
EXPERIMENTS = ("ext-rows1", "ext-rows8", "ext-noxpf", "ext-unordered", "ext-no-xsmem", "ext-prologue8", "ext-prologue0", "ext-notune", "ext-norm8", "ext-gate", "ext-nogate",
               "ext-tri1", "ext-notri", "ext-late-launch", "ext-attn1", "ext-mha-per-head", "ext-attn-table", "ext-lt", "ext-cublas-lt")
# Columns whose change acts at a kernel's launch (its config), not at compile: their graph must be
# captured inside the context, and full CUDA graphs capture on a later call than the first.
AT_LAUNCH = ("ext-row", "ext-noxpf", "ext-unordered", "ext-no-xsmem", "ext-attn1", "ext-mha-per-head", "ext-lt",
             "ext-cublas-lt")


@contextlib.contextmanager
def column_experiment(name: str):
    """What the experimental column `name` (EXPERIMENTS, ext-row-*) changes while it compiles and captures;
    other names change nothing. ext-row-n<BLOCK_N>-p<PRE_K>-k<BLOCK_K>-w<warps> overrides the launch
    config of decode_linear's one-row path."""
    if name == "ext-attn1":
        yield from _one_split_attention()
        return
    if name == "ext-mha-per-head":  # MHA decode attention on its per-head kernel at every batch (before 8a2d1cc)
        import torch_ext.kernels.decode_attention as attention

        before, attention.MHA_ON_TENSOR_CORES = attention.MHA_ON_TENSOR_CORES, False
        try:
            yield
        finally:
            attention.MHA_ON_TENSOR_CORES = before
        return
    if name == "ext-attn-table":  # decode attention's built-in table, not its launch measured per shape
        import torch_ext.backend.rewrite.decode as rewrite

        class Table(rewrite.AttentionTuner):
            def choose(self, shape, device):
                return None

        before, rewrite.AttentionTuner = rewrite.AttentionTuner, Table
        try:
            yield
        finally:
            rewrite.AttentionTuner = before
        return
    if name in ("ext-lt", "ext-cublas-lt"):  # cuBLASLt picks the GEMMs the graphs capture
        before = torch.backends.cuda.preferred_blas_library()
        torch.backends.cuda.preferred_blas_library("cublaslt")
        try:
            yield
        finally:
            torch.backends.cuda.preferred_blas_library(before)
        return
    if name in ("ext-rows1", "ext-rows8", "ext-noxpf", "ext-unordered", "ext-no-xsmem", "ext-prologue8", "ext-prologue0", "ext-norm8", "ext-gate", "ext-nogate",
                "ext-tri1", "ext-notri", "ext-late-launch"):
        import torch_ext.backend.compile.decode_options as options
        import torch_ext.kernels.decode_linear as op
        import torch_ext.kernels.decode_linear_mma as mma
        import torch_ext.kernels.decode_linear_tuning as tuning

        def config_before_xpf(n, device_index, rows):
            sms = torch.cuda.get_device_properties(device_index).multi_processor_count
            return (1, 16, 2) if (n + 15) // 16 <= sms * 5 // 4 else (1, 8, 1)

        ordered_default = mma.default_config
        before_ordered = {(1, 16, 1, 2): (1, 16, 1, 1), (1, 8, 1, 2): (1, 8, 2, 1), (1, 16, 1, 3): (1, 16, 1, 1)}
        before_x_smem = {(1, 16, 1, 3): (1, 16, 1, 1)}

        def config_before_ordered(n, device_index, rows):  # the defaults, the ordered pipeline's as they were
            config = ordered_default(n, device_index, rows)
            return before_ordered.get(config, config)

        def config_before_x_smem(n, device_index, rows):  # x a round ahead in registers where x now goes through smem
            config = ordered_default(n, device_index, rows)
            return before_x_smem.get(config, config)

        patches = {"ext-rows1": [(op, "MAX_ROWS", 1)], "ext-rows8": [(op, "MAX_ROWS", 8)],
                   "ext-noxpf": [(mma, "default_config", config_before_xpf)],
                   "ext-unordered": [(mma, "default_config", config_before_ordered)],
                   "ext-no-xsmem": [(mma, "default_config", config_before_x_smem)],
                   "ext-prologue8": [(op, "NORM_PROLOGUE_MAX_ROWS", 8), (op, "GATE_PROLOGUE_MAX_ROWS", 8)],
                   "ext-prologue0": [(op, "NORM_PROLOGUE_MAX_ROWS", 0), (op, "GATE_PROLOGUE_MAX_ROWS", 0)],
                   "ext-norm8": [(op, "NORM_PROLOGUE_MAX_ROWS", 8)],
                   "ext-gate": [(op, "GATE_EPILOGUE_ROWS", range(1, op.MAX_ROWS + 1))],
                   "ext-nogate": [(op, "GATE_EPILOGUE", False)],
                   "ext-tri1": [(tuning, "TRITON_ALTERNATIVES", ())],
                   "ext-notri": [(tuning, "triton_configs", lambda k: [])],
                   "ext-late-launch": [(options, "EARLY_LAUNCH", False)]}[name]
        before = [(module, field, getattr(module, field)) for module, field, _ in patches]
        for module, field, value in patches:
            setattr(module, field, value)
        try:
            yield
        finally:
            for module, field, value in before:
                setattr(module, field, value)
        return
    if not name.startswith("ext-row-"):
        yield
        return
    import torch_ext.kernels.decode_linear as op

    config = op.config
    overrides = {}  # ext-row-n<BLOCK_N>-p<PRE_K>-k<BLOCK_K>-w<warps>
    for part in name.split("-")[2:]:
        key = {"p": "PRE_K", "n": "BLOCK_N", "w": "num_warps", "k": "BLOCK_K"}[part[0]]
        overrides[key] = int(part[1:])

    def patched(k):
        cfg = {**config(k), **overrides}
        if k % cfg["BLOCK_K"]:
            cfg["BLOCK_K"] = config(k)["BLOCK_K"]
        # a multiple of BLOCK_K, at most k: a power of two <= k
        cfg["PRE_K"] = max(cfg["BLOCK_K"], min(cfg["PRE_K"], 1 << (k.bit_length() - 1)))
        return cfg

    op.config = patched
    try:
        yield
    finally:
        op.config = config


def _one_split_attention():
    """ext-attn1: decode attention without splitting the cache (one program per head and sequence
    walks it all; no combine launch), while the column compiles and captures."""
    import torch_ext.kernels.decode_attention as op

    target = op._TARGET_PROGRAMS
    op._TARGET_PROGRAMS = 1
    try:
        yield
    finally:
        op._TARGET_PROGRAMS = target
