"""Debug dumps (CompileConfig.debug_dump_dir): readable Python of the Dynamo graph, the split graph
and every piece, and depyf's decompilation of the bytecode Dynamo generated around them.

Layout: <dir>/graph_<pid>_<n>/{dynamo_graph.py, split_graph.py, pieces/<name>.py} and
<dir>/transformed_<pid>_<code name>_<k>.py. Also sent to torch._logging's structured trace
(tlparse) as artifacts named torch_ext_*.
"""
from __future__ import annotations

import dis
import io
import logging
import os

import torch
import torch.fx as fx

log = logging.getLogger(__name__)

_pending_transformed: list[str] = []  # dump roots waiting for Dynamo's transformed bytecode
_hook_handle = None
_transformed_count = 0


def trace_artifact(name: str, text_fn) -> None:
    """Send text to torch._logging's structured trace (a no-op unless tracing is on)."""
    torch._logging.trace_structured(
        "artifact", metadata_fn=lambda: {"name": name, "encoding": "string"}, payload_fn=text_fn)


def readable(gm: fx.GraphModule) -> str:
    return gm.print_readable(print_output=False, include_stride=True, include_device=True)


class DebugDumper:
    def __init__(self, root: str, graph_index: int):
        self.root = root
        self.directory = os.path.join(root, f"graph_{os.getpid()}_{graph_index}")
        os.makedirs(os.path.join(self.directory, "pieces"), exist_ok=True)
        _expect_transformed_code(root)

    def write(self, relative: str, text: str) -> None:
        path = os.path.join(self.directory, relative)
        with open(path, "w") as f:
            f.write(text)

    def graph(self, relative: str, gm: fx.GraphModule, header: str = "") -> None:
        self.write(relative, (f"# {header}\n" if header else "") + readable(gm))


def decompile(code) -> str:
    """Python source for Dynamo's transformed code (depyf), or its disassembly where depyf can't."""
    try:
        import depyf

        return depyf.decompile(code)
    except Exception as e:  # depyf missing, or a bytecode it does not know
        out = io.StringIO()
        dis.dis(code, file=out)
        return f"# depyf could not decompile this code ({type(e).__name__}: {e}); disassembly follows\n" + \
            "\n".join("# " + line for line in out.getvalue().splitlines())


def _expect_transformed_code(root: str) -> None:
    """Ask for the next bytecode Dynamo generates to be decompiled (depyf) into root."""
    global _hook_handle
    _pending_transformed.append(root)
    if _hook_handle is None:
        _hook_handle = torch._dynamo.convert_frame.register_bytecode_hook(_bytecode_hook)


def _bytecode_hook(code, new_code):
    global _transformed_count
    while _pending_transformed:
        root = _pending_transformed.pop()
        _transformed_count += 1
        path = os.path.join(root, f"transformed_{os.getpid()}_{code.co_name}_{_transformed_count}.py")
        text = decompile(new_code)
        try:
            with open(path, "w") as f:
                f.write(f"# Dynamo's transformed code for {code.co_name} ({code.co_filename}:{code.co_firstlineno})\n")
                f.write(text)
        except OSError as e:
            log.warning("torch_ext: cannot write debug dump %s: %s", path, e)
    return None
