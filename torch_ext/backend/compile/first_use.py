"""Libraries a compiled graph calls that load on their first call in a process, loaded where the graph
is compiled or loaded instead.

cuDNN's attention: the first cuDNN SDPA call of a process took 1.53 s on an H200 (torch 2.11, cuDNN
9.19: it loads its engine libraries), the next calls 0.3-1.1 ms; a new shape or a new thread costs
75-80 ms (its plans are kept per thread). Inductor calls it for a prefill whose mask transformers
materializes under compile, so a background-compiling process paid 1.79 s at its first prefill
program call, 1.73 s of it in 16 cuDNN calls (bench/hf_generate.py --profile-switch). Loaded on the
compile thread, the serving thread pays its plan only.

Our own Triton kernels (torch_ext::decode_linear, decode_attention, fused_add_rms_norm) compile at their
first launch for each specialization (shapes, strides, dtypes). A cold background-compiling process
compiled them at the decode program's first call, on the serving thread: 1.50 s of Triton (H200,
bench/hf_generate.py --sample-gap). Each distinct call of the graph is now made once on zeros of its
layouts where the graph compiles (or loads: then from Triton's cache).

Which library a graph needs is decided from its nodes' example values (SDPA's own choice for those
shapes, `torch._fused_sdp_choice`), so a process that never calls cuDNN does not load it; warm start
saves the names (the loaded graph has no example values inside its pieces).
"""
from __future__ import annotations

import inspect
import json
import logging
import threading
import time

import torch
import torch.fx as fx

log = logging.getLogger(__name__)

CUDNN_SDPA = "cudnn_sdpa"
# Our decode attention's first launch in a process imported triton.experimental.gluon (0.11-0.2 s of a
# warm process's 0.21 s switch, H200) and the kernels' module.
TRITON_DECODE_ATTENTION = "triton_decode_attention"
# A call of one of our ops on zeros of the graph's layouts: "torch_ext_op {spec}". Only our namespace:
# its ops have no effect beyond their outputs and the inputs they declare mutated, so zeros are safe.
TORCH_EXT_OP = "torch_ext_op"
MAX_PROBE_BYTES = 256 << 20  # tensors made for one probe (a training-size batch or a huge head skips it)

_loaded: set[tuple[str, int]] = set()
_lock = threading.Lock()


def _sdpa_signature(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                    enable_gqa=False):
    pass


_SDPA = inspect.signature(_sdpa_signature)
_SDPA_TARGETS = {torch._C._nn.scaled_dot_product_attention, torch.nn.functional.scaled_dot_product_attention}


def libraries_needed(gm: fx.GraphModule) -> tuple[str, ...]:
    """Names of the first-use libraries the graph's calls would load (from example values; () where
    they are not there). Never raises: a probe that fails costs the first call its load, nothing else."""
    try:
        return _libraries_needed(gm)
    except Exception as e:  # noqa: BLE001 - an optimization only
        log.info("torch_ext: could not tell which libraries the graph loads (%s: %s)", type(e).__name__, e)
        return ()


def _libraries_needed(gm: fx.GraphModule) -> tuple[str, ...]:
    needed = []
    cudnn = _cudnn_sdpa_possible()
    for module in gm.modules():
        if not isinstance(module, fx.GraphModule):
            continue
        for node in module.graph.nodes:
            if node.op != "call_function":
                continue
            if cudnn and node.target in _SDPA_TARGETS:
                name = _cudnn_call_name(node)
                if name is not None and name not in needed:
                    needed.append(name)
            elif _is_torch_ext_op(node):
                if TRITON_DECODE_ATTENTION not in needed and _is_decode_attention(node) and _on_cuda(node):
                    needed.append(TRITON_DECODE_ATTENTION)
                name = _torch_ext_op_call_name(node)
                if name is not None and name not in needed:
                    needed.append(name)
    return tuple(needed)


def _example_value(node: fx.Node):
    return node.meta.get("example_value", node.meta.get("val"))


def _is_torch_ext_op(node: fx.Node) -> bool:
    return isinstance(node.target, torch._ops.OpOverload) and node.target.namespace == "torch_ext"


def _torch_ext_op_call_name(node: fx.Node) -> str | None:
    """"torch_ext_op {spec}" for a call of our op on CUDA tensors of concrete layouts (the spec its loader
    repeats on zeros); None where an argument is not known or the call is too large to repeat."""
    budget = MAX_PROBE_BYTES
    on_cuda = False

    def encode(value):
        nonlocal budget, on_cuda
        if isinstance(value, fx.Node):
            value = _example_value(value)
            if not isinstance(value, torch.Tensor):
                return _NOT_KNOWN if value is None else encode(value)
            size, stride = _concrete(value.shape), _concrete(value.stride())
            if size is None or stride is None or value.device.type != "cuda":
                return _NOT_KNOWN
            offset = value.storage_offset()  # a view's offset changes its pointer's alignment: Triton specializes on it
            if not isinstance(offset, int):
                return _NOT_KNOWN
            on_cuda = True
            budget -= _storage_bytes(size, stride, value.dtype) + offset * value.dtype.itemsize
            return {"tensor": [list(size), list(stride), str(value.dtype).removeprefix("torch.")],
                    **({"offset": offset} if offset else {})}
        if isinstance(value, (list, tuple)):
            items = [encode(v) for v in value]
            return _NOT_KNOWN if any(i is _NOT_KNOWN for i in items) else items
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        return _NOT_KNOWN

    args, kwargs = encode(list(node.args)), {k: encode(v) for k, v in node.kwargs.items()}
    if args is _NOT_KNOWN or any(v is _NOT_KNOWN for v in kwargs.values()) or not on_cuda or budget < 0:
        return None
    spec = {"op": node.target._name.split("::", 1)[1], "overload": node.target._overloadname, "args": args,
            "kwargs": kwargs}
    return f"{TORCH_EXT_OP} {json.dumps(spec, sort_keys=True)}"


_NOT_KNOWN = object()


def _is_decode_attention(node: fx.Node) -> bool:
    name = getattr(node.target, "_name", None)  # an OpOverload's "namespace::op"
    return isinstance(name, str) and name.startswith("torch_ext::decode_attention")


def _on_cuda(node: fx.Node) -> bool:
    """A CUDA example value among its inputs (a loaded graph's pieces have none: then assumed, as
    decode attention is rewritten in only for CUDA graphs)."""
    values = [_example_value(a) for a in node.all_input_nodes]
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    return not tensors or any(v.device.type == "cuda" for v in tensors)


def _cudnn_sdpa_possible() -> bool:
    return torch.cuda.is_available() and torch.backends.cuda.cudnn_sdp_enabled()


def load_libraries(names, device: int | None = None) -> None:
    """Load each named library once per process and device (a tiny call); failures are logged, never
    raised: the graph's own first call would load it anyway."""
    if not names or not torch.cuda.is_available():
        return
    device = torch.cuda.current_device() if device is None else device
    for name in names:
        with _lock:
            if (name, device) in _loaded:
                continue
            _loaded.add((name, device))
        loader = _LOADERS.get(name.split(" ", 1)[0])
        if loader is None:
            log.debug("torch_ext: no first-use loader for %r", name)
            continue
        start = time.perf_counter()
        try:
            loader(device, json.loads(name.split(" ", 1)[1]) if " " in name else {})
        except Exception as e:  # noqa: BLE001 - an optimization only
            log.info("torch_ext: loading %s ahead of the first call failed (%s: %s)", name, type(e).__name__, e)
            continue
        log.info("torch_ext: %s loaded ahead of the first call (%.2f s)", name, time.perf_counter() - start)


def _load_cudnn_sdpa(device: int, spec: dict) -> None:
    """One call like the graph's (its shapes, dtypes, mask and flags): cuDNN loads, or compiles at run
    time, the engine for that configuration. A call of another configuration (1 x 64 x 64, no mask)
    left the graph's first call at 0.98 s (H200)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dtype = getattr(torch, spec["dtype"])
    q, k, v = (torch.zeros(spec[n], device=f"cuda:{device}", dtype=dtype) for n in ("q", "k", "v"))
    mask = None
    if spec.get("mask"):
        mask = torch.zeros(spec["mask"][0], device=f"cuda:{device}", dtype=getattr(torch, spec["mask"][1]))
    with torch.no_grad(), sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=spec["causal"],
                                                         scale=spec["scale"], enable_gqa=spec["gqa"])
    torch.cuda.synchronize(device)


def _load_triton_decode_attention(device: int, spec: dict) -> None:
    from torch_ext.kernels import decode_attention

    decode_attention._kernels()
    try:
        import triton.experimental.gluon  # noqa: F401
    except ImportError:  # a Triton without Gluon does not import it at the launch either
        pass


def torch_ext_op_call(spec: dict, device: str):
    """(op, args, kwargs) of a "torch_ext_op" spec, its tensors zeros of the recorded layouts on device."""

    def decode(value):
        if isinstance(value, dict):
            size, stride, dtype = value["tensor"]
            offset = value.get("offset", 0)
            storage = torch.zeros(offset + _storage_bytes(size, stride, torch.int8), device=device,
                                  dtype=getattr(torch, dtype))  # elements: bytes of int8
            return storage.as_strided(size, stride, offset)
        if isinstance(value, list):
            return [decode(v) for v in value]
        return value

    op = getattr(getattr(torch.ops.torch_ext, spec["op"]), spec["overload"])
    return op, decode(spec["args"]), {k: decode(v) for k, v in spec["kwargs"].items()}


def _load_torch_ext_op(device: int, spec: dict) -> None:
    """The call on zeros of its layouts: its Triton kernels compile (cold) or load from Triton's cache."""
    op, args, kwargs = torch_ext_op_call(spec, f"cuda:{device}")
    with torch.no_grad(), torch.cuda.device(device):
        op(*args, **kwargs)
    torch.cuda.synchronize(device)


_LOADERS = {CUDNN_SDPA: _load_cudnn_sdpa, TRITON_DECODE_ATTENTION: _load_triton_decode_attention,
            TORCH_EXT_OP: _load_torch_ext_op}


def _cudnn_call_name(node: fx.Node) -> str | None:
    """"cudnn_sdpa {spec}" where SDPA picks cuDNN for the node's call, the spec its loader repeats."""
    from torch.nn.attention import SDPBackend

    call = _sdpa_call(node)
    if call is None or call[0].type != "cuda" or _sdpa_choice(*call) != int(SDPBackend.CUDNN_ATTENTION):
        return None
    _, shapes, options = call
    mask = shapes.get("attn_mask")
    spec = {"q": shapes["query"][0], "k": shapes["key"][0], "v": shapes["value"][0],
            "dtype": str(shapes["query"][2]).removeprefix("torch."),
            "mask": [mask[0], str(mask[2]).removeprefix("torch.")] if mask else None,
            "causal": bool(options.get("is_causal", False)), "scale": options.get("scale"),
            "gqa": bool(options.get("enable_gqa", False))}
    return f"{CUDNN_SDPA} {json.dumps(spec, sort_keys=True)}"


def _sdpa_call(node: fx.Node) -> tuple[torch.device, dict, dict] | None:
    """The device, the (size, stride, dtype) of each tensor argument and the other options of an SDPA
    node, from its arguments' example values; None where one is missing, symbolic without a hint, or too
    large to probe."""
    try:
        arguments = dict(_SDPA.bind(*node.args, **node.kwargs).arguments)
    except TypeError:
        return None
    shapes = {}
    device = None
    for name in ("query", "key", "value", "attn_mask"):
        value = arguments.pop(name, None)
        if isinstance(value, fx.Node):
            value = _example_value(value)
        elif value is None:  # no mask
            continue
        if not isinstance(value, torch.Tensor):
            return None
        size, stride = _concrete(value.shape), _concrete(value.stride())
        if size is None or stride is None:
            return None
        shapes[name] = (size, stride, value.dtype)
        device = device or value.device
    if "query" not in shapes or any(isinstance(v, fx.Node) for v in arguments.values()):
        return None
    if sum(_storage_bytes(*shape) for shape in shapes.values()) > MAX_PROBE_BYTES:
        return None
    return device, shapes, arguments


def _sdpa_choice(device: torch.device, shapes: dict, options: dict) -> int:
    """SDPA's own backend choice for tensors of these layouts (zeros) on the device."""
    real = {name: torch.empty_strided(size, stride, device=device, dtype=dtype).zero_()
            for name, (size, stride, dtype) in shapes.items()}
    return torch._fused_sdp_choice(real["query"], real["key"], real["value"], real.get("attn_mask"),
                                   options.get("dropout_p", 0.0), options.get("is_causal", False),
                                   scale=options.get("scale"), enable_gqa=options.get("enable_gqa", False))


def _concrete(values) -> tuple[int, ...] | None:
    out = []
    for v in values:
        if isinstance(v, int):
            out.append(v)
        elif isinstance(v, torch.SymInt) and getattr(v.node, "hint", None) is not None:
            out.append(int(v.node.hint))  # the size Dynamo traced with
        else:
            return None
    return tuple(out)


def _storage_bytes(size, stride, dtype) -> int:
    if any(s == 0 for s in size):
        return 0
    return (1 + sum((s - 1) * st for s, st in zip(size, stride))) * dtype.itemsize
