"""Graph snapshots: a captured graph's code pinned in a text file kept with the tests that ask for it.

Where the files live (the first that applies):
  1. `directory=` of the call;
  2. the environment variable TORCH_EXT_SNAPSHOT_DIR (TORCH_EXT_EXPECTED_DIR, its older name);
  3. the ini option `torch_ext_snapshot_dir`, relative to the ini file's folder (pytest with the
     plugin `torch_ext.pytest_plugin` enabled);
  4. `expected/` beside the calling test file: the file of the first frame outside the torch_ext
     package (a helper module of yours that calls assert_graph_snapshot counts as the caller), or
     `expected/` in the working directory when that frame has no file (`python -c`, a REPL).
Nothing is ever written inside the installed torch_ext package.

Per torch version: `<name>.txt` is the shared file; `<name>.torch<major>.<minor>.txt`, where one
exists, is that version's own and takes precedence for it. Under EXPECTTEST_ACCEPT=1 the *primary*
version writes the shared file, any other writes its own file only where it prints the graph
differently from the shared one (and removes its own file where it prints the same). The primary is
`primary=` of the call, else TORCH_EXT_SNAPSHOT_PRIMARY (e.g. "2.15"), else the ini option
`torch_ext_snapshot_primary_version`, else the newest torch that accepted: the shared file is written
when none exists or when the torch that wrote it (recorded in `torch_versions.json` in the snapshot
folder, commit it with the snapshots) is the same or older. Accept with the newest torch first, then
the older ones, so they compare with the newest's graph.
"""
from __future__ import annotations

import difflib
import json
import os
import re
import sys
from pathlib import Path

import torch

from torch_ext import compat, pytest_plugin
from torch_ext.pytest_plugin import DIR_INI, PRIMARY_INI

try:
    import fcntl
except ImportError:  # Windows: no lock around the version record
    fcntl = None

DIR_ENV = "TORCH_EXT_SNAPSHOT_DIR"
OLD_DIR_ENV = "TORCH_EXT_EXPECTED_DIR"
PRIMARY_ENV = "TORCH_EXT_SNAPSHOT_PRIMARY"
VERSIONS_FILE = "torch_versions.json"
_PACKAGE_DIR = Path(__file__).resolve().parent  # the torch_ext package


def graph_text(gm: torch.fx.GraphModule) -> str:
    """The readable code of a graph (and its subgraphs) without source-location comments, so a
    snapshot does not depend on file paths or line numbers."""
    text = gm.print_readable(print_output=False)
    lines = []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("# File:") or stripped.startswith("# No stacktrace"):
            continue
        if stripped.startswith("#") and " File: " in stripped:  # 2.11: "# ac_graph_id: <n> - ... File: ..."
            continue
        if not stripped:
            continue
        lines.append(line.rstrip())
    return "\n".join(lines) + "\n"


def normalized_graph(gm: torch.fx.GraphModule) -> str:
    """`gm`'s code as text for expecttest: `self.assertExpectedInline(normalized_graph(gm), '''''')`
    (EXPECTTEST_ACCEPT=1 fills the literal in). graph_text without any comment line (source locations,
    2.11's ac_graph_id), blank lines or trailing spaces: the same on every machine, and on torch 2.9.1,
    2.13, 2.14 and 2.15 for plain tensor code, static or dynamic shapes. Graphs with regions
    (invoke_subgraph, checkpoint, local_map) print differently on some versions: pin those in snapshot
    files, which have per-version files."""
    lines = [line for line in graph_text(gm).splitlines() if not line.lstrip().startswith("#")]
    return "\n".join(lines) + "\n"


def parse_version(version: str | tuple[int, ...]) -> tuple[int, int]:
    """(major, minor) of "2.14", "2.14.1", "2.14.1+cu128" or (2, 14, ...)."""
    if isinstance(version, str):
        match = re.match(r"(\d+)\.(\d+)", version.strip())
        if not match:
            raise ValueError(f"torch version {version!r} should read like '2.14'")
        return int(match.group(1)), int(match.group(2))
    return int(version[0]), int(version[1])


def _caller_file() -> Path | None:
    """The file of the first frame outside the torch_ext package (None: no file, e.g. a REPL)."""
    frame = sys._getframe(1)
    while frame is not None and Path(frame.f_code.co_filename).resolve().is_relative_to(_PACKAGE_DIR):
        frame = frame.f_back
    path = Path(frame.f_code.co_filename) if frame is not None else None
    return path.resolve() if path is not None and path.is_file() else None


def snapshot_dir(directory: str | os.PathLike | None = None) -> tuple[Path, str]:
    """The snapshot folder and why it is that one (see the module docstring)."""
    if directory is not None:
        return Path(directory), "directory= argument"
    for env in (DIR_ENV, OLD_DIR_ENV):
        if os.environ.get(env):
            return Path(os.environ[env]), f"${env}"
    ini = pytest_plugin.ini_value(DIR_INI)
    if ini is not None and ini[0]:
        return ini[1] / ini[0], f"ini option {DIR_INI}"
    caller = _caller_file()
    if caller is None:
        return Path.cwd() / "expected", "expected/ in the working directory (the caller has no file)"
    return caller.parent / "expected", f"expected/ beside {caller.name}"


def primary_version(primary: str | tuple[int, ...] | None = None) -> tuple[int, int] | None:
    """The torch version that writes shared files, or None: the newest that accepted."""
    if primary is None and os.environ.get(PRIMARY_ENV):
        primary = os.environ[PRIMARY_ENV]
    if primary is None:
        ini = pytest_plugin.ini_value(PRIMARY_INI)
        primary = ini[0] if ini is not None and ini[0] else None
    return parse_version(primary) if primary is not None else None


def _running() -> tuple[int, int]:
    return parse_version(compat.TORCH_VERSION)


def _writer(folder: Path, name: str) -> tuple[int, int] | None:
    path = folder / VERSIONS_FILE
    if not path.exists():
        return None
    written = json.loads(path.read_text() or "{}").get(name)
    return parse_version(written) if written else None


def _record_writer(folder: Path, name: str) -> None:
    """Note in VERSIONS_FILE that the running torch wrote `name`'s shared file."""
    with open(folder / VERSIONS_FILE, "a+") as f:
        if fcntl is not None:  # pytest-xdist workers may accept at once
            fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        versions = json.loads(f.read() or "{}")
        versions[name] = "{}.{}".format(*_running())
        f.seek(0)
        f.truncate()
        f.write(json.dumps(versions, indent=1, sort_keys=True) + "\n")


def _writes_shared(folder: Path, name: str, shared: Path, primary: tuple[int, int] | None) -> bool:
    if primary is not None:
        return _running() == primary
    writer = _writer(folder, name)
    return not shared.exists() or writer is None or writer <= _running()


def _files(folder: Path, name: str) -> tuple[Path, Path]:
    """The shared snapshot file and the running torch's own."""
    return folder / f"{name}.txt", folder / "{}.torch{}.{}.txt".format(name, *_running())


def _accept(folder: Path, name: str, actual: str, primary: tuple[int, int] | None) -> None:
    shared, own = _files(folder, name)
    if folder.resolve().is_relative_to(_PACKAGE_DIR):
        raise ValueError(f"snapshot folder {folder} is inside the torch_ext package: keep snapshots "
                         "with the tests")
    folder.mkdir(parents=True, exist_ok=True)
    if _writes_shared(folder, name, shared, primary):
        shared.write_text(actual)
        own.unlink(missing_ok=True)
        if primary is None:
            _record_writer(folder, name)
    elif shared.exists() and shared.read_text() == actual:
        own.unlink(missing_ok=True)  # prints what the primary prints: no file of its own
    else:
        own.write_text(actual)


def assert_graph_snapshot(name: str, gm: torch.fx.GraphModule, *, directory: str | os.PathLike | None = None,
                          primary: str | tuple[int, ...] | None = None) -> None:
    """Compare `gm`'s code (graph_text) with the snapshot `name`: `<folder>/<name>.txt`, or the running
    torch's own `<name>.torch<major>.<minor>.txt`. EXPECTTEST_ACCEPT=1 writes them (module docstring)."""
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        raise ValueError(f"snapshot name {name!r} must be letters, digits, '_', '.' or '-'")
    folder, why = snapshot_dir(directory)
    actual = graph_text(gm)
    if os.environ.get("EXPECTTEST_ACCEPT"):
        _accept(folder, name, actual, primary_version(primary))
        return
    shared, own = _files(folder, name)
    expected_file = own if own.exists() else shared
    if not expected_file.exists():
        raise AssertionError(f"no snapshot {shared} (folder: {why}); run with EXPECTTEST_ACCEPT=1 to record "
                             f"it. Captured graph:\n{actual}")
    expected = expected_file.read_text()
    if expected != actual:
        diff = "".join(difflib.unified_diff(expected.splitlines(True), actual.splitlines(True),
                                            str(expected_file), "captured"))
        raise AssertionError(f"graph differs from snapshot (EXPECTTEST_ACCEPT=1 to update):\n{diff}")
