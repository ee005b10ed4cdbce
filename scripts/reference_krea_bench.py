"""Krea Realtime 14B's own server loop (its per-block K/V rebuild), timed (the families' side-by-side; not part
of Cadence).

    python scripts/reference_krea_bench.py --ref /path/to/realtime-video [--compile] [--blocks 6] \
        [--repeats 2] [--out ref.json] [--small]

``--ref`` is a checkout of krea-ai/realtime-video (imported from there, never copied). The script serves what
its README's ``uvicorn release_server:app`` serves with ``configs/self_forcing_server_14b.yaml``, with random
weights, driving ``release_server.GenerationSession`` block by block as the server's ``generate_loop`` does
(``generate_block``): the session's own ``__init__`` (noise, ``init_models``: the pipeline's K/V cache sized
for ``kv_cache_num_frames`` 3 + 3 frames, its scheduler, ``get_denoising_schedule`` for 5 steps), then per
block ``generate_block_internal``: the cache cleared and rebuilt at t = 0 from a first frame + the last 2 clean
frames (``recompute_kv_cache``: one model pass over 3 latent frames through the flex-attention block mask;
from the second re-encoding block on the first frame is the VAE re-encoding of an old pixel frame,
``keep_first_frame`` False, Krea's default), 5 denoising passes with re-noising, the block decoded by its
``demo_utils/vae_block3.VAEDecoderWrapper`` in fp16 (the server's ``load_vae``, unchanged, reading a random
Wan 2.1 VAE this script writes in ``Wan2.1_VAE.pth``'s format), the frames handed to its frame callback
(here: copied to the host). The transformer is Wan2.1-T2V-14B-sized (5120 wide, 40 layers, 40 heads), made
on the GPU in float32 and cast to bf16 as ``load_transformer`` casts it (a CPU init of 14B would eat the
device time; 56 GB in float32 fit an H200), with its q/k/v fused as ``load_transformer`` fuses them. ``--compile`` is the README's ``DO_COMPILE=true`` (``release_server.compile_models``:
``torch.compile`` of the transformer, and of the decoder with ``fullgraph=True``).

What differs from the server, outside its math: random weights (``load_transformer``'s safetensors read
replaced by a random ``CausalWanModel`` in its ``WanDiffusionWrapper``, every parameter + N(0, 0.05^2)); the
umT5 encoder is a stub returning a fixed random [1, 512, 4096] embedding; frames are not JPEG-encoded or sent;
``omegaconf`` (imported by the server, used only to read its config file) is a stub when absent. Attention:
the server's own fallbacks, unchanged (no sageattention or flash-attn on the GPU machine: its self- and
cross-attention fall back to torch SDPA in bf16; the rebuild pass takes its compiled ``flex_attention``).
``--small`` (CPU): the fixture's shims (scripts/fixtures/make_krea.py: tiny sizes, the hard-coded 1560 tokens
per frame set to the tiny model's, dense SDPA for flex attention, SDPA in float32), everything in float32.

Timing (scripts/reference_common.py): per block the host wall time of ``generate_block`` (its frames copied
to the host at the end), CUDA-event spans of the rebuild pass, the denoising passes, the VAE re-encode and the
decode; ``ttff_ms`` from the session's creation to the first block's frames on the host."""

from __future__ import annotations

import contextlib
import sys
import tempfile
import time
import types
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE / "fixtures")]
from _reference import PromptStub, open_checkout, wan_wrapper  # noqa: E402
from reference_common import (  # noqa: E402
    Clock,
    Spans,
    base_parser,
    built,
    checkout_commit,
    random_wan_vae,
    report,
    run_repeats,
    stream_result,
    summary,
    sync,
)

WAN14 = dict(dim=5120, num_heads=40, ffn_dim=13824, num_layers=40, freq_dim=256, text_dim=4096, text_len=512)
KV_FRAMES, FRAMES_PER_BLOCK, STEPS, SHIFT = 3, 3, 5, 5.0


def stub_omegaconf() -> None:
    try:
        import omegaconf  # noqa: F401
    except ImportError:
        stub = types.ModuleType("omegaconf")
        stub.OmegaConf = None  # only load_merge_config (the server's config file) uses it
        sys.modules["omegaconf"] = stub


def import_full(ref: Path):
    """The server module on a GPU machine (``wan`` bare; ``omegaconf`` a stub when absent)."""
    open_checkout(ref)
    stub_omegaconf()
    import logging

    import release_server as rs
    import utils.wan_wrapper as ww
    import wan.modules.causal_model as cm
    import wan.modules.vae as wv
    from pipeline.causal_inference import CausalInferencePipeline
    from utils.scheduler import FlowMatchScheduler

    logging.getLogger().setLevel(logging.WARNING)  # the server logs at DEBUG
    return types.SimpleNamespace(
        rs=rs, ww=ww, cm=cm, wv=wv, CIP=CausalInferencePipeline, FMS=FlowMatchScheduler
    )


def build_full(ref, dev: str, vae_dir: Path, emb):
    """The server's ``load_all`` with random weights: the 14B transformer made on the GPU, cast to bf16 (q/k/v
    fused as ``load_transformer`` does), the VAE through its own ``load_vae``, its pipeline."""
    with torch.device(dev):  # float32 as WanDiffusionWrapper builds it, then bf16 as load_transformer casts
        torch.manual_seed(0)
        model = ref.cm.CausalWanModel(model_type="t2v", patch_size=(1, 2, 2), **WAN14).eval()
    wrapper = wan_wrapper(ref.ww, model, ref.FMS, SHIFT)  # + N(0, 0.05^2); its scheduler on the CPU, float32
    wrapper.seq_len = 32760
    wrapper = wrapper.to(dtype=torch.bfloat16).eval().requires_grad_(False)
    for block in wrapper.model.blocks:
        block.self_attn.fuse_projections()
    torch.save(random_wan_vae(ref.wv.WanVAE_).state_dict(), vae_dir / "Wan2.1-T2V-1.3B" / "Wan2.1_VAE.pth")
    ref.rs.MODEL_FOLDER = str(vae_dir)
    enc, dec = ref.rs.load_vae()
    cfg = types.SimpleNamespace(
        denoising_step_list=[1000, 937, 833, 625, 0],  # configs/self_forcing_server_14b.yaml (the server
        warp_denoising_step=False,  # replaces it with its own get_denoising_schedule)
        num_frame_per_block=FRAMES_PER_BLOCK,
        independent_first_frame=False,
        use_taehv=False,
    )
    pipe = ref.rs.load_pipeline(cfg, dev, wrapper, PromptStub(emb), dec)
    return ref.rs.Models(PromptStub(emb), wrapper, pipe, enc, dec), cfg


class AllFloat32(torch.overrides.TorchFunctionMode):
    """--small (CPU) only: the server's bf16 / fp16 tensors and casts made float32 (as the fixture runs it),
    ``.cuda()`` a no-op."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.Tensor.half, torch.Tensor.bfloat16):
            return args[0].float()
        if func is torch.Tensor.cuda:
            return args[0]
        low = (torch.float16, torch.bfloat16)
        args = tuple(torch.float32 if a in low else a for a in args)
        kwargs = {k: torch.float32 if v in low else v for k, v in kwargs.items()}
        return func(*args, **kwargs)


class _Event:
    def record(self, *a, **k):
        pass


@contextlib.contextmanager
def cpu_server():
    """--small: the server's CUDA calls answered on the CPU (as scripts/fixtures/make_krea.py runs it)."""
    real = (torch.cuda.current_device, torch.cuda.Event)
    torch.cuda.current_device, torch.cuda.Event = (lambda: "cpu"), _Event
    try:
        with AllFloat32():
            yield
    finally:
        torch.cuda.current_device, torch.cuda.Event = real


def build_small(ref_dir: Path, vae_dir: Path, emb):
    """--small: the fixture's own import and builders (tiny model, tiny VAE through the server's load_vae)."""
    import make_krea as mk

    lh, lw = mk.LATENT_HW
    stub_omegaconf()
    rs, ww, cm, CIP, FMS = mk.import_reference(ref_dir, (lh // 2) * (lw // 2))
    path = vae_dir / mk.VAE_FILE
    mk.make_vae(path)
    enc, dec = mk.load_vae(rs, path)
    wrapper = mk.build_wrapper(ww, cm, FMS, seed=0)
    cfg = types.SimpleNamespace(
        denoising_step_list=[1000, 937, 833, 625, 0],
        warp_denoising_step=False,
        num_frame_per_block=FRAMES_PER_BLOCK,
        independent_first_frame=False,
        use_taehv=False,
    )
    pipe = CIP(cfg, device="cpu", generator=wrapper, text_encoder=PromptStub(emb), vae=dec)
    pipe.frame_seq_length = (lh // 2) * (lw // 2)
    ns = types.SimpleNamespace(rs=rs)
    return ns, rs.Models(PromptStub(emb), wrapper, pipe, enc, dec), cfg, (lh * 8, lw * 8)


def instrument(ref, models, spans: Spans):
    """Marks around the transformer calls (rebuild vs denoising), the decoder and the re-encode; the calls
    themselves unchanged. Returns a switch the rebuild wrapper flips."""
    state = {"in_rebuild": False}
    tf, dec, enc = models.transformer, models.vae_decoder, ref.rs.encode_video_latent
    models.transformer = spans.wrap("pass", tf, lambda a, k: {"rebuild": state["in_rebuild"]})
    models.vae_decoder = spans.wrap("decode", dec)
    ref.rs.encode_video_latent = spans.wrap("reencode", enc)
    own = ref.rs.GenerationSession.recompute_kv_cache

    def recompute(self, m):
        state["in_rebuild"] = True
        try:
            return own(self, m)
        finally:
            state["in_rebuild"] = False

    ref.rs.GenerationSession.recompute_kv_cache = recompute


@torch.inference_mode()
def run_stream(ref, models, cfg, spans: Spans, blocks: int, hw, dev: str, seed: int, small: bool) -> dict:
    shown: list = []
    params = ref.rs.GenerateParams(
        prompt="benchmark prompt",
        width=hw[1],
        height=hw[0],
        seed=seed,
        keep_first_frame=False,
        kv_cache_num_frames=KV_FRAMES,
        num_blocks=blocks,
        num_denoising_steps=STEPS,
        timestep_shift=SHIFT,
    )
    sync(dev)
    t_start = time.perf_counter()
    s = ref.rs.GenerationSession(
        params, cfg, frame_callback=lambda px, ids, ev: shown.append(px[0].cpu()), models=models
    )
    out, first = [], None
    for idx in range(blocks):
        spans.clear()
        t0 = time.perf_counter()
        if small:
            s.generate_block_internal(models)
        else:
            s.generate_block(models)
        host = shown[-1]
        t1 = time.perf_counter()
        first = first if first is not None else t1 - t_start
        sync(dev)
        sp = spans.read()
        out.append(
            dict(
                block=idx,
                frames=int(host.shape[0]),
                wall_ms=(t1 - t0) * 1e3,
                rebuild_ms=sum(x["ms"] for x in sp if x["name"] == "pass" and x["rebuild"]),
                denoise_ms=sum(x["ms"] for x in sp if x["name"] == "pass" and not x["rebuild"]),
                reencode_ms=sum(x["ms"] for x in sp if x["name"] == "reencode"),
                decode_ms=sum(x["ms"] for x in sp if x["name"] == "decode"),
                passes=sum(x["name"] == "pass" for x in sp),
                finite=bool(torch.isfinite(host).all()),
            )
        )
    s.dispose()
    return stream_result(out, time.perf_counter() - t_start, first, FRAMES_PER_BLOCK * 4)


def main() -> None:
    ap = base_parser(__doc__, "checkout of krea-ai/realtime-video")
    ap.add_argument("--compile", action="store_true", help="the README's DO_COMPILE=true (compile_models)")
    ap.add_argument("--blocks", type=int, default=6, help="blocks per stream (the server's default: 9)")
    a = ap.parse_args()
    ref_dir = a.ref.resolve()
    commit = checkout_commit(ref_dir, a.commit, open_checkout(ref_dir))
    dev = "cpu" if a.small else a.device
    text = (8, 32) if a.small else (WAN14["text_len"], WAN14["text_dim"])
    emb = torch.randn(1, *text, generator=torch.Generator().manual_seed(1))
    torch.set_grad_enabled(False)
    with tempfile.TemporaryDirectory() as tmp:
        vae_dir = Path(tmp)
        (vae_dir / "Wan2.1-T2V-1.3B").mkdir()
        t = time.perf_counter()
        if a.small:
            ref, models, cfg, hw = build_small(ref_dir, vae_dir, emb)
            ref.rs.gpu = "cpu"
            own_encode = ref.rs.encode_video_latent

            def encode_at_frame_size(vae, cache, *args, frames=None, height=None, width=None, **kw):
                # the fixture's shim: Krea resizes to 480x832 (an identity at its size), here the tiny frame's
                return own_encode(
                    vae, cache, *args, frames=frames, height=frames.shape[-2], width=frames.shape[-1], **kw
                )

            ref.rs.encode_video_latent = encode_at_frame_size
        else:
            ref = import_full(ref_dir)
            models, cfg = build_full(ref, dev, vae_dir, emb.to(dev, torch.bfloat16))
            hw = (480, 832)
        build_s = time.perf_counter() - t
        built(dev)
    if a.compile:
        ref.rs.compile_models(models)
    spans = Spans(Clock(dev))
    instrument(ref, models, spans)
    ctx = cpu_server() if a.small else contextlib.nullcontext()
    with ctx:
        runs, first_run_s = run_repeats(
            lambda r: run_stream(ref, models, cfg, spans, a.blocks, hw, dev, r, a.small), a.repeats
        )
    meta = dict(
        reference="krea-ai/realtime-video",
        reference_commit=commit,
        harness="scripts/reference_krea_bench.py (release_server.GenerationSession.generate_block)",
        dtype="float32 (small)" if a.small else "bfloat16 (transformer), float16 (VAE)",
        compile="DO_COMPILE=true (compile_models)" if a.compile else None,
        attention="the server's own fallbacks: torch SDPA in bf16 (no sageattention / flash-attn); flex_attention "
        "(compiled, max-autotune-no-cudagraphs) for the rebuild pass"
        if not a.small
        else "fixture shims: SDPA in float32, dense SDPA for flex attention",
        decoder="demo_utils.vae_block3.VAEDecoderWrapper (Wan 2.1, streaming, fp16) via release_server.load_vae",
        geometry=dict(
            latent=[hw[0] // 8, hw[1] // 8],
            blocks=a.blocks,
            frames_per_block=FRAMES_PER_BLOCK,
            num_denoising_steps=STEPS,
            kv_cache_num_frames=KV_FRAMES,
            keep_first_frame=False,
            model="tiny (the fixture's)" if a.small else "Wan2.1-T2V-14B sizes",
        ),
        small=a.small,
        build_s=build_s,
        fps_steady_rule="12 frames / median wall time of blocks 2..",
    )
    s = summary(meta, runs, first_run_s, dev, ("rebuild", "denoise", "reencode", "decode"))
    report(s, "compiled" if a.compile else "eager", a.out)


if __name__ == "__main__":
    main()
