"""Can L1 serve the selected forward's shared blocks? The reads-alone floor of the selected forward
(`floors.gather_blocks_sum`) with the positions spread so that programs running together on one SM
hold consecutive positions (H200).

    PYTHONPATH=. python3 scripts/probe_l1.py

On random inputs neighbouring positions share only their forced blocks (block 0 and the two local
ones: 3 of 16), and every read goes through L2 (136 GB at 64k, 9.5 TB/s: `floors.py`). CUDA hands
consecutive program ids to different SMs, so neighbours never meet in one SM's L1. Here program p
takes position (p % S) * chunk + p // S for S slots of the grid (the SM count, times the programs an
SM runs at once when `spread` says so): an SM's programs then walk neighbouring positions, and their
forced blocks could come from its L1 if the loads go through it (plain `ld.global`, not the
`cp.async` of a pipelined load, which bypasses L1; hence num_stages=1 rows). Every variant's sums
are checked against `gather_blocks_sum_reference`.
"""

import torch
import triton
import triton.language as tl

from nsa_eval.bench.kernels import _inputs, _time
from nsa_eval.kernels import floors, importance
from nsa_eval.kernels._triton_utils import load_kv, pow2
from nsa_eval.kernels.compression import compressed_attention

T = 65536


@triton.jit
def _gather_spread_kernel(
    K, V, BI, OUT, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, T, HKV, NSEL, SLOTS, CHUNK,
    DK: tl.constexpr, DV: tl.constexpr, BS: tl.constexpr, NP: tl.constexpr, SPREAD: tl.constexpr,
    CACHE: tl.constexpr,
):
    p = tl.program_id(0)
    t = p
    if SPREAD:
        t = (p % SLOTS) * CHUNK + p // SLOTS
    if t < T:
        i_bh = tl.program_id(1)
        i_b = (i_bh // HKV).to(tl.int64)
        i_hk = i_bh % HKV
        row = (i_b * T + t) * HKV + i_hk
        o_s = tl.arange(0, NP)
        idx = tl.load(BI + row * NSEL + o_s, mask=o_s < NSEL, other=-1)
        usable = (idx >= 0) & (idx <= t // BS)
        slot = tl.where(usable, tl.cumsum(usable.to(tl.int32), 0) - 1, -1)
        k_base = K + i_b * sk_b + i_hk * sk_h
        v_base = V + i_b * sv_b + i_hk * sv_h
        o_n = tl.arange(0, BS)
        o_dk = tl.arange(0, DK)
        o_dv = tl.arange(0, DV)
        acc_k = tl.zeros([BS, DK], tl.float32)
        acc_v = tl.zeros([BS, DV], tl.float32)
        for i in range(0, tl.sum(usable.to(tl.int32), 0)):
            blk = tl.sum(tl.where(slot == i, idx, 0), 0)
            o_k = blk * BS + o_n
            if CACHE == "":
                k, v = load_kv(k_base, v_base, o_k, o_k < T, sk_t, sv_t, o_dk, o_dv, DK, DV, False)
            else:
                k = tl.load(k_base + o_k[:, None].to(tl.int64) * sk_t + o_dk[None, :], cache_modifier=CACHE)
                v = tl.load(v_base + o_k[:, None].to(tl.int64) * sv_t + o_dv[None, :], cache_modifier=CACHE)
            acc_k += k.to(tl.float32)
            acc_v += v.to(tl.float32)
        tl.store(OUT + row, tl.sum(tl.sum(acc_k, 1), 0) + tl.sum(tl.sum(acc_v, 1), 0))


def gather_spread(k, v, bi, *, spread, slots, warps, stages, cache=""):
    B, T, HKV, DK = k.shape
    chunk = triton.cdiv(T, slots)
    out = torch.empty(B, T, HKV, device=k.device, dtype=torch.float32)
    _gather_spread_kernel[(slots * chunk if spread else T, B * HKV)](
        k, v, bi, out, *k.stride()[:3], *v.stride()[:3], T, HKV, bi.shape[-1], slots, chunk,
        DK=DK, DV=v.shape[3], BS=64, NP=pow2(bi.shape[-1], 1), SPREAD=spread, CACHE=cache,
        num_warps=warps, num_stages=stages,
    )
    return out


def main():
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    x = _inputs(1, T, 64, 4, 128, grad=False)
    with torch.no_grad():
        _, lse = compressed_attention(x["q"], x["k_cmp"], x["v_cmp"])
        bi = importance.select_blocks(x["q"], x["k_cmp"], lse=lse)
    k, v = x["k"], x["v"]
    want = floors.gather_blocks_sum_reference(k, v, bi)
    base = _time(lambda: floors.gather_blocks_sum(k, v, bi))
    print(f"floors.gather_blocks_sum (4 warps, 2 stages): {base:.3f} ms", flush=True)
    for warps in (1, 2, 4):
        for stages in (1, 2):
            for cache in ("", ".ca"):
                for spread, per_sm in ((False, 1), (True, 1), (True, 4), (True, 8), (True, 16)):
                    if cache and stages > 1:
                        continue

                    def run():
                        return gather_spread(k, v, bi, spread=spread, slots=sms * per_sm,  # noqa: B023
                                             warps=warps, stages=stages, cache=cache)  # noqa: B023

                    try:
                        same = torch.allclose(run(), want, rtol=1e-3, atol=1e-2)
                        ms = _time(run)
                    except Exception as err:  # a variant may not compile
                        print(f"warps={warps} stages={stages} failed: {str(err).splitlines()[0][:120]}")
                        continue
                    where = f"spread over {sms}x{per_sm} slots" if spread else "index order"
                    print(f"warps={warps} stages={stages} cache={cache or 'default'} {where}: {ms:.3f} ms "
                          f"({ms / base:.2f}x), sums ok={same}", flush=True)


if __name__ == "__main__":
    main()
