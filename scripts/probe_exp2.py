"""Half the softmax exponentials by a polynomial on the FMA units (run 77 on the H200): the banded
forwards' unmasked tiles (`band.BAND_EXP2_POLY`) and the importance pass's unmasked chunks
(`selection.IMPORTANCE_EXP2_POLY`), through `_triton_utils.exp2_split`, against ex2 alone.

    PYTHONPATH=. python3 scripts/probe_exp2.py

Per shape (64k at 64/4 and 16/4 heads, 8k at 64/4): the compression and window forwards, the block
selection and the whole NSA forward (no grad) with each combination, and against ex2 alone the max
|diff| of the outputs and the share of block indices that differ (near-ties may reorder).
"""

import torch

from nsa_eval.bench import _inputs, _time, _with_flags, nsa_prefill
from nsa_eval.kernels import band, selection
from nsa_eval.kernels.compression import compressed_attention
from nsa_eval.kernels.selection import select_blocks
from nsa_eval.kernels.window import sliding_window_attention

D = 128
COMBOS = {"ex2 alone": (False, False), "band": (True, False), "importance": (False, True),
          "both": (True, True)}


def with_poly(combo, fn):
    on_band, on_imp = COMBOS[combo]
    return _with_flags(band, {"BAND_EXP2_POLY": on_band},
                       lambda: _with_flags(selection, {"IMPORTANCE_EXP2_POLY": on_imp}, fn))


def probe(T, hq, hkv):
    x = _inputs(1, T, hq, hkv, D, grad=False)
    q, k, v, kc, vc = (x[n] for n in ("q", "k", "v", "k_cmp", "v_cmp"))
    _, lse = compressed_attention(q, kc, vc)
    ops = {
        "compression": lambda: compressed_attention(q, kc, vc)[0],
        "window": lambda: sliding_window_attention(q, k, v),
        "selection": lambda: select_blocks(q, kc, lse=lse),
        "nsa": lambda: nsa_prefill(**x, return_block_indices=True),
    }
    print(f"T={T}, {hq}/{hkv} heads:", flush=True)
    with torch.no_grad():
        want = {name: with_poly("ex2 alone", fn) for name, fn in ops.items()}
        for combo in [*COMBOS, "ex2 alone"]:  # ex2 alone again: the drift between first and last
            cells = []
            for name, fn in ops.items():
                got = with_poly(combo, fn)
                ms = with_poly(combo, lambda fn=fn: _time(fn))
                if name == "selection":
                    diff = f"{(got != want[name]).float().mean().item():.1e} of indices differ"
                elif name == "nsa":
                    o, bi = got
                    diff = (f"max |diff| {(o.float() - want[name][0].float()).abs().max().item():.1e}, "
                            f"{(bi != want[name][1]).float().mean().item():.1e} of indices differ")
                else:
                    diff = f"max |diff| {(got.float() - want[name].float()).abs().max().item():.1e}"
                cells.append(f"{name} {ms:.3f} ms ({diff})")
            print(f"  {combo}: " + "; ".join(cells), flush=True)


def main():
    print(torch.cuda.get_device_name(), flush=True)
    for T, hq, hkv in ((65536, 64, 4), (65536, 16, 4), (8192, 64, 4)):
        probe(T, hq, hkv)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
