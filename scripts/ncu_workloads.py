"""One call of an NSA workload at the benchmark's shapes, for Nsight Compute to profile (run 83 on).

    PYTHONPATH=. python3 scripts/ncu_workloads.py prefill|g4|decode [T]

`prefill`: the forward+backward at T (default 64k), B = 1, 64/4 heads, d = 128, bf16, the paper's
config (`bench.nsa_prefill`); `g4`: the forward at 16/4 heads; `decode`: the fused decode at
B = 16 (plain launches). Each runs its workload once to compile (outside the profiled range), then
once inside `cudaProfilerStart/Stop`, so `ncu --profile-from-start off` sees only that call's
kernels. `reports/kernels/ncu_kernels.sh` wraps it in ncu and prints the sections read.
"""

import sys

import torch

from nsa_eval.bench.kernels import PAPER, _fwd_bwd, _inputs, nsa_prefill


def prefill(T, hq=64, hkv=4):
    x = _inputs(1, T, hq, hkv, 128, grad=True)
    return _fwd_bwd(lambda: nsa_prefill(**x), x)


def forward(T, hq=16, hkv=4):
    x = _inputs(1, T, hq, hkv, 128, grad=False)
    return lambda: nsa_prefill(**x)


def decode(T, batch=16, hq=64, hkv=4, d=128):
    from nsa_eval.kernels.decode import nsa_decode

    tc = (T - PAPER["block_len"]) // PAPER["stride"] + 1
    r = lambda *shape: torch.randn(*shape, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    q, k, v = r(batch, 1, hq, d), r(batch, T, hkv, d), r(batch, T, hkv, d)
    kc, vc = r(batch, tc, hkv, d), r(batch, tc, hkv, d)
    gates = [torch.rand(batch, 1, hq, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    return lambda: nsa_decode(q, k, v, kc, vc, *gates)


WORKLOADS = {"prefill": prefill, "g4": forward, "decode": decode}


def main(argv):
    name = argv[0] if argv else "prefill"
    if name not in WORKLOADS:
        raise SystemExit(f"workload must be one of {sorted(WORKLOADS)}, got {name!r}")
    T = int(argv[1]) if len(argv) > 1 else 65536
    step = WORKLOADS[name](T)
    grad = torch.enable_grad() if name == "prefill" else torch.no_grad()
    with grad:
        step()  # compiles every kernel
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        step()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
    print(f"{name} T={T}: done")


if __name__ == "__main__":
    main(sys.argv[1:])
