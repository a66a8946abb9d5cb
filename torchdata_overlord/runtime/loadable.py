"""Preflight: can a role process load this object? Checked before any role process starts.

The rpc runtime pickles the strategy and every source's transform to role processes. A pickle
names functions and classes by module and name, and a role process imports the trainer's main
script the way ``multiprocessing`` does: under another name, without running its
``if __name__ == "__main__":`` block. So a strategy defined in that block pickles fine here and
then fails there, deep in a nested RPC traceback. This module finds every function and class the
pickle refers to (one pickling pass, no new interpreter) and reads the main script's syntax tree
to see whether each ``__main__`` name is bound outside the guard: a function whose code lies in a guarded
block is refused whatever else the script binds to its name, and the names of a ``from module import *``
outside the guard are read from that module (imported here already). A main module multiprocessing does not
import again (``python -m pkg``: ``pkg/__main__.py``) can give the roles nothing. For the same reason a script
must build its rpc loader under that guard: :func:`check_main_guarded` says so before anything starts (else every role
process would build one as it imports the script).
"""

from __future__ import annotations

import ast
import importlib.util
import io
import os
import pickle
import sys
import types
from functools import lru_cache

from ..errors import ConfigError

__all__ = ["check_loadable", "check_main_guarded"]


class _RefPickler(pickle.Pickler):
    """A pickler that notes every function and class it saves by name: ``(module, qualname) -> object``."""

    def __init__(self, file):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.refs: dict[tuple[str | None, str], object] = {}

    def reducer_override(self, obj):
        if isinstance(obj, (type, types.FunctionType)):
            self.refs.setdefault((getattr(obj, "__module__", None), obj.__qualname__), obj)
        return NotImplemented


def check_loadable(obj, what: str, must_pickle: bool = True) -> None:
    """Raise :class:`ConfigError` (one line: what to move where) if a role process could not load
    ``obj``: it does not pickle, or it refers to a function or class defined under the main script's
    ``if __name__ == "__main__":`` (or in an interactive ``__main__``, or in a main module role processes
    do not import), or to a module a fresh process cannot import. ``what`` names it in the message
    (``"the strategy"``). ``must_pickle=False``: an object that does not pickle here passes (the start of
    the roles, which pickles it again, says why)."""
    pickler = _RefPickler(io.BytesIO())
    try:
        pickler.dump(obj)
    except Exception as e:          # noqa: BLE001 - any pickling failure: say what to do
        if not must_pickle:
            return
        raise ConfigError(f"runtime='rpc' sends {what} to its role processes, so it must pickle (define it at module "
                          f"level, not as a closure or lambda): {type(e).__name__}: {e}") from e
    for (module, qualname), ref in sorted(pickler.refs.items(), key=lambda kv: str(kv[0])):
        problem = _unloadable(module, qualname, ref)
        if problem:
            raise ConfigError(f"runtime='rpc' cannot send {what} to its role processes: {problem}")


def check_main_guarded(what: str) -> None:
    """Raise :class:`ConfigError` when this call comes from the main script's top level outside its
    ``if __name__ == "__main__":`` block: role processes import that script, so each would run ``what``
    again (and multiprocessing refuses to start processes then). The line judged is the one the script's top
    level stands on, however many functions deep the call is; nothing to check without a script file, or
    from a thread (no frame of the script's top level below it)."""
    main = sys.modules.get("__main__")
    path = _main_path(main)
    if path is None:
        return
    frame = sys._getframe(1)
    top, where = vars(main), os.path.abspath(path)
    while frame is not None and not (frame.f_globals is top and frame.f_code.co_name == "<module>"
                                     and os.path.abspath(frame.f_code.co_filename) == where):   # (not exec'd code)
        frame = frame.f_back
    if frame is None:
        return
    line = frame.f_lineno
    guarded = _guarded_lines(path, os.stat(path).st_mtime_ns)
    if guarded is not None and not any(a <= line <= b for a, b in guarded):
        raise ConfigError(f"{what} is started at the top level of {path} (line {line}), outside "
                          f"`if __name__ == \"__main__\":`; its role processes import that script, so each would "
                          f"start one too: put the code that builds and runs the loader under that guard (keep the "
                          f"strategy and transform definitions at module level)")


def _main_path(main) -> str | None:
    """The file of the main module (None: interactive, or none on disk)."""
    spec = getattr(main, "__spec__", None)
    path = getattr(spec, "origin", None) or getattr(main, "__file__", None)
    return path if path and os.path.isfile(path) else None


@lru_cache(maxsize=8)
def _script_tree(path: str, mtime_ns: int) -> ast.Module | None:
    """A script's syntax tree, parsed once per version of the file (None: unreadable, or it does not parse)."""
    try:
        with open(path, "rb") as f:
            return ast.parse(f.read(), path)
    except (OSError, SyntaxError, ValueError):
        return None


@lru_cache(maxsize=8)
def _guarded_lines(path: str, mtime_ns: int) -> list[tuple[int, int]] | None:
    """The line ranges of a script's ``if __name__ == "__main__":`` bodies (None: its source does not parse)."""
    tree = _script_tree(path, mtime_ns)
    if tree is None:
        return None
    return [(min([node.body[0].lineno] + [d.lineno for d in getattr(node.body[0], "decorator_list", ())]),
             node.body[-1].end_lineno) for node in ast.walk(tree)
            if isinstance(node, ast.If) and _is_main_guard(node.test)]     # (a decorated def starts at its decorator)


def _unloadable(module: str | None, qualname: str, obj=None) -> str | None:
    """Why a fresh role process could not find ``module.qualname`` (None: it can, or we cannot tell)."""
    if module is None:
        return None
    if module != "__main__":
        try:
            found, why = importlib.util.find_spec(module), "no such module on sys.path"
        except ModuleNotFoundError as e:
            found, why = None, str(e)
        except ValueError:                         # no __spec__: made in memory, unless it has a file
            in_memory = getattr(sys.modules.get(module), "__file__", None) is None
            found, why = (None if in_memory else True), "it was made in memory, it has no file"
        except ImportError:                        # a parent failed to import here: not ours to judge
            return None
        if found is None:
            return (f"`{qualname}` comes from module {module!r}, which a new process cannot import ({why}); "
                    f"define it in an importable module")
        return None
    main = sys.modules.get("__main__")
    path = _main_path(main)
    top = qualname.split(".")[0]
    if path is None:
        return (f"`{qualname}` is defined in an interactive `__main__` (no file), which role processes cannot "
                f"import; move `{top}` into a .py module and import it from there")
    run_as = _main_not_imported(main, path)
    if run_as:
        return (f"`{qualname}` is defined in {path}, {run_as}, which role processes do not import (multiprocessing "
                f"does not run it again); move `{top}` into another module and import it from there")
    mtime = os.stat(path).st_mtime_ns
    moved = (f"move `{top}` above the guard, to module level (or into a module the script imports)")
    if _defined_under_guard(obj, path, mtime):     # a function whose code lies in a guarded block
        return (f"`{qualname}` is defined inside `if __name__ == \"__main__\":` in {path}, which role processes "
                f"import without running that block; {moved}")
    outside, guarded, stars = _main_names(path, mtime)
    if outside is None or top in outside:
        return None
    starred = _star_binding(main, stars, top)
    if starred is None:                            # a `*` import we cannot read might bind it
        return None
    module_name, value = starred
    if value is not _MISSING:                      # what the role processes find: that module's, not ours
        for part in qualname.split(".")[1:]:
            value = getattr(value, part, _MISSING)
        if value is obj or obj is None:
            return None
        return (f"`{qualname}` is defined inside `if __name__ == \"__main__\":` in {path}, which role processes "
                f"import without running that block (they would find the `{top}` of `from {module_name} import *` "
                f"instead); {moved}")
    if top in guarded:
        return (f"`{qualname}` is defined inside `if __name__ == \"__main__\":` in {path}, which role processes "
                f"import without running that block; {moved}")
    return None


_MISSING = object()


def _main_not_imported(main, path: str) -> str | None:
    """How the main module was run when role processes do not import it at all (None: they run it as
    ``__mp_main__``, without its guarded block). multiprocessing's ``spawn.prepare`` (fork server and spawn
    alike) skips a package's ``__main__`` (``python -m pkg``) and a script named ``ipython``."""
    name = getattr(getattr(main, "__spec__", None), "name", None)
    if name is not None:
        if name == "__main__" or name.endswith(".__main__"):
            return (f"run as `python -m {name.rsplit('.', 1)[0]}`" if name != "__main__"
                    else "the `__main__.py` of a folder or zip run as a script")
        return None
    if os.path.splitext(os.path.basename(path))[0] == "ipython":
        return "the ipython launcher"
    return None


def _defined_under_guard(obj, path: str, mtime_ns: int) -> bool:
    """Whether ``obj`` is a function whose code is in the main script, on a line of an
    ``if __name__ == "__main__":`` block (whatever the script binds to its name elsewhere)."""
    code = getattr(obj, "__code__", None) if isinstance(obj, types.FunctionType) else None
    if code is None or os.path.abspath(code.co_filename) != os.path.abspath(path):
        return False
    guarded = _guarded_lines(path, mtime_ns)
    return bool(guarded) and any(a <= code.co_firstlineno <= b for a, b in guarded)


def _star_binding(main, stars: tuple, name: str):
    """``(module, value)``: the last ``from module import *`` outside the guard that binds ``name``
    (``_MISSING`` as value: none does); None when one of them cannot be read (not imported here)."""
    package = getattr(main, "__package__", None)
    found: tuple = ("", _MISSING)
    for level, module in stars:
        try:
            full = importlib.util.resolve_name("." * level + (module or ""), package) if level else module
        except (ImportError, ValueError):
            return None
        mod = sys.modules.get(full)
        if mod is None:
            return None
        public = getattr(mod, "__all__", None)
        exported = name in public if public is not None else not name.startswith("_")
        value = getattr(mod, name, _MISSING) if exported else _MISSING
        if value is not _MISSING:
            found = (full, value)
    return found


@lru_cache(maxsize=8)
def _main_names(path: str, mtime_ns: int) -> tuple[frozenset | None, frozenset, tuple]:
    """Names a script binds at module level outside / inside its ``if __name__ == "__main__":``
    blocks (``None`` outside when its source cannot be read), and the ``(level, module)`` of each
    ``from module import *`` outside them, in order (what else they bind is read from the modules)."""
    tree = _script_tree(path, mtime_ns)
    if tree is None:
        return None, frozenset(), ()
    outside: set[str] = set()
    guarded: set[str] = set()
    stars: list[tuple[int, str | None]] = []

    def visit(stmts, names: set[str]) -> None:
        for node in stmts:
            if isinstance(node, ast.If) and _is_main_guard(node.test):
                visit(node.body, guarded)
                visit(node.orelse, names)          # the else branch runs on import
            elif isinstance(node, (ast.If, ast.For, ast.AsyncFor, ast.While, ast.With, ast.AsyncWith)):
                for t in [getattr(node, "target", None)] + [i.optional_vars for i in getattr(node, "items", [])]:
                    _targets(t, names)
                visit(node.body, names)
                visit(getattr(node, "orelse", []), names)
            elif isinstance(node, ast.Try) or type(node).__name__ == "TryStar":
                visit(node.body, names)
                for h in node.handlers:
                    if h.name:
                        names.add(h.name)
                    visit(h.body, names)
                visit(node.orelse, names)
                visit(node.finalbody, names)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Assign):
                for t in node.targets:
                    _targets(t, names)
            elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
                _targets(node.target, names)
            elif isinstance(node, ast.Import):
                names.update(a.asname or a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                for a in node.names:
                    if a.name == "*":
                        if names is outside:
                            stars.append((node.level, node.module))
                    else:
                        names.add(a.asname or a.name)

    visit(tree.body, outside)
    return frozenset(outside), frozenset(guarded), tuple(stars)


def _targets(node, names: set[str]) -> None:
    """The plain names an assignment target binds."""
    if isinstance(node, ast.Name):
        names.add(node.id)
    elif isinstance(node, (ast.Tuple, ast.List)):
        for elt in node.elts:
            _targets(elt, names)
    elif isinstance(node, ast.Starred):
        _targets(node.value, names)


def _is_main_guard(test) -> bool:
    """``__name__ == "__main__"`` (either way round)."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = [test.left, test.comparators[0]]
    return (any(isinstance(s, ast.Name) and s.id == "__name__" for s in sides)
            and any(isinstance(s, ast.Constant) and s.value == "__main__" for s in sides))
