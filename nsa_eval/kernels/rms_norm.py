"""The decoder's residual add and the RMSNorm after it in one Triton launch, for the decode step.

`NSABlock` runs `x = x + attn(attn_norm(x)); x = x + mlp(mlp_norm(x))`: at one token a row, each add
and each norm (six elementwise launches in torch) is a launch of its own. `add_rms_norm` gives the
new residual stream and its normalised copy from one launch, so a layer's two adds and two norms are
two launches. The arithmetic is `modeling_nsa.RMSNorm`'s: the add rounds to the stream's dtype, the
norm runs in float32, rounds to that dtype, then multiplies by the weight and rounds again.
`add_rms_norm_reference` below is the same in PyTorch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nsa_eval.kernels._triton_utils import launcher, pow2, rounded


@triton.jit
def _add_rms_norm_kernel(X, R, W, H, Y, eps, C: tl.constexpr, BC: tl.constexpr, HAS_R: tl.constexpr):
    # one row of C per program; X, R, H, Y contiguous [N, C], W [C]
    i_n = tl.program_id(0).to(tl.int64)
    o_c = tl.arange(0, BC)
    m_c = o_c < C
    DT: tl.constexpr = X.dtype.element_ty
    h = tl.load(X + i_n * C + o_c, mask=m_c, other=0.0).to(tl.float32)  # [BC]
    if HAS_R:
        h = rounded(h + tl.load(R + i_n * C + o_c, mask=m_c, other=0.0).to(tl.float32), DT)
        tl.store(H + i_n * C + o_c, h, mask=m_c)
    r = tl.rsqrt(tl.sum(h * h, 0) / C + eps)
    y = rounded(h * r, DT)
    w = tl.load(W + o_c, mask=m_c, other=0.0).to(tl.float32)
    tl.store(Y + i_n * C + o_c, rounded(w * y, Y.dtype.element_ty), mask=m_c)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """`h = x + residual`, then `RMSNorm(h)` with `weight`, in one launch.

    Args:
        x: `[..., C]` the residual stream; residual: the same shape and dtype (a block's output), or
            None to normalise `x` alone. weight: `[C]` the norm's scale. eps: the norm's epsilon.

    Returns:
        h `[..., C]` in x's dtype (x itself when residual is None), y `[..., C]` the normalised h in the
        dtype of `weight * h` (torch's promotion).
    """
    C = x.shape[-1]
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"add_rms_norm: residual must match x {list(x.shape)} {x.dtype}, got "
                         f"{list(residual.shape)} {residual.dtype}")
    if list(weight.shape) != [C]:
        raise ValueError(f"add_rms_norm: weight must be [{C}], got {list(weight.shape)}")
    x = x.contiguous()
    h = x if residual is None else torch.empty_like(x)
    y = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    BC = pow2(C)
    launcher(_add_rms_norm_kernel)[(x.numel() // max(C, 1),)](
        x, x if residual is None else residual.contiguous(), weight, h, y, float(eps), C=C, BC=BC,
        HAS_R=residual is not None, num_warps=max(1, min(8, BC // 256)),
        enable_fp_fusion=False)  # no fused multiply-add: torch rounds each product on its own
    return h, y


def add_rms_norm_reference(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """`add_rms_norm` in PyTorch (`modeling_nsa.RMSNorm` after the add): the same arguments and results."""
    h = x if residual is None else x + residual
    h32 = h.float()
    h32 = h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + eps)
    return h, weight * h32.to(h.dtype)
