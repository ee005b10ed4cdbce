"""The import structure: layers import downward only, and no module imports itself back through others.

Every ``import cadence...`` / ``from cadence... import`` in the package is read with ``ast`` (module level and
inside functions alike: a lazy import is still a dependency), mapped onto the layers below, and checked:

* an import from a lower layer to a higher one fails (the layer table is the architecture: docs/architecture.md);
* a cycle between modules fails (at module granularity, lazy imports included);
* the web process's side of the server imports no torch (``cadence.serve.app`` in a fresh interpreter).

Layers, lowest first. Within one layer modules may import each other (acyclically).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import numpy as np

PKG = Path(__file__).resolve().parents[1] / "cadence"

LAYERS: list[set[str]] = [
    {"__init__", "errors", "config", "net", "telemetry"},  # plain data, errors, timing regions, device names
    {"model", "media"},  # the plain model and media in/out
    {"kernels"},  # fast kernels, each beside its PyTorch reference
    {"cache", "quant"},  # the K/V caches and FP8 linears, built on the kernels
    {"runtime"},  # the chunk step, sampler, graphs, compile
    {"engine", "parallel"},  # the one engine and tensor parallelism
    {"serve"},  # the live server (web side and its session logic)
    {"fleet"},  # its groups on a Ray fleet (serve holds a FleetConfig and calls it: no import upward)
    {"devtools"},  # clients that drive the server from outside: WebRTC client, headless browser, test helpers
    {"bench", "train", "eval", "integrations"},  # benchmarks, training, the quality harness, Cadence inside
    #                                                other frameworks (Pipecat): drive everything below
    {"cli", "__main__"},  # the entry point dispatches to everything
]


def _layer_of(top: str) -> int:
    for i, names in enumerate(LAYERS):
        if top in names:
            return i
    raise AssertionError(f"cadence.{top} is in no layer of tests/test_layers.py: add it")


def _module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: Path, name: str) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "cadence"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = pkg.split(".")
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.split(".")[0] != "cadence":
                continue
            out.add(mod)
            for a in node.names:  # `from cadence.engine import spec` imports the module cadence.engine.spec
                sub = f"{mod}.{a.name}"
                if (PKG.parent / Path(*sub.split("."))).with_suffix(".py").is_file():
                    out.add(sub)
    return out - {name}


def _graph() -> dict[str, set[str]]:
    mods = {_module_name(p): p for p in PKG.rglob("*.py")}
    return {m: {i for i in _imports(p, m) if i in mods} for m, p in mods.items()}


def _top(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_every_import_goes_down_the_layers():
    bad = []
    for mod, deps in _graph().items():
        for dep in deps:
            if _layer_of(_top(dep)) > _layer_of(_top(mod)):
                bad.append(
                    f"{mod} (layer {_layer_of(_top(mod))}) imports {dep} (layer {_layer_of(_top(dep))})"
                )
    assert not bad, "upward imports:\n" + "\n".join(sorted(bad))


def test_no_import_cycles():
    graph = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    cycles: list[list[str]] = []
    counter = [0]

    def strong(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    sys.setrecursionlimit(max(10_000, sys.getrecursionlimit()))
    for v in sorted(graph):
        if v not in index:
            strong(v)
    # a package's __init__ re-exporting its submodules is not a cycle with them when the submodules never
    # import the package itself; anything else is
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_layer_table_knows_every_subpackage():
    tops = {_top(_module_name(p)) for p in PKG.rglob("*.py")}
    for t in tops:
        _layer_of(t)


def test_the_web_app_imports_no_torch():
    """One file per process side: the web process (the FastAPI app, the session logic, the worker-group
    proxy) never imports torch; the worker processes do (cadence.engine.worker). The engine's recipe and its
    flag set are torch-free too (the web side resolves its workers' recipes; every command parses its words
    before anything heavy is imported)."""
    code = (
        "import sys, cadence.serve.app, cadence.serve.workers, cadence.serve.session, cadence.serve.config, "
        "cadence.serve.manager, cadence.serve.routes, cadence.serve.guard, cadence.serve.uploads, "
        "cadence.serve.schemas, cadence.serve.connections, cadence.serve.admission, cadence.media.pcm, "
        "cadence.fleet.frontend, cadence.fleet.state, cadence.fleet.group, cadence.engine.recipe, "
        "cadence.engine.flags, cadence.engine.spec, cadence.model.families; "
        "print('torch' in sys.modules); sys.exit(1 if 'torch' in sys.modules else 0)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_an_uploaded_image_is_decoded_without_torch(tmp_path):
    """The upload path too: the header check and the decode of an image (one under the pixel limit, one
    over it) run in the web process, and a first upload used to import torch there (+180 MB of RSS for
    the life of the server, measured on `cadence serve`). The array is what the worker gets: float32
    [3, H, W] in [-1, 1], equal to what ``load_reference_image`` gives the CLI."""
    from PIL import Image

    png = tmp_path / "face.png"
    Image.fromarray(
        (np.arange(40 * 30 * 3, dtype=np.uint32).reshape(40, 30, 3) * 7 % 256).astype(np.uint8)
    ).save(png)
    code = (
        "import sys, types, numpy as np\n"
        "from cadence.serve.guard import ApiError\n"
        "from cadence.serve.uploads import decode_image\n"
        "cfg = types.SimpleNamespace(stream=types.SimpleNamespace(height=16, width=24))\n"
        f"data = open({str(png)!r}, 'rb').read()\n"
        "a = decode_image(data, cfg, 10**6, 10**6)\n"
        "assert a.shape == (3, 16, 24) and a.dtype == np.float32 and -1 <= a.min() < a.max() <= 1, a.shape\n"
        "try:\n"
        "    decode_image(data, cfg, 10**6, 40 * 30 - 1)\n"
        "except ApiError as e:\n"
        "    assert e.status == 413, e.status\n"
        "else:\n"
        "    raise AssertionError('over the pixel limit and decoded')\n"
        "np.save(sys.argv[1], a)\n"
        "sys.exit(1 if 'torch' in sys.modules else 0)\n"
    )
    out_npy = tmp_path / "a.npy"
    out = subprocess.run(
        [sys.executable, "-c", code, str(out_npy)], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stdout + out.stderr
    from cadence.media.image import load_reference_image

    ref = load_reference_image(png, 16, 24).numpy()
    assert np.array_equal(np.load(out_npy), ref)  # what the web side sends is what the CLI loads
