"""GPU parity of the Wan decoder's fast paths (issue 17): random 2.1 / 2.2 weights, bf16, a stream of
1 + 4 latent frames at a reduced size, each fast mode vs the plain decoder in fp32 (the reference) next to
the plain decoder in bf16 (what bf16 alone costs). Prints one line per (variant, mode); JSON to argv[1]."""

import copy
import json
import os
import sys

import torch

from cadence.model.vae import WanVAE, wan_vae_config
from cadence.runtime.vae_fast import accelerate_decoder


def run(vae, z, sizes):
    st = vae.stream()
    outs, i = [], 0
    for n in sizes:
        outs.append(st.decode_chunk(z[:, i : i + n].to(vae.param_dtype())).float())
        i += n
    return torch.cat(outs, 1)


def rel(a, b):
    return float((a - b).norm() / b.norm())


rows = []
for variant, (h, w), lf in (("2.2", (176, 272), 1), ("2.1", (240, 416), 3)):
    torch.manual_seed(0)
    ref32 = WanVAE(wan_vae_config(variant)).cuda().eval()
    with torch.no_grad():
        for name, p in ref32.named_parameters():
            if name.endswith("gamma"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    s = ref32.stride
    sizes = [1] + [lf] * 3
    z = torch.randn(ref32.z_dim, sum(sizes), h // s[1], w // s[2], device="cuda")
    want = run(ref32, z, sizes)
    plain16 = copy.deepcopy(ref32).to(torch.bfloat16)
    base = rel(run(plain16, z, sizes), want)
    rows.append(dict(variant=variant, mode="plain-bf16", rel_vs_fp32=base))
    for mode in os.environ.get("PARITY_MODES", "cl compile fold").split():
        fast = copy.deepcopy(plain16)
        rep = accelerate_decoder(fast, mode)
        got = run(fast, z, sizes)
        got = run(fast, z, sizes)  # second stream: the compiled graphs
        rows.append(
            dict(
                variant=variant,
                mode=mode,
                applied=rep.describe(),
                rel_vs_fp32=rel(got, want),
                rel_vs_plain_bf16=rel(got, run(plain16, z, sizes)),
            )
        )
    del ref32, plain16
    torch.cuda.empty_cache()
for r in rows:
    print(
        f"parity {r['variant']} {r['mode']:10} rel vs fp32 {r['rel_vs_fp32']:.2e}"
        + (f"  vs plain bf16 {r['rel_vs_plain_bf16']:.2e}  [{r['applied']}]" if "applied" in r else "")
    )
json.dump(rows, open(sys.argv[1], "w"), indent=1)
