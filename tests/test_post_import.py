"""Post-import hooks (apt_model/base/post_import.py) and the FSDP2 guard they install lazily."""
import gc
import sys
import weakref

from apt_model.base.post_import import when_imported
from conftest import clean_env, run_python


def _module(tmp_path, monkeypatch, name):
    (tmp_path / f"{name}.py").write_text("class C:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)


def test_the_callback_runs_after_the_first_import_once_and_not_after_undo(tmp_path, monkeypatch):
    _module(tmp_path, monkeypatch, "vb_post_import_a")
    _module(tmp_path, monkeypatch, "vb_post_import_b")
    seen = []
    undo_a = when_imported("vb_post_import_a", lambda m: seen.append((m.__name__, hasattr(m, "C"))))
    undo_b = when_imported("vb_post_import_b", lambda m: seen.append(m.__name__))
    assert callable(undo_a) and seen == []
    undo_b()  # stopped watching before the import: no callback
    import vb_post_import_a  # noqa: F401
    import vb_post_import_b  # noqa: F401
    assert seen == [("vb_post_import_a", True)]  # after the module's code ran: its class exists
    sys.modules.pop("vb_post_import_a")
    import vb_post_import_a  # noqa: F401,F811 - imported again: the watch is gone
    assert seen == [("vb_post_import_a", True)]
    assert when_imported("vb_post_import_a", lambda m: seen.append("now")) is None and seen[-1] == "now"


def test_nothing_of_the_watch_stays_on_the_loader_after_the_import(tmp_path, monkeypatch):
    """The module keeps its loader for good: the wrapper put on it (and the callback it holds, a
    paging session's guard that held every parameter of a model) goes once the import has run."""
    _module(tmp_path, monkeypatch, "vb_post_import_d")
    _module(tmp_path, monkeypatch, "vb_post_import_e")

    class Callback:
        def __call__(self, module):
            self.seen = module.__name__

    cb, dropped = Callback(), Callback()
    held, freed = weakref.ref(cb), weakref.ref(dropped)
    when_imported("vb_post_import_d", cb)
    undo = when_imported("vb_post_import_e", dropped)
    import vb_post_import_d  # noqa: F401
    assert cb.seen == "vb_post_import_d"
    assert "exec_module" not in vars(vb_post_import_d.__loader__)
    undo()
    del cb, dropped
    gc.collect()
    assert held() is None and freed() is None


def test_a_loader_shared_with_other_modules_is_never_changed(tmp_path, monkeypatch):
    """A zip archive's modules share one loader: a spec found only to ask whether the watched
    module exists (``importlib.util.find_spec``) left the wrapper on it, and the next module
    imported from the archive ran the callback in the watched one's place."""
    import importlib.util
    import zipfile

    archive = tmp_path / "mods.zip"
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("vbz_watched_a.py", "X = 1\n")
        z.writestr("vbz_other_a.py", "Y = 2\n")
    monkeypatch.syspath_prepend(str(archive))
    for name in ("vbz_watched_a", "vbz_other_a"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    seen = []
    when_imported("vbz_watched_a", lambda m: seen.append(m.__name__))
    assert importlib.util.find_spec("vbz_watched_a") is not None  # an availability probe
    import vbz_other_a  # noqa: F401
    assert seen == []
    import vbz_watched_a
    assert seen == ["vbz_watched_a"] and vbz_watched_a.__loader__ is vbz_other_a.__loader__
    assert vbz_watched_a.__spec__.loader is vbz_watched_a.__loader__


def test_a_failing_callback_never_fails_the_scripts_import(tmp_path, monkeypatch, caplog):
    _module(tmp_path, monkeypatch, "vb_post_import_c")
    when_imported("vb_post_import_c", lambda m: 1 / 0)
    with caplog.at_level("WARNING", logger="apt_model.base.post_import"):
        import vb_post_import_c  # noqa: F401
    assert any("ZeroDivisionError" in r.getMessage() for r in caplog.records)


def test_enable_does_not_import_fsdp_and_guards_it_once_the_script_does():
    """enable() used to import torch.distributed.fsdp (about 1 s: DTensor, SymPy) only to patch FSDP2's
    parameter groups. Now the guard is installed when the script imports FSDP2, and undone by disable()."""
    code = """
import sys
import apt_model.optimization.vb_global as vb
vb.enable("balanced", banner=False)
print("fsdp imported by enable:", "torch.distributed.fsdp" in sys.modules)
from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
print("guarded:", hasattr(FSDPParamGroup.__init__, "__wrapped__"))
vb.disable()
print("restored:", not hasattr(FSDPParamGroup.__init__, "__wrapped__"))
"""
    res = run_python(code, env=clean_env(VB_DEVICE="cpu"))
    assert res.returncode == 0, res.stderr[-2000:]
    assert "fsdp imported by enable: False" in res.stdout, res.stdout
    assert "guarded: True" in res.stdout and "restored: True" in res.stdout, res.stdout
