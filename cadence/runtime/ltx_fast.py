"""Fast paths for FlashHead Lite's LTX-Video VAE, applied from outside to a built :class:`LTXVideoVAE`.

    rep = accelerate_ltx(vae, "compile")     # channels-last + torch.compile of the encoder and the decoder
    rep.describe()                           # what applied ('channels_last+compile', 'plain (...why)')

Modes (:data:`MODES`), each adding to the one before; ``off`` is the plain module, the reference every mode
is tested against (tests/test_ltx_fast.py, CPU, float32):

* ``off``: the plain encoder / decoder.
* ``cl``: weights in channels_last_3d; the activations follow on CUDA (cuDNN's NDHWC kernels). The time
  padding is a ``replicate`` pad (``cadence.model.ltx_vae.pad_frames``), which keeps the layout, where a
  ``cat`` with an expanded frame would fall back to NCDHW before every conv.
* ``compile``: ``cl`` + ``torch.compile`` (``dynamic=False``: one graph per input shape; FlashHead's are
  three: the 33-frame reference encode once per session, the 9-frame motion encode and the 5-latent decode
  per clip) of ``encoder.forward`` and ``decoder.forward``: the pixel norm + SiLU + time pad before each conv
  fuse into one pass. FlashHead's own pipeline compiles ``encode`` / ``decode`` the same way.
* ``fp8`` (opt-in, not a default anywhere): ``compile`` + the 3x3x3 convs of the decoder's full-rate
  residual blocks (the last up block: 8 convs, 50% of the decode's multiply-adds at the released widths) in
  FP8 e4m3 with float32 accumulation (``cadence.kernels.conv_fp8``; weight scale per output channel,
  activation scale per call; input channels a multiple of 128 on the GPU: 128 at the released widths).
  Everything else stays in the weights' dtype. Image error on the CPU (reference backend, random weights,
  released structure at widths 32/64/128/128, 17 x 128 x 128, decode vs the plain module in float32;
  ``bench vae --decoder ltx --eager --error``): these 8 convs 6.6% relative L2 / 39.6 dB PSNR (with bf16
  elsewhere 6.9% / 39.2 dB; bf16 alone 2.1% / 49.7 dB); FP8 in every up-block conv (``where=
  vae.decoder.up_blocks``) 15.9% / 32.0 dB, so it is not the default selection (docs/perf/vae/LTX_NOTES.md).
  Random weights are not the trained VAE; whether the speed pays for the error is measured on the GPU.
  Backend from ``CADENCE_CONV_FP8`` (``triton`` default | ``cudnn`` | ``reference``); one that cannot run
  here leaves the convs as they are, one log line; a conv that raises at a call runs plain from then on,
  one log line.

The streaming decode (:class:`cadence.model.ltx_vae.LTXDecodeStream`) calls the conv modules itself, so
``cl`` and ``fp8`` apply to it and ``compile`` does not (its pieces change shape call to call).

Fallbacks: a compile that fails (no C++ compiler for inductor on a CPU, a graph break that raises) logs one
line at the first call that fails and runs that part eagerly from then on; the call is re-run eagerly, so no
output is lost (encode and decode hold no state between calls). Calls that may compile go through
``cadence.runtime.compile.COMPILE_GATE`` (the engine diffuses and decodes on different threads).
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F

from cadence.errors import ConfigError
from cadence.kernels import conv_fp8
from cadence.model.ltx_vae import LTXVideoVAE
from cadence.runtime.compile import COMPILE_GATE, input_signature
from cadence.runtime.vae_fast import DecoderFastReport, _Fp8Conv, _raise_compile_limits, channels_last

log = logging.getLogger("cadence.ltx_vae")

MODES = ("off", "cl", "compile", "fp8")


class Fp8Conv3d(_Fp8Conv, torch.nn.Conv3d):
    """A decoder conv (3x3x3, stride 1, spatial padding 1, time already padded) in FP8 per call; made in place
    from the built conv by :func:`fp8_decoder_convs` (same parameters, quantised weight copies as buffers)."""

    def _conv_forward(self, x, weight, bias):
        return self._fp8(x, 3, lambda: F.conv3d(x, weight, bias, self.stride, self.padding))


def _fp8_ok(m: torch.nn.Module, multiple: int) -> bool:
    return (
        type(m) is torch.nn.Conv3d
        and m.kernel_size == (3, 3, 3)
        and m.stride == (1, 1, 1)
        and m.padding == (0, 1, 1)
        and m.groups == 1
        and m.dilation == (1, 1, 1)
        and m.padding_mode == "zeros"
        and m.in_channels % multiple == 0
        and m.out_channels % 16 == 0
    )


def fp8_decoder_convs(
    vae: LTXVideoVAE, backend: str, multiple: int | None = None, where: torch.nn.Module | None = None
) -> int:
    """Turn the convs under ``where`` (default: the residual blocks of the decoder's last, full-rate up block:
    8 of the released decoder's convs, 50% of its multiply-adds) that the FP8 path takes into
    :class:`Fp8Conv3d` (per-call activation scales); returns how many. ``multiple``: input channels must be a
    multiple of it (as ``cadence.runtime.vae_fast.fp8_convs``: 128 for Triton on a GPU, 16 interpreted /
    cuDNN, 1 reference)."""
    if multiple is None:
        multiple = {"reference": 1, "cudnn": 16}.get(backend, 16 if conv_fp8.interpreting() else 128)
    where = vae.decoder.up_blocks[-1].resnets if where is None else where
    n = 0
    for m in list(where.modules()):
        if _fp8_ok(m, multiple):
            m.__class__ = Fp8Conv3d
            m._fp8_setup(backend, "call")
            n += 1
    return n


class _Guarded:
    """A compiled ``forward`` that falls back to the eager one for good (one log line) when a call raises."""

    def __init__(self, name: str, eager, report: DecoderFastReport):
        self.name, self.eager, self.report = name, eager, report
        self.compiled = torch.compile(eager, dynamic=False)
        self.failed = False
        self.seen: set = set()  # input signatures compiled (COMPILE_GATE)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.failed:
            return self.eager(x)
        try:
            return COMPILE_GATE.call(self.seen, input_signature(x), self.compiled, x)
        except Exception as e:  # a compile error at this shape: eager from now on (the call is pure)
            self.failed = True
            why = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
            log.warning("LTX %s torch.compile failed at a call (%s): running it eagerly", self.name, why)
            self.report.notes.append(f"{self.name} compile failed ({why}): eager")
            return self.eager(x)


def accelerate_ltx(vae: LTXVideoVAE, mode: str = "compile", encoder: bool = True) -> DecoderFastReport:
    """Apply ``mode`` (module docstring) in place to ``vae``'s decoder and (``encoder``) encoder. Idempotent
    per VAE; another mode on the same VAE is refused (build a fresh one)."""
    if mode not in MODES:
        raise ConfigError(f"LTX VAE fast path must be one of {', '.join(MODES)}, got {mode!r}")
    done = getattr(vae, "_ltx_fast", None)
    if done is not None:
        if done.mode != mode:
            raise ConfigError(f"LTX VAE fast path already {done.mode!r}; cannot switch to {mode!r}")
        return done
    rep = DecoderFastReport(mode)
    vae._ltx_fast = rep
    if mode == "off":
        return rep
    parts = [("decoder", vae.decoder)] + ([("encoder", vae.encoder)] if encoder else [])
    for _, m in parts:
        channels_last(m)
    rep.applied.append("channels_last")
    if mode == "fp8":
        backend = os.environ.get("CADENCE_CONV_FP8", "triton")
        why = conv_fp8.why_not(vae.decoder.conv_in.conv.weight.device, backend)
        if why:
            log.warning("LTX decoder FP8 convs unavailable (%s): convs unchanged", why)
            rep.notes.append(f"fp8 unavailable ({why})")
        else:
            rep.applied.append(f"fp8:{fp8_decoder_convs(vae, backend)}:{backend}")
    if mode in ("compile", "fp8"):
        try:
            _raise_compile_limits()
            for name, m in parts:
                m.forward = _Guarded(name, m.forward, rep)
            rep.applied.append("compile")
        except Exception as e:  # no dynamo / inductor in this build
            why = f"{type(e).__name__}: {e}"
            log.warning("LTX VAE torch.compile unavailable (%s): eager", why)
            rep.notes.append(f"compile unavailable ({why}): eager")
    log.info("LTX VAE fast path: %s", rep.describe())
    return rep
