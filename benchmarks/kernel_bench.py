"""Micro-benchmarks of the Triton kernels at real model shapes, against the device's measured copy
bandwidth and against their torch references; plus the SSD prefill of one mamba2-130m layer against
HF's torch path.

    python benchmarks/kernel_bench.py                 # on a CUDA GPU (the prepared device check)
    python benchmarks/kernel_bench.py --small         # tiny shapes, any device (CPU: interpreter)

Per kernel it prints: time (median of triton.testing.do_bench), the bytes the kernel must move at
least (inputs read once, outputs and states written once), the achieved bandwidth, that bandwidth as a
fraction of the measured copy bandwidth (a large device-to-device copy, read + write), and the torch
reference's time. Targets (issue "Triton kernels"): the Mamba2 selective state update at batch 256
reaches >= 70% of copy bandwidth; the SSD prefill of 128 x 64 tokens (mamba2-130m layer) beats HF's
torch path >= 20x.
"""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")      # before toolkit.kernels defines the kernels

import triton

sys.path.insert(0, os.path.dirname(__file__))
from toolkit.attention.mamba2 import compute_chunk_metadata
from toolkit.attention.paged_attn import PagedAttentionMetadata
from toolkit.layers import ops as ops_mod

from table import print_markdown_table


@dataclass
class Case:
    kernel: str
    shape: str
    min_bytes: int
    run_triton: Callable[[], object]
    run_torch: Callable[[], object] | None


def bench_ms(fn: Callable[[], object], device: torch.device) -> float:
    if device.type == "cuda":
        return float(triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median"))
    import time
    fn()
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """bytes/s of a device-to-device copy (read + write counted)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src), device)
    return 2 * nbytes / (ms * 1e-3)


def esize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def cases(device: torch.device, dtype: torch.dtype, small: bool) -> list[Case]:
    tri = ops_mod.triton_ops(device)
    ref = ops_mod.TORCH_OPS
    g = torch.Generator(device="cpu").manual_seed(0)

    def rnd(*shape, dt=dtype, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dt)

    out: list[Case] = []
    e = esize(dtype)
    f32 = torch.float32

    # Mamba2 selective state update: mamba2-130m layer, decode batch B
    H, P, N, G = (4, 8, 16, 1) if small else (24, 64, 128, 1)
    for b in ([2] if small else [1, 32, 128, 256]):
        state = rnd(b + 1, H, P, N, dt=f32)
        x, dt_, A = rnd(b, H, P), rnd(b, H, dt=f32).abs() * 0.1, -rnd(H, dt=f32).abs()
        B, C, D = rnd(b, G, N), rnd(b, G, N), rnd(H, dt=f32)
        idx = torch.arange(1, b + 1, device=device, dtype=torch.int32)
        nbytes = 2 * b * H * P * N * 4 + b * H * P * (e + 4) + 2 * b * G * N * e + b * H * 4
        out.append(Case("mamba2 state update", f"B={b} H={H} P={P} N={N}", nbytes,
                        lambda s=state, x=x, d=dt_, A=A, B=B, C=C, D=D, i=idx:
                            tri.mamba2_update(s, x, d, A, B, C, D, i),
                        lambda s=state, x=x, d=dt_, A=A, B=B, C=C, D=D, i=idx:
                            ref.mamba2_update(s, x, d, A, B, C, D, i)))

    # the same update as the model calls it: raw dt (a column of in_proj's output) prepared in the kernel
    b = 2 if small else 256
    state = rnd(b + 1, H, P, N, dt=f32)
    x, dt_raw, dt_bias, A = rnd(b, H, P), rnd(b, H), rnd(H), -rnd(H, dt=f32).abs()
    B, C, D = rnd(b, G, N), rnd(b, G, N), rnd(H, dt=f32)
    idx = torch.arange(1, b + 1, device=device, dtype=torch.int32)
    nbytes = 2 * b * H * P * N * 4 + b * H * P * (e + 4) + 2 * b * G * N * e + b * H * e
    lim = (0.0, float("inf"))
    out.append(Case("mamba2 state update, raw dt", f"B={b} H={H} P={P} N={N}", nbytes,
                    lambda a=(state, x, dt_raw, A, B, C, D, idx, dt_bias, lim): tri.mamba2_update(*a),
                    lambda a=(state, x, dt_raw, A, B, C, D, idx, dt_bias, lim): ref.mamba2_update(*a)))

    # RMS norms: every block's (mamba2-130m hidden 768) and Mamba2's gated norm (1536 channels, one group)
    for tokens in ([3] if small else [1, 256, 8192]):
        hid = 40 if small else 768
        xn, wn = rnd(tokens, hid), rnd(hid)
        out.append(Case("rms norm", f"T={tokens} D={hid}", 2 * tokens * hid * e + hid * e,
                        lambda x=xn, w=wn: tri.rms_norm(x, w, 1e-5), lambda x=xn, w=wn: ref.rms_norm(x, w, 1e-5)))
    for tokens in ([3] if small else [1, 256]):
        inter = 48 if small else 1536
        y, z, wn = rnd(tokens, inter, dt=f32), rnd(tokens, inter), rnd(inter)
        out.append(Case("gated rms norm", f"T={tokens} D={inter}", tokens * inter * (4 + 2 * e) + inter * e,
                        lambda y=y, z=z, w=wn, g=inter: tri.rms_norm_gated(y, z, w, g, 1e-5, False, False, dtype),
                        lambda y=y, z=z, w=wn, g=inter: ref.rms_norm_gated(y, z, w, g, 1e-5, False, False, dtype)))

    # RoPE on q and k: lfm2-350m attention (16 / 8 heads, head_dim 64)
    from toolkit.layers.rotary import default_inv_freq
    rq, rk, rd = (4, 2, 16) if small else (16, 8, 64)
    for tokens in ([3] if small else [1, 256]):
        q, k = rnd(tokens, rq, rd), rnd(tokens, rk, rd)
        pos = torch.arange(tokens, device=device) + 1000
        inv = default_inv_freq(rd, 1e6).to(device)
        out.append(Case("rotary q+k", f"T={tokens} Hq={rq} Hkv={rk} D={rd}",
                        2 * tokens * (rq + rk) * rd * e + tokens * 8,
                        lambda q=q, k=k, p=pos, i=inv: tri.rotary(p, q, k, i, 1.0, rd),
                        lambda q=q, k=k, p=pos, i=inv: ref.rotary(p, q, k, i, 1.0, rd)))

    # Mamba1 selective state update: mamba-130m layer
    Di, N1 = (16, 16) if small else (1536, 16)
    for b in ([2] if small else [1, 128, 256]):
        state = rnd(b + 1, Di, N1, dt=f32)
        x, dt_, A = rnd(b, Di), rnd(b, Di, dt=f32).abs() * 0.1, -rnd(Di, N1, dt=f32).abs()
        B, C, D = rnd(b, N1), rnd(b, N1), rnd(Di, dt=f32)
        idx = torch.arange(1, b + 1, device=device, dtype=torch.int32)
        nbytes = 2 * b * Di * N1 * 4 + b * Di * (e + 8) + Di * N1 * 4
        out.append(Case("mamba1 state update", f"B={b} Di={Di} N={N1}", nbytes,
                        lambda s=state, x=x, d=dt_, A=A, B=B, C=C, D=D, i=idx:
                            tri.mamba1_update(s, x, d, A, B, C, D, i),
                        lambda s=state, x=x, d=dt_, A=A, B=B, C=C, D=D, i=idx:
                            ref.mamba1_update(s, x, d, A, B, C, D, i)))

    # Gated DeltaNet decode update: Qwen3-Next layer (Hk 16, Hv 32, K = V = 128)
    hk, hv, dk = (2, 4, 16) if small else (16, 32, 128)
    for b in ([2] if small else [1, 128]):
        state = rnd(b + 1, hv, dk, dk, dt=f32)
        q, k, v = rnd(b, hk, dk), rnd(b, hk, dk), rnd(b, hv, dk)
        gate, beta = -rnd(b, hv, dt=f32).abs() * 0.1, rnd(b, hv, dt=f32).sigmoid()
        idx = torch.arange(1, b + 1, device=device, dtype=torch.int32)
        nbytes = 2 * b * hv * dk * dk * 4 + b * (2 * hk * dk + hv * dk) * e + b * hv * dk * 4
        out.append(Case("gdn state update", f"B={b} Hv={hv} K=V={dk}", nbytes,
                        lambda s=state, q=q, k=k, v=v, a=gate, bt=beta, i=idx: tri.gdn_update(s, q, k, v, a, bt, i),
                        lambda s=state, q=q, k=k, v=v, a=gate, bt=beta, i=idx: ref.gdn_update(s, q, k, v, a, bt, i)))

    # causal conv1d decode update: mamba2-130m xBC (Dc 1792, K 4) and lfm2-350m short conv (1024, K 3)
    for dc, k, act in ([(24, 4, "silu")] if small else [(1792, 4, "silu"), (1024, 3, None)]):
        for b in ([2] if small else [1, 256]):
            state = rnd(b + 1, k - 1, dc)
            x, w, bias = rnd(b, dc), rnd(dc, k), rnd(dc)
            idx = torch.arange(1, b + 1, device=device, dtype=torch.int32)
            nbytes = (2 * b * (k - 1) * dc + 2 * b * dc + dc * (k + 1)) * e
            out.append(Case("conv1d update", f"B={b} Dc={dc} K={k}", nbytes,
                            lambda s=state, x=x, w=w, bb=bias, i=idx, a=act: tri.conv_update(x, s, i, w, bb, a),
                            lambda s=state, x=x, w=w, bb=bias, i=idx, a=act: ref.conv_update(x, s, i, w, bb, a)))

    # prefill: 128 sequences x 64 tokens (small: 3 x 9)
    nseq, seqlen = (3, 9) if small else (128, 64)
    t = nseq * seqlen
    lens = torch.full((nseq,), seqlen)
    cu = torch.zeros(nseq + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lens, 0)
    cu = cu.to(device)
    slots = torch.arange(1, nseq + 1, device=device, dtype=torch.int32)
    no_init = torch.zeros(nseq, dtype=torch.bool, device=device)
    for dc, k, act in ([(24, 4, "silu")] if small else [(1792, 4, "silu"), (1024, 3, None)]):
        state = rnd(nseq + 1, k - 1, dc)
        x, w, bias = rnd(t, dc), rnd(dc, k), rnd(dc)
        nbytes = (2 * t * dc + nseq * (k - 1) * dc + dc * (k + 1)) * e
        out.append(Case("conv1d prefill", f"{nseq}x{seqlen} Dc={dc} K={k}", nbytes,
                        lambda s=state, x=x, w=w, bb=bias, a=act: tri.conv_prefill(x, s, slots, no_init, cu, w, bb, a),
                        lambda s=state, x=x, w=w, bb=bias, a=act: ref.conv_prefill(x, s, slots, no_init, cu, w, bb, a)))

    chunk = 8 if small else 256
    cu_chunk, seq_idx, last_chunk = (torch.from_numpy(a).to(device) for a in
                                     compute_chunk_metadata(lens.numpy(), np.zeros(nseq, dtype=np.int64), chunk))
    state = rnd(nseq + 1, H, P, N, dt=f32)
    x, dt_, A = rnd(t, H, P), rnd(t, H, dt=f32).abs() * 0.1, -rnd(H, dt=f32).abs()
    B, C, D = rnd(t, G, N), rnd(t, G, N), rnd(H, dt=f32)
    nbytes = t * H * P * (e + 4) + 2 * t * G * N * e + t * H * 4 + nseq * H * P * N * 4
    ssd_args = (x, dt_, A, B, C, D, cu_chunk, seq_idx, last_chunk, chunk, state, slots, no_init)
    out.append(Case("ssd scan (mamba2 prefill)", f"{nseq}x{seqlen} H={H} P={P} N={N}", nbytes,
                    lambda: tri.ssd_scan(*ssd_args), lambda: ref.ssd_scan(*ssd_args)))

    state1 = rnd(nseq + 1, Di, N1, dt=f32)
    x1, dt1, A1 = rnd(t, Di), rnd(t, Di, dt=f32).abs() * 0.1, -rnd(Di, N1, dt=f32).abs()
    B1, C1, D1 = rnd(t, N1), rnd(t, N1), rnd(Di, dt=f32)
    nbytes = t * Di * (e + 8) + 2 * t * N1 * e + nseq * Di * N1 * 4
    m1_args = (x1, dt1, A1, B1, C1, D1, cu, state1, slots, no_init)
    out.append(Case("mamba1 scan (prefill)", f"{nseq}x{seqlen} Di={Di} N={N1}", nbytes,
                    lambda: tri.mamba1_scan(*m1_args), lambda: ref.mamba1_scan(*m1_args)))

    # paged attention, lfm2-350m layer: decode rows over a long context, and a mixed batch
    hq, hkv, hd, bs = (4, 2, 16, 4) if small else (16, 8, 64, 16)
    for rows, ctx in ([(2, 9)] if small else [(1, 1024), (128, 1024)]):
        blocks_per = -(-ctx // bs)
        cache = rnd(rows * blocks_per + 1, 2, bs, hkv, hd)
        table = (torch.arange(rows * blocks_per, dtype=torch.int32) + 1).view(rows, blocks_per).to(device)
        q = rnd(rows, hq, hd)
        qsl = torch.arange(rows + 1, dtype=torch.int32)
        seq = torch.full((rows,), ctx, dtype=torch.int32)
        md = PagedAttentionMetadata(num_actual_tokens=rows, num_reqs=rows, max_query_len=1, max_seq_len=ctx,
                                    block_size=bs, query_start_loc=qsl.to(device), query_start_loc_cpu=qsl,
                                    seq_lens=seq.to(device), seq_lens_cpu=seq, block_table=table,
                                    slot_mapping=torch.zeros(rows, dtype=torch.int64, device=device))
        nbytes = rows * ctx * hkv * hd * 2 * e + 2 * rows * hq * hd * e
        scale = hd ** -0.5
        out.append(Case("paged attention decode", f"B={rows} ctx={ctx} Hq={hq} Hkv={hkv} D={hd}", nbytes,
                        lambda q=q, c=cache, m=md, s=scale: tri.paged_attention(q, c, m, s),
                        lambda q=q, c=cache, m=md, s=scale: ref.paged_attention(q, c, m, s)))

    # Gumbel-max sampling over a large vocabulary
    for b, v in ([(2, 37)] if small else [(1, 151936), (256, 151936)]):
        scaled = rnd(b, v, dt=f32)
        seeds = torch.randint(0, 2**32, (b, 2), generator=g, dtype=torch.int64).to(device)
        pos = torch.arange(b, device=device)
        out.append(Case("gumbel argmax", f"B={b} V={v}", b * v * 4,
                        lambda s=scaled, sd=seeds, p=pos: tri.gumbel_argmax(s, sd, p),
                        lambda s=scaled, sd=seeds, p=pos: ref.gumbel_argmax(s, sd, p)))
    return out


def ssd_layer_vs_hf(device: torch.device, dtype: torch.dtype, small: bool) -> list[str]:
    """One Mamba2 layer, prefill of nseq x seqlen tokens: HF's torch path vs our mixer (Triton ops)."""
    from transformers import Mamba2Config
    from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer as HFMixer

    from toolkit.layers.mamba2_mixer import Mamba2Mixer
    from toolkit.models.presets import PRESETS
    cfg: Mamba2Config = PRESETS["tiny-mamba2" if small else "mamba2-130m-shape"]()
    nseq, seqlen = (3, 9) if small else (128, 64)
    hf = HFMixer(cfg, layer_idx=0).to(device=device, dtype=dtype).eval()
    ours = Mamba2Mixer(layer_name="bench", hidden_size=cfg.hidden_size, num_heads=cfg.num_heads,
                       head_dim=cfg.head_dim, state_size=cfg.state_size, n_groups=cfg.n_groups,
                       conv_kernel=cfg.conv_kernel, chunk_size=cfg.chunk_size, use_bias=cfg.use_bias,
                       use_conv_bias=cfg.use_conv_bias, norm_eps=cfg.layer_norm_epsilon,
                       time_step_limit=cfg.time_step_limit).to(device=device, dtype=dtype).eval()
    ours.load_state_dict(hf.state_dict())
    ours.ops = ops_mod.triton_ops(device)
    hidden = torch.randn(nseq, seqlen, cfg.hidden_size, device=device, dtype=dtype)
    with torch.inference_mode():
        diff = (hf(hidden).float().view(-1, cfg.hidden_size) - _ours_prefill(ours, hidden).float()).abs().max()
        hf_ms = bench_ms(lambda: hf(hidden), device)      # no mamba_ssm installed: HF's torch path
        ours_ms = bench_ms(lambda: _ours_prefill(ours, hidden), device)
    return [f"mamba2 layer prefill {nseq}x{seqlen}", f"{hf_ms:.3f}", f"{ours_ms:.3f}", f"{hf_ms / ours_ms:.1f}x",
            f"{diff.item():.1e}"]


def _ours_prefill(mixer, hidden: torch.Tensor):
    """Our mixer on nseq independent sequences (zero initial states) through real Mamba2 metadata."""
    from types import SimpleNamespace
    nseq, seqlen, hs = hidden.shape
    dev = hidden.device
    if not hasattr(mixer, "_bench_md"):
        lens = torch.full((nseq,), seqlen)
        cu = torch.zeros(nseq + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(lens, 0)
        cu_chunk, seq_idx, last = (torch.from_numpy(a).to(dev) for a in
                                   compute_chunk_metadata(lens.numpy(), torch.zeros(nseq, dtype=torch.int64).numpy(),
                                                          mixer.chunk_size))
        shapes, dtypes = mixer.state_shapes(), mixer.state_dtypes()
        mixer.bind_kv_cache([torch.zeros(nseq + 1, *s, dtype=d, device=dev) for s, d in zip(shapes, dtypes)])
        mixer._bench_md = {"bench": SimpleNamespace(
            num_decodes=0, num_decode_tokens=0, num_prefills=nseq, num_prefill_tokens=nseq * seqlen,
            state_indices_tensor_p=torch.arange(1, nseq + 1, dtype=torch.int32, device=dev),
            has_initial_states_p=torch.zeros(nseq, dtype=torch.bool, device=dev), query_start_loc_p=cu.to(dev),
            cu_chunk_seqlen_p=cu_chunk, seq_idx_p=seq_idx, last_chunk_indices_p=last, chunk_size=mixer.chunk_size)}
    return mixer(hidden.view(-1, hs), mixer._bench_md)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--small", action="store_true", help="tiny shapes (CPU interpreter smoke run)")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"])
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype)
    print(f"device {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu (interpreter)'}, "
          f"torch {torch.__version__}, triton {triton.__version__}, dtype {args.dtype}")
    bw = copy_bandwidth(device, (1 << 20) if args.small else (1 << 30))
    print(f"measured copy bandwidth (read + write): {bw / 1e12:.2f} TB/s\n")
    rows = []
    for case in cases(device, dtype, args.small):
        ms = bench_ms(case.run_triton, device)
        ref_ms = bench_ms(case.run_torch, device) if case.run_torch else float("nan")
        gbs = case.min_bytes / (ms * 1e-3)
        rows.append([case.kernel, case.shape, f"{ms * 1e3:.1f}", f"{case.min_bytes / 1e6:.2f}",
                     f"{gbs / 1e9:.0f}", f"{100 * gbs / bw:.0f}%", f"{ref_ms * 1e3:.1f}", f"{ref_ms / ms:.1f}x"])
    print_markdown_table(["kernel", "shape", "triton µs", "min MB", "GB/s", "of copy bw", "torch ref µs",
                          "speed-up"], rows)
    print()
    print_markdown_table(["layer", "HF torch ms", "ours (triton) ms", "speed-up", "max |out diff|"],
                         [ssd_layer_vs_hf(device, dtype, args.small)])


if __name__ == "__main__":
    main()
