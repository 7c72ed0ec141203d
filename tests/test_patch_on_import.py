"""patch_when_imported (torch_ext/patch_on_import.py): install() wraps Inductor's compile_fx when its
module is first imported rather than importing it (0.8 s) where install() runs."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from torch_ext.patch_on_import import patch_when_imported


@pytest.fixture
def module_file(tmp_path, monkeypatch):
    (tmp_path / "te_patch_target.py").write_text("def f():\n    return 1\n\ndef g():\n    return f()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "te_patch_target"
    sys.modules.pop("te_patch_target", None)


def _twice(f):
    return lambda: 2 * f()


def test_a_module_not_yet_imported_is_patched_as_it_is_imported_and_undone_exactly(module_file):
    undo = patch_when_imported(module_file, "f", _twice)
    assert module_file not in sys.modules  # nothing imported by the call itself
    import te_patch_target

    assert te_patch_target.f() == 2 and te_patch_target.g() == 2  # the module's own callers see it too
    assert te_patch_target.__loader__.get_filename(module_file).endswith("te_patch_target.py")
    assert not any(type(f).__name__ == "_PatchingFinder" for f in sys.meta_path)  # one-shot
    undo()
    assert te_patch_target.f() == 1


def test_an_imported_module_is_patched_now_and_a_waiting_patch_can_be_dropped(module_file):
    import te_patch_target

    undo = patch_when_imported(module_file, "f", _twice)
    assert te_patch_target.f() == 2
    undo()
    assert te_patch_target.f() == 1
    del sys.modules[module_file]
    undo = patch_when_imported(module_file, "f", _twice)
    undo()  # before the import: the finder goes, nothing is patched
    import te_patch_target as again

    assert again.f() == 1
    assert not any(type(f).__name__ == "_PatchingFinder" for f in sys.meta_path)


def test_a_module_another_thread_is_still_importing_is_patched_once_it_has_executed(tmp_path, monkeypatch):
    """The call waits for the module to finish executing: patching it half-way failed (its attribute not
    there yet)."""
    (tmp_path / "te_patch_busy.py").write_text(textwrap.dedent("""
        import threading, time
        from torch_ext.patch_on_import import patch_when_imported

        undo = []
        patcher = threading.Thread(target=lambda: undo.append(patch_when_imported(__name__, "f", lambda f: lambda: 2 * f())))
        patcher.start()
        time.sleep(0.3)  # the patcher finds this module in sys.modules, not yet executed
        def f():
            return 1
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        import te_patch_busy

        te_patch_busy.patcher.join(10)
        assert te_patch_busy.undo and te_patch_busy.f() == 2
        te_patch_busy.undo[0]()
        assert te_patch_busy.f() == 1
    finally:
        sys.modules.pop("te_patch_busy", None)


def test_install_leaves_inductor_unimported_and_wraps_compile_fx_when_it_is_imported():
    code = textwrap.dedent("""
        import sys, torch, torch._dynamo
        import torch_ext
        torch_ext.install()
        assert "torch._inductor.compile_fx" not in sys.modules, "install() imported Inductor"
        import torch._inductor.compile_fx as m
        original = m.compile_fx.__wrapped__  # functools.wraps: the wrapper's mark
        assert m.compile_fx.__code__.co_name == "wrapper", m.compile_fx
        assert torch.compile(lambda x: x.sin() + 1, backend="inductor")(torch.ones(3)).eq(torch.ones(3).sin() + 1).all()
        torch_ext.uninstall()
        assert m.compile_fx is original
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
