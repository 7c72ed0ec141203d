"""What besides the graph and the config decides the code Inductor compiles: the software, the
hardware the graph runs on, and, for graphs holding collectives, the rank. Part of the cache's
directory key, so a cache directory shared by ranks or machines (a home on NFS) never hands one
process another's artifact.
"""
from __future__ import annotations

import importlib.metadata
import sys

import torch
import torch.fx as fx

# What pieces are compiled from, as torch_ext does it: bumped when that changes for one graph (v2:
# size variants get inputs in their fakes' layout, backend/runtime/layout.py; v3: decode pieces compile
# with combo kernels, compile/decode_options.py), so no older artifact is taken.
ARTIFACT_FORMAT = 4

# Operator namespaces of the collectives Dynamo records (functional collectives and c10d ops).
_COLLECTIVE_NAMESPACES = ("_c10d_functional", "c10d_functional", "_c10d_functional_autograd", "c10d", "_dtensor")


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "none"


def _devices(gm: fx.GraphModule) -> set[str]:
    """Device types of the graph's inputs (what its compiled kernels target)."""
    types = set()
    for node in gm.graph.find_nodes(op="placeholder"):
        value = node.meta.get("example_value", node.meta.get("val"))
        if isinstance(value, torch.Tensor):
            types.add(value.device.type)
    return types


def holds_collectives(gm: fx.GraphModule) -> bool:
    """Whether gm (or a subgraph of it) calls a collective: its code is then per rank."""
    for module in gm.modules():
        if not isinstance(module, fx.GraphModule):
            continue
        for node in module.graph.nodes:
            target = node.target
            if isinstance(target, torch._ops.OpOverload):
                target = target.overloadpacket
            if isinstance(target, torch._ops.OpOverloadPacket) and \
                    target._qualified_op_name.split("::")[0] in _COLLECTIVE_NAMESPACES:
                return True
            if node.op == "call_function" and getattr(target, "__module__", "").startswith("torch.distributed"):
                return True
    return False


def environment_factors(gm: fx.GraphModule) -> dict[str, str]:
    """The factors of the directory key that come from this process and machine."""
    return process_factors(_devices(gm), holds_collectives(gm))


def process_factors(devices: set[str], collectives: bool) -> dict[str, str]:
    """The same factors for graphs on `devices` (device types) that may hold collectives."""
    factors = {
        "torch_ext_artifacts": f"v{ARTIFACT_FORMAT}",
        "torch": f"{torch.__version__} git={torch.version.git_version}",
        "python": sys.version,
        "triton": _version("triton"),
        "cuda": str(torch.version.cuda),
        "hip": str(getattr(torch.version, "hip", None)),
    }
    if "cpu" in devices:  # Inductor's C++ kernels use the vector ISA of the machine that compiled them
        factors["cpu"] = torch.backends.cpu.get_cpu_capability()
    if "cuda" in devices and torch.cuda.is_available():
        gpus = (torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count()))
        factors["gpus"] = "; ".join(sorted({f"{p.name} sm_{p.major}{p.minor}" for p in gpus}))
    if collectives and torch.distributed.is_available() and torch.distributed.is_initialized():
        factors["rank"] = f"{torch.distributed.get_rank()}/{torch.distributed.get_world_size()}"
    return factors
