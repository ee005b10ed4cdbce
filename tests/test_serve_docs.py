"""What the server's docstrings name is there: lists of code in prose go stale unless a test reads them.

* Every dotted name ``cadence.x.y[.Name[.member]]`` in a docstring of ``cadence/serve``, ``cadence/fleet`` or
  ``cadence/devtools`` (module, class, function) resolves: to a module, a name defined (or imported) at its
  top level, or a member of a class there. Read with ``ast``: nothing is imported.
* The route table of ``cadence.serve.app``'s docstring is the server's routes (``cadence.serve.routes``).
"""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REF = re.compile(r"(?<![\w.])cadence(?:\.[A-Za-z_]\w*)+")


def _module(parts: list[str]) -> Path | None:
    p = ROOT.joinpath(*parts)
    for cand in (p.with_suffix(".py"), p / "__init__.py"):
        if cand.is_file():
            return cand
    return None


def _top_level(tree: ast.Module) -> dict[str, ast.AST]:
    out: dict[str, ast.AST] = {}
    for n in tree.body:
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out[n.name] = n
        elif isinstance(n, ast.Assign):
            out |= {t.id: n for t in n.targets if isinstance(t, ast.Name)}
        elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
            out[n.target.id] = n
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            out |= {(a.asname or a.name).split(".")[0]: n for a in n.names}
    return out


def _members(cls: ast.ClassDef) -> set[str]:
    out = set()
    for n in ast.walk(cls):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(n.name)
        elif isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self":
            out.add(n.attr)
        elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
            out.add(n.id)
    return out


def resolves(ref: str) -> bool:
    parts = ref.split(".")
    for k in range(len(parts), 0, -1):
        path = _module(parts[:k])
        if path is None:
            continue
        rest = parts[k:]
        if not rest:
            return True
        node = _top_level(ast.parse(path.read_text())).get(rest[0])
        if node is None:
            return False
        return len(rest) == 1 or not isinstance(node, ast.ClassDef) or rest[1] in _members(node)
    return False


def test_the_resolver_refuses_what_is_not_there():
    assert resolves("cadence.serve.manager.SessionManager.create_local")
    assert resolves("cadence.serve.ports") and resolves("cadence.fleet")
    assert not resolves("cadence.serve.app.BodyLimit")  # (it moved to cadence.serve.guard)
    assert not resolves("cadence.serve.manager.SessionManager.release_group")
    assert not resolves("cadence.serve.client")


def test_every_code_name_in_the_servers_docstrings_resolves():
    bad = []
    for pkg in ("serve", "fleet", "devtools"):
        for path in sorted((ROOT / "cadence" / pkg).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                for ref in REF.findall(ast.get_docstring(node, clean=False) or ""):
                    if not resolves(ref):
                        bad.append(f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 1)}: {ref}")
    assert not bad, "\n".join(bad)


def test_the_apps_route_table_is_its_routes():
    doc = ast.get_docstring(ast.parse((ROOT / "cadence/serve/app.py").read_text()))
    table = set()
    for line in doc.splitlines():
        m = re.match(r"^\s{4}(GET|POST|DELETE)\s+(/[^\s,]*(?:, /[^\s,]*)*)", line)
        if m:
            table |= {(m.group(1), p.replace("{id}", "{sid}")) for p in m.group(2).split(", ")}
    routes = ast.parse((ROOT / "cadence/serve/routes.py").read_text())
    (assign,) = [n for n in routes.body if isinstance(n, ast.Assign) and n.targets[0].id == "ROUTES"]
    served = {(method, path) for method, path, *_ in ast.literal_eval(assign.value)}
    assert table == served
