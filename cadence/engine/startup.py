"""A worker's cold start, said and remembered: compiled kernels kept across restarts, and how long the start took.

A fresh GPU machine compiles for minutes before a model with ``torch.compile`` serves its first frame (every
elementwise op, the decoder's convs, the CUDA graphs captured after them); a restart used to pay it again when
inductor's default cache (``/tmp/torchinductor_<user>``) had been cleared with ``/tmp``. Two things here:

* **One cache folder per user** (:func:`use_compile_cache`): inductor's FX-graph and AOT-autograd caches
  (``TORCHINDUCTOR_CACHE_DIR``) and Triton's kernel cache (``TRITON_CACHE_DIR``) under
  ``$CADENCE_CACHE_DIR`` (default ``$XDG_CACHE_HOME/cadence``, else ``~/.cache/cadence``): ``compile/inductor``
  and ``compile/triton``. Set only where the variable is unset (a value the operator chose wins), before the
  engine is built (``cadence.engine.build.build_engine``). A second start of the same recipe on the same
  machine then loads the compiled kernels instead of generating them (dynamo still traces: seconds).
* **The start said in the log** (:func:`announce`, :func:`remember`; the worker calls them around its build
  and warm-up): what it will do and how long it took last time on this machine for the same model, device
  and fast path (``starts.json`` in the cache folder), or that no earlier start is on record (a first start
  compiles everything: minutes on a GPU for a model with ``--compile``); then what each phase took (build,
  warm-up and its first stream: the compile), written back for the next start.

Torch is read only for the device's name and version (both passed in by the caller); this module is plain
Python over files, so it is tested on the CPU (tests/test_engine_flashhead.py).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import MutableMapping
from pathlib import Path

log = logging.getLogger("cadence.startup")

RECORDS = "starts.json"
KEEP = 32  # start records kept (the most recent)


def cache_root(env: MutableMapping[str, str] | None = None) -> Path:
    """``$CADENCE_CACHE_DIR``, else ``$XDG_CACHE_HOME/cadence``, else ``~/.cache/cadence``."""
    env = os.environ if env is None else env
    if env.get("CADENCE_CACHE_DIR"):
        return Path(env["CADENCE_CACHE_DIR"]).expanduser()
    base = Path(env["XDG_CACHE_HOME"]).expanduser() if env.get("XDG_CACHE_HOME") else Path.home() / ".cache"
    return base / "cadence"


def use_compile_cache(env: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Point torch.compile's caches at the per-user folder where they are not set already; returns every cache
    variable's value now (what the compiles of this process use)."""
    env = os.environ if env is None else env
    root = cache_root(env) / "compile"
    wanted = {
        "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"),
        "TRITON_CACHE_DIR": str(root / "triton"),
        "TORCHINDUCTOR_FX_GRAPH_CACHE": "1",
        "TORCHINDUCTOR_AUTOGRAD_CACHE": "1",
    }
    for k, v in wanted.items():
        if not env.get(k):
            env[k] = v
    return {k: env[k] for k in wanted}


def start_key(recipe, device_name: str, torch_version: str) -> str:
    """What makes two starts comparable: the model and its geometry, the fast path, the device kind, torch."""
    d = recipe.describe().as_dict()
    what = {k: d[k] for k in ("model", "tp", "fast", "decoder", "geometry", "warmup", "warmup_chunks")}
    what.update(device=device_name, torch=torch_version)
    digest = hashlib.blake2b(json.dumps(what, sort_keys=True).encode(), digest_size=8).hexdigest()
    return f"{recipe.model}|{device_name}|{digest}"


def _load(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def announce(recipe, device_name: str, torch_version: str, env=None) -> dict | None:
    """Log what the start will do and, from the last start of the same key on this machine, how long it took;
    returns that record (None: no earlier start on record)."""
    root = cache_root(env)
    rec = _load(root / RECORDS).get(start_key(recipe, device_name, torch_version))
    compiles = bool(recipe.fast.compile or recipe.fast.decoder_fast not in ("off", "cl"))
    what = f"{recipe.model} on {recipe.device} ({device_name})"
    if rec:
        log.info(
            "start: %s: the last start here took %.0f s to be ready (build %.0f s, warm-up %.0f s); compiled "
            "kernels are cached in %s, so expect less where they still apply",
            what,
            rec["ready_s"],
            rec["build_s"],
            rec["warmup_s"],
            root / "compile",
        )
    elif compiles and str(recipe.device).startswith("cuda"):
        log.info(
            "start: %s: no earlier start on record here; torch.compile builds every kernel during the warm-up "
            "(minutes on a GPU the first time; kept in %s for the next start)",
            what,
            root / "compile",
        )
    else:
        log.info("start: %s: no earlier start on record here (nothing is compiled: seconds)", what)
    return rec


def remember(
    recipe, device_name: str, torch_version: str, build_s: float, warmup: dict | None, env=None
) -> dict:
    """Log what the start took, phase by phase, and keep it for the next start's estimate. Returns the record."""
    warm = warmup or {}
    warmup_s = (warm.get("ms") or 0.0) / 1e3
    rec = {
        "build_s": round(build_s, 1),
        "warmup_s": round(warmup_s, 1),
        "first_stream_s": round((warm.get("first_stream_ttff_ms") or 0.0) / 1e3, 1),
        "ready_s": round(build_s + warmup_s, 1),
        "at": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    log.info(
        "start: %s ready in %.1f s: build %.1f s, warm-up %.1f s (its first stream, where kernels compile, "
        "%.1f s to its first frame)",
        recipe.model,
        rec["ready_s"],
        rec["build_s"],
        rec["warmup_s"],
        rec["first_stream_s"],
    )
    root = cache_root(env)
    path = root / RECORDS
    try:
        root.mkdir(parents=True, exist_ok=True)
        data = _load(path)
        data[start_key(recipe, device_name, torch_version)] = rec
        data = dict(sorted(data.items(), key=lambda kv: kv[1].get("at", ""))[-KEEP:])
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(path)
    except OSError as e:  # a read-only home: the estimate is lost, nothing else
        log.warning("start: could not keep the start record in %s (%s)", path, e)
    return rec
