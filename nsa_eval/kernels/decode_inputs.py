"""A decode step's attention inputs from its one fused projection, in one Triton launch.

The model projects a decode token's hidden state through one matrix (`NSAAttention.decode_weight`:
q, k, v and the branches' own keys/values side by side, the gate logits after them). This kernel
splits that row: it rotates q, k and the window's keys (and the compression's for `"mean"`), takes
the three gates' sigmoids, and writes the keys/values straight into the cache's rows for the token
(`cache_nsa.DecodeStep`), where the unfused step ran some twenty small launches for the same work.

The arithmetic is the model's (`modeling_nsa.apply_rope`, `NSAAttention.project`): each product and
sum of the rotation rounds to the model's dtype as torch's elementwise ops do, and a gate is
`sigmoid` in float32 rounded once. `decode_inputs_reference` below is the same in PyTorch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nsa_eval.kernels._triton_utils import launcher, pow2, rotated_half, rounded


@triton.jit
def _rope(X, o_d, o_r, m_d, first_half, cos, sin):
    # x [BD] at X rotated half by cos/sin [BD] float32, rounded to X's dtype as torch does (`rotated_half`)
    x = tl.load(X + o_d, mask=m_d, other=0.0).to(tl.float32)
    x_swapped = tl.load(X + o_r, mask=m_d, other=0.0).to(tl.float32)
    return rotated_half(x, x_swapped, first_half, cos, sin, X.dtype.element_ty)


@triton.jit
def _decode_inputs_kernel(
    Y, G, COS, SIN, Q, GATES, K, V, KC, VC, KS, VS, POS, CROW, WROW,
    sy_b, sg_b, sk_b, sk_t, sv_b, sv_t, skc_b, skc_t, svc_b, svc_t, sks_b, sks_t, svs_b, svs_t, B,
    HQ: tl.constexpr, HKV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BDK: tl.constexpr,
    BDV: tl.constexpr, SHARED_KV: tl.constexpr, HAS_SWA: tl.constexpr, ROPE_CMP: tl.constexpr,
    GATE_SWA: tl.constexpr,
):
    # grid (Hq + Hkv, B): program i_h < Hq writes query head i_h and its three gates, the others KV head
    # i_h - Hq's keys/values into the cache (rows [.., Hkv, D] with a contiguous head and dim)
    i_h = tl.program_id(0)
    i_b = tl.program_id(1).to(tl.int64)
    HALF: tl.constexpr = DK // 2
    o_d = tl.arange(0, BDK)
    m_d = o_d < DK
    o_r = tl.where(o_d < HALF, o_d + HALF, o_d - HALF)  # the halves swapped
    first_half = o_d < HALF
    cos = tl.load(COS + o_d, mask=m_d, other=0.0).to(tl.float32)  # [BDK]
    sin = tl.load(SIN + o_d, mask=m_d, other=0.0).to(tl.float32)
    y = Y + i_b * sy_b
    # column offsets of y: q, k, v, then the compression's k, v and the window's k, v where they exist
    O_K: tl.constexpr = HQ * DK
    O_V: tl.constexpr = O_K + HKV * DK
    O_KC: tl.constexpr = O_V + HKV * DV
    O_VC: tl.constexpr = O_KC + HKV * DK
    O_KS: tl.constexpr = O_VC + HKV * DV
    O_VS: tl.constexpr = O_KS + HKV * DK
    if i_h < HQ:
        q = _rope(y + i_h * DK, o_d, o_r, m_d, first_half, cos, sin)
        tl.store(Q + (i_b * HQ + i_h) * DK + o_d, q, mask=m_d)
        g = G + i_b * sg_b + i_h * 3  # the head's logits, branches (cmp, slc, swa)
        gc = tl.sigmoid(tl.load(g).to(tl.float32))
        gs = tl.sigmoid(tl.load(g + 1).to(tl.float32))
        gw = tl.sigmoid(tl.load(g + 2).to(tl.float32))
        if not GATE_SWA:
            gw = gw * 0.0  # no window branch: its output is multiplied by 0
        GT: tl.constexpr = GATES.dtype.element_ty
        tl.store(GATES + i_b * HQ + i_h, rounded(gc, GT))
        tl.store(GATES + (B + i_b) * HQ + i_h, rounded(gs, GT))
        tl.store(GATES + (2 * B + i_b) * HQ + i_h, rounded(gw, GT))
    else:
        i_k = i_h - HQ
        o_v = tl.arange(0, BDV)
        m_v = o_v < DV
        pos = tl.load(POS)
        crow = tl.load(CROW)
        k = _rope(y + O_K + i_k * DK, o_d, o_r, m_d, first_half, cos, sin)
        v = tl.load(y + O_V + i_k * DV + o_v, mask=m_v, other=0.0)
        tl.store(K + i_b * sk_b + pos * sk_t + i_k * DK + o_d, k, mask=m_d)
        tl.store(V + i_b * sv_b + pos * sv_t + i_k * DV + o_v, v, mask=m_v)
        if SHARED_KV:  # the compression reads the selection's keys (before RoPE for "mlp") and values
            o_kc = O_K
            o_vc = O_V
        else:
            o_kc = O_KC
            o_vc = O_VC
        if ROPE_CMP:
            k_cmp = _rope(y + o_kc + i_k * DK, o_d, o_r, m_d, first_half, cos, sin)
        else:
            k_cmp = tl.load(y + o_kc + i_k * DK + o_d, mask=m_d, other=0.0)
        v_cmp = tl.load(y + o_vc + i_k * DV + o_v, mask=m_v, other=0.0)
        tl.store(KC + i_b * skc_b + crow * skc_t + i_k * DK + o_d, k_cmp, mask=m_d)
        tl.store(VC + i_b * svc_b + crow * svc_t + i_k * DV + o_v, v_cmp, mask=m_v)
        if HAS_SWA:
            wrow = tl.load(WROW)
            k_swa = _rope(y + O_KS + i_k * DK, o_d, o_r, m_d, first_half, cos, sin)
            v_swa = tl.load(y + O_VS + i_k * DV + o_v, mask=m_v, other=0.0)
            tl.store(KS + i_b * sks_b + wrow * sks_t + i_k * DK + o_d, k_swa, mask=m_d)
            tl.store(VS + i_b * svs_b + wrow * svs_t + i_k * DV + o_v, v_swa, mask=m_v)


def _check(y, g, cos, k, v, k_cmp_in, v_cmp_in, k_swa, v_swa, shared_kv):
    B, N = y.shape
    Hq, (Hkv, Dk), Dv = g.shape[1] // 3, k.shape[2:], v.shape[3]
    width = Hq * Dk + Hkv * (Dk + Dv) * (1 if shared_kv else 2 if k_swa is None else 3)
    if N < width or y.stride(1) != 1 or g.stride(1) != 1 or g.shape[0] != B:
        raise ValueError(f"decode_inputs: y must be [B, >= {width}] and g [B, 3 * Hq] with contiguous rows, "
                         f"got y {list(y.shape)}, g {list(g.shape)}")
    if Dk % 2 or list(cos.shape) != [1, Dk]:
        raise ValueError(f"decode_inputs: cos/sin must be [1, Dk] with Dk even, got {list(cos.shape)}, "
                         f"Dk={Dk}")
    for x in (k, v, k_cmp_in, v_cmp_in, k_swa, v_swa):
        if x is not None and (x.stride(3) != 1 or x.stride(2) != x.shape[3]):
            raise ValueError("decode_inputs: cache buffers need a contiguous [Hkv, D] per row")
    return B, Hq, Hkv, Dk, Dv


def decode_inputs(y, g, cos, sin, k, v, k_cmp_in, v_cmp_in, pos, cmp_in_row, *, k_swa=None, v_swa=None,
                  window_row=None, shared_kv: bool, rope_cmp_in: bool, gate_swa: bool):
    """One decode token's query and gates, its keys/values written into the cache: one launch.

    Args:
        y: `[B, N]` the token's projections, columns q `[Hq * Dk]`, k `[Hkv * Dk]` and v `[Hkv * Dv]`
            (keys before RoPE), then unless `shared_kv` the compression's k, v and, with `k_swa`, the
            window's k, v, each laid out `[Hkv * D]`; columns past those are not read.
        g: `[B, 3 * Hq]` gate logits laid out (head, branch), branches (cmp, slc, swa); may be a column
            slice of y.
        cos, sin: `[1, Dk]` the rotary tables of the token's position, in y's dtype (`rope_cos_sin`).
        k, v: `[B, S, Hkv, Dk]`, `[B, S, Hkv, Dv]` the cache's keys/values: row `pos` gets the rotated
            key and the value.
        k_cmp_in, v_cmp_in: `[B, l, Hkv, Dk]`, `[B, l, Hkv, Dv]` the ring of compression inputs: row
            `cmp_in_row` gets the compression's key (rotated if `rope_cmp_in`, as `"mean"` pools) and
            value, with `shared_kv` the selection's.
        pos, cmp_in_row, window_row: int64 `[1]` device rows (`DecodeStep`).
        k_swa, v_swa: `[B, W, Hkv, Dk]`, `[B, W, Hkv, Dv]` the window's ring (row `window_row` gets the
            rotated key and the value), or None where the window reads k, v.
        shared_kv: y holds one set of keys/values for every branch. gate_swa: False where the window
            branch is off (g_swa is then 0).

    Returns:
        q `[B, 1, Hq, Dk]` rotated, g_cmp, g_slc, g_swa `[B, 1, Hq]` (contiguous), in y's dtype.
    """
    B, Hq, Hkv, Dk, Dv = _check(y, g, cos, k, v, k_cmp_in, v_cmp_in, k_swa, v_swa, shared_kv)
    q = y.new_empty(B, 1, Hq, Dk)
    gates = y.new_empty(3, B, 1, Hq)
    has_swa = k_swa is not None
    ks, vs, wrow = (k_swa, v_swa, window_row) if has_swa else (k, v, pos)  # unread without HAS_SWA
    launcher(_decode_inputs_kernel)[(Hq + Hkv, B)](
        y, g, cos, sin, q, gates, k, v, k_cmp_in, v_cmp_in, ks, vs, pos, cmp_in_row, wrow,
        y.stride(0), g.stride(0), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cmp_in.stride(0), k_cmp_in.stride(1), v_cmp_in.stride(0), v_cmp_in.stride(1),
        ks.stride(0), ks.stride(1), vs.stride(0), vs.stride(1), B,
        HQ=Hq, HKV=Hkv, DK=Dk, DV=Dv, BDK=pow2(Dk), BDV=pow2(Dv), SHARED_KV=shared_kv, HAS_SWA=has_swa,
        ROPE_CMP=rope_cmp_in, GATE_SWA=gate_swa, num_warps=1,
        enable_fp_fusion=False)  # no fused multiply-add: torch rounds x * cos before the sum
    return q, *gates.unbind(0)


def _rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # modeling_nsa.apply_rope on x [B, 1, H, D] with cos/sin [1, D]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos[:, None, :] + torch.cat([-x2, x1], dim=-1) * sin[:, None, :]


def decode_inputs_reference(y, g, cos, sin, k, v, k_cmp_in, v_cmp_in, pos, cmp_in_row, *, k_swa=None,
                            v_swa=None, window_row=None, shared_kv: bool, rope_cmp_in: bool,
                            gate_swa: bool):
    """`decode_inputs` in PyTorch: the same arguments, writes and results."""
    B = y.shape[0]
    Hq, (Hkv, Dk), Dv = g.shape[1] // 3, k.shape[2:], v.shape[3]
    widths = [Hq * Dk, Hkv * Dk, Hkv * Dv]
    if not shared_kv:
        widths += [Hkv * Dk, Hkv * Dv] + ([Hkv * Dk, Hkv * Dv] if k_swa is not None else [])
    parts = y[:, : sum(widths)].split(widths, dim=1)
    heads = [p.view(B, 1, Hq if i == 0 else Hkv, -1) for i, p in enumerate(parts)]  # [B, 1, H, D] each
    q, k_new, v_new = _rope_reference(heads[0], cos, sin), _rope_reference(heads[1], cos, sin), heads[2]
    k_cmp, v_cmp = (heads[1], heads[2]) if shared_kv else (heads[3], heads[4])
    if rope_cmp_in:
        k_cmp = _rope_reference(k_cmp, cos, sin)
    writes = [(k, pos, k_new), (v, pos, v_new), (k_cmp_in, cmp_in_row, k_cmp), (v_cmp_in, cmp_in_row, v_cmp)]
    if k_swa is not None:
        writes += [(k_swa, window_row, _rope_reference(heads[5], cos, sin)), (v_swa, window_row, heads[6])]
    for buffer, row, x in writes:
        buffer.index_copy_(1, row, x.to(buffer.dtype))
    gates = torch.sigmoid(g.float()).view(B, 1, Hq, 3).to(y.dtype)  # [B, 1, Hq, 3]
    g_cmp, g_slc, g_swa = (x.contiguous() for x in gates.unbind(-1))
    if not gate_swa:
        g_swa = torch.zeros_like(g_swa)
    return q, g_cmp, g_slc, g_swa
