"""How many distinct selection blocks a program of P consecutive positions reads, on random inputs (CPU).

    PYTHONPATH=. python3 scripts/selection_overlap.py [T] [--heads HQ HKV] [--dim D]

The selected forward's programs at G = 4 hold 4 positions (`selection.SELECTED_ROWS`) and read each
block any of their lists holds once, so the branch's bytes per (position, KV head) are the distinct
blocks of P lists over P. The benchmark's inputs are random, so neighbouring positions share the
forced blocks (block 0, the two local ones) and, where few blocks are visible, chance overlaps. Uses
the PyTorch reference `select_blocks` (the paper's geometry) over every position of one sequence.
"""

import argparse

import torch

from nsa_eval.kernels.reference import select_blocks


def distinct_blocks(block_indices: torch.Tensor, positions: int) -> float:
    """Mean number of distinct blocks (not -1) over groups of `positions` consecutive positions of one
    KV head. block_indices: int32 [T, Hkv, n] with T a multiple of `positions`."""
    T, hkv, n = block_indices.shape
    groups = block_indices.reshape(T // positions, positions, hkv, n).permute(0, 2, 1, 3)
    groups = groups.reshape(-1, positions * n)
    counts = [len(set(row.tolist()) - {-1}) for row in groups]
    return sum(counts) / len(counts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("T", type=int, nargs="?", default=65536)
    parser.add_argument("--heads", type=int, nargs=2, default=(4, 1), metavar=("HQ", "HKV"))
    parser.add_argument("--dim", type=int, default=64)
    args = parser.parse_args()
    hq, hkv = args.heads
    torch.manual_seed(0)
    tc = (args.T - 32) // 16 + 1
    q = torch.randn(1, args.T, hq, args.dim)
    k_cmp = torch.randn(1, tc, hkv, args.dim)
    block_indices = select_blocks(q, k_cmp)[0]  # [T, Hkv, 16]
    print(f"T={args.T}, {hq}/{hkv} heads, d={args.dim}, random inputs, every position:")
    for positions in (1, 2, 4, 8, 16):
        n = distinct_blocks(block_indices, positions)
        print(f"  {positions:2d} positions a program: {n:6.2f} distinct blocks, "
              f"{n / positions:5.2f} per position")


if __name__ == "__main__":
    main()
