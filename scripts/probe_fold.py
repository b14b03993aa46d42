"""The online softmax's scale folded into the exponential's FMA (run 78 on the H200): the banded
forwards with the row max taken over the unscaled scores (`band.FOLD_SCALE`, one multiply per score
fewer) against the scores scaled first, side by side, and the max |diff| of their outputs. Run 79:
also lazy rescaling of the unmasked tiles (`band.LAZY_RESCALE`: the running max moves only when some
row's max grew by more than 2**8).

    PYTHONPATH=. python3 scripts/probe_fold.py
"""

import torch

from nsa_eval.bench import _inputs, _time, _with_flags, nsa_prefill
from nsa_eval.kernels import band
from nsa_eval.kernels.compression import compressed_attention
from nsa_eval.kernels.window import sliding_window_attention

D = 128
VARIANTS = {"scaled first": dict(FOLD_SCALE=False), "folded": dict(FOLD_SCALE=True),
            "folded, lazy rescale": dict(FOLD_SCALE=True, LAZY_RESCALE=8.0)}


def probe(T, hq, hkv):
    x = _inputs(1, T, hq, hkv, D, grad=False)
    q, k, v, kc, vc = (x[n] for n in ("q", "k", "v", "k_cmp", "v_cmp"))
    ops = {"compression": lambda: compressed_attention(q, kc, vc)[0],
           "window": lambda: sliding_window_attention(q, k, v), "nsa": lambda: nsa_prefill(**x)}
    print(f"T={T}, {hq}/{hkv} heads:", flush=True)
    with torch.no_grad():
        want = {name: _with_flags(band, VARIANTS["scaled first"], fn) for name, fn in ops.items()}
        for variant in [*VARIANTS, *VARIANTS]:
            cells = []
            for name, fn in ops.items():
                got = _with_flags(band, VARIANTS[variant], fn)
                ms = _with_flags(band, VARIANTS[variant], lambda fn=fn: _time(fn))
                diff = (got.float() - want[name].float()).abs().max().item()
                cells.append(f"{name} {ms:.3f} ms (max |diff| {diff:.1e})")
            print(f"  {variant}: " + "; ".join(cells), flush=True)


def main():
    print(torch.cuda.get_device_name(), flush=True)
    for T, hq, hkv in ((65536, 64, 4), (65536, 16, 4), (8192, 64, 4)):
        probe(T, hq, hkv)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
