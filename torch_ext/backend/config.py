"""CompileConfig: everything the torch_ext backend needs to know, validated on construction.

Cache directory: by default a per-user directory, `$TORCH_EXT_CACHE_DIR`, else
`$XDG_CACHE_HOME/torch_ext`, else `~/.cache/torch_ext`. `cache_dir=None` (or "") turns the
on-disk cache off; identical pieces are still compiled once per process.

Compile variants of every piece: one for the general symbolic shape (compiled when Dynamo
hands us the graph), one per size in `compile_sizes` and one per bounded range of
`compile_ranges_split_points` (both compiled lazily, the first time a call falls into them).
Split points p1 < ... < pk give ranges [1, p1), [p1, p2), ..., [pk, inf); the unbounded last
range is served by the general compile. Range variants are symbolic compiles like the
general one; post-grad passes can tell them apart (see compiler.current_compile_variant()).
"""
from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import os
import re
from collections.abc import Mapping
from typing import Any

import torch

CUDAGRAPH_MODES = ("none", "piecewise", "full", "full_and_piecewise")
HOP_SPLIT_MODES = ("inline", "in_body")
TRAINING_CUDAGRAPH_MODES = (False, "pieces", "whole")

_OP_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*::[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)?$")
_FUNCTION_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+$")  # module.function


def default_cache_dir() -> str:
    if os.environ.get("TORCH_EXT_CACHE_DIR"):
        return os.path.abspath(os.path.expanduser(os.environ["TORCH_EXT_CACHE_DIR"]))
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(os.path.abspath(base), "torch_ext")


class FrozenDict(dict):
    """A read-only dict (unlike MappingProxyType it copies and pickles)."""

    def _refuse(self, *args, **kwargs):
        raise TypeError("CompileConfig is frozen: build a new one (dataclasses.replace) to change options")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = __ior__ = _refuse

    def __reduce__(self):
        return (FrozenDict, (dict(self),))

    def __deepcopy__(self, memo):
        return self  # immutable

    def __repr__(self) -> str:
        return f"{dict(self)!r}"


class ConfigError(ValueError):
    """A CompileConfig field has a bad value; the message names the field and the fix."""


def _file_in_the_way(path: str | None) -> str | None:
    """The path itself or an ancestor of it that exists and is not a directory, else None."""
    while path:
        if os.path.exists(path):
            return None if os.path.isdir(path) else path
        parent = os.path.dirname(path)
        if parent == path:
            return None
        path = parent
    return None


def _fail(field: str, problem: str, fix: str) -> None:
    raise ConfigError(f"CompileConfig.{field}: {problem}. {fix}")


def op_name(op: Any) -> str:
    """The qualified name ("ns::name" or "ns::name.overload") of an op given as a string or op object."""
    if isinstance(op, str):
        return op
    if isinstance(op, torch._ops.OpOverload):
        return op.name() if op._overloadname == "default" else f"{op._schema.name}.{op._overloadname}"
    if isinstance(op, torch._ops.OpOverloadPacket):
        return op._qualified_op_name
    qualname = getattr(op, "_qualname", None)  # torch.library.custom_op's CustomOpDef
    if isinstance(qualname, str):
        return qualname
    if callable(op) and "<locals>" not in getattr(op, "__qualname__", "<locals>"):
        return f"{op.__module__}.{op.__qualname__}"  # a function Dynamo keeps as one call
    raise TypeError(f"not an operator: {op!r}")


def resolve_op(name: str) -> torch._ops.OpOverloadPacket | torch._ops.OpOverload | Any:
    """Look an op name up in torch.ops (a "module.function" name: import it); raise ConfigError
    (naming the op and the fix) if absent."""
    if "::" not in name:
        return _resolve_function(name)
    ns, _, rest = name.partition("::")
    base, _, overload = rest.partition(".")
    try:
        packet = getattr(getattr(torch.ops, ns), base)
        return getattr(packet, overload) if overload else packet
    except (AttributeError, RuntimeError):
        _fail(
            "splitting_ops",
            f"no operator named {name!r} is registered",
            "Define it before building the config (torch_ext.hops.splitting_op.splitting_op or "
            "torch.library.custom_op) and check the spelling 'namespace::name'",
        )
        raise  # unreachable


def _qualified_name(obj: Any) -> str:
    target = obj if hasattr(obj, "__qualname__") else type(obj)
    return f"{target.__module__}.{target.__qualname__}"


def _resolve_function(name: str) -> Any:
    """A function given as "module.function" (e.g. torch.nn.functional.multi_head_attention_forward)."""
    import importlib

    parts = name.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            value = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for attr in parts[cut:]:
                value = getattr(value, attr)
        except AttributeError:
            break
        if callable(value):
            return value
        break
    _fail("splitting_ops", f"no function named {name!r} can be imported",
          "Name an operator as 'namespace::name', or a function Dynamo keeps as one call as 'module.function'")


def inductor_option_key(value: Any) -> str | None:
    """What identifies an Inductor option's value across processes: a custom graph pass its uuid (its repr
    names an object address, new in every process), a list its items' keys (newer torch takes lists of
    passes), other data its repr; None for code without a uuid (a plain function), which nothing here can
    tell from an edited one (compile.compiler keeps such pieces out of the disk cache)."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    if isinstance(value, CustomGraphPass):
        uuid = value.uuid()
        return None if uuid is None else f"{type(value).__qualname__} uuid={uuid!r}"
    if isinstance(value, (list, tuple)):
        keys = [inductor_option_key(v) for v in value]
        return None if None in keys else f"[{', '.join(keys)}]"
    return None if callable(value) else repr(value)


def _as_int_tuple(field: str, value: Any) -> tuple[int, ...]:
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        _fail(field, f"expected a sequence of ints, got {value!r}", f"Write e.g. {field}=(8, 32)")
    out = []
    for v in value:
        if isinstance(v, bool) or not isinstance(v, int):
            _fail(field, f"{v!r} is not an int", f"Write e.g. {field}=(8, 32)")
        if v <= 0:
            _fail(field, f"{v} is not positive", "Sizes count rows of the dynamic dimension; use values >= 1")
        out.append(v)
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class CompileConfig:
    # Ops the graph is split at; they run eagerly between compiled pieces ("ns::name" or op objects;
    # "module.function" or the function for a Python function Dynamo keeps as one call).
    splitting_ops: tuple[str, ...] = ()
    # Sizes of the dynamic dimension (dim 0 of the batch input) compiled specifically.
    compile_sizes: tuple[int, ...] = ()
    # Strictly increasing split points of the dynamic dimension into compile ranges.
    compile_ranges_split_points: tuple[int, ...] = ()
    # Inductor config patches applied to every piece compile (keys of torch._inductor.config).
    inductor_options: Mapping[str, Any] = dataclasses.field(default_factory=dict, hash=False)
    # Where compiled pieces (and warm-start programs) are kept on disk: $TORCH_EXT_CACHE_DIR, else
    # $XDG_CACHE_HOME/torch_ext, else ~/.cache/torch_ext. None (or ""): no disk cache. A directory other
    # users can write is refused: its artifacts are code.
    cache_dir: str | None = dataclasses.field(default_factory=default_cache_dir)
    # Readable Python of the Dynamo graph, the split graph and every piece; depyf of Dynamo's code.
    debug_dump_dir: str | None = None
    # Compile pieces with identical graphs once and share the result.
    dedup: bool = True
    # Splitting ops inside HOP bodies: "inline" the HOP into its caller before the split (default,
    # measured faster at run time, see split/splitter.py), or split "in_body" and share the split body.
    hop_split: str = "inline"
    # Training graphs (compiled while autograd records): AOTAutograd differentiates the whole graph once and
    # its forward and backward graphs are split and run as straight-line code (backend/joint.py: Inductor's
    # step time and memory). False: each piece is differentiated on its own (the split-per-piece path).
    differentiate_once: bool = True
    # Training graphs differentiated once, replayed as CUDA graphs by Inductor's CUDA-graph trees (its rules,
    # as under mode="reduce-overhead": a step's outputs are overwritten by the next step's). "pieces" (or
    # True): each compiled piece of the forward and backward graphs is a graph, the splitting ops run
    # eagerly between them. "whole": the forward and the backward are one graph each, the splitting ops
    # captured too (they must be capturable: no host sync, nothing on the CPU that must run every step);
    # a graph that cannot be (RNG state set from Python around a random op, CPU work, a non-static input
    # written) keeps "pieces", said once.
    training_cudagraphs: bool | str = False
    # Inductor CustomGraphPass-style passes run post-grad through torch_ext.backend.passes.PassManager.
    post_grad_passes: tuple[Any, ...] = dataclasses.field(default=(), hash=False)
    # Run passes.UnfuseOutputAddmm before them: a residual sum that the split made a piece output
    # would otherwise become an addmm, which costs a memcpy per residual on CUDA.
    unfuse_output_addmm: bool = True
    # Inference graphs (compiled with grad off): projections reading one input (q/k/v, gate/up) run as one
    # GEMM; their parameters become views of one buffer per group (rewrite/merge_projections.py).
    merge_projections: bool = True
    # Inference graphs: SDPA of one query token per sequence (decode) runs torch_ext's split-KV kernel
    # (kernels/decode_attention.py) instead of a prefill kernel (rewrite/decode_attention.py).
    # None (the default): where CUDA graphs replay the launches (cudagraph_mode other than "none"). Our
    # ops launch their Triton kernels from Python, ~0.1 ms of CPU a call: without graphs a decode step
    # waits on them (H100, HF Llama batch 1: 12.8 ms a step against 0.9 ms captured).
    decode_attention: bool | None = None
    # Inference graphs on CUDA: linear calls of one row (a batch-1 decode step's projections), and of 2-32
    # rows in float16 / bfloat16, run torch_ext's kernels (kernels/decode_linear.py: a Triton GEMV, a CUDA
    # tensor-core kernel; rewrite/decode_linear.py) instead of cuBLAS, with
    # Inductor's dependent launch (Hopper+) and combo kernels in the pieces that call it or decode
    # attention (compile/decode_options.py). None: as decode_attention's.
    decode_linear: bool | None = None
    # Those calls also run the RMSNorm before them, a gated MLP's silu(gate) * up (in the merged gate/up
    # projection's epilogue, or before the down projection) and the residual add after them, where the graph
    # has HF's forms and, with kernel_tuning, where that times faster (rewrite/decode_linear_fusion.py).
    decode_linear_fusion: bool = True
    # Inference graphs: an SDPA splitting op given a bool mask gets it as SDPA's additive mask (0 / -inf),
    # made inside the compiled piece before it, once for all calls sharing the mask
    # (rewrite/attention_mask.py): SDPA's own conversion was ~25 us of host time per eager call.
    additive_attention_masks: bool = True
    # Pick each decode_linear shape's kernel (cuBLAS among the candidates) and each decode_attention
    # shape's launch (SDPA among them) by timing them on this GPU when it is compiled; kept under
    # cache_dir/tuning per GPU model (kernels/decode_*_tuning.py). False: the built-in configs.
    kernel_tuning: bool = True
    # tqdm progress bars while compiling several pieces (None: only on a terminal).
    progress_bar: bool | None = None
    # CUDA graphs (docs/guide/cuda-graphs.md): "none", "piecewise" (a graph per compiled piece, splitting
    # ops eager between them), "full" (one graph per forward, splitting ops captured too), or
    # "full_and_piecewise" (full graphs, and piecewise ones where a full graph cannot serve a call).
    cudagraph_mode: str = "none"
    # Batch sizes captured as CUDA graphs; a smaller batch is padded to the next one, a larger one runs
    # the compiled pieces without graphs.
    cudagraph_capture_sizes: tuple[int, ...] = ()
    # "full_and_piecewise": capture sizes up to this one get full graphs, larger ones piecewise
    # graphs (vLLM's split: decode-sized batches full, prefill-sized piecewise). None: all full.
    full_cudagraph_max_size: int | None = None
    # Calls at a capture size that run uncaptured before the capture (at least one: lazy compiles and
    # Triton autotuning cannot run under capture).
    cudagraph_num_warmup: int = 1
    # A parameter or buffer that moved is an error (CudaGraphAddressError) instead of a new capture, and
    # constant arguments are checked too.
    cudagraph_check_addresses: bool = False
    # torch_ext.compile: after a compile, calls run Dynamo's transformed code behind one generated check
    # of what it was compiled for, not Dynamo's guards (backend/dispatch/).
    guard_free_dispatch: bool = False
    # torch_ext.compile saves the traced program beside the pieces and a new process loads it without
    # tracing (backend/warm_start/). None: on where a cache_dir is set and torch has AOT compile
    # (2.11+); True: the same, said once where it cannot be; False: off.
    warm_start: bool | None = None
    # torch_ext.compile: a call with autograd off whose program is not ready runs the forward eagerly
    # while one compile thread loads or compiles it (backend/warm_start/background.py; needs warm start).
    background_compile: bool = False

    def __post_init__(self) -> None:
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen)

        if isinstance(self.splitting_ops, (str, bytes)) or not hasattr(self.splitting_ops, "__iter__"):
            _fail("splitting_ops", f"expected a sequence of op names, got {self.splitting_ops!r}",
                  'Write e.g. splitting_ops=("mylib::attention",)')
        names = []
        for op in self.splitting_ops:
            try:
                name = op_name(op)
            except TypeError:
                _fail("splitting_ops", f"{op!r} is neither an op name nor an op",
                      'Write names like "mylib::attention"')
            if not (_OP_NAME.match(name) or _FUNCTION_NAME.match(name)):
                _fail("splitting_ops", f"{name!r} is not of the form 'namespace::name[.overload]' or "
                      "'module.function'", 'Write e.g. "mylib::attention"')
            resolve_op(name)
            if name not in names:
                names.append(name)
        set_("splitting_ops", tuple(names))

        set_("compile_sizes", tuple(sorted(set(_as_int_tuple("compile_sizes", self.compile_sizes)))))
        points = _as_int_tuple("compile_ranges_split_points", self.compile_ranges_split_points)
        if any(a >= b for a, b in zip(points, points[1:])):
            _fail("compile_ranges_split_points", f"{points} is not strictly increasing",
                  f"Sort them and drop duplicates: {tuple(sorted(set(points)))}")
        set_("compile_ranges_split_points", points)

        if not isinstance(self.inductor_options, Mapping):
            _fail("inductor_options", f"expected a dict, got {type(self.inductor_options).__name__}",
                  'Write e.g. inductor_options={"max_autotune": True}')
        known = torch._inductor.config.get_config_copy()
        for key in self.inductor_options:
            if key not in known:
                close = difflib.get_close_matches(str(key), list(known), n=3)
                _fail("inductor_options", f"{key!r} is not an Inductor config option",
                      f"Did you mean {close}?" if close else "See torch._inductor.config for the options")
        set_("inductor_options", FrozenDict(self.inductor_options))

        if self.cache_dir is not None and not isinstance(self.cache_dir, (str, os.PathLike)):
            _fail("cache_dir", f"expected a path or None, got {self.cache_dir!r}",
                  "Pass a directory path, or None to turn the disk cache off")
        cache_dir = os.fspath(self.cache_dir) if self.cache_dir else None
        set_("cache_dir", os.path.abspath(os.path.expanduser(cache_dir)) if cache_dir else None)
        blocker = _file_in_the_way(self.cache_dir)
        if blocker is not None:
            _fail("cache_dir", f"{self.cache_dir!r} cannot be a directory: {blocker!r} is a file",
                  "Name a directory (it is created if missing), or cache_dir=None for no disk cache")
        if self.debug_dump_dir is not None and not isinstance(self.debug_dump_dir, (str, os.PathLike)):
            _fail("debug_dump_dir", f"expected a path or None, got {self.debug_dump_dir!r}",
                  "Pass a directory path")
        dump = os.fspath(self.debug_dump_dir) if self.debug_dump_dir else None
        set_("debug_dump_dir", os.path.abspath(os.path.expanduser(dump)) if dump else None)

        for flag in ("dedup", "cudagraph_check_addresses", "guard_free_dispatch", "unfuse_output_addmm",
                     "merge_projections", "decode_linear_fusion", "differentiate_once",
                     "kernel_tuning", "background_compile", "additive_attention_masks"):
            if not isinstance(getattr(self, flag), bool):
                _fail(flag, f"expected True or False, got {getattr(self, flag)!r}", f"Write {flag}=True")
        for flag in ("decode_attention", "decode_linear"):
            if getattr(self, flag) is not None and not isinstance(getattr(self, flag), bool):
                _fail(flag, f"expected True, False or None, got {getattr(self, flag)!r}",
                      "None runs it where CUDA graphs replay its launches")
        if self.training_cudagraphs is True:
            set_("training_cudagraphs", "pieces")
        if self.training_cudagraphs is not False and self.training_cudagraphs not in TRAINING_CUDAGRAPH_MODES[1:]:
            _fail("training_cudagraphs", f"expected one of {TRAINING_CUDAGRAPH_MODES} (True is 'pieces'), got "
                  f"{self.training_cudagraphs!r}", 'Write training_cudagraphs="whole" where the splitting ops are '
                  'capturable, else "pieces"')
        if self.training_cudagraphs and not self.differentiate_once:
            _fail("training_cudagraphs", "needs differentiate_once=True: the split-per-piece training path has no "
                  "CUDA graphs", "Drop differentiate_once=False, or drop training_cudagraphs")
        if self.warm_start is not None and not isinstance(self.warm_start, bool):
            _fail("warm_start", f"expected True, False or None, got {self.warm_start!r}",
                  "None turns it on where a cache_dir is set")
        if self.warm_start and not self.cache_dir:
            _fail("warm_start", "is True but cache_dir is None: the traced program is saved in the cache dir",
                  "Set cache_dir, or warm_start=None/False")
        if self.background_compile and (self.warm_start is False or not self.cache_dir):
            _fail("background_compile", "needs warm start: the compile thread traces through its AOT compile and "
                  "saves the program", "Set cache_dir (and leave warm_start=None or True)")
        if self.progress_bar is not None and not isinstance(self.progress_bar, bool):
            _fail("progress_bar", f"expected True, False or None, got {self.progress_bar!r}",
                  "None shows bars only on a terminal")
        if self.hop_split not in HOP_SPLIT_MODES:
            _fail("hop_split", f"{self.hop_split!r} is not one of {HOP_SPLIT_MODES}", 'Write hop_split="inline"')

        passes = self.post_grad_passes
        if callable(passes) or isinstance(passes, (str, bytes)) or not hasattr(passes, "__iter__"):
            _fail("post_grad_passes", f"expected a sequence of passes, got {passes!r}",
                  "Write post_grad_passes=(my_pass,)")
        passes = tuple(passes)
        for p in passes:
            if not callable(p):
                _fail("post_grad_passes", f"{p!r} is not callable", "Each pass is called with the FX graph")
        set_("post_grad_passes", passes)

        if self.cudagraph_mode not in CUDAGRAPH_MODES:
            _fail("cudagraph_mode", f"{self.cudagraph_mode!r} is not one of {CUDAGRAPH_MODES}",
                  'Write cudagraph_mode="none" on CPU')
        set_("cudagraph_capture_sizes",
             tuple(sorted(set(_as_int_tuple("cudagraph_capture_sizes", self.cudagraph_capture_sizes)))))
        full_max = self.full_cudagraph_max_size
        if full_max is not None:
            if isinstance(full_max, bool) or not isinstance(full_max, int) or full_max < 1:
                _fail("full_cudagraph_max_size", f"expected a positive int or None, got {full_max!r}",
                      "Write e.g. full_cudagraph_max_size=32")
            if self.cudagraph_mode != "full_and_piecewise":
                _fail("full_cudagraph_max_size", f"it applies only to cudagraph_mode='full_and_piecewise', not "
                      f"{self.cudagraph_mode!r}", "Drop it, or set cudagraph_mode='full_and_piecewise'")
            if self.cudagraph_capture_sizes and full_max < self.cudagraph_capture_sizes[0]:
                _fail("full_cudagraph_max_size", f"{full_max} is below every capture size "
                      f"{self.cudagraph_capture_sizes}: no full graph would ever be captured",
                      "Use cudagraph_mode='piecewise', or raise it to a capture size")
        if isinstance(self.cudagraph_num_warmup, bool) or not isinstance(self.cudagraph_num_warmup, int) \
                or self.cudagraph_num_warmup < 0:
            _fail("cudagraph_num_warmup", f"expected an int >= 0, got {self.cudagraph_num_warmup!r}",
                  "Write cudagraph_num_warmup=1")

    def compile_ranges(self) -> tuple[tuple[int, int | None], ...]:
        """Bounded ranges [lo, hi) of the split points, then the unbounded last one (lo, None)."""
        points = self.compile_ranges_split_points
        if not points:
            return ((1, None),)
        bounds = (1,) + points if points[0] > 1 else points
        return tuple(zip(bounds, bounds[1:])) + ((bounds[-1], None),)

    def uses(self, decode_op: str) -> bool:
        """Whether the decode_attention or decode_linear rewrite runs: as set, or (None) where CUDA
        graphs replay its launches."""
        wanted = getattr(self, decode_op)
        return self.cudagraph_mode != "none" if wanted is None else wanted

    def artifact_hash(self) -> str:
        """Hash of the fields that change compiled code (not where files go or how often we dedup)."""
        factors = {
            "splitting_ops": list(self.splitting_ops),
            "compile_ranges_split_points": list(self.compile_ranges_split_points),
            # Code without a uuid by repr: pieces compiled with it are not cached (compile.compiler).
            "inductor_options": {str(k): inductor_option_key(v) or repr(v)
                                 for k, v in sorted(self.inductor_options.items())},
            "hop_split": self.hop_split,
            "differentiate_once": self.differentiate_once,
            "training_cudagraphs": self.training_cudagraphs,
            "merge_projections": self.merge_projections,
            "decode_attention": self.uses("decode_attention"),
            "decode_linear": self.uses("decode_linear"),
            "decode_linear_fusion": self.decode_linear_fusion,
            "additive_attention_masks": self.additive_attention_masks,
            "kernel_tuning": self.kernel_tuning,
            # Pass identity also goes into every artifact key through PassManager.uuid().
            "post_grad_passes": [_qualified_name(p) for p in self.post_grad_passes],
        }
        return hashlib.sha256(json.dumps(factors, sort_keys=True).encode()).hexdigest()
