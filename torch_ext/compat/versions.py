"""Which torch this is, whether torch_ext supports it, and the version-dependent facts
(features, known bugs) other modules branch on through torch_ext.compat."""
from __future__ import annotations

import re
import warnings

import torch

def _release(version: str) -> tuple[int, ...]:
    """(major, minor, patch) of a version string such as "2.14.1+cu130" or "2.15.0.dev20260101"."""
    return tuple(int(re.match(r"\d+", part).group()) for part in version.split("+")[0].split(".")[:3])


# The torch releases CI runs the whole suite on (the Makefile's VERSIONS; the GPU machine adds 2.11);
# `python -m torch_ext doctor` says whether the installed one is among them.
TESTED_TORCH_VERSIONS = ("2.9.1", "2.11.0", "2.13.0", "2.14.1", "2.15.0")
OLDEST_SUPPORTED_TORCH = _release(TESTED_TORCH_VERSIONS[0])
NEWEST_TESTED_TORCH = _release(TESTED_TORCH_VERSIONS[-1])
TORCH_RELEASE = _release(torch.__version__)


def _shown(release: tuple[int, ...] | None) -> str:
    return torch.__version__ if release is None else ".".join(map(str, release))


def check_torch_version(release: tuple[int, ...] | None = None) -> None:
    """Refuse a torch older than the oldest supported: its Dynamo internals differ."""
    if (release or TORCH_RELEASE) < OLDEST_SUPPORTED_TORCH:
        raise ImportError(f"torch_ext needs torch >= {TESTED_TORCH_VERSIONS[0]} (tested: "
                          f"{', '.join(TESTED_TORCH_VERSIONS)}); this is torch {_shown(release)}. Upgrade "
                          f"torch, e.g. `pip install torch=={TESTED_TORCH_VERSIONS[-1]}`.")


def warn_if_untested(release: tuple[int, ...] | None = None) -> bool:
    """Warn (install() does, once) when torch is newer than the newest tested; returns whether it is."""
    if (release or TORCH_RELEASE) <= NEWEST_TESTED_TORCH:
        return False
    warnings.warn(f"torch_ext is tested with torch {', '.join(TESTED_TORCH_VERSIONS)}; this is torch "
                  f"{_shown(release)}, newer. If compiling fails or results differ from eager, please "
                  "report it with the output of `python -m torch_ext doctor`.", stacklevel=3)
    return True


check_torch_version()  # before the imports of internals below, which older releases lack

from torch._dynamo.variables import higher_order_ops as _hops  # noqa: E402

TORCH_VERSION = TORCH_RELEASE[:2]

# 2.10 introduced wrap-semantics speculation in torch itself.
TORCH_HAS_WRAP_SEMANTICS = hasattr(_hops, "speculate_subgraph_with_auto_output_flattening")

# torch's own wrap semantics (2.10 .. 2.12) compile HOP bodies returning closures or objects holding
# SymInts into graphs that fail at run time (UnboundLocalError, None sizes: 2.11; 2.13+ are right).
# torch_ext lets torch's tracing stand there only for bodies returning tensors, constants and
# containers of them.
TORCH_WRAP_SEMANTICS_UNRELIABLE = TORCH_HAS_WRAP_SEMANTICS and TORCH_VERSION < (2, 13)

# torch 2.9.1's invoke_subgraph autograd assumes every output is a tensor; 2.10+ also returns SymInts.
INVOKE_SUBGRAPH_RETURNS_SYMINTS = TORCH_HAS_WRAP_SEMANTICS

# 2.14 functionalizes a custom op that mutates its inputs inside a nested_compile_region (earlier:
# "Found a custom (non-ATen) operator whose output has alias annotations"), so plain torch.compile
# compiles region layers around an in-place attention op.
INDUCTOR_COMPILES_MUTATING_OPS_IN_REGIONS = TORCH_VERSION >= (2, 14)

# Known torch bugs torch_ext avoids (torch_ext/workarounds.py; pinned in tests/test_torch_bugs.py).
# Inductor reuses buffers an invoke_subgraph call still needs: wrong gradients (2.9.1 .. 2.15.0).
INDUCTOR_REUSES_REGION_BUFFERS = True
# The invoke_subgraph backward-graph cache ignores which tangents are the same tensor (2.9.1; 2.13
# adds the aliasing to its key).
BACKWARD_CACHE_IGNORES_TANGENT_ALIASING = TORCH_VERSION < (2, 10)
# invoke_subgraph's backward traces a graph, so it needs fake tensors: under backend="eager" a region
# needing gradients fails ("fake_mode should be enabled for HOPs"); 2.14 runs such calls itself.
EAGER_REGION_BACKWARD_NEEDS_FAKE_MODE = TORCH_VERSION < (2, 14)
# A region bound per instance (`layer.forward = MethodType(nested_compile_region(cls.forward), layer)`)
# and called for two instances: torch's subgraph reuse (keyed on the code) passes the first instance's
# parameters to every later call: wrong outputs (2.12.1 .. 2.15.0; 2.9.1 and 2.11 are right; 2.10 untested).
# torch_ext's region tracing lifts each call's own parameters.
REGION_REUSE_BINDS_FIRST_INSTANCE = TORCH_VERSION >= (2, 12)
# torch's subgraph reuse stamps out later calls of a region as a plain tuple whatever the first call
# returned: a namedtuple or a list of tensors comes back from the second call on as a tuple, so
# `isinstance(out, NT)` is False there (silently another branch) and `out.a` fails (2.15.0; 2.13 and
# 2.14.1: see tests/test_torch_bugs.py; 2.9.1 and 2.11 do not reuse). torch_ext lets torch reuse only
# results returned as a tensor or a plain tuple; other calls are traced (and deduplicated) as the first.
REGION_REUSE_FLATTENS_OUTPUT_TYPE = TORCH_VERSION >= (2, 12)

# An activation checkpoint run outside of tracing (backend="eager") recomputes its body without the
# forward's RNG state: dropout draws a new mask in backward, wrong gradients. Plain checkpoints: 2.12.1
# .. 2.15.0 (they take the selective-checkpoint path; 2.9.1 and 2.11 do not recompute them; 2.10 untested);
# with a context_fn (selective checkpointing): every version. torch_ext checkpoints such calls as eager does.
EAGER_CHECKPOINT_LOSES_RNG_STATE = TORCH_VERSION >= (2, 12)
# A nested_compile_region called inside another HOP body (a region, a checkpoint) fails AOTAutograd's
# trace when gradients are needed ("fake mode from tracing context doesn't match mode from active fake
# mode"): 2.9.1, also vanilla; 2.11+ compile it; 2.10 untested (inlining is right everywhere).
# torch_ext traces such an inner region inline (a region just runs its body).
NESTED_REGION_FAILS_AOT = TORCH_VERSION < (2, 11)
# Inductor compiling an activation checkpoint whose body draws random numbers (dropout), with dynamic
# shapes, in training: AOTAutograd's min-cut partitioner fails ("Node mm was invalid, but is output"),
# vanilla too (2.9.1, 2.11, 2.12.1; 2.13+ compile it; 2.10 untested). Eager's RNG ops
# (fallback_random) avoid it. torch_ext compiles such graphs with fallback_random=True.
PARTITIONER_FAILS_ON_DYNAMIC_CHECKPOINTED_RNG = TORCH_VERSION < (2, 13)
# A piece compiled with gradients saves to the disk cache (its artifact holds the AOTAutograd entry):
# 2.10+ (2.10-2.12 with the backward compiled up front: compat.saveable_training_patches); 2.9.1 cannot.
TRAINING_ARTIFACTS_SAVEABLE = TORCH_VERSION >= (2, 10)
