"""``cadence bench step --profile``: every kernel of one (graph-replayed where possible) step, named.

The split of ``cadence bench step`` has six coarse regions and an "elementwise + rest" remainder; this profile
names every kernel instead: it attributes each one to a **part** (linears, FP8 quantisation, self-attention,
text / audio cross-attention, cache writes, q/k norms, norms + modulation, residual adds + gates, row-parallel
bias adds, GELU, the timestep path, patch embedding + head, the audio front end, the sampler, the collectives or
their stand-ins, ...) with its count, time, the work counted for it and its floor (``cadence.bench.floors``
:func:`~cadence.bench.floors.part_work`), so that no unnamed rest is left.

How a kernel gets its part (nothing in ``cadence/model`` knows about any of this):

1. **Labels.** While one eager step runs under ``torch.profiler``, every place that can say what it is says
   it, as a ``record_function`` range: the timing regions (``region("linear")`` etc., through a
   ``SpanRecorder`` subclass that opens ranges instead of events), forward hooks on the modules (blocks,
   self / cross / audio attention, the FFN, row-parallel linears, q/k norms, patch embedding, head, the
   timestep MLPs), the block's elementwise ops (the ``ops`` seam wrapped), and a few methods of this run's
   model and session (``forward_chunk``, ``time_embedding``, ``embed_audio``, ``prepare_step``, the audio
   front end). A kernel's labels are the ranges open on the host when it was launched (chrome trace:
   the launch's correlation id, then the user annotations around the launch on its thread); on the CPU an
   op's labels are those around the op. :func:`part_of` maps labels + kernel name to the part.
2. **The graph-replayed step** (CUDA, ring cache): its kernels carry no host ranges (one graph launch), so
   they take the parts of the labelled eager step's kernels by aligning the two kernel-name sequences in
   order (:func:`align`; a graph replays the kernels of the step it captured, in order); a kernel the
   alignment misses takes the part its name has most often in the eager step. The replay's own wall time
   less the union of its kernels' intervals is named "GPU idle between kernels".
3. **Scale.** A run of some of the layers (``--layers``) scales the parts inside the blocks to all layers
   and leaves the once-per-pass / once-per-chunk parts (timestep path, embedding, head, sampler) as they
   are; ``step_as_scaled_ms`` is the whole profiled step times the layer factor, as ``step_ms`` scales it,
   for reconciliation (the difference is what ``step_ms`` over-counts of the per-pass work).

On the CPU (``--device cpu``, the tiny preset: what CI runs) the "kernels" are the ATen ops of the eager step
(no graphs on the CPU), each with its self time (its time less that of the ops inside it); the host's Python
time between ops is the part "gaps" there ("host (Python) between ops": a CPU profile cannot put it on an op).

Written beside the step JSON as ``<step json>-profile.json`` (schema: :func:`summarise`'s dict).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import tempfile
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import torch

#: part key -> what it is (the order of the printed table)
PARTS = {
    "linear": "linears (block GEMMs)",
    "quant": "FP8 activation quantisation",
    "attention": "self-attention",
    "cross_attention": "text cross-attention",
    "audio_attention": "audio cross-attention",
    "cache": "cache writes (q/k RoPE + FP8 at write)",
    "rope": "RoPE of q/k (whole-sequence path, float32)",
    "rope_table": "RoPE table + ring slot (per chunk)",
    "qk_norm": "q/k RMS norms (local halves)",
    "norm_mod": "norms + modulation (adaLN, affine LN)",
    "res_norm": "residual add + the norm after it (one op)",
    "residual": "residual adds + gates (+ modulation rows)",
    "bias": "row-parallel bias adds (after the sum)",
    "gelu": "GELU",
    "linear_glue": "casts / copies around the linears",
    "attn_glue": "copies inside attention modules",
    "comm": "collectives",
    "timestep": "timestep path (sinusoid, time MLP, projection)",
    "embed_head": "patch embedding, head, (un)patchify, token layout",
    "audio_embed": "audio front end + audio embedding",
    "sampler": "sampler / session (noise, scheduler, bookkeeping)",
    "gaps": "GPU idle between kernels",
    "other": "unnamed",
}
#: parts that run once per pass / chunk whatever the layer count (not scaled by --layers)
PER_STEP = ("timestep", "embed_head", "audio_embed", "sampler", "rope_table")

_GEMM = re.compile(
    r"gemm|gemv|xmma|cutlass|nvjet|scaled_mm|matmul|cublas|splitk|^aten::(mm|addmm|bmm|baddbmm|_scaled_mm|"
    r"addmv|mv|linear)$",
    re.IGNORECASE,
)
_QUANT = re.compile(r"quant", re.IGNORECASE)


@dataclass
class Kernel:
    """One kernel (CUDA) or leaf op (CPU) of a profiled step."""

    name: str
    ms: float
    start: float  # us, trace clock
    labels: tuple[str, ...] = ()
    part: str = "other"
    in_block: bool = False
    graph: bool = False  # launched by a CUDA graph replay (its labels are those of the replay call)


def part_of(labels: tuple[str, ...] | list[str], name: str) -> str:
    """The part of a kernel from the host ranges open at its launch (outer first) and its name."""
    s = set(labels)
    if "region:allreduce" in s or ("region:linear_comm" in s and not _GEMM.search(name)):
        return "comm"
    if "region:quant" in s or ("region:linear" in s and _QUANT.search(name)):
        return "quant"
    for fn, part in (("fn:timestep", "timestep"), ("fn:audio_frontend", "audio_embed")):
        if fn in s:
            return part
    if "fn:audio_embed" in s or "mod:embed" in s or "mod:head" in s:
        return "audio_embed" if "fn:audio_embed" in s else "embed_head"
    if "region:linear" in s or "region:linear_comm" in s:
        return "linear" if _GEMM.search(name) else "linear_glue"
    if "region:attention" in s:
        return (
            "audio_attention"
            if "mod:audio_attn" in s
            else "cross_attention"
            if "mod:cross_attn" in s
            else "attention"
        )
    if "fn:rope" in s:
        return "rope"
    if "fn:begin_chunk" in s:
        return "rope_table"
    if "region:cache" in s:
        return "cache" if "fn:model" in s else "rope_table"
    if "region:bias" in s:
        return "bias"
    return _part_by_scope(s)


def _part_by_scope(s: set) -> str:
    if "op:apply_rope" in s:
        return "rope"
    if s & {"op:sum_squares", "op:rms_scale", "op:rms_norm", "op:sum_squares_pair", "mod:qk_norm"}:
        return "qk_norm"
    if s & {"op:gate_residual_layer_norm", "op:add_layer_norm", "op:add_norm_modulate"}:
        return "res_norm"
    if s & {"op:norm_modulate", "op:layer_norm_cast"}:
        return "norm_mod"
    if "op:gate_residual" in s:
        return "residual"
    for mod, part in (
        ("mod:rowpar", "linear_glue"),
        ("mod:ffn", "gelu"),
        ("mod:self_attn", "attn_glue"),
        ("mod:cross_attn", "attn_glue"),
        ("mod:audio_attn", "attn_glue"),
        ("mod:block", "residual"),
        ("fn:model", "embed_head"),
        ("fn:prepare", "sampler"),
        ("fn:denoise", "sampler"),
    ):
        if mod in s:
            return part
    if any(x == STEP or x.startswith("cadence:replay") for x in s):
        return "sampler"  # the session's own work around the passes (eager, outside every other label)
    return "other"


# ---- labelling ---------------------------------------------------------------------------------------------
class _RangeRecorder:
    """Stands in for ``cadence.telemetry.spans.SpanRecorder`` while active: each region becomes a profiler range
    ``region:<name>`` (no CUDA events)."""

    def __init__(self):
        from cadence.telemetry import spans

        self._spans, self._prev, self._open = spans, None, {}
        self._n = 0

    def __enter__(self):
        self._prev, self._spans._active = self._spans._active, self
        return self

    def __exit__(self, *exc):
        self._spans._active = self._prev

    def open(self, name: str) -> int:
        cm = torch.profiler.record_function(f"region:{name}")
        cm.__enter__()
        self._n += 1
        self._open[self._n] = cm
        return self._n

    def close(self, i: int) -> None:
        self._open.pop(i).__exit__(None, None, None)


class _LabelledOps:
    """A module's elementwise ops (``ops`` seam), each call inside an ``op:<name>`` range."""

    def __init__(self, base):
        self.base = base

    def __getattr__(self, name):
        if name == "base":
            raise AttributeError(name)
        fn = getattr(self.base, name)
        if not callable(fn):
            return fn

        def call(*a, **k):
            with torch.profiler.record_function(f"op:{name}"):
                return fn(*a, **k)

        return call


def _module_label(name: str, mod) -> str | None:
    from cadence.model.dit import Block
    from cadence.model.layers import RMSNorm

    kind = type(mod).__name__
    if isinstance(mod, Block):
        return "block"
    if isinstance(mod, RMSNorm) or kind == "ShardedRMSNorm":
        return "qk_norm"
    if kind == "RowParallelLinear":
        return "rowpar"
    leaf = name.rsplit(".", 1)[-1]
    if leaf in ("self_attn", "cross_attn", "audio_attn", "ffn") and name.startswith("blocks."):
        return leaf
    return {"patch_embed": "embed", "head": "head", "time_embed": "timestep", "time_proj": "timestep"}.get(
        name
    )


class Labels:
    """Everything :func:`part_of` reads, installed on a built model and its session for one profiled step, and
    removed after (``with Labels(model, session): ...``). ``regions=False`` leaves the timing regions alone:
    a graph-replayed step must not see an active recorder (``cadence.runtime.graphs.GraphRunner`` runs
    eagerly while one is: its events could not be captured), and its graph's kernels take their parts from
    the eager step anyway; the session's own eager work keeps its method labels."""

    def __init__(self, model, session=None, regions: bool = True):
        self.model, self.session, self.regions = model, session, regions
        self._undo: list = []

    def __enter__(self) -> Labels:
        for name, mod in self.model.named_modules():
            label = _module_label(name, mod)
            if label is not None:
                self._hook(mod, f"mod:{label}")
            if hasattr(mod, "ops") and not isinstance(mod.ops, _LabelledOps):
                self._swap(mod, "ops", _LabelledOps(mod.ops))
        wraps = [(self.model, "forward_chunk", "fn:model"), (self.model, "time_embedding", "fn:timestep")]
        wraps.append((self.model, "forward_full", "fn:model"))  # a clip step (FlashTalk) runs whole clips
        wraps.append((self.model, "embed_audio", "fn:audio_embed"))
        if self.session is not None:
            s = self.session
            wraps += [(s, "prepare_step", "fn:prepare"), (s, "_audio_feats", "fn:audio_frontend")]
            wraps.append((s, "denoise", "fn:denoise"))
            if getattr(s, "cache", None) is not None:
                wraps.append((s.cache, "begin_chunk", "fn:begin_chunk"))
        import cadence.model.full as full  # its attend's RoPE (a module function: labelled where it is looked up)

        wraps.append((full, "apply_rope", "fn:rope"))
        for obj, attr, label in wraps:
            if hasattr(obj, attr):
                self._wrap(obj, attr, label)
        self._rec = _RangeRecorder().__enter__() if self.regions else None
        return self

    def __exit__(self, *exc) -> None:
        if self._rec is not None:
            self._rec.__exit__(*exc)
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()

    def _hook(self, mod, label: str) -> None:
        stack: list = []

        def pre(m, args):
            cm = torch.profiler.record_function(label)
            cm.__enter__()
            stack.append(cm)

        def post(m, args, out):
            if stack:
                stack.pop().__exit__(None, None, None)

        h1 = mod.register_forward_pre_hook(pre)
        h2 = mod.register_forward_hook(post, always_call=True)
        self._undo += [h1.remove, h2.remove]

    def _swap(self, obj, attr: str, value) -> None:
        old = getattr(obj, attr)
        setattr(obj, attr, value)
        self._undo.append(lambda: setattr(obj, attr, old))

    def _wrap(self, obj, attr: str, label: str) -> None:
        fn = getattr(obj, attr)
        had = attr in vars(obj)

        def wrapped(*a, **k):
            with torch.profiler.record_function(label):
                return fn(*a, **k)

        obj.__dict__[attr] = wrapped

        def undo():
            if had:
                obj.__dict__[attr] = fn
            else:
                obj.__dict__.pop(attr, None)

        self._undo.append(undo)


# ---- reading a chrome trace ----------------------------------------------------------------------------------
_LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
_KERNEL_CATS = ("kernel", "gpu_memset", "gpu_memcpy")


@dataclass
class Trace:
    """The events of one profiler run this module reads: user annotations (per thread, outer first when
    starting together), kernels (CUDA) with the CPU time and thread of their launch, or CPU ops."""

    annotations: dict = field(default_factory=dict)  # tid -> [(ts, end, name)]
    kernels: list = field(default_factory=list)  # [(ts, dur, name, launch_ts, launch_tid, launch name)]
    ops: dict = field(default_factory=dict)  # tid -> [(ts, end, name)]


def read_trace(prof) -> Trace:
    """The profile's chrome trace (exported to a temporary file and parsed: a stable, documented format)."""
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as fh:
            events = json.load(fh).get("traceEvents", [])
    finally:
        os.unlink(path)
    tr, launches = Trace(), {}
    for e in events:
        if e.get("ph") != "X":
            continue
        cat, ts, dur = e.get("cat", ""), float(e.get("ts", 0.0)), float(e.get("dur", 0.0))
        if cat == "user_annotation":
            tr.annotations.setdefault(e.get("tid"), []).append((ts, ts + dur, e.get("name", "")))
        elif cat == "cpu_op":
            tr.ops.setdefault(e.get("tid"), []).append((ts, ts + dur, e.get("name", "")))
        elif cat in _LAUNCH_CATS and "correlation" in e.get("args", {}):
            launches[e["args"]["correlation"]] = (ts, e.get("tid"), e.get("name", ""))
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in _KERNEL_CATS:
            lt, tid, how = launches.get(e.get("args", {}).get("correlation"), (None, None, ""))
            tr.kernels.append((float(e["ts"]), float(e.get("dur", 0.0)), e.get("name", ""), lt, tid, how))
    tr.kernels.sort(key=lambda k: k[0])
    for d in (tr.annotations, tr.ops):
        for v in d.values():
            v.sort(key=lambda a: (a[0], -a[1]))
    return tr


def labels_at(annotations: list, times: list[float]) -> list[tuple[str, ...]]:
    """For each of `times` (one thread's), the names of the annotations open then, outer first (a sweep:
    annotations of one thread nest)."""
    order = sorted(range(len(times)), key=lambda i: times[i])
    out: list[tuple[str, ...]] = [()] * len(times)
    stack: list = []
    j = 0
    for i in order:
        t = times[i]
        while j < len(annotations) and annotations[j][0] <= t:
            while stack and stack[-1][1] < annotations[j][0]:
                stack.pop()
            stack.append(annotations[j])
            j += 1
        while stack and stack[-1][1] < t:
            stack.pop()
        out[i] = tuple(a[2] for a in stack if a[0] <= t <= a[1])
    return out


def self_times(ops: list) -> list:
    """The ops of one thread, each as (start, self ms, name): its duration less that of the ops directly inside
    it (ATen ops nest: ``aten::linear`` > ``aten::addmm`` > ...; the self times of a thread's ops add up to the
    time of its outermost ones)."""
    selfs = [(o[1] - o[0]) for o in ops]
    stack: list[int] = []
    for i, (ts, _end, _) in enumerate(ops):
        while stack and ops[stack[-1]][1] < ts:
            stack.pop()
        if stack and ts <= ops[stack[-1]][1]:
            selfs[stack[-1]] -= ops[i][1] - ops[i][0]
        stack.append(i)
    return [(o[0], max(0.0, d) / 1e3, o[2]) for o, d in zip(ops, selfs)]


def _within(labels: tuple[str, ...], name: str) -> bool:
    return name in labels


def labelled_kernels(tr: Trace, step: str) -> list[Kernel]:
    """The kernels (CUDA) or leaf ops (CPU) launched inside the annotation `step`, each with its labels and
    part, in start order."""
    out: list[Kernel] = []
    if tr.kernels:
        by_tid: dict = defaultdict(list)
        for k in tr.kernels:
            if k[3] is not None:
                by_tid[k[4]].append(k)
        for tid, ks in by_tid.items():
            labs = labels_at(tr.annotations.get(tid, []), [k[3] for k in ks])
            out += [
                Kernel(k[2], k[1] / 1e3, k[0], lab, graph="Graph" in k[5])
                for k, lab in zip(ks, labs)
                if _within(lab, step)
            ]
    else:
        for tid, ops in tr.ops.items():
            own = self_times(ops)
            labs = labels_at(tr.annotations.get(tid, []), [o[0] for o in own])
            out += [Kernel(o[2], o[1], o[0], lab) for o, lab in zip(own, labs) if _within(lab, step)]
    out.sort(key=lambda k: k.start)
    for k in out:
        k.part = part_of(k.labels, k.name)
        k.in_block = "mod:block" in k.labels
    return out


def annotation_span(tr: Trace, name: str) -> tuple[float, float] | None:
    for anns in tr.annotations.values():
        for ts, end, n in anns:
            if n == name:
                return ts, end
    return None


# ---- graph kernels take the eager step's parts ---------------------------------------------------------------
def align(a: list[str], b: list[str], window: int = 64) -> list[int | None]:
    """For each name of `b`, the index of the name of `a` it matches, or None: a greedy walk down both sequences
    that re-synchronises after an insertion or deletion of up to `window` names (the graph's kernels are the
    captured step's, in order, so the sequences agree almost everywhere; O(len x window))."""
    out: list[int | None] = [None] * len(b)
    i = j = 0
    while i < len(a) and j < len(b):
        if a[i] == b[j]:
            out[j] = i
            i, j = i + 1, j + 1
            continue
        skip = None
        for k in range(1, window):
            if i + k < len(a) and a[i + k] == b[j]:
                skip = ("a", k)
                break
            if j + k < len(b) and b[j + k] == a[i]:
                skip = ("b", k)
                break
        if skip is None:
            i, j = i + 1, j + 1
        elif skip[0] == "a":
            i += skip[1]
        else:
            j += skip[1]
    return out


def attribute_graph(graph_ks: list[Kernel], eager_ks: list[Kernel]) -> dict:
    """Give the graph-launched kernels of a replayed step the parts (and labels) of the labelled eager step's
    kernels they align with; the rest the most common part of their name there (else "other"). Returns how
    many were matched by position / by name / not at all."""
    ref = [k for k in eager_ks if "fn:denoise" in k.labels] or eager_ks
    g = [k for k in graph_ks if k.graph]
    idx = align([k.name for k in ref], [k.name for k in g])
    votes: dict = defaultdict(Counter)
    for k in ref:
        votes[k.name][(k.part, k.in_block)] += 1
    stats = Counter()
    for k, i in zip(g, idx):
        if i is not None:
            src = ref[i]
            k.part, k.in_block, k.labels = src.part, src.in_block, src.labels
            stats["by_position"] += 1
        elif votes.get(k.name):
            k.part, k.in_block = votes[k.name].most_common(1)[0][0]
            stats["by_name"] += 1
        else:
            k.part = "other"
            stats["unmatched"] += 1
    return dict(stats)


# ---- running the profiles ------------------------------------------------------------------------------------
STEP = "cadence:step"


def primed_stream(sess, audio, device: torch.device):
    """A new stream for a capture, with one eager step run on it first: lazy per-stream library state
    (cuBLAS workspaces) must exist before the capture."""
    stream = torch.cuda.Stream(device=device)
    cur = torch.cuda.current_stream(device)
    stream.wait_stream(cur)
    with torch.cuda.stream(stream):
        sess.step(audio)
    cur.wait_stream(stream)
    return stream


def _profiler(device: torch.device):
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(activities=acts)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def eager_profile(run, device: torch.device, model, sess=None) -> tuple[list[Kernel], float]:
    """One labelled eager step (``run()``) under the profiler: its kernels (ops on the CPU) with parts, and its
    wall ms. `sess`: the session whose methods are labelled too (None: a clip step without one)."""
    with Labels(model, sess):
        _sync(device)
        with _profiler(device) as prof:
            with torch.profiler.record_function(STEP):
                run()
            _sync(device)
    tr = read_trace(prof)
    ks = labelled_kernels(tr, STEP)
    span = annotation_span(tr, STEP)
    if device.type == "cuda" and ks:
        wall = (max(k.start + k.ms * 1e3 for k in ks) - ks[0].start) / 1e3
    else:
        wall = (span[1] - span[0]) / 1e3 if span else sum(k.ms for k in ks)
    return ks, wall


def graph_profile(sess, audio, device, model, group=None, replays: int = 3) -> tuple[list, str | None]:
    """`replays` graph-replayed steps under the profiler (labels on, for the eager work around the replay):
    a list of (kernels, wall ms) per replay, or ([], why) when no graph could be captured or the profiler saw
    none of its kernels. The graph is captured before the profiler starts; where the profiler then sees no
    kernel of its replays, it is captured again with the profiler running (what some CUPTI versions need)."""
    from cadence.parallel.graphs import agreeing_capture
    from cadence.runtime.graphs import GraphRunner

    why = None
    for inside in (False, True):
        stream = primed_stream(sess, audio, device)
        runner = GraphRunner(
            max_graphs=1, warmup=1, max_captures_per_key=1, capture=agreeing_capture(group, stream=stream)
        )
        prof = _profiler(device) if inside else None
        try:
            if prof is not None:
                prof.start()
            for _ in range(2):  # the runner's eager warm-up, then the capture (and its first replay)
                sess.step(audio, runner=runner)
            if not runner.stats.captures:
                if prof is not None:
                    prof.stop()
                return [], f"no graph captured ({runner.last})"
            replay = functools.partial(sess.step, audio, runner=runner)
            out, why = replay_profile(replay, device, model, sess, replays, prof)
        finally:
            runner.clear()
        if out:
            return out, None
    return [], why


def replay_profile(replay, device, model, sess, replays: int, prof=None) -> tuple[list, str | None]:
    """`replays` calls of `replay` (a step that replays a CUDA graph), each inside ``cadence:replay<i>``, under
    the profiler (`prof`: one already running, else a new one): (kernels, wall ms) per replay."""
    with Labels(model, sess, regions=False):
        _sync(device)
        with contextlib.nullcontext(prof) if prof is not None else _profiler(device) as p:
            for i in range(replays):
                with torch.profiler.record_function(f"cadence:replay{i}"):
                    replay()
            _sync(device)
    if prof is not None:
        prof.stop()
    tr = read_trace(p)
    out = []
    for i in range(replays):
        ks = labelled_kernels(tr, f"cadence:replay{i}")
        if not any(k.graph for k in ks):
            return [], "the profiler saw no kernel of the graph replays (CUPTI)"
        out.append((ks, (max(k.start + k.ms * 1e3 for k in ks) - ks[0].start) / 1e3))
    return out, None


# ---- the summary ---------------------------------------------------------------------------------------------
def _idle(ks: list[Kernel], wall_ms: float, scale: float, cpu: bool) -> tuple[float, float]:
    """(idle ms between the kernels' intervals in the step, the same with idle inside the blocks scaled):
    the wall less the union of the kernels' intervals. On the CPU (ops, by self time): the wall less the ops'
    time, i.e. the host's Python between ops, scaled by the blocks' share of the op time."""
    if not ks:
        return wall_ms, wall_ms
    if cpu:
        tot = sum(k.ms for k in ks)
        idle = max(0.0, wall_ms - tot)
        share = sum(k.ms for k in ks if k.in_block) / tot if tot > 0 else 0.0
        return idle, idle * (share * scale + 1 - share)
    idle = scaled = 0.0
    end = ks[0].start + ks[0].ms * 1e3
    prev = ks[0]
    for k in ks[1:]:
        gap = max(0.0, k.start - end) / 1e3
        idle += gap
        scaled += gap * (scale if prev.in_block and k.in_block else 1.0)
        end = max(end, k.start + k.ms * 1e3)
        prev = k
    busy = (end - ks[0].start) / 1e3 - idle  # the union
    tail = max(0.0, wall_ms - busy - idle)  # the step's wall beyond the kernels (host work at its ends)
    return idle + tail, scaled + tail


def summarise(ks: list[Kernel], wall_ms: float, scale: float, floors: dict | None, mode: str) -> dict:
    """Per part: kernels (count), ms (scaled to all layers: parts inside the blocks x `scale`), share of the
    profiled step, the work counted and its floor, the part's five costliest kernel names; plus the idle time
    between kernels as the part "gaps", and the checks (unnamed share, coverage)."""
    parts: dict = {}
    for p, title in PARTS.items():
        if p == "gaps":
            continue
        sel = [k for k in ks if k.part == p]
        ms = sum(k.ms * (scale if k.in_block else 1.0) for k in sel)
        names: dict = defaultdict(lambda: [0, 0.0])
        for k in sel:
            names[k.name][0] += 1
            names[k.name][1] += k.ms * (scale if k.in_block else 1.0)
        top = sorted(names.items(), key=lambda kv: -kv[1][1])[:5]
        parts[p] = {
            "title": title,
            "count": sum(scale if k.in_block else 1.0 for k in sel),
            "ms": ms,
            "top": [{"name": n[:160], "count": c, "ms": t} for n, (c, t) in top],
        }
    idle, idle_scaled = _idle(ks, wall_ms, scale, mode == "cpu")
    title = "host (Python) between ops" if mode == "cpu" else PARTS["gaps"]
    parts["gaps"] = {"title": title, "count": 0, "ms": idle_scaled, "top": []}
    total = sum(v["ms"] for v in parts.values())
    for p, v in parts.items():
        v["share"] = v["ms"] / total if total > 0 else 0.0
        f = (floors or {}).get(p)
        v["floor_ms"] = f["floor_ms"] if f else (0.0 if p == "gaps" else None)
        v["work"] = {"amount": f["amount"], "unit": f["unit"], "at": f["at"]} if f else None
        v["floor_over_ms"] = (v["floor_ms"] / v["ms"]) if v["floor_ms"] is not None and v["ms"] > 0 else None
    kernel_ms = sum(k.ms for k in ks)
    return {
        "mode": mode,
        "parts": parts,
        "step_ms": total,
        "step_as_scaled_ms": wall_ms * scale,
        "wall_unscaled_ms": wall_ms,
        "kernels_unscaled": len(ks),
        "kernel_ms_unscaled": kernel_ms,
        "idle_unscaled_ms": idle,
        "unnamed_share": parts["other"]["ms"] / total if total > 0 else 0.0,
        "unnamed_share_of_kernels": (
            sum(k.ms for k in ks if k.part == "other") / kernel_ms if kernel_ms > 0 else 0.0
        ),
        "scale": scale,
        "per_step_parts": list(PER_STEP),
    }


def profile_step(sess, audio, device: torch.device, model, *, graphs: bool, scale: float, floors: dict | None,
                 group=None, replays: int = 3) -> dict:  # fmt: skip
    """The profile of module docstring: the labelled eager step, then (with `graphs`) `replays` graph-replayed
    steps whose kernels take the eager step's parts; the summary of the median replay (by wall) with every
    replay's part times beside it."""
    eager, eager_wall = eager_profile(lambda: sess.step(audio), device, model, sess)
    mode = "cpu" if device.type != "cuda" else "eager"
    why = None if graphs else "graphs off"
    runs = []
    if graphs:
        runs, why = graph_profile(sess, audio, device, model, group, replays)
    out_eager = summarise(eager, eager_wall, scale, floors, mode)
    if not runs:
        out_eager["graph_unavailable"] = why
        return out_eager
    return _graph_summary(runs, eager, out_eager, scale, floors)


def _graph_summary(runs: list, eager: list, out_eager: dict, scale: float, floors: dict | None) -> dict:
    """The median replay's summary (parts from the eager kernels), every replay's part times beside it."""
    summaries = []
    for ks, wall in runs:
        match = attribute_graph(ks, eager)
        s = summarise(ks, wall, scale, floors, "graph")
        s["attribution"] = match
        summaries.append(s)
    summaries.sort(key=lambda s: s["wall_unscaled_ms"])
    best = summaries[len(summaries) // 2]
    best["replays"] = {p: [s["parts"][p]["ms"] for s in summaries] for p in best["parts"]}
    best["replay_walls_unscaled_ms"] = [s["wall_unscaled_ms"] for s in summaries]
    best["eager"] = {p: v["ms"] for p, v in out_eager["parts"].items()}
    best["eager_step_ms"] = out_eager["step_ms"]
    return best


def profile_run(run, device: torch.device, model, *, scale: float, floors: dict | None, replay=None) -> dict:
    """The profile of a step given as callables (a clip step: no session): the labelled eager `run`, and where
    `replay` (a captured graph's replay) is given, the replays with the eager kernels' parts."""
    ks, wall = eager_profile(run, device, model)
    out = summarise(ks, wall, scale, floors, "cpu" if device.type != "cuda" else "eager")
    if replay is None:
        out["graph_unavailable"] = "no graph of the clip (eager)"
        return out
    runs, why = replay_profile(replay, device, model, None, 3)
    if not runs:
        out["graph_unavailable"] = why
        return out
    return _graph_summary(runs, ks, out, scale, floors)


def rows(prof: dict) -> list[tuple[str, str]]:
    """The printed table: one row per part with time."""
    head = f"{'kernels':>9} {'ms':>9} {'share':>6} {'floor ms':>9} {'floor/meas':>10}  costliest kernel"
    out = [(f"part ({prof['mode']})", head)]
    for p, v in sorted(prof["parts"].items(), key=lambda kv: -kv[1]["ms"]):
        if v["ms"] <= 0 and p != "other":
            continue
        fl = "-" if v["floor_ms"] is None else f"{v['floor_ms']:9.2f}"
        ratio = "-" if v["floor_over_ms"] is None else f"{v['floor_over_ms']:10.0%}"
        top = v["top"][0]["name"][:48] if v["top"] else ""
        out.append(
            (
                f"  {v['title'][:44]}",
                f"{v['count']:9.0f} {v['ms']:9.2f} {v['share']:6.1%} {fl:>9} {ratio:>10}  {top}",
            )
        )
    out.append(
        ("  step (parts added)", f"{prof['step_ms']:9.2f} ms; unnamed {prof['unnamed_share']:.1%} of it")
    )
    return out
