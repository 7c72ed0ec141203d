"""pytest plugin: ini options for torch_ext's graph snapshots (torch_ext/snapshots.py).

Enable it with `pytest -p torch_ext.pytest_plugin`, `addopts = "-p torch_ext.pytest_plugin"`, or
`pytest_plugins = ["torch_ext.pytest_plugin"]` in the conftest.py at your rootdir. Then, e.g. in
pyproject.toml:

    [tool.pytest.ini_options]
    torch_ext_snapshot_dir = "tests/snapshots"         # relative to this file's folder
    torch_ext_snapshot_primary_version = "2.15"        # the torch that writes the shared files
"""
from __future__ import annotations

from pathlib import Path

DIR_INI = "torch_ext_snapshot_dir"
PRIMARY_INI = "torch_ext_snapshot_primary_version"
_config = None  # the running session's pytest config


def pytest_addoption(parser):
    parser.addini(DIR_INI, "folder of torch_ext graph snapshots, relative to the ini file's folder "
                  "(default: expected/ beside each test file)", default="")
    parser.addini(PRIMARY_INI, "torch version (e.g. 2.15) that writes the shared graph snapshot files "
                  "(default: the newest that accepted)", default="")


def pytest_configure(config):
    global _config
    _config = config


def pytest_unconfigure(config):
    global _config
    _config = None


def ini_value(name: str) -> tuple[str, Path] | None:
    """The option's value and the folder a relative path in it starts from; None outside a session."""
    if _config is None:
        return None
    base = Path(_config.inipath).parent if _config.inipath else Path(_config.rootpath)
    return str(_config.getini(name)).strip(), base
