"""How much of the selected forward the forced blocks cost: an upper bound on moving them out of it.

    PYTHONPATH=. python3 scripts/probe_forced.py

The two local blocks of query t (t // l' and the one before) lie inside its sliding window (w = 512
>= 2 l'), and with shared keys the window kernel computes their scores anyway: run in the order
diagonal tile, tile before it, rest of the window, its state after the first two tiles would be the
selected branch's softmax over exactly those blocks, so the selected forward could start from that
state instead of reading them. Block 0, in every list, could likewise come from a small dense pass.
Before writing either, this measures what they could save at most: the selected op on the real
block lists, on the same lists without the local blocks (14 blocks), and without block 0 too (13),
for 64/4 (G = 16, the walk) and 16/4 heads (G = 4, per key block), at 8k and 64k, three rounds in
alternation, beside the window forward and the whole NSA forward, whose gap to the 8k cuDNN time
(or the 64k target) these savings would have to close.
"""

import torch

from nsa_eval.bench.kernels import PAPER, _inputs, _time, block_lists, nsa_prefill
from nsa_eval.kernels import selection
from nsa_eval.kernels.window import sliding_window_attention

D = 128
SEL = PAPER["select_size"]


def without(bi, drop_first: bool):
    """bi [B, T, Hkv, n] without the local blocks (and block 0), still ascending and -1 padded."""
    T = bi.shape[1]
    last = (torch.arange(T, device=bi.device) // SEL).view(1, T, 1, 1)
    drop = (bi >= last - 1) & (bi >= 0)
    if drop_first:
        drop |= bi == 0
    kept = torch.where(drop | (bi < 0), torch.iinfo(torch.int32).max, bi).sort(dim=-1).values
    return torch.where(kept == torch.iinfo(torch.int32).max, -1, kept).to(torch.int32).contiguous()


def probe(T, hq, rounds=3):
    x = _inputs(1, T, hq, 4, D, grad=False)
    bi = block_lists(x)
    lists = {"16 blocks": bi, "no local (14)": without(bi, False),
             "no local, no block 0 (13)": without(bi, True)}
    used = {k: (v >= 0).sum(-1).float().mean().item() for k, v in lists.items()}

    def sel(idx):
        return lambda: selection.selected_forward(x["q"], x["k"], x["v"], idx, select_size=SEL, scale=D**-0.5,
                                                  presorted=True)

    def window():
        return sliding_window_attention(x["q"], x["k"], x["v"], window=PAPER["window"])

    with torch.no_grad():
        for r in range(rounds):
            times = {k: _time(sel(v)) for k, v in lists.items()}
            base = times["16 blocks"]
            cells = [f"{k} ({used[k]:.2f} used) {t:.3f} ms ({t - base:+.3f})" for k, t in times.items()]
            print(f"T={T} {hq}/4 round {r}: selected op " + "; ".join(cells)
                  + f"; window fwd {_time(window):.3f} ms; NSA fwd {_time(lambda: nsa_prefill(**x)):.3f} ms",
                  flush=True)


def main():
    torch.manual_seed(0)
    for T in (8192, 65536):
        for hq in (64, 16):
            probe(T, hq)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
