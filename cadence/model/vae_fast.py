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
  1.78 s (ttff 519 -> 1783 ms; docs/perf/vae/NOTES.md): a throughput mode, not the default.
* ``fold``: every 3x3x3 / 3x1x1 / 1x1x1 temporal-stride-1 causal conv runs as ONE conv2d over
  ``[B * T_out, H, W, kt * C]`` (the kt input frames of each output frame stacked along channels): a 2D
  implicit GEMM with a kt-times deeper reduction instead of cuDNN's conv3d (same math, summation order
  differs).
* ``up`` (instead of ``fold``): ``compile`` + every spatial upsampler's "nearest 2x, then 3x3 conv" as one
  2x2 conv to the four output phases at the LOW resolution, then the phases interleaved: the same math
  with 2.25x fewer multiply-adds in those convs (Wan 2.2 at 704x1088: 7.7 -> 3.4 of 56.4 TFLOP per 4-frame
  chunk; Wan 2.1 at 480x832, 12 frames: 3.4 -> 1.5 of 40.7). Not measured on a GPU yet.

Fallbacks: a mode that cannot apply (no CUDA for ``compile``/``fold`` is fine; a torch.compile that fails at
build or at its first call) logs one line and the decoder carries on with the modes below it. The first
call's failure is caught per call: the stream's causal memory is restored and the call re-run eagerly,
so no frame is lost. Parity with the plain decoder: tests/test_vae_fast.py (CPU, fp32).

Apply after loading weights (``fold`` keeps a folded copy of each conv weight, taken now).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from cadence.errors import ConfigError
from cadence.model.vae import CausalConv3d, Resample, WanVAE, fold_time_weight, subpixel_weight

log = logging.getLogger("cadence.vae")

MODES = ("off", "cl", "compile", "bench", "fold", "up")


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


class _GuardedForward:
    """``decoder.forward`` compiled, falling back to the eager forward (for good, one log line) when a call
    raises; the stream's causal memory is restored before the eager re-run."""

    def __init__(self, decoder: torch.nn.Module, eager, report: DecoderFastReport):
        self.eager = eager
        self.compiled = torch.compile(eager, dynamic=False)
        self.report = report
        self.failed = False
        self.decoder = decoder

    def __call__(self, x, mem):
        if self.failed:
            return self.eager(x, mem)
        slots, first = list(mem.slots), mem.first
        try:
            return self.compiled(x, mem)
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
    if mode in ("compile", "bench", "fold", "up"):
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
