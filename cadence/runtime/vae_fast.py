"""Fast paths for the streaming Wan VAE decoder, applied from outside to a built :class:`WanVAE`.

    rep = accelerate_decoder(vae, "compile")      # channels-last + torch.compile of the decoder
    rep = accelerate_decoder(vae, "fold")         # ... + every stride-1 temporal conv as one conv2d
    rep.describe()                                # what applied ('compile: 3 graphs', 'eager: <why>')

Modes (:data:`MODES`), each adding to the one before:

* ``off``: the plain decoder (the reference path).
* ``cl``: the decoder's weights in channels_last(_3d); the activations follow (cuDNN's NHWC kernels; the
  causal memory is kept in the same layout, so the ``cat`` of kept + new frames reads what the next conv
  wants).
* ``compile``: ``torch.compile`` of ``decoder.forward`` (``dynamic=False``: one graph per stream phase,
  i.e. first frame, second call, steady chunk): RMSNorm + SiLU + the causal ``cat`` fuse into one pass
  per conv input; the convs stay cuDNN's heuristic choices.
* ``bench``: ``compile`` + ``torch.backends.cudnn.benchmark`` on CUDA (process-wide; each conv shape is
  timed): faster steady chunks (119.9 -> 97.6 ms per 12-frame Wan 2.1 chunk at 480x832; W1.3 on one H200
  with the full decoder 29.5 -> 30.7 fps), but in the pipeline the first chunk of EVERY stream then took
  1.78 s (ttff 519 -> 1783 ms; docs/perf/vae/NOTES.md). Cause: PyTorch caches cuDNN's plans and timings
  per thread, and the engine made a decode thread per stream; it now keeps one per engine
  (``cadence.engine.engine.DecodeWorker``; in one thread the timings hold from stream to stream,
  docs/perf/pipeline/NOTES.md). Opt-in until the pipeline is measured again.
* ``fold``: every 3x3x3 / 3x1x1 / 1x1x1 temporal-stride-1 causal conv runs as ONE conv2d over
  ``[B * T_out, H, W, kt * C]`` (the kt input frames of each output frame stacked along channels): a 2D
  implicit GEMM with a kt-times deeper reduction instead of cuDNN's conv3d (same math, summation order
  differs).
* ``up`` (instead of ``fold``): ``compile`` + every spatial upsampler's "nearest 2x, then 3x3 conv" as one
  2x2 conv to the four output phases at the LOW resolution, then the phases interleaved: the same math
  with 2.25x fewer multiply-adds in those convs (Wan 2.2 at 704x1088: 7.7 -> 3.4 of 56.4 TFLOP per 4-frame
  chunk; Wan 2.1 at 480x832, 12 frames: 3.4 -> 1.5 of 40.7). Not measured on a GPU yet.
* ``fp8`` (instead of ``fold`` / ``up``): ``compile`` + the up blocks' big convs in FP8 e4m3 with float32
  accumulation (``cadence.kernels.conv_fp8``): every 3x3x3 stride-1 causal conv and every upsampler's 3x3
  conv in ``decoder.up_blocks`` whose input channels are a multiple of 128 and output channels of 16 (the
  residual blocks' convs and the 2D upsampler convs; not the 1x1 shortcuts or the 3x1x1 time convs). The
  mid block (1% of the work, but on a random-weight decoder a fifth of FP8's image error), conv_in and
  conv_out stay bf16. Weights get a scale per output channel, taken now; each conv input one per tensor:
  delayed (default, ``CADENCE_CONV_FP8_SCALE=delayed``: 2x the amax the conv's previous call in the stream
  recorded, clamped to +-448; a stream's first call scales per call; :class:`Fp8Streams`) or per call
  (``call``: an amax pass on the device first), quantised by an opaque op after the norm + SiLU + causal cat that torch.compile
  fuses (``CADENCE_CONV_FP8_QUANT=triton``, the default; ``torch`` lets inductor fuse the quantisation too:
  measured 16 ms slower per chunk). Backend: ``CADENCE_CONV_FP8`` = ``triton`` (default: the implicit-GEMM
  kernel) | ``cudnn`` (cuDNN's FP8 conv fprop, when the ``cudnn`` frontend is installed: measured ~300
  TFLOP/s, 2.5x slower than bf16). An FP8 conv that cannot run (no CUDA, no Triton, sm < 8.9) leaves the
  convs in bf16 with one log line; one that raises at a call falls back to the plain conv for good, one log
  line. Image error vs bf16 / fp32: docs/perf/vae/NOTES.md.

Fallbacks: a mode that cannot apply (no CUDA for ``compile``/``fold`` is fine; a torch.compile that fails at
build or at its first call) logs one line and the decoder carries on with the modes below it. The first
call's failure is caught per call: the stream's causal memory is restored and the call re-run eagerly,
so no frame is lost. Parity with the plain decoder: tests/test_vae_fast.py (CPU, fp32).

Apply after loading weights (``fold`` keeps a folded copy of each conv weight, taken now).
"""

from __future__ import annotations

import logging
import os
import weakref
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from cadence.errors import ConfigError
from cadence.kernels import conv_fp8
from cadence.model.vae import CausalConv3d, Resample, WanVAE, fold_time_weight, subpixel_weight
from cadence.runtime.compile import COMPILE_GATE, input_signature

log = logging.getLogger("cadence.vae")

MODES = ("off", "cl", "compile", "bench", "fold", "up", "fp8")


@dataclass
class DecoderFastReport:
    mode: str
    """The mode asked for."""
    applied: list[str] = field(default_factory=list)
    """What is in effect: 'channels_last', 'fold:<n>' (convs folded), 'cudnn_benchmark', 'compile'."""
    notes: list[str] = field(default_factory=list)
    """One line per thing that could not apply."""

    def describe(self) -> str:
        s = "+".join(self.applied) if self.applied else "plain"
        return s + ("" if not self.notes else " (" + "; ".join(self.notes) + ")")


def channels_last(module: torch.nn.Module) -> None:
    """channels_last_3d for 5D weights, channels_last for 4D (``Module.to(memory_format=...)`` refuses the
    2D convs inside a 3D model)."""
    for p in module.parameters():
        if p.dim() == 5:
            p.data = p.data.contiguous(memory_format=torch.channels_last_3d)
        elif p.dim() == 4:
            p.data = p.data.contiguous(memory_format=torch.channels_last)


def fold_convs(module: torch.nn.Module) -> int:
    """Give every temporal-stride-1 :class:`CausalConv3d` under ``module`` its folded conv2d weight; returns
    how many. Undo with :func:`unfold_convs`."""
    n = 0
    for m in module.modules():
        if isinstance(m, CausalConv3d) and m.stride[0] == 1 and m.padding[0] == 0:
            m.w2d = fold_time_weight(m.weight.detach())
            n += 1
    return n


def subpixel_upsamplers(module: torch.nn.Module) -> int:
    """Give every spatial upsampler under ``module`` its sub-pixel 2x2 weights; returns how many."""
    n = 0
    for m in module.modules():
        if isinstance(m, Resample) and m.mode.startswith("upsample"):
            m.w_subpixel = subpixel_weight(m.resample[1].weight.detach())
            n += 1
    return n


def unfold_convs(module: torch.nn.Module) -> None:
    for m in module.modules():
        if isinstance(m, CausalConv3d):
            m.w2d = None


SCALINGS = ("delayed", "call")


class Fp8Streams:
    """Which stream the delayed activation scales of a decoder's FP8 convs belong to (one per decoder, shared
    by its convs; a forward pre-hook on the decoder, outside torch.compile). ``warm`` is False on a stream's
    first decoder call (``mem.first``: the convs then compute their scales from their inputs, per call) and
    True after, when each conv scales by the amax its previous call in the stream recorded. Streams sharing
    the decoder: on a switch the amax buffers are saved on the old stream's memory and the new stream's
    restored (device copies, no host sync); a stream with none saved scales per call once."""

    def __init__(self, convs: list):
        self.convs = convs
        self.warm = False
        self._owner = None  # weakref to the _Memory whose amax values the buffers hold (not kept alive)

    def __call__(self, _module, args):
        mem = args[1] if len(args) > 1 else None
        owner = None if self._owner is None else self._owner()
        first = mem is None or getattr(mem, "first", True)
        warm = not first and mem is owner
        if mem is not owner:
            bufs = [c.fp8_amax for c in self.convs]
            if owner is not None:
                owner.fp8_amax = [b.clone() for b in bufs]
            saved = None if first else getattr(mem, "fp8_amax", None)
            if saved is not None:
                torch._foreach_copy_(bufs, saved)
                warm = True
            self._owner = None if mem is None else weakref.ref(mem)
        self.warm = warm


class _Fp8Conv:
    """What the FP8 conv classes share: the quantised weight (buffers, not in the state dict), the backend,
    the activation scaling (``fp8_scaling``: 'delayed', the default, or 'call'; ``CADENCE_CONV_FP8_SCALE``)
    with its state (``fp8_amax``, the amax of the last input) and the fall back to the plain conv (for good,
    one log line) when the FP8 conv raises at an eager call. Under torch.compile a raise reaches
    :class:`_GuardedForward`, whose eager re-run lands here."""

    fp8_backend: str = "triton"
    fp8_quant: str | None = os.environ.get("CADENCE_CONV_FP8_QUANT") or None  # None: conv3x3_fp8's default
    fp8_scaling: str = "delayed"
    fp8_streams: Fp8Streams | None = None
    fp8_off: str = ""

    def _fp8_setup(self, backend: str, scaling: str) -> None:
        wq, sw = conv_fp8.quantize_weight(self.weight)
        self.register_buffer("fp8_w", wq, persistent=False)
        self.register_buffer("fp8_sw", sw, persistent=False)
        b = None if self.bias is None else self.bias.detach().float()
        self.register_buffer("fp8_bias", b, persistent=False)
        amax = torch.zeros(1, device=self.weight.device, dtype=torch.float32)
        self.register_buffer("fp8_amax", amax, persistent=False)
        self.fp8_backend = backend
        self.fp8_scaling = scaling

    def _fp8(self, x: torch.Tensor, kt: int, plain, post=None):
        """The FP8 conv of ``x`` [B, C, T_out + kt - 1, H, W] (then ``post``), or ``plain()`` once it failed."""
        streams = self.fp8_streams
        delayed = self.fp8_scaling == "delayed" and streams is not None

        def fp8():
            y = conv_fp8.conv3x3_fp8(
                x,
                self.fp8_w,
                self.fp8_sw,
                self.fp8_bias,
                kt,
                self.fp8_backend,
                self.fp8_quant,
                amax=self.fp8_amax if delayed else None,
                delayed=delayed and streams.warm,
            )
            return y if post is None else post(y)

        if torch.compiler.is_compiling():
            return fp8()
        if self.fp8_off:
            return plain()
        try:
            return fp8()
        except Exception as e:
            self.fp8_off = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
            log.warning(
                "FP8 conv (%s) failed at a call (%s): plain conv from now on", self.fp8_backend, self.fp8_off
            )
            return plain()


class Fp8CausalConv3d(_Fp8Conv, CausalConv3d):
    """A :class:`CausalConv3d` (3x3x3, stride 1) whose conv, after the causal frames are put in front, runs in
    FP8 (``cadence.kernels.conv_fp8``). Made by :func:`fp8_convs` from a built conv (same parameters)."""

    def _conv_forward(self, x, weight, bias):
        return self._fp8(x, 3, lambda: F.conv3d(x, weight, bias, self.stride, self.padding))


class Fp8Conv2d(_Fp8Conv, torch.nn.Conv2d):
    """An upsampler's 3x3 conv (stride 1, padding 1) in FP8: the frames [N, C, H, W] as one clip of N frames
    through the same kernel with a 1-frame temporal kernel."""

    def _conv_forward(self, x, weight, bias):
        return self._fp8(
            x.transpose(0, 1).unsqueeze(0),  # [1, C, N, H, W]: a view of the NHWC frames
            1,
            lambda: F.conv2d(x, weight, bias, self.stride, self.padding),
            post=lambda y: y[0].transpose(0, 1),  # [N, O, H, W] channels_last
        )


def _fp8_kind(m: torch.nn.Module, multiple: int) -> str:
    """'3d' / '2d' when ``m`` is a conv the FP8 path takes, else ''."""
    if isinstance(m, CausalConv3d):
        ok = m.kernel_size == (3, 3, 3) and m.stride == (1, 1, 1) and m.padding == (0, 1, 1) and m.tpad == 2
        kind = "3d"
    elif type(m) is torch.nn.Conv2d:
        ok = m.kernel_size == (3, 3) and m.stride == (1, 1) and m.padding == (1, 1)
        kind = "2d"
    else:
        return ""
    ok = ok and m.groups == 1 and all(d == 1 for d in m.dilation) and m.padding_mode == "zeros"
    return kind if ok and m.in_channels % multiple == 0 and m.out_channels % 16 == 0 else ""


def fp8_convs(
    module: torch.nn.Module,
    backend: str,
    multiple: int | None = None,
    scaling: str | None = None,
    decoder: torch.nn.Module | None = None,
) -> int:
    """Turn every conv under ``module`` the FP8 path takes into :class:`Fp8CausalConv3d` / :class:`Fp8Conv2d`
    (in place: same parameters, quantised copies of the weights as buffers); returns how many. ``multiple``:
    the input channels must be a multiple of it (default: 128 for the Triton kernel's BLOCK_K on GPUs, 16
    under the interpreter and for cuDNN, 1 for the reference). ``scaling``: 'delayed' or 'call' (default:
    ``CADENCE_CONV_FP8_SCALE``, else 'delayed'). Delayed scaling needs the streams of the decoder the convs
    sit in: ``decoder`` (default ``module``) gets an :class:`Fp8Streams` pre-hook; the convs of a decoder
    without one scale per call."""
    if multiple is None:
        multiple = {"reference": 1, "cudnn": 16}.get(backend, 16 if conv_fp8.interpreting() else 128)
    scaling = scaling or os.environ.get("CADENCE_CONV_FP8_SCALE") or "delayed"
    if scaling not in SCALINGS:
        raise ConfigError(f"FP8 activation scaling must be one of {', '.join(SCALINGS)}, got {scaling!r}")
    convs = []
    for m in list(module.modules()):
        kind = _fp8_kind(m, multiple)
        if kind:
            m.__class__ = Fp8CausalConv3d if kind == "3d" else Fp8Conv2d
            m._fp8_setup(backend, scaling)
            convs.append(m)
    if scaling == "delayed" and convs:
        root = module if decoder is None else decoder
        streams = Fp8Streams(convs)
        root.register_forward_pre_hook(streams)
        for m in convs:
            m.fp8_streams = streams
    return len(convs)


class _GuardedForward:
    """``decoder.forward`` compiled, falling back to the eager forward (for good, one log line) when a call
    raises; the stream's causal memory is restored before the eager re-run."""

    def __init__(self, decoder: torch.nn.Module, eager, report: DecoderFastReport):
        self.eager = eager
        self.compiled = torch.compile(eager, dynamic=False)
        self.report = report
        self.failed = False
        self.decoder = decoder
        self.seen: set = set()  # input signatures compiled (cadence.runtime.compile.COMPILE_GATE)

    def __call__(self, x, mem):
        if self.failed:
            return self.eager(x, mem)
        slots, first = list(mem.slots), mem.first
        # the input signature: the latent and the causal memory's state (the compile's guards, roughly)
        key = (input_signature(x), first, input_signature(*slots))

        def restore():  # a rerun after meeting another thread's compile starts from the same memory
            mem.slots[:], mem.first = slots, first

        try:
            return COMPILE_GATE.call(self.seen, key, self.compiled, x, mem, restore=restore)
        except Exception as e:  # a compile error at this shape: eager from now on
            self.failed = True
            why = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
            log.warning("Wan decoder torch.compile failed at a call (%s): running it eagerly", why)
            self.report.notes.append(f"compile failed at a call ({why}): eager")
            if "compile" in self.report.applied:
                self.report.applied.remove("compile")
            mem.slots[:], mem.first = slots, first
            return self.eager(x, mem)


def _raise_compile_limits() -> None:
    import torch._dynamo.config as dcfg

    # stream phases (first frame, second call, steady) and block instances differ in shapes
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(dcfg, name):
            setattr(dcfg, name, max(64, getattr(dcfg, name)))


def accelerate_decoder(vae: WanVAE, mode: str = "compile") -> DecoderFastReport:
    """Apply ``mode`` (see the module docstring) to ``vae``'s decoder in place; the encoder is untouched.
    Idempotent per VAE (a second call with another mode is refused: build a fresh VAE)."""
    if mode not in MODES:
        raise ConfigError(f"decoder fast path must be one of {', '.join(MODES)}, got {mode!r}")
    rep = DecoderFastReport(mode)
    done = getattr(vae, "_decoder_fast", None)
    if done is not None:
        if done.mode != mode:
            raise ConfigError(f"decoder fast path already {done.mode!r}; cannot switch to {mode!r}")
        return done
    vae._decoder_fast = rep
    if mode == "off":
        return rep
    dec = vae.decoder
    channels_last(dec)
    channels_last(vae.post_quant_conv)
    rep.applied.append("channels_last")
    if mode == "fold":
        n = fold_convs(dec) + fold_convs(vae.post_quant_conv)
        rep.applied.append(f"fold:{n}")
    if mode == "up":
        rep.applied.append(f"subpixel:{subpixel_upsamplers(dec)}")
    if mode == "fp8":
        backend = os.environ.get("CADENCE_CONV_FP8", "triton")
        why = conv_fp8.why_not(dec.conv_in.weight.device, backend)
        if why:
            log.warning("Wan decoder FP8 convs unavailable (%s): bf16 convs", why)
            rep.notes.append(f"fp8 unavailable ({why}): bf16 convs")
        else:
            scaling = os.environ.get("CADENCE_CONV_FP8_SCALE") or "delayed"
            n = fp8_convs(dec.up_blocks, backend, scaling=scaling, decoder=dec)
            rep.applied.append(f"fp8:{n}:{backend}:{scaling}")
    if mode in ("compile", "bench", "fold", "up", "fp8"):
        if mode == "bench" and dec.conv_in.weight.is_cuda and torch.backends.cudnn.is_available():
            torch.backends.cudnn.benchmark = True
            rep.applied.append("cudnn_benchmark")
        try:
            _raise_compile_limits()
            dec.forward = _GuardedForward(dec, dec.forward, rep)
            rep.applied.append("compile")
        except Exception as e:  # no inductor / dynamo here
            why = f"{type(e).__name__}: {e}"
            log.warning("Wan decoder torch.compile unavailable (%s): eager", why)
            rep.notes.append(f"compile unavailable ({why}): eager")
    log.info("Wan decoder fast path: %s", rep.describe())
    return rep
