"""runtime='rpc' refuses, before any role process starts, a strategy or transform the roles could not load.

The real case runs as a user would: a training script (``python train.py``) that defines its
strategy, or a transform class, inside ``if __name__ == "__main__":``. The variants (an
interactive ``__main__``, an ``else:`` branch, a ``*`` import, ``python -m pkg``) are checked in this process
against a ``__main__`` module built from a real script file; a script that star-imports its helpers runs for real.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import textwrap
import time
import types
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import torchdata_overlord as ol
from torchdata_overlord.runtime.loadable import check_loadable
from torchdata_overlord.runtime.rpc_job import RoleConfig

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = '''
import json, multiprocessing, sys

import torch
import torchdata_overlord as ol
from torchdata_overlord.sources import ParquetSource


def module_strategy(g):
    return g.mix({"s": 1.0}).distribute("DP").cost(ol.token_count).balance("greedy", microbatches=1).plan()


class ModuleTransform:
    columns = ["n"]

    def __call__(self, row):
        return {"input_ids": torch.arange(row["n"] + 1)}


def attempt(results, key, transform, strategy, steps=0):
    try:
        with ol.OverlordLoader([ParquetSource("s", sys.argv[1], transform, seed=1)], strategy,
                               ol.ClientPlaceTree(dp=1), rank=0, global_batch=2, seq_len=None, runtime="rpc",
                               n_workers=1, startup_timeout=60, timeout=60) as loader:
            results[key] = [len(next(loader)["microbatches"]) for _ in range(steps)]
    except Exception as e:
        results[key] = f"{type(e).__name__}: {e}"
    results[key + ":children"] = len(multiprocessing.active_children())


if __name__ == "__main__":
    def strategy(g):
        return module_strategy(g)

    class Transform(ModuleTransform):
        pass

    results = {}
    attempt(results, "strategy", ModuleTransform(), strategy)
    attempt(results, "transform", Transform(), module_strategy)
    attempt(results, "module level", ModuleTransform(), module_strategy, steps=2)   # these load: no false alarm
    with open(sys.argv[2], "w") as f:
        json.dump(results, f)
'''


@pytest.mark.slow
def test_strategy_or_transform_under_the_main_guard_is_refused_before_any_role_starts(tmp_path):
    pq.write_table(pa.table({"n": list(range(8))}), tmp_path / "s.parquet")
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    out = tmp_path / "out.json"
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "s.parquet"), str(out)], cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(out.read_text())
    for key, name in (("strategy", "strategy"), ("transform", "Transform")):
        msg = got[key]
        assert msg.startswith("ConfigError: runtime='rpc' cannot send"), msg
        assert f"`{name}` is defined inside `if __name__ == \"__main__\":` in {script}" in msg
        assert f"move `{name}` above the guard, to module level" in msg and "\n" not in msg
        assert got[key + ":children"] == 0                      # refused before any role process started
    assert "the strategy" in got["strategy"] and "source 's'" in got["transform"]
    assert got["module level"] == [1, 1]


# ---- the same check against other shapes of __main__, in this process ---------------------------------------

MAIN = textwrap.dedent('''
    import os
    from json import *

    def top(g):
        return g

    if __name__ == "__main__":
        def guarded(g):
            return g
    else:
        def in_else(g):
            return g

    try:
        import nothing_here
    except ImportError:
        def in_except(g):
            return g
''')


@pytest.fixture
def fake_main(tmp_path, monkeypatch):
    """``__main__`` as a role process would see it missing: a module executed from a real file, with
    its guarded block run (as ``python file.py`` does)."""

    def make(source: str, with_file: bool = True):
        path = tmp_path / "script.py"
        path.write_text(source)
        mod = types.ModuleType("__main__")
        if with_file:
            mod.__file__ = str(path)
        exec(compile(source, str(path), "exec"), mod.__dict__)
        monkeypatch.setitem(sys.modules, "__main__", mod)
        return mod
    return make


def test_guarded_name_is_refused_other_module_level_names_pass(fake_main):
    main = fake_main(MAIN.replace("from json import *\n", ""))
    with pytest.raises(ol.ConfigError, match=r"move `guarded` above the guard"):
        check_loadable(main.guarded, "the strategy")
    for name in ("top", "in_except"):
        check_loadable(getattr(main, name), "the strategy")


def test_a_star_import_is_read_from_its_module_not_taken_as_binding_everything(fake_main):
    """``from json import *`` binds json's public names, not ``guarded``: a guarded function or class is
    still refused (before, any ``*`` import let everything through, and the roles failed minutes later)."""
    main = fake_main(MAIN + textwrap.dedent("""
        if __name__ == "__main__":
            class Guarded:
                pass

            class JSONDecoder:                   # json's name: the roles would find json's class instead
                pass
    """))
    with pytest.raises(ol.ConfigError, match=r"`guarded` is defined inside `if __name__ == \"__main__\":`"):
        check_loadable(main.guarded, "the strategy")
    with pytest.raises(ol.ConfigError, match=r"`Guarded` is defined inside .*move `Guarded` above the guard"):
        check_loadable(main.Guarded, "the strategy")
    with pytest.raises(ol.ConfigError, match=r"they would find the `JSONDecoder` of `from json import \*` instead"):
        check_loadable(main.JSONDecoder, "the strategy")
    for name in ("top", "in_except"):
        check_loadable(getattr(main, name), "the strategy")


def test_a_star_import_of_a_module_not_imported_here_leaves_a_guarded_class_to_the_roles(fake_main, tmp_path,
                                                                                        monkeypatch):
    (tmp_path / "helper_for_star.py").write_text("def helper():\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    main = fake_main("from helper_for_star import *\nif __name__ == '__main__':\n    class Guarded:\n        pass\n")
    monkeypatch.delitem(sys.modules, "helper_for_star")
    check_loadable(main.Guarded, "the strategy")       # what the unread `*` binds is unknown: let the roles tell


def test_a_guarded_function_is_refused_whatever_the_top_level_binds_to_its_name(fake_main):
    main = fake_main(textwrap.dedent("""
        def register(f):
            return f

        transform = registered = None            # the roles would find these, not the guarded functions

        if __name__ == "__main__":
            @register                            # its code starts at this line, above the `def`
            def registered(x):
                return x

            def transform(row):
                return row
    """))
    for obj, name in ((main.transform, "transform"), (main.registered, "registered")):
        with pytest.raises(ol.ConfigError, match=rf"`{name}` is defined inside `if __name__ == \"__main__\":`"):
            check_loadable(obj, "the strategy")


def test_a_package_main_run_with_dash_m_is_refused_even_at_module_level(fake_main, monkeypatch):
    """multiprocessing does not import ``pkg/__main__.py`` again in its children: nothing defined there loads."""
    main = fake_main(MAIN.replace("from json import *\n", ""))
    monkeypatch.setattr(main, "__spec__", types.SimpleNamespace(name="pkg.__main__", origin=main.__file__),
                        raising=False)
    with pytest.raises(ol.ConfigError, match=r"run as `python -m pkg`, which role processes do not import.*move "
                                             r"`top` into another module"):
        check_loadable(main.top, "the strategy")
    monkeypatch.setattr(main, "__spec__", types.SimpleNamespace(name="train", origin=main.__file__))
    check_loadable(main.top, "the strategy")           # `python -m train`: imported again, as __mp_main__


def test_interactive_main_is_refused(fake_main):
    main = fake_main(MAIN, with_file=False)
    with pytest.raises(ol.ConfigError, match=r"interactive `__main__` \(no file\).*move `top` into a \.py module"):
        check_loadable(main.top, "the strategy")


def test_a_transform_referring_to_a_guarded_class_is_refused_in_role_config(fake_main, tmp_path):
    main = fake_main(MAIN.replace("from json import *\n", "") + textwrap.dedent('''
        if __name__ == "__main__":
            class Upper:
                def __call__(self, row):
                    return row

            from torchdata_overlord.sources import ParquetSource

            class MySource(ParquetSource):
                pass
    '''))
    pq.write_table(pa.table({"n": [1, 2]}), tmp_path / "s.parquet")
    src = ol.ParquetSource("s", str(tmp_path / "s.parquet"), main.Upper())
    with pytest.raises(ol.ConfigError, match=r"the transform of source 's' to its role processes: `Upper` is defined"):
        RoleConfig([src], top_level_strategy, ol.ClientPlaceTree(dp=1), 2, None)
    with pytest.raises(ol.ConfigError, match="must pickle"):
        RoleConfig([src], lambda g: g, ol.ClientPlaceTree(dp=1), 2, None)
    mine = main.MySource("s", str(tmp_path / "s.parquet"))
    with pytest.raises(ol.ConfigError, match=r"the class of source 's' to its role processes: `MySource` is defined"):
        RoleConfig([mine], top_level_strategy, ol.ClientPlaceTree(dp=1), 2, None)
    RoleConfig([ol.ParquetSource("s", str(tmp_path / "s.parquet"))], top_level_strategy, ol.ClientPlaceTree(dp=1), 2,
               None)


def top_level_strategy(g):
    return g


def test_a_module_no_new_process_can_import_is_refused(tmp_path, monkeypatch):
    mod = types.ModuleType("made_in_memory")
    exec("def strategy(g):\n    return g\n", mod.__dict__)
    monkeypatch.setitem(sys.modules, "made_in_memory", mod)
    pickle.dumps(mod.strategy)                         # it pickles here...
    with pytest.raises(ol.ConfigError, match=r"module 'made_in_memory', which a new process cannot import"):
        check_loadable(mod.strategy, "the strategy")   # ...but a role process could not import it


# ---- a user's script: helpers star-imported, a transform defined under the guard ----------------------------

HELPER = SCRIPT.split("\n\nif __name__")[0]
STAR_SCRIPT = '''
import json, sys, time

from helper import *

if __name__ == "__main__":
    def local_tx(row):
        return ModuleTransform()(row)

    results = {}
    t0 = time.monotonic()
    attempt(results, "nested def", local_tx, module_strategy)
    results["seconds"] = time.monotonic() - t0
    with open(sys.argv[2], "w") as f:
        json.dump(results, f)
'''


def _processes_with(marker: str) -> list[int]:
    """The processes whose environment carries ``marker`` (whatever a test's subprocess started inherits it)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if marker.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            continue
    return found


@pytest.mark.slow
def test_a_transform_defined_under_the_guard_of_a_script_with_a_star_import_is_refused_at_once(tmp_path):
    """The user's case: ``from helper import *`` at the top, ``def local_tx`` under the guard. It pickles here
    as ``__main__.local_tx``; before, the check let it through (a ``*`` import might bind anything) and
    ~2 minutes later the Planner's process failed with ``Can't get attribute 'local_tx' on __mp_main__``."""
    pq.write_table(pa.table({"n": list(range(8))}), tmp_path / "s.parquet")
    (tmp_path / "helper.py").write_text(HELPER)
    script = tmp_path / "train.py"
    script.write_text(STAR_SCRIPT)
    out = tmp_path / "out.json"
    key, value = "TDO_LOADABLE_TEST", f"{os.getpid()}-{tmp_path.name}"
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "s.parquet"), str(out)], cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}", key: value},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(out.read_text())
    msg = got["nested def"]
    assert msg.startswith("ConfigError: runtime='rpc' cannot send the transform of source 's' to its role "
                          "processes: `local_tx` is defined inside `if __name__ == \"__main__\":` in "
                          f"{script}"), msg
    assert "move `local_tx` above the guard, to module level (or into a module the script imports)" in msg
    assert got["nested def:children"] == 0 and "overlord-actors" not in proc.stderr   # no role process started
    assert got["seconds"] < 30, got                     # refused at once, not after the roles' start-up timeout
    deadline = time.monotonic() + 60                    # the fork server (started early) ends with the script,
    while _processes_with(f"{key}={value}") and time.monotonic() < deadline:    # once its preload imports are done
        time.sleep(0.2)
    assert _processes_with(f"{key}={value}") == []


# ---- a script that builds its loader outside the guard -------------------------------------------------------

UNGUARDED = SCRIPT.split("\n\ndef attempt")[0] + '''

with ol.OverlordLoader([ParquetSource("s", sys.argv[1], ModuleTransform(), seed=1)], module_strategy,
                       ol.ClientPlaceTree(dp=1), rank=0, global_batch=2, seq_len=None, runtime="rpc", n_workers=1,
                       startup_timeout=60, timeout=60) as loader:
    next(loader)
'''


@pytest.mark.slow
def test_a_script_that_builds_its_loader_outside_the_guard_is_refused_before_any_role_starts(tmp_path):
    pq.write_table(pa.table({"n": list(range(8))}), tmp_path / "s.parquet")
    script = tmp_path / "train.py"
    script.write_text(UNGUARDED)
    line = UNGUARDED.splitlines().index(next(x for x in UNGUARDED.splitlines() if x.startswith("with "))) + 1
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "s.parquet")], cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("torchdata_overlord.errors.ConfigError: OverlordLoader(runtime='rpc') is started at the "
                           f"top level of {script} (line {line}), outside `if __name__ == \"__main__\":`"), last
    assert "put the code that builds and runs the loader under that guard" in last
    assert "overlord-actors" not in proc.stderr          # refused in the trainer: no role process was started


def test_only_the_scripts_top_level_outside_the_guard_is_refused(tmp_path, monkeypatch):
    from torchdata_overlord.runtime.loadable import check_main_guarded

    source = textwrap.dedent('''
        from torchdata_overlord.runtime.loadable import check_main_guarded

        def build():
            check_main_guarded("building")

        if __name__ == "__main__":
            build()                           # guarded: fine
            exec("build()")                   # code exec'd under the guard: the guarded line counts
        build()
    ''')
    path = tmp_path / "script.py"
    path.write_text(source)
    mod = types.ModuleType("__main__")
    mod.__file__ = str(path)
    monkeypatch.setitem(sys.modules, "__main__", mod)
    with pytest.raises(ol.ConfigError, match=rf"building is started at the top level of {path} \(line 10\)"):
        exec(compile(source, str(path), "exec"), mod.__dict__)
    check_main_guarded("building")            # not called from the script's top level: nothing to say
    monkeypatch.setitem(sys.modules, "__main__", types.ModuleType("__main__"))
    check_main_guarded("building")            # an interactive __main__: nothing to tell


def test_a_role_process_importing_the_main_script_refuses_to_start_roles(monkeypatch):
    """What a role process says if a loader is still built while it imports the main module (the check
    above could not see it): its own clear error, not multiprocessing's bootstrapping one."""
    import multiprocessing

    from torchdata_overlord.runtime import rpc_session

    monkeypatch.setattr(multiprocessing.current_process(), "_inheriting", True, raising=False)
    with pytest.raises(ol.ConfigError, match=r"while a role process was importing the main module.*under "
                                             r"`if __name__ == \"__main__\":`"):
        rpc_session.prestart_fork_server()
