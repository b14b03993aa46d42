"""NSA's selection budget cut at inference (`num_selected`, configs/long.yaml's sweep) on a CUDA GPU: the
Triton kernels, the graph decode and the statistics all run with the overriding top-n, not the
checkpoint's. Run with `pytest -m gpu tests/models`."""

from __future__ import annotations

import pytest
import torch

from nsa_eval.models.loading import load_for_eval
from tests.models.test_gpu_decode_graph import decode
from tests.models.test_gpu_model import build, logits_with, prefill

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tokenizer_dir):
    """A saved random NSA model of the paper's geometry (top-n 16), queries sharpened as in
    test_gpu_model.py so that no near-tie of block importances decides a block."""
    from transformers import AutoTokenizer

    model = build()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.attn.q_proj.weight.mul_(20)
    out = tmp_path_factory.mktemp("nsa_n16")
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out)
    return out


def test_a_smaller_top_n_runs_on_the_triton_kernels_and_the_graph_decode(checkpoint):
    model, _ = load_for_eval(checkpoint, attention="nsa", dtype="float32", device="cuda",
                             method_params={"num_selected": 4})
    trained, _ = load_for_eval(checkpoint, attention="nsa", dtype="float32", device="cuda")
    assert (model.config.num_selected, trained.config.num_selected) == (4, 16)
    ids = torch.randint(0, 97, (2, 3000), device="cuda")
    triton = logits_with(model, "triton", lambda m: prefill(m, ids))
    torch.testing.assert_close(triton, logits_with(model, "reference", lambda m: prefill(m, ids)),
                               atol=2e-4, rtol=1e-3)
    assert not torch.allclose(triton[:, -1], logits_with(trained, "triton", lambda m: prefill(m, ids))[:, -1])
    # decode: the graph is captured with top-n 4, its steps equal the prefill's last rows
    model.reset_attention_stats()
    graphed, cache = decode(model, ids, 2960, graph=True)
    assert cache.decode_graph is not None
    torch.testing.assert_close(graphed, triton, atol=2e-4, rtol=1e-3)
    stats = model.attention_stats()
    assert stats["params"]["num_selected"] == 4
    assert stats["phases"]["decode"]["mean_per_branch"]["selected"] <= 4 * 64
