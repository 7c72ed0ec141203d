"""Inductor: the per-process state a warm process takes from an earlier one (ISA probe, torch_key), and
which of its options this torch has."""
from __future__ import annotations

import contextlib
import contextvars
import os


def pin_triton_cache_dir(device: int) -> str:
    """TRITON_CACHE_DIR, set where unset to Inductor's Triton dir (under its cache dir), as Inductor's first
    CachingAutotuner of a process sets it (2.9.1 through 2.15). A process whose kernels all come back
    from compile workers constructs none before it builds Triton's launchers (unpickled autotuners skip
    the constructor): its launchers, and the kernels of our own Triton ops, went to ~/.triton/cache,
    while a warm process, which constructs autotuners when it loads, looks under Inductor's dir and
    built them all again at its first calls. Set once, early, both look in one place."""
    if os.environ.get("TRITON_CACHE_DIR") is None:
        from torch._inductor.runtime.cache_dir_utils import triton_cache_dir

        os.environ["TRITON_CACHE_DIR"] = triton_cache_dir(device)
    return os.environ["TRITON_CACHE_DIR"]


def pin_triton_ptxas() -> str | None:
    """TRITON_PTXAS_PATH, set where unset to the ptxas torch ships (torch/bin/ptxas, CUDA wheels), as
    Inductor sets it before it compiles a Triton kernel in this process (2.9.1 through 2.15). Triton's cache
    key holds the ptxas version: a cold process, where Inductor had set it, compiled our decode-attention
    kernels under one key, and a warm process, where Inductor compiles nothing, looked under another and
    compiled them again at its switch to the program (0.5-0.7 s, H200)."""
    from torch._inductor.runtime.compile_tasks import _set_triton_ptxas_path

    _set_triton_ptxas_path()
    return os.environ.get("TRITON_PTXAS_PATH")


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


_early_launch = contextvars.ContextVar("torch_ext_early_dependent_launch", default=False)


@contextlib.contextmanager
def early_dependent_launch():
    """While inside (this thread / context), Inductor's Triton kernels under `triton.enable_pdl` trigger
    their dependents right after their first wait, not after their last load.

    Why: Inductor writes `gdc_launch_dependents()` after a kernel's last load, so a decode layer's
    small kernels (norms, rotary) let the next kernel launch only near their end, and our projection
    after them cannot load its weights while they run (bench/results/NOTES_issue25.md: such kernels
    started 0.0 us after the kernel before ended). Safe: the trigger still follows a wait in program
    order, so when a dependent launches, everything before this kernel has completed, as Inductor's
    own placement guarantees; each dependent waits for this kernel before reading what it writes.
    `TritonKernel._filter_pdl` (2.11+; keeps a kernel's first wait and last trigger) is wrapped once,
    and acts only inside this context."""
    _install_early_launch()
    token = _early_launch.set(True)
    try:
        yield
    finally:
        _early_launch.reset(token)


def move_launch_after_first_wait(lines: list, wait: str, launch: str) -> bool:
    """In a kernel body's lines: the trigger line placed right after the first wait (with its
    indentation); False where there is no wait before the trigger (left alone)."""
    first_wait = next((i for i, line in enumerate(lines) if type(line) is str and wait in line), None)
    trigger = next((i for i, line in enumerate(lines) if type(line) is str and launch in line), None)
    if first_wait is None or trigger is None or trigger < first_wait:
        return False
    lines.pop(trigger)
    lines.insert(first_wait + 1, lines[first_wait].replace(wait, launch))
    return True


def _install_early_launch() -> None:
    from torch._inductor.codegen.triton import TritonKernel

    original = TritonKernel.__dict__.get("_filter_pdl")
    if original is None or getattr(original, "_torch_ext_early_launch", False):
        return

    def _filter_pdl(self, code):
        original(self, code)
        if _early_launch.get():
            move_launch_after_first_wait(code._lines, self.GDC_WAIT, self.GDC_LAUNCH)

    _filter_pdl._torch_ext_early_launch = True
    TritonKernel._filter_pdl = _filter_pdl
