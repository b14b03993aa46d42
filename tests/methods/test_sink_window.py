"""sink_window on an unpadded batch reads only its sink and local keys: the same keys, output and
counts as the masked path over every key, which a 4D mask (the padded case) still takes."""

from __future__ import annotations

import pytest
import torch

from tests.methods.conftest import random_qkv, run_attend


@pytest.mark.parametrize("query_chunk, sink, local", [(512, 4, 8), (16, 4, 8), (7, 0, 5), (16, 12, 3)])
def test_the_sink_and_local_columns_give_the_masked_path_result(query_chunk, sink, local):
    q, k, v = random_qkv(B=2, Hq=4, Hkv=2, T=64)
    causal = torch.ones(64, 64, dtype=torch.bool).tril()[None, None].expand(2, 1, 64, 64)  # [B, 1, T, S]
    budget = sink + local
    fast, keep_fast = run_attend("sink_window", q, k, v, None, budget, sink, local, query_chunk=query_chunk)
    masked, keep_masked = run_attend("sink_window", q, k, v, causal, budget, sink, local,
                                     query_chunk=query_chunk)
    assert torch.equal(keep_fast, keep_masked)
    torch.testing.assert_close(fast, masked, atol=1e-6, rtol=1e-5)


def test_decode_steps_read_sink_plus_local_keys():
    """One new query after 63 cached keys: the kept keys are the 4 sink and the 8 latest."""
    q, k, v = random_qkv(B=1, Hq=4, Hkv=2, T=64)
    _, keep = run_attend("sink_window", q[:, :, -1:], k, v, None, 12, 4, 8)  # [B, Hq, 1, S]
    want = torch.zeros(64, dtype=torch.bool)
    want[:4] = True
    want[-8:] = True
    assert torch.equal(keep[0, 0, 0], want) and torch.equal(keep[0, 3, 0], want)
