"""CausVid's own autoregressive inference, timed (the families' side-by-side; not part of Cadence).

    python scripts/reference_causvid_bench.py --ref /path/to/CausVid [--repeats 2] [--out ref.json] [--small]

``--ref`` is a checkout of tianweiy/CausVid (imported from there, never copied). The script runs what the
README's ``minimal_inference/autoregressive_inference.py --config_path configs/wan_causal_dmd.yaml`` runs,
with random weights: its ``causvid.models.wan.causal_inference.InferencePipeline`` built by its own
``__init__`` from the config (denoising steps 1000/757/522/0, not warped, 3 latent frames per block), moved to
bf16 on the GPU as the script does (``pipeline.to(device="cuda", dtype=torch.bfloat16)``), then
``pipeline.inference(noise=[1, 21, 16, 60, 104], text_prompts=...)`` unchanged: per block 3 denoising passes
with re-noising and the clean pass at t = 0 that writes the global K/V cache (every block attends to all
earlier ones), then the whole 21-frame latent decoded by the Wan 2.1 VAE (``WanVAEWrapper.decode_to_pixel``:
Wan's ``WanVAE_.decode``, 81 frames), the frames copied to the host. No torch.compile (the script has none).

What differs from the script, all outside its math: the weights are random (``get_diffusion_wrapper`` /
``get_vae_wrapper`` / ``get_text_encoder_wrapper`` answer builders of the same classes without their
``from_pretrained`` / ``.pth`` loads: ``CausalWanDiffusionWrapper`` with a Wan2.1-T2V-1.3B-sized
``CausalWanModel``, ``WanVAEWrapper`` with a random ``WanVAE_``); the umT5 encoder is a stub returning a fixed
random [1, 512, 4096] embedding (its cost is outside the block loop in a server; here it would be inside
``inference``); ``causvid.models`` is a bare package (its ``__init__`` imports the SD-XL wrappers); the video
is not written to mp4. Attention: the reference calls flash-attn 2/3 (its cross-attention asserts without it;
the GPU machine has none): ``flash_attention`` and ``attention`` are torch SDPA in the inputs' dtype
(``_reference.sdpa_attention``).

Timing (scripts/reference_common.py): the first of ``--repeats`` runs absorbs warm-up; the block boundaries
are CUDA events of forward hooks on the generator (a pass's ``current_start`` names its block), the end decode
is timed apart. The script delivers frames only when the whole video is decoded, so ``ttff_ms`` is the whole
run; ``first_latents_ms`` is when block 1's latents existed. ``fps_steady``: 12 frames / (median block span of
blocks 2..7 + a seventh of the end decode and host copy)."""

from __future__ import annotations

import contextlib
import sys
import time
import types
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE / "fixtures")]
from _reference import PromptStub, cuda_device_zero, sdpa_attention  # noqa: E402
from reference_common import (  # noqa: E402
    Clock,
    CudaOnCpu,
    PassLog,
    base_parser,
    built,
    checkout_commit,
    end_decoded_blocks,
    perturb_,
    random_wan_vae,
    report,
    run_repeats,
    stream_result,
    summary,
    sync,
)

WAN13 = dict(
    dim=1536,
    num_heads=12,
    ffn_dim=8960,
    num_layers=30,
    freq_dim=256,
    text_dim=4096,
    text_len=512,
    cross_attn_norm=True,
    eps=1e-6,
)
CONFIG = dict(  # configs/wan_causal_dmd.yaml, the keys InferencePipeline reads
    model_name="wan",
    generator_name="causal_wan",
    denoising_step_list=[1000, 757, 522, 0],
    warp_denoising_step=False,
    num_frame_per_block=3,
)
BLOCKS, FRAMES_PER_BLOCK = 7, 3


def import_reference(ref: Path, geo: dict, emb: torch.Tensor, dev: str, vae_dim: int = 96):
    """CausVid's modules, with ``causvid.models``' three wrapper getters answering random-weight builders."""
    sys.path.insert(0, str(ref))
    import causvid  # a namespace package (no __init__)

    models = types.ModuleType("causvid.models")
    models.__path__ = [str(ref / "causvid/models")]
    sys.modules["causvid.models"] = causvid.models = models
    import causvid.models.wan

    base = types.ModuleType("causvid.models.wan.wan_base")  # its __init__ imports the T2V/I2V apps
    base.__path__ = [str(ref / "causvid/models/wan/wan_base")]
    sys.modules["causvid.models.wan.wan_base"] = causvid.models.wan.wan_base = base
    with cuda_device_zero():  # t5.py reads torch.cuda.current_device() for a default argument at import
        import causvid.models.wan.wan_base.modules.attention as wattn
        import causvid.models.wan.wan_base.modules.model as wm
        import causvid.models.wan.wan_base.modules.vae as wv
        import causvid.models.wan.wan_wrapper as ww
        from causvid.models.wan.causal_model import CausalWanModel

    if wattn.FLASH_ATTN_3_AVAILABLE or wattn.FLASH_ATTN_2_AVAILABLE:
        attention = "flash-attn (installed)"
    else:
        import causvid.models.wan.causal_model as cm

        wm.flash_attention = sdpa_attention
        cm.attention = sdpa_attention
        attention = "torch SDPA in the inputs' dtype (flash-attn not installed)"

    def diffusion():
        torch.manual_seed(0)
        w = ww.CausalWanDiffusionWrapper.__new__(ww.CausalWanDiffusionWrapper)
        torch.nn.Module.__init__(w)
        with torch.device(dev):  # random weights made on the device (the script loads them from disk)
            w.model = CausalWanModel(
                model_type="t2v", patch_size=(1, 2, 2), in_dim=16, out_dim=16, **geo
            ).eval()
        perturb_(w.model)
        w.uniform_timestep = False  # as WanDiffusionWrapper.__init__ then CausalWanDiffusionWrapper set it
        w.scheduler = ww.FlowMatchScheduler(shift=8.0, sigma_min=0.0, extra_one_step=True)
        w.scheduler.set_timesteps(1000, training=True)
        w.seq_len = 32760
        w.post_init()
        return w

    def vae():
        v = ww.WanVAEWrapper.__new__(ww.WanVAEWrapper)
        torch.nn.Module.__init__(v)
        v.mean, v.std = _wan21_latent_stats()
        v.model = random_wan_vae(wv.WanVAE_, vae_dim).requires_grad_(False)
        return v

    models.get_diffusion_wrapper = lambda model_name: diffusion
    models.get_vae_wrapper = lambda model_name: vae
    models.get_text_encoder_wrapper = lambda model_name: lambda: PromptStub(emb)
    from causvid.models.wan.causal_inference import InferencePipeline

    return InferencePipeline, attention


def _wan21_latent_stats():
    """Wan 2.1's latent mean / std (the literals of ``WanVAEWrapper.__init__``)."""
    mean = [-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508]
    mean += [0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921]
    std = [2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743]
    std += [3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160]
    return torch.tensor(mean, dtype=torch.float32), torch.tensor(std, dtype=torch.float32)


def small_caches(pipe, geo: dict, hw: tuple[int, int]) -> None:
    """--small: the pipeline hard-codes Wan 1.3B's 30 blocks, 1560 tokens a frame and [.., 12, 128] caches."""
    fsl = (hw[0] // 2) * (hw[1] // 2)
    heads, hd = geo["num_heads"], geo["dim"] // geo["num_heads"]
    n = geo["num_layers"]
    pipe.num_transformer_blocks, pipe.frame_seq_length = n, fsl

    def kv(batch_size, dtype, device):
        z = [1, BLOCKS * FRAMES_PER_BLOCK * fsl, heads, hd]
        pipe.kv_cache1 = [
            {"k": torch.zeros(z, dtype=dtype, device=device), "v": torch.zeros(z, dtype=dtype, device=device)}
            for _ in range(n)
        ]

    def cross(batch_size, dtype, device):
        z = [1, geo["text_len"], heads, hd]
        pipe.crossattn_cache = [
            {
                "k": torch.zeros(z, dtype=dtype, device=device),
                "v": torch.zeros(z, dtype=dtype, device=device),
                "is_init": False,
            }
            for _ in range(n)
        ]

    pipe._initialize_kv_cache, pipe._initialize_crossattn_cache = kv, cross


@torch.no_grad()
def run_video(pipe, log: PassLog, clock: Clock, noise, dev: str) -> dict:
    """One ``pipeline.inference`` call, as the script makes it (a fresh pipeline state each video: the
    script's loop reuses the caches, resetting the cross-attention ones), then the frames to the host."""
    pipe.kv_cache1 = None  # the first call's path: caches allocated inside inference
    decode = []
    real = pipe.vae.decode_to_pixel

    def timed_decode(latent):
        a = clock.mark()
        out = real(latent)
        decode.append((a, clock.mark()))
        return out

    pipe.vae.decode_to_pixel = timed_decode
    log.clear()
    sync(dev)
    t_start = time.perf_counter()
    t0 = clock.mark()
    video = pipe.inference(noise=noise, text_prompts=["benchmark prompt"])[0]
    h0 = clock.mark()
    host = video.permute(0, 2, 3, 1).cpu()
    total = time.perf_counter() - t_start
    h1 = clock.mark()
    sync(dev)
    frames = [9] + [12] * (BLOCKS - 1)  # 81 = 1 + 4 * 20 decoded frames, as Wan's causal decode gives them
    blocks = end_decoded_blocks(clock, log.blocks(), decode[0], t0, clock.ms(h0, h1), frames)
    fin = bool(torch.isfinite(host).all())
    for b in blocks:
        b["finite"] = fin
    return stream_result(
        blocks,
        total,
        total,
        FRAMES_PER_BLOCK * 4,
        first_latents_ms=blocks[0]["from_start_ms"],
        end_decode_ms=clock.ms(*decode[0]),
        host_copy_ms=clock.ms(h0, h1),
    )


def main() -> None:
    a = base_parser(__doc__, "checkout of tianweiy/CausVid").parse_args()
    ref = a.ref.resolve()
    commit = checkout_commit(ref, a.commit, "")
    dev = a.device
    dtype = torch.bfloat16 if dev.startswith("cuda") else torch.float32
    geo, hw = dict(WAN13), (60, 104)
    if a.small:
        geo.update(dim=64, num_heads=2, ffn_dim=128, num_layers=2, freq_dim=32, text_dim=32, text_len=8)
        hw = (8, 12)  # and a VAE 8 wide (the released one: 96)
    emb = torch.randn(1, geo["text_len"], geo["text_dim"], generator=torch.Generator().manual_seed(1))
    InferencePipeline, attention = import_reference(ref, geo, emb.to(dev, dtype), dev, 8 if a.small else 96)
    torch.set_grad_enabled(False)
    mode = CudaOnCpu() if not dev.startswith("cuda") else contextlib.nullcontext()
    with mode:
        t = time.perf_counter()
        pipe = InferencePipeline(types.SimpleNamespace(**CONFIG), device=dev)
        pipe.to(device=dev, dtype=dtype)  # the script: pipeline.to(device="cuda", dtype=torch.bfloat16)
        if a.small:
            small_caches(pipe, geo, hw)
        build_s = time.perf_counter() - t
        built(dev)
        clock = Clock(dev)
        log = PassLog(clock, pipe.generator)
        noise = torch.randn([1, BLOCKS * FRAMES_PER_BLOCK, 16, *hw], device=dev, dtype=dtype)
        runs, first_run_s = run_repeats(lambda r: run_video(pipe, log, clock, noise, dev), a.repeats)
    meta = dict(
        reference="tianweiy/CausVid",
        reference_commit=commit,
        harness="scripts/reference_causvid_bench.py (minimal_inference/autoregressive_inference.py: "
        "InferencePipeline.inference)",
        dtype=str(dtype).removeprefix("torch."),
        compile=None,
        attention=attention,
        decoder="causvid WanVAEWrapper.decode_to_pixel (Wan 2.1 WanVAE_.decode, whole video after the loop)",
        geometry=dict(
            latent=list(hw),
            blocks=BLOCKS,
            frames_per_block=FRAMES_PER_BLOCK,
            steps=CONFIG["denoising_step_list"],
        ),
        small=a.small,
        build_s=build_s,
        fps_steady_rule="12 frames / (median block span of blocks 2..7 + 1/7 of the end decode and host copy)",
        ttff_rule="the whole run: the script decodes the video after its block loop",
    )
    report(summary(meta, runs, first_run_s, dev, ("denoise", "cache_pass", "decode")), "eager", a.out)


if __name__ == "__main__":
    main()
