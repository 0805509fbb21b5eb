"""No module writes another object's private attribute: a write to ``obj._x`` where ``obj`` is
not ``self`` or ``cls`` (plain, augmented, annotated, in a tuple, or ``setattr(obj, "_x",
...)``) means one object reaches into another; the owner offers a method instead. torch's own
``_ddp_*`` attributes (set on modules and parameters as torch DDP sets them) and dunders
(``__name__``) are exempt. Every ``fastcomm/**/*.py`` is read (an AST walk, nothing imported).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "fastcomm"

#: Writes kept for good: (file, attribute, why). At most 5.
ALLOWED: tuple[tuple[str, str, str], ...] = (
    ("fastcomm/comm/c10d/group.py", "_timeout",
     "torch's ProcessGroupNCCL.Options has no public timeout field; torch sets `_timeout` "
     "itself (distributed_c10d)"),
    ("fastcomm/ddp/ddp.py", "_active_ddp_module",
     "torch's DistributedDataParallel._active_ddp_module, which Dynamo's DDPOptimizer reads; "
     "torch DDP sets it the same way around its module's call"),
)

def _private(name: str) -> bool:
    return (name.startswith("_") and not name.startswith("_ddp_")
            and not (name.startswith("__") and name.endswith("__")))


def _foreign(target: ast.expr) -> str | None:
    """The attribute `target` writes when it is another object's private one, else ``None``."""
    if not isinstance(target, ast.Attribute) or not _private(target.attr):
        return None
    owner = target.value
    if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
        return None
    return target.attr


def _targets(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        found = list(node.targets)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        found = [node.target]
    else:
        return []
    flat = []
    while found:
        t = found.pop()
        if isinstance(t, (ast.Tuple, ast.List)):
            found.extend(t.elts)
        elif isinstance(t, ast.Starred):
            found.append(t.value)
        else:
            flat.append(t)
    return flat


def _setattr(node: ast.AST) -> str | None:
    """The attribute of ``setattr(obj, "_x", ...)`` on another object, else ``None``."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id == "setattr" and len(node.args) >= 2):
        return None
    owner, name = node.args[0], node.args[1]
    if not (isinstance(name, ast.Constant) and isinstance(name.value, str)
            and _private(name.value)):
        return None
    if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
        return None
    return name.value


def foreign_writes(source: str) -> list[tuple[int, str]]:
    """``(line, attribute)`` of every write in `source` to another object's private
    attribute."""
    found = []
    for node in ast.walk(ast.parse(source)):
        attr = _setattr(node)
        if attr is not None:
            found.append((node.lineno, attr))
        for target in _targets(node):
            attr = _foreign(target)
            if attr is not None:
                found.append((node.lineno, attr))
    return sorted(found)


def _all_writes() -> list[tuple[str, int, str]]:
    writes = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = path.relative_to(ROOT).as_posix()
        writes += [(name, line, attr)
                   for line, attr in foreign_writes(path.read_text(encoding="utf-8"))]
    return writes


def test_no_module_writes_another_objects_private_attribute():
    known = {(f, a) for f, a, _ in ALLOWED}
    left = [f"{f}:{line} {a}" for f, line, a in _all_writes() if (f, a) not in known]
    assert not left, (
        "writes to another object's private attribute (give the owner a method):\n  "
        + "\n  ".join(left)
    )


def test_the_lists_are_short_and_current():
    assert len(ALLOWED) <= 5
    written = {(f, a) for f, _, a in _all_writes()}
    stale = [(f, a) for f, a, _ in ALLOWED if (f, a) not in written]
    assert not stale, f"entries whose write is gone (remove them): {stale}"
    assert all(why for _, _, why in ALLOWED)


def test_what_counts_as_a_write():
    source = """
class A:
    def f(self, other, cls):
        self._mine = 1
        cls._also_mine = 2
        other._x = 1
        other._y += 1
        other._z: int = 3
        a, (other._t, b) = 1, (2, 3)
        setattr(other, "_s", 4)
        setattr(self, "_own", 5)
        other.public = 6
        other._ddp_ignored = True
        other.__name__ = "f"
        other._d[0] = 7
        x = other._read
"""
    assert foreign_writes(source) == [(6, "_x"), (7, "_y"), (8, "_z"), (9, "_t"), (10, "_s")]
