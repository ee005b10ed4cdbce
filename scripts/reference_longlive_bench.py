"""LongLive's own interactive inference (local window + frame sink, a prompt switch and its K/V re-cache),
timed (the families' side-by-side; not part of Cadence).

    python scripts/reference_longlive_bench.py --ref /path/to/LongLive [--blocks 12] [--switch 18] \
        [--repeats 2] [--out ref.json] [--small]

``--ref`` is a checkout of NVlabs/LongLive at v1.0 (imported from there, never copied). The script runs what
its README's ``interactive_inference.sh`` runs (``interactive_inference.py --config_path
configs/longlive_interactive_inference.yaml``), with random weights: its ``CausalWanModel`` (Wan2.1-T2V-1.3B,
``local_attn_size`` 12 frames, ``sink_size`` 3) in its ``WanDiffusionWrapper`` (shift 5), wrapped by the
script's own LoRA step (``utils.lora_utils.configure_lora_for_model``: peft ``LoraConfig`` rank 256, alpha
256 on every linear of the attention blocks, un-merged adapters as the script serves them), the whole pipeline
cast to bf16 (``pipeline.to(dtype=torch.bfloat16)``), then ``InteractiveCausalInferencePipeline.inference(
noise, text_prompts_list=[[a], [b]], switch_frame_indices=[switch])`` unchanged: per block 4 passes
(1000/750/500/250 warped by shift 5) with re-noising and the clean pass at ``context_noise`` 0, the window
rolled by its own cache code; at the switch (``global_sink`` true, the shipped config) the cross-attention
caches reset and the last 12 frames re-run under the new prompt (``_recache_after_switch``); after the loop
the whole latent decoded by its ``WanVAEWrapper.decode_to_pixel`` (Wan 2.1 ``WanVAE_.decode``). No
torch.compile (the script has none; its ``flex_attention`` compile serves only the training path).

Cut to fit the device time: ``--blocks`` 12 (36 latent frames, 141 video frames; the shipped example makes
240 latent frames with 5 switches) and one switch at latent frame 18 (block 7: the window is full, so the
re-cache covers all 12 frames).

What differs from the script, outside its math: random weights (the wrapper assembled without its
``from_pretrained``; the LoRA factors drawn instead of read from ``lora.pt``; every parameter + N(0, 0.05^2));
the umT5 encoder is a stub mapping each of the two prompts to a fixed random [512, 4096] embedding; ``wan``
and ``pipeline`` are bare packages (their ``__init__`` import the torchvision apps and the training pipelines);
flash-attn is not on the GPU machine: ``flash_attention`` / ``attention`` are torch SDPA in the inputs' dtype.

Timing (scripts/reference_common.py): block boundaries from forward hooks on the generator, the re-cache
and the end decode timed apart (the re-cache opens the block after the switch: ``recache_ms``); the script
delivers frames after the end decode, so ``ttff_ms`` is the whole run (``first_latents_ms``: block 1's)."""

from __future__ import annotations

import importlib.util
import sys
import time
import types
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE / "fixtures")]
from _reference import cuda_device_zero, open_checkout, sdpa_attention, wan_wrapper  # noqa: E402
from reference_common import (  # noqa: E402
    Clock,
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

WAN13 = dict(dim=1536, num_heads=12, ffn_dim=8960, num_layers=30, freq_dim=256, text_dim=4096, text_len=512)
LOCAL_ATTN, SINK, FRAMES_PER_BLOCK = 12, 3, 3
ADAPTER = dict(type="lora", rank=256, alpha=256, dropout=0.0, dtype="bfloat16", verbose=False)
LATENT_MEAN = [-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508, 0.4134, -0.0715, 0.5517]
LATENT_MEAN += [-0.3632, -0.1922, -0.9497, 0.2503, -0.2921]
LATENT_STD = [2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743, 3.2687, 2.1526, 2.8652, 1.5579]
LATENT_STD += [1.6382, 1.1253, 2.8251, 1.9160]


class AttrDict(dict):
    """The config's ``adapter`` as the script hands it over (OmegaConf: ``.get`` and attributes)."""

    __getattr__ = dict.get


def import_reference(ref: Path):
    open_checkout(ref)
    pipeline = types.ModuleType("pipeline")
    pipeline.__path__ = [str(ref / "pipeline")]
    sys.modules["pipeline"] = pipeline
    with cuda_device_zero():
        import utils.wan_wrapper as ww
        import wan.modules.attention as wattn
        import wan.modules.causal_model as cm
        import wan.modules.model as wm
        import wan.modules.vae as wv
        from utils.lora_utils import configure_lora_for_model
        from utils.scheduler import FlowMatchScheduler

        for name in ("causal_inference", "interactive_causal_inference"):
            spec = importlib.util.spec_from_file_location(f"pipeline.{name}", ref / f"pipeline/{name}.py")
            mod = importlib.util.module_from_spec(spec)
            sys.modules[f"pipeline.{name}"] = mod
            spec.loader.exec_module(mod)
    if wattn.FLASH_ATTN_3_AVAILABLE or wattn.FLASH_ATTN_2_AVAILABLE:
        attention = "flash-attn (installed)"
    else:
        wm.flash_attention = sdpa_attention
        cm.attention = sdpa_attention
        attention = "torch SDPA in the inputs' dtype (flash-attn not installed)"
    return types.SimpleNamespace(
        ww=ww,
        cm=cm,
        wv=wv,
        FMS=FlowMatchScheduler,
        lora=configure_lora_for_model,
        ici=sys.modules["pipeline.interactive_causal_inference"],
        attention=attention,
    )


class PromptTable(torch.nn.Module):
    """The text encoder: each prompt to its fixed random embedding."""

    def __init__(self, table: dict):
        super().__init__()
        self.table = table

    def forward(self, text_prompts):
        return {"prompt_embeds": torch.stack([self.table[p] for p in text_prompts])}


def build(ref, geo: dict, dev: str, vae_dim: int, table: dict):
    with torch.device(dev):  # random weights made on the device (the script loads them from disk)
        torch.manual_seed(0)
        model = ref.cm.CausalWanModel(
            model_type="t2v", patch_size=(1, 2, 2), local_attn_size=LOCAL_ATTN, sink_size=SINK, **geo
        ).eval()
        wrapper = wan_wrapper(ref.ww, model, ref.FMS, 5.0)  # + N(0, 0.05^2) on every parameter
        wrapper.seq_len = 32760  # WanDiffusionWrapper.__init__ at local_attn_size 12
        wrapper.model = ref.lora(wrapper.model, "generator", AttrDict(ADAPTER), is_main_process=False)
        perturb_(wrapper.model)  # the LoRA factors random too (peft zero-initialises B)
    vae = ref.ww.WanVAEWrapper.__new__(ref.ww.WanVAEWrapper)
    torch.nn.Module.__init__(vae)
    vae.mean, vae.std = torch.tensor(LATENT_MEAN), torch.tensor(LATENT_STD)
    vae.model = random_wan_vae(ref.wv.WanVAE_, vae_dim).requires_grad_(False)
    args = types.SimpleNamespace(
        denoising_step_list=[1000, 750, 500, 250],
        warp_denoising_step=True,
        num_frame_per_block=FRAMES_PER_BLOCK,
        independent_first_frame=False,
        context_noise=0,
        global_sink=True,
        model_kwargs=types.SimpleNamespace(local_attn_size=LOCAL_ATTN, sink_size=SINK, timestep_shift=5.0),
    )
    pipe = ref.ici.InteractiveCausalInferencePipeline(
        args, device=dev, generator=wrapper, text_encoder=PromptTable(table), vae=vae
    )
    return pipe


def small_caches(pipe, geo: dict, hw: tuple[int, int]) -> None:
    """--small: the pipeline hard-codes Wan 1.3B's 30 blocks, 1560 tokens a frame and [.., 12, 128] caches."""
    fsl = (hw[0] // 2) * (hw[1] // 2)
    heads, hd, n = geo["num_heads"], geo["dim"] // geo["num_heads"], geo["num_layers"]
    pipe.num_transformer_blocks, pipe.frame_seq_length = n, fsl

    def kv(batch_size, dtype, device, kv_cache_size_override=None):
        size = kv_cache_size_override or LOCAL_ATTN * fsl
        z = dict(dtype=dtype, device=device)
        pipe.kv_cache1 = [
            {
                "k": torch.zeros([batch_size, size, heads, hd], **z),
                "v": torch.zeros([batch_size, size, heads, hd], **z),
                "global_end_index": torch.tensor([0], dtype=torch.long, device=device),
                "local_end_index": torch.tensor([0], dtype=torch.long, device=device),
            }
            for _ in range(n)
        ]

    def cross(batch_size, dtype, device):
        z = dict(dtype=dtype, device=device)
        pipe.crossattn_cache = [
            {
                "k": torch.zeros([batch_size, geo["text_len"], heads, hd], **z),
                "v": torch.zeros([batch_size, geo["text_len"], heads, hd], **z),
                "is_init": False,
            }
            for _ in range(n)
        ]

    pipe._initialize_kv_cache, pipe._initialize_crossattn_cache = kv, cross


def timed_methods(pipe, log: PassLog, clock: Clock):
    """The re-cache and the end decode, with marks around them (the calls unchanged)."""
    marks: dict = {"recache": [], "decode": []}
    recache, decode = pipe._recache_after_switch, pipe.vae.decode_to_pixel

    def timed_recache(output, current_start_frame, new_conditional_dict):
        a = clock.mark()
        log.tag = "recache"
        try:
            recache(output, current_start_frame, new_conditional_dict)
        finally:
            log.tag = None
        marks["recache"].append((current_start_frame // FRAMES_PER_BLOCK, a, clock.mark()))

    def timed_decode(latent, use_cache=False):
        a = clock.mark()
        out = decode(latent, use_cache=use_cache)
        marks["decode"].append((a, clock.mark()))
        return out

    pipe._recache_after_switch, pipe.vae.decode_to_pixel = timed_recache, timed_decode
    return marks


@torch.no_grad()
def run_video(pipe, log, clock, marks, noise, prompts, switch: int, dev: str) -> dict:
    log.clear()
    for v in marks.values():
        v.clear()
    sync(dev)
    t_start = time.perf_counter()
    t0 = clock.mark()
    video = pipe.inference(
        noise=noise,
        text_prompts_list=[[p] for p in prompts],
        switch_frame_indices=[switch],
        return_latents=False,
    )
    h0 = clock.mark()
    host = video[0].cpu()
    total = time.perf_counter() - t_start
    h1 = clock.mark()
    sync(dev)
    groups = log.blocks()
    frames = [9] + [12] * (len(groups) - 1)  # 1 + 4 (n - 1) frames from Wan's causal decode of n latents
    before = {blk: ("recache", a, b) for blk, a, b in marks["recache"]}
    blocks = end_decoded_blocks(clock, groups, marks["decode"][0], t0, clock.ms(h0, h1), frames, before)
    fin = bool(torch.isfinite(host).all())
    for b in blocks:
        b["finite"] = fin
    rec = [clock.ms(a, b) for _, a, b in marks["recache"]]
    return stream_result(
        blocks,
        total,
        total,
        FRAMES_PER_BLOCK * 4,
        first_latents_ms=blocks[0]["from_start_ms"],
        end_decode_ms=clock.ms(*marks["decode"][0]),
        host_copy_ms=clock.ms(h0, h1),
        recache_ms=rec,
        recache_passes=len(log.tagged),
        switch_block=switch // FRAMES_PER_BLOCK,
    )


def main() -> None:
    ap = base_parser(__doc__, "checkout of NVlabs/LongLive (v1.0)")
    ap.add_argument("--blocks", type=int, default=12, help="blocks of 3 latent frames (the example: 80)")
    ap.add_argument("--switch", type=int, default=18, help="the prompt switch, in latent frames")
    a = ap.parse_args()
    if a.switch % FRAMES_PER_BLOCK or not 0 < a.switch < a.blocks * FRAMES_PER_BLOCK:
        ap.error(f"--switch must be a multiple of 3 inside the video, got {a.switch}")
    ref_dir = a.ref.resolve()
    commit = checkout_commit(ref_dir, a.commit, open_checkout(ref_dir))
    ref = import_reference(ref_dir)
    dev = a.device
    dtype = torch.bfloat16 if dev.startswith("cuda") else torch.float32
    geo, hw, vae_dim = dict(WAN13), (60, 104), 96
    if a.small:
        geo.update(dim=64, num_heads=2, ffn_dim=128, num_layers=2, freq_dim=32, text_dim=32, text_len=8)
        hw, vae_dim = (8, 12), 8
        ADAPTER["rank"] = ADAPTER["alpha"] = 8
    g = torch.Generator().manual_seed(1)
    prompts = ["a red fox in the snow", "a city street at night"]
    table = {p: torch.randn(geo["text_len"], geo["text_dim"], generator=g).to(dev, dtype) for p in prompts}
    torch.set_grad_enabled(False)
    t = time.perf_counter()
    pipe = build(ref, geo, dev, vae_dim, table)
    pipe = pipe.to(dtype=dtype)  # the script: pipeline.to(dtype=torch.bfloat16), then to the device
    pipe.generator.to(device=dev)
    pipe.vae.to(device=dev)
    if a.small:
        small_caches(pipe, geo, hw)
    build_s = time.perf_counter() - t
    built(dev)
    clock = Clock(dev)
    log = PassLog(clock, pipe.generator)
    marks = timed_methods(pipe, log, clock)
    noise = torch.randn([1, a.blocks * FRAMES_PER_BLOCK, 16, *hw], device=dev, dtype=dtype)
    runs, first_run_s = run_repeats(
        lambda r: run_video(pipe, log, clock, marks, noise, prompts, a.switch, dev), a.repeats
    )
    meta = dict(
        reference="NVlabs/LongLive (v1.0)",
        reference_commit=commit,
        harness="scripts/reference_longlive_bench.py (interactive_inference.py: "
        "InteractiveCausalInferencePipeline.inference)",
        dtype=str(dtype).removeprefix("torch."),
        compile=None,
        attention=ref.attention,
        lora=f"peft LoRA rank {ADAPTER['rank']}, alpha {ADAPTER['alpha']}, un-merged (the script's)",
        lora_linears=sum(n.endswith(".lora_A") for n, _ in pipe.generator.model.named_modules()),
        decoder="LongLive WanVAEWrapper.decode_to_pixel (Wan 2.1 WanVAE_.decode, whole video after the loop)",
        geometry=dict(
            latent=list(hw),
            blocks=a.blocks,
            frames_per_block=FRAMES_PER_BLOCK,
            steps=[1000, 750, 500, 250],
            local_attn_size=LOCAL_ATTN,
            sink_size=SINK,
            switch_frame=a.switch,
            global_sink=True,
        ),
        small=a.small,
        build_s=build_s,
        fps_steady_rule="12 frames / (median block span of blocks 2.. + 1/n of the end decode and host copy)",
        ttff_rule="the whole run: the script decodes the video after its block loop",
    )
    report(summary(meta, runs, first_run_s, dev, ("denoise", "cache_pass", "decode")), "eager", a.out)


if __name__ == "__main__":
    main()
