"""Inductor: the per-process state a warm process takes from an earlier one (ISA probe, torch_key), and
which of its options this torch has."""
from __future__ import annotations


def cpu_vec_isa_names() -> list[str] | None:
    """The vector ISAs Inductor found usable for C++ kernels in this process (it compiles and loads a
    probe per candidate, in subprocesses: about a second per process on a small CPU), or None if it
    has not looked yet. `torch._inductor.cpu_vec_isa.valid_vec_isa_list` (functools.cache), 2.9-2.14."""
    from torch._inductor import cpu_vec_isa

    if cpu_vec_isa.valid_vec_isa_list.cache_info().currsize == 0:
        return None
    return [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()]


def prime_cpu_vec_isa(names: list[str]) -> bool:
    """Let Inductor take `names` (what an earlier process on the same CPU ISA and torch found, saved
    with a warm-start entry) as the probe results instead of probing again. Only candidates the CPU
    reports are considered, as in the probe. No-op (False) once this process has its own list."""
    from torch._inductor import cpu_vec_isa

    if cpu_vec_isa.valid_vec_isa_list.cache_info().currsize:
        return False
    original = cpu_vec_isa.VecISA.check_build
    cpu_vec_isa.VecISA.check_build = lambda self, code: str(self) in names
    try:
        cpu_vec_isa.valid_vec_isa_list()
    finally:
        cpu_vec_isa.VecISA.check_build = original
    return True


def lazy_graph_modules():
    """GraphModules made in this context generate their Python code at their first call, not when
    built (what Dynamo does with its graphs): the split of a loaded graph builds one per piece,
    and the pieces deduplication replaces never run. torch.fx._lazy_graph_module, 2.9-2.14."""
    from torch.fx._lazy_graph_module import _use_lazy_graph_module

    return _use_lazy_graph_module(True)


def torch_key() -> bytes:
    """Inductor's digest of torch's sources (computed once per process; 2.9-2.14)."""
    from torch._inductor.codecache import torch_key as key

    return key()


def prime_torch_key(value: bytes) -> bool:
    """Let Inductor take `value` as torch_key() instead of hashing torch's sources; False when this
    process has it already. `torch_key.set`: an assert on 2.9, a RuntimeError on 2.13-2.14."""
    from torch._inductor.codecache import torch_key as key

    try:
        key.set(value)
    except (AssertionError, RuntimeError):
        return False
    return True


def saveable_training_patches() -> dict:
    """torch._functorch config under which a piece compiled with gradients gives a saveable artifact.
    2.10-2.12 compile a training graph's backward lazily, at its first backward, and only then record
    the AOTAutograd entry that CompiledArtifact.save needs ("no aot_autograd artifacts"): compile the
    backward with the forward (`force_non_lazy_backward_lowering`, 2.10+). 2.13+ record the entry
    without it; 2.9.1 has no such switch (its training pieces stay unsaved, said once)."""
    import torch._functorch.config as functorch_config

    from torch_ext.compat.versions import TORCH_VERSION

    if TORCH_VERSION < (2, 13) and hasattr(functorch_config, "force_non_lazy_backward_lowering"):
        return {"force_non_lazy_backward_lowering": True}
    return {}


def combo_kernels_measured() -> bool:
    """Inductor's combo kernels (horizontal fusion) for our decode pieces: measured correct and faster on
    2.11 (the GPU machines' torch) and on by default there and after; earlier torches had open combo
    bugs (constexpr arguments, pytorch#168124; the CPU backend, pytorch#167780) and stay as Inductor sets."""
    from torch_ext.compat.versions import TORCH_VERSION

    return TORCH_VERSION >= (2, 11)


def has_inductor_pdl() -> bool:
    """Inductor can emit programmatic dependent launch for its Triton kernels (triton.enable_pdl: 2.11+)."""
    import torch._inductor.config as inductor_config

    return hasattr(inductor_config.triton, "enable_pdl")
