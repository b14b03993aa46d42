"""The Triton NSA kernels on a CUDA GPU, in bf16, against the float32 PyTorch reference, up to
T = 64k; gradients at moderate T; decode against prefill.
Run with `pytest -m gpu tests/kernels/test_gpu.py`."""

import functools

import pytest
import torch

from nsa_eval.kernels import reference as ref

pytestmark = pytest.mark.gpu

BF16_TOL = 2e-2  # bf16 operands, float32 accumulation


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30)).item()


def make(B, T, hq, hkv, d, dtype=torch.bfloat16, seed=0, grad=False, dv=None):
    g = torch.Generator(device="cuda").manual_seed(seed)
    tc = (T - 32) // 16 + 1
    dv = dv or d

    def rnd(*shape):
        return torch.randn(*shape, generator=g, device="cuda").to(dtype).requires_grad_(grad)

    return dict(q=rnd(B, T, hq, d), k=rnd(B, T, hkv, d), v=rnd(B, T, hkv, dv), k_cmp=rnd(B, tc, hkv, d),
                v_cmp=rnd(B, tc, hkv, dv))


def importance(q, k_cmp, block_len=32, stride=16, select_size=64):
    """Reference importances [B, T, Hkv, Ns] (float32), row by row chunks."""
    B, T = q.shape[:2]
    ns = -(-T // select_size)
    w = ref._overlap_weights(k_cmp.shape[1], ns, block_len, stride, select_size, q.device)
    out = []
    for start in range(0, T, 512):
        pos = torch.arange(start, min(T, start + 512), device=q.device).expand(B, -1)
        p = ref._compressed_chunk(q[:, start:start + 512].float(), pos, k_cmp.float(), k_cmp.float()[..., :1],
                                  block_len, stride, q.shape[-1] ** -0.5)[2]
        out.append(p.sum(3) @ w)
    return torch.cat(out, 1)


def assert_same_selection(idx, idx_ref, importances, rel=1e-3):
    """idx, idx_ref [B, T, Hkv, n] may differ only by blocks of equal importance (up to rel);
    importances() gives the rows' reference importances [B, T, Hkv, Ns], computed on a mismatch."""
    assert idx.shape == idx_ref.shape
    diff = (idx != idx_ref).any(-1)
    if not diff.any():
        return
    imp = importances()
    for b, t, h in diff.nonzero().tolist()[:200]:
        a = set(idx[b, t, h].tolist()) - {-1}
        r = set(idx_ref[b, t, h].tolist()) - {-1}
        assert len(a) == len(r)
        sa = sorted(imp[b, t, h, list(a - r)].tolist())
        sr = sorted(imp[b, t, h, list(r - a)].tolist())
        assert sa == pytest.approx(sr, rel=rel, abs=1e-6), (b, t, h, sa, sr)


@pytest.mark.parametrize("T,hq,hkv", [(1024, 16, 1), (8192, 16, 4), (8192, 12, 4), (65536, 16, 1)],
                         ids=["T1k-G16", "T8k-G4", "T8k-G3", "T64k-G16"])
def test_forward_bf16_vs_reference(T, hq, hkv):
    from nsa_eval.kernels.compression import compressed_attention
    from nsa_eval.kernels.importance import select_blocks
    from nsa_eval.kernels.selection import selected_attention
    from nsa_eval.kernels.window import sliding_window_attention

    x = make(1, T, hq, hkv, 128)
    with torch.no_grad():
        o, lse = compressed_attention(x["q"], x["k_cmp"], x["v_cmp"])
        o_ref, lse_ref = ref.compressed_attention(x["q"], x["k_cmp"], x["v_cmp"])
        assert rel_err(o, o_ref) < BF16_TOL
        fin = torch.isfinite(lse_ref)
        assert torch.equal(fin, torch.isfinite(lse)) and rel_err(lse[fin], lse_ref[fin]) < 1e-3

        idx = select_blocks(x["q"], x["k_cmp"], lse=lse)
        idx_ref = ref.select_blocks(x["q"], x["k_cmp"])
        assert_same_selection(idx, idx_ref, lambda: importance(x["q"], x["k_cmp"]))

        o = selected_attention(x["q"], x["k"], x["v"], idx_ref)
        assert rel_err(o, ref.selected_attention(x["q"], x["k"], x["v"], idx_ref)) < BF16_TOL
        o = sliding_window_attention(x["q"], x["k"], x["v"])
        assert rel_err(o, ref.sliding_window_attention(x["q"], x["k"], x["v"])) < BF16_TOL


def topk_by_rule(imp, *, T, hkv, select_size, n, num_init=1, num_local=2, positions=None):
    """The rows' blocks by the rule, in torch: int64 keys (importance bits, then the block index
    reversed) so that ties go to the lower index, forced blocks first, no block after t; ascending,
    -1 padded. imp [rows, Ns] float32 >= 0 -> int32 [rows, n]."""
    rows, ns = imp.shape
    r = torch.arange(rows, device=imp.device)
    t = positions.long() if positions is not None else (r // hkv) % T
    cur = (t // select_size)[:, None]  # [rows, 1]
    j = torch.arange(ns, device=imp.device)[None, :]
    forced = (j < num_init) | (j > cur - num_local)
    bits = torch.where(forced, float("inf"), imp + 0.0).view(torch.int32).long()  # ordered like the values
    key = torch.where(j <= cur, (bits << 32) + (ns - 1 - j), -1)
    top = key.topk(n, dim=1).values
    blk = torch.where(top >= 0, ns - 1 - (top & 0xFFFFFFFF), ns).sort(dim=1).values
    return torch.where(blk == ns, -1, blk).int()


@pytest.mark.parametrize("T,hq", [(65536, 64), (65536, 16), (8192, 64)],
                         ids=["T64k-G16", "T64k-G4", "T8k-G16"])
def test_topk_matches_rule(T, hq):
    """`topk_blocks` (the lean filter at its register cap, the arg-max passes for the rows it leaves)
    on the benchmark's importances (4 KV heads) takes the blocks of the rule, computed in torch; and so
    does a decode-sized call (64 rows at given positions, which runs over 4 warps)."""
    from nsa_eval.kernels import topk
    from nsa_eval.kernels.compression import compressed_attention
    from nsa_eval.kernels.importance import block_importance

    x = make(1, T, hq, 4, 128)
    with torch.no_grad():
        _, lse = compressed_attention(x["q"], x["k_cmp"], x["v_cmp"])
        imp = block_importance(x["q"], x["k_cmp"], lse, block_len=32, stride=16, select_size=64,
                               scale=128 ** -0.5)
    got = topk.topk_blocks(imp, T=T, num_kv_heads=4, select_size=64, num_selected=16, num_init=1, num_local=2)
    for rows in torch.arange(imp.shape[0], device="cuda").split(32768):  # the keys' memory in parts
        want = topk_by_rule(imp[rows], T=T, hkv=4, select_size=64, n=16, positions=rows // 4)
        assert torch.equal(got[rows], want)
    rows = torch.arange(T * 4 - 64 * 97, T * 4, 97, device="cuda")  # 64 rows (b, t, h_kv) of the last
    few = topk.topk_blocks(imp[rows], T=T, num_kv_heads=1, select_size=64, num_selected=16, num_init=1,
                           num_local=2, positions=(rows // 4).int())
    assert torch.equal(few, got[rows])


@pytest.mark.parametrize("layout", [dict(block_len=32, stride=16), dict(block_len=64, stride=64)],
                         ids=["paper", "fla"])
def test_float32_selection_matches_reference(layout):
    """Float32 inputs choose the float32 reference's blocks, in prefill and decode, up to ties within
    1e-5: their score products run in three tf32 passes (`_triton_utils.dot`). With one pass, Triton's
    default for float32, scores move by ~1e-3 and nearly tied blocks swap."""
    from nsa_eval.kernels.compression import compressed_attention
    from nsa_eval.kernels.decode import nsa_decode
    from nsa_eval.kernels.importance import select_blocks

    B, T = 2, 8192
    tc = (T - layout["block_len"]) // layout["stride"] + 1
    x = make(B, T, 16, 4, 128, dtype=torch.float32)
    q, k_cmp, v_cmp = x["q"], x["k_cmp"][:, :tc].contiguous(), x["v_cmp"][:, :tc].contiguous()
    imp = functools.cache(lambda: importance(q, k_cmp, **layout))
    with torch.no_grad():
        _, lse = compressed_attention(q, k_cmp, v_cmp, **layout)
        idx = select_blocks(q, k_cmp, lse=lse, **layout)
        idx_ref = ref.select_blocks(q, k_cmp, **layout)
        assert_same_selection(idx, idx_ref, imp, rel=1e-5)

        gates = [torch.full((B, 1, 16), 1.0, device="cuda") for _ in range(3)]
        rows = torch.arange(B, device="cuda")
        for pos in ([T - 1, T - 1], [100, 5000], [1000, 4095], [6000, 7777]):
            p = torch.tensor(pos, device="cuda")
            _, idx_dec = nsa_decode(q[rows, p][:, None], x["k"], x["v"], k_cmp, v_cmp, *gates,
                                    cache_seqlens=(p + 1).int(), return_block_indices=True, **layout)
            assert_same_selection(idx_dec, idx_ref[rows, p][:, None], lambda p=p: imp()[rows, p][:, None],
                                  rel=1e-5)


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 3e-2), (torch.float32, 5e-3)], ids=["bf16", "fp32"])
def test_gradients_vs_fp32_reference(dtype, tol):
    from nsa_eval.kernels.compression import compressed_attention
    from nsa_eval.kernels.selection import selected_attention
    from nsa_eval.kernels.window import sliding_window_attention

    x = make(2, 4096, 16, 4, 128, dtype=dtype, grad=True)
    x32 = {n: t.detach().float().requires_grad_() for n, t in x.items()}
    idx = ref.select_blocks(x32["q"].detach(), x32["k_cmp"].detach())
    g = torch.Generator(device="cuda").manual_seed(9)

    def check(tri, refo, names):
        do = torch.randn(refo.shape, generator=g, device="cuda")
        got = torch.autograd.grad(tri, [x[n] for n in names], do.to(tri.dtype))
        want = torch.autograd.grad(refo, [x32[n] for n in names], do)
        assert rel_err(tri, refo) < tol
        for n, a, b in zip(names, got, want, strict=True):
            assert rel_err(a, b) < tol, n

    o, lse = compressed_attention(x["q"], x["k_cmp"], x["v_cmp"])
    o_ref, _ = ref.compressed_attention(x32["q"], x32["k_cmp"], x32["v_cmp"])
    check(o, o_ref, ["q", "k_cmp", "v_cmp"])
    check(selected_attention(x["q"], x["k"], x["v"], idx),
          ref.selected_attention(x32["q"], x32["k"], x32["v"], idx), ["q", "k", "v"])
    check(sliding_window_attention(x["q"], x["k"], x["v"]),
          ref.sliding_window_attention(x32["q"], x32["k"], x32["v"]), ["q", "k", "v"])


@pytest.mark.parametrize("hq,hkv", [(64, 4), (12, 4)], ids=["G16", "G3"])
def test_decode_matches_prefill(hq, hkv):
    from nsa_eval.kernels.compression import compressed_attention
    from nsa_eval.kernels.decode import nsa_decode
    from nsa_eval.kernels.importance import select_blocks
    from nsa_eval.kernels.selection import selected_attention
    from nsa_eval.kernels.window import sliding_window_attention

    B, T = 2, 8192
    x = make(B, T, hq, hkv, 128)
    g = torch.Generator(device="cuda").manual_seed(4)
    gates = [torch.rand(B, T, hq, generator=g, device="cuda").to(torch.bfloat16) for _ in range(3)]
    with torch.no_grad():
        o_cmp, lse = compressed_attention(x["q"], x["k_cmp"], x["v_cmp"])
        idx = select_blocks(x["q"], x["k_cmp"], lse=lse)
        o_slc = selected_attention(x["q"], x["k"], x["v"], idx)
        o_swa = sliding_window_attention(x["q"], x["k"], x["v"])
        o = (gates[0][..., None] * o_cmp + gates[1][..., None] * o_slc + gates[2][..., None] * o_swa)
        for pos in ([T - 1, T - 1], [100, 5000], [31, 4095]):
            rows = torch.arange(B, device="cuda")
            p = torch.tensor(pos, device="cuda")
            pick = lambda y, rows=rows, p=p: y[rows, p][:, None]  # noqa: E731  [B, 1, ...]
            o_dec, idx_dec = nsa_decode(pick(x["q"]), x["k"], x["v"], x["k_cmp"], x["v_cmp"],
                                        *[pick(gt) for gt in gates], cache_seqlens=(p + 1).int(),
                                        return_block_indices=True)
            # the decode selection must be the prefill selection of that row (up to exact ties)
            mismatch = (idx_dec != pick(idx)).any(-1)
            assert mismatch.float().mean() <= 0.25
            ok = ~mismatch[:, 0].any(-1)  # [B] sequences whose selection matches prefill
            assert rel_err(o_dec[ok], pick(o)[ok]) < BF16_TOL
            o_ref = ref.nsa_decode(pick(x["q"]), x["k"], x["v"], x["k_cmp"], x["v_cmp"],
                                   *[pick(gt) for gt in gates], cache_seqlens=(p + 1).int())
            assert rel_err(o_dec, o_ref) < BF16_TOL


@pytest.mark.parametrize("gate_in_branches", [False, True], ids=["gate-copies", "gates-in-branches"])
def test_nsa_attention_triton_gradients(gate_in_branches):
    """nsa_attention(impl="triton") (reused compression lse, fused gated sum, inverted-index selection
    backward with work items split over long block lists, the branches' dq summed across the window's
    stream) against the float32 reference, G = 16; the gates applied as copies g_x * do or in the
    branches' kernels (`gate_in_branches`)."""
    g = torch.Generator(device="cuda").manual_seed(10)
    assert_nsa_matches_reference(with_gates(make(1, 4096, 16, 1, 128, grad=True), g), g,
                                 gate_in_branches=gate_in_branches)


def test_nsa_attention_with_the_long_recipes_wide_start():
    """The long recipe's NSA heads (8 query and 4 KV heads of 32) with its first steps' 64 selected blocks
    (`TrainConfig.wide_selection`: the top-k's arg-max path, past the lean filter's 32) and window 256, at
    8k: blocks, output and gradients against the float32 reference."""
    g = torch.Generator(device="cuda").manual_seed(11)
    assert_nsa_matches_reference(with_gates(make(1, 8192, 8, 4, 32, grad=True), g), g,
                                 params=dict(num_selected=64, window=256))


NSA_ARGS = ["q", "k", "v", "k_cmp", "v_cmp", "g_cmp", "g_slc", "g_swa"]  # nsa_attention's, in order


def with_gates(x, g):
    """x plus random gates [B, T, Hq] in q's dtype, leaves with gradients."""
    B, T, hq = x["q"].shape[:3]
    for name in ("g_cmp", "g_slc", "g_swa"):
        x[name] = torch.rand(B, T, hq, generator=g, device="cuda").to(x["q"].dtype).requires_grad_()
    return x


def assert_nsa_matches_reference(x, g, params=None, **options):
    """nsa_attention(impl="triton", **params, **options) on x against the float32 reference with `params`:
    blocks, output and the gradients of every input; returns the output."""
    from nsa_eval import kernels

    params = params or {}
    x32 = {n: t.detach().float().requires_grad_() for n, t in x.items()}
    o, idx = kernels.nsa_attention(*[x[n] for n in NSA_ARGS], impl="triton", return_block_indices=True,
                                   **params, **options)
    o_ref, idx_ref = kernels.nsa_attention(*[x32[n] for n in NSA_ARGS], impl="reference",
                                           return_block_indices=True, **params)
    # near-ties may pick other blocks in bf16: few rows, so the whole-tensor errors stay small
    assert (idx != idx_ref).any(-1).float().mean() < 0.01
    assert rel_err(o, o_ref) < BF16_TOL
    do = torch.randn(o.shape, generator=g, device="cuda")
    got = torch.autograd.grad(o, [x[n] for n in NSA_ARGS], do.to(o.dtype))
    want = torch.autograd.grad(o_ref, [x32[n] for n in NSA_ARGS], do)
    for n, a, b in zip(NSA_ARGS, got, want, strict=True):
        assert rel_err(a, b) < 3e-2, n
    return o


@pytest.mark.parametrize("dk,dv,dtype", [(192, 128, torch.bfloat16), (256, 256, torch.bfloat16),
                                         (128, 128, torch.float16)], ids=["192-128-bf16", "256-bf16", "fp16"])
def test_head_dims_and_float16(dk, dv, dtype):
    """The paper's head dims (192 for q/k, 128 for v), the largest the kernels take (256) and float16:
    nsa_attention(impl="triton") and its gradients against the float32 reference, G = 16 (T = 4096),
    and the decode against the reference decode on the same inputs."""
    from nsa_eval import kernels

    g = torch.Generator(device="cuda").manual_seed(11)
    x = with_gates(make(2, 4096, 16, 1, dk, dtype=dtype, grad=True, dv=dv), g)
    o = assert_nsa_matches_reference(x, g)
    assert o.shape == (2, 4096, 16, dv) and o.dtype == dtype

    y = {n: t.detach() for n, t in x.items()}
    rows = torch.arange(2, device="cuda")
    for pos in ([4095, 4095], [100, 3000]):
        p = torch.tensor(pos, device="cuda")
        step = [y[n][rows, p][:, None] for n in ("q", "g_cmp", "g_slc", "g_swa")]
        args = (step[0], y["k"], y["v"], y["k_cmp"], y["v_cmp"], *step[1:])
        lens = (p + 1).int()
        o_dec = kernels.nsa_decode(*args, cache_seqlens=lens, impl="triton")
        assert rel_err(o_dec, kernels.nsa_decode(*args, cache_seqlens=lens, impl="reference")) < BF16_TOL


@pytest.mark.parametrize("hq, per_block", [(16, False), (4, False), (4, True)],
                         ids=["G16", "G4", "G4-by-block"])
def test_gated_sum_in_selected_forward(hq, per_block):
    """NSA's output from the selected forward's last launch (the walk's epilogue, or the merge of the
    forward per key block; also the default at this length), without gradients (o_slc not stored) and
    with them, against the separate gate pass and the float32 reference (T = 4096, bf16, 4 KV heads at
    G = 16 and G = 4, the walk and per key block)."""
    from nsa_eval import kernels
    from nsa_eval.kernels import prefill

    g = torch.Generator(device="cuda").manual_seed(12)
    x = with_gates(make(1, 4096, hq * 4, 4, 128, grad=True), g)
    args = [x[n] for n in NSA_ARGS]
    out = {}
    for in_selected in (False, True, None):
        run = lambda choice=in_selected: prefill.nsa_attention(  # noqa: E731
            *args, selected_per_block=per_block, gated_sum_in_selected=choice)
        with torch.no_grad():
            out[in_selected, False] = run()
        out[in_selected, True] = run().detach()
    for key in out:
        assert rel_err(out[key], out[False, False]) < 1e-3, key
    with torch.no_grad():
        o_ref = kernels.nsa_attention(*[x[n].float() for n in NSA_ARGS], impl="reference")
    assert rel_err(out[True, False], o_ref) < BF16_TOL


def test_window_side_stream_gated_merge():
    """The window on its own stream, joined just before the merge of the forward per key block that
    writes NSA's gated output (G = 4): the output of one stream bit for bit, without gradients and with
    them; 20 calls in a row with fresh inputs, so that a merge that read the window's output before the
    window wrote it would show."""
    from nsa_eval.kernels import prefill

    for seed in range(20):
        g = torch.Generator(device="cuda").manual_seed(seed)
        x = with_gates(make(1, 4096, 16, 4, 128, grad=True, seed=seed), g)
        args = [x[n] for n in NSA_ARGS]
        out = {}
        for on in (False, True):
            run = lambda on=on, args=args: prefill.nsa_attention(  # noqa: E731
                *args, window_stream=on, selected_per_block=True, gated_sum_in_selected=True)
            with torch.no_grad():
                out[on, False] = run()
            out[on, True] = run().detach()
        assert torch.equal(out[True, False], out[False, False]), seed
        assert torch.equal(out[True, True], out[False, True]), seed
        assert torch.equal(out[True, True], out[True, False]), seed


def test_window_side_stream_matches_one_stream():
    """The window branch on a second stream gives the output of the single stream bit for bit, and the
    same gradients up to the order of the selected branch's float32 atomics; 20 calls in a row with
    fresh inputs (the allocator reusing memory across the streams; the selected atomics wait for the
    window's dq on the other stream)."""
    from nsa_eval.kernels import prefill

    for seed in range(20):
        g = torch.Generator(device="cuda").manual_seed(seed)
        x = with_gates(make(1, 4096, 16, 1, 128, grad=True, seed=seed), g)
        do = torch.randn(1, 4096, 16, 128, generator=g, device="cuda").to(torch.bfloat16)
        out = {}
        for on in (False, True):
            o = prefill.nsa_attention(*[x[n] for n in NSA_ARGS], window_stream=on)
            out[on] = (o, torch.autograd.grad(o, [x[n] for n in NSA_ARGS], do))
        assert torch.equal(out[True][0], out[False][0])
        for n, a, b in zip(NSA_ARGS, out[True][1], out[False][1], strict=True):
            assert rel_err(a, b) < 1e-3, (seed, n)


def test_direct_launches_keep_triton_specialisations_apart():
    """`_triton_utils.Launcher` launches a compiled kernel directly once Triton found it: each
    specialisation Triton's binder tells apart (here a row count divisible by 16, one that is not,
    a single row, and a pointer off 16-byte alignment) gets its own compiled kernel, and every later
    launch, the direct ones, gives Triton's own launch's output bit for bit."""
    from nsa_eval.kernels._triton_utils import launcher
    from nsa_eval.kernels.gates import _gate_fwd_kernel, gate_forward

    def misaligned(t):  # t's values at an address 2 bytes past a 16-byte boundary, contiguous
        buf = torch.empty(t.numel() + 1, device="cuda", dtype=t.dtype)
        out = buf[1:].view(t.shape)
        out.copy_(t)
        return out

    fast = launcher(_gate_fwd_kernel)
    fast.compiled.clear()
    g = torch.Generator(device="cuda").manual_seed(0)
    for rows, shift in ((64, False), (63, False), (1, False), (64, True)):
        xs = [torch.randn(1, rows, 1, 128, generator=g, device="cuda").bfloat16() for _ in range(3)]
        gs = [torch.rand(1, rows, 1, generator=g, device="cuda").bfloat16() for _ in range(3)]
        if shift:
            xs = [misaligned(x) for x in xs]
        want = sum(gx.float()[..., None] * x.float() for gx, x in zip(gs, xs, strict=True))
        first = gate_forward(*xs, *gs)  # through Triton's JITFunction.run
        for _ in range(3):  # direct launches
            assert torch.equal(gate_forward(*xs, *gs), first), (rows, shift)
        assert rel_err(first, want) < BF16_TOL, (rows, shift)
    assert len(fast.compiled) == 4
