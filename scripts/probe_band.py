"""The banded kernels' launch order and dk/dv launches, timed side by side at 64k (H200).

    PYTHONPATH=. python3 scripts/probe_band.py

Forward+backward of the compression and window branches (64/4 heads, random inputs) with the
default configuration, with the tiles launched in index order (`BAND_LONGEST_FIRST = False`) and
with other dk/dv launches, masked or split (`BAND_SPLIT_MASK`); then the whole NSA with each launch
order. Run 21: reports/kernels/band_run21.log.
"""

import torch

from nsa_eval.bench import _fwd_bwd, _inputs, _time, _with_flag, bench_nsa_prefill
from nsa_eval.kernels import band
from nsa_eval.kernels.compression import compressed_attention
from nsa_eval.kernels.window import sliding_window_attention

T = 65536
DKV = [(64, 64, 8, 2), (32, 64, 4, 2), (64, 32, 4, 2)]  # (BM, BN, warps, stages) besides the default


def with_dkv(branch, cfg, split, fn):
    table = {b: dict(parts) for b, parts in band.BAND_CONFIGS.items()}
    if cfg is not None:
        table[branch]["dkv"] = dict(BM=cfg[0], BN=cfg[1], num_warps=cfg[2], num_stages=cfg[3])
    masks = dict(band.BAND_SPLIT_MASK)
    parts = set(masks[branch]) - {"dkv"}
    masks[branch] = tuple(sorted(parts | ({"dkv"} if split else set())))
    return _with_flag(band, "BAND_CONFIGS", table, lambda: _with_flag(band, "BAND_SPLIT_MASK", masks, fn))


def probe_branches():
    x = _inputs(1, T, 64, 4, 128, grad=True)
    branches = {"cmp": lambda: compressed_attention(x["q"], x["k_cmp"], x["v_cmp"])[0],
                "swa": lambda: sliding_window_attention(x["q"], x["k"], x["v"])}
    for branch, fn in branches.items():
        step = _fwd_bwd(fn, x)
        default_split = "dkv" in band.BAND_SPLIT_MASK[branch]
        for longest in (True, False, True):
            ms = _with_flag(band, "BAND_LONGEST_FIRST", longest, lambda: _time(step))  # noqa: B023
            print(f"{branch} fwd+bwd default, longest_first={longest}: {ms:.2f} ms", flush=True)
        with torch.no_grad():
            for longest in (True, False):
                ms = _with_flag(band, "BAND_LONGEST_FIRST", longest, lambda: _time(fn))  # noqa: B023
                print(f"{branch} fwd default, longest_first={longest}: {ms:.2f} ms", flush=True)
        for cfg in [None, *DKV]:
            for split in (False, True):
                if cfg is None and split == default_split:
                    continue
                try:
                    ms = with_dkv(branch, cfg, split, lambda: _time(step))  # noqa: B023
                    print(f"{branch} fwd+bwd dkv={cfg or 'default'} split={split}: {ms:.2f} ms", flush=True)
                except Exception as err:  # a launch may not compile or fit
                    print(f"{branch} dkv={cfg} split={split} failed: {str(err).splitlines()[0][:120]}")


def main():
    probe_branches()
    torch.cuda.empty_cache()
    for longest in (True, False, True, False):
        fwd, fb = _with_flag(band, "BAND_LONGEST_FIRST", longest,
                             lambda: bench_nsa_prefill(T, 64, 4, 128))
        print(f"nsa 64/4 longest_first={longest}: fwd {fwd:.2f} ms, fwd+bwd {fb:.2f} ms", flush=True)


if __name__ == "__main__":
    main()
