"""The training-free baselines' Triton prefills, apart from NSA's kernels (nsa_eval/kernels/).

Each file holds its kernels with their readable PyTorch reference beside them; the methods (one file
each in nsa_eval/methods/) call them from their fast-path hooks (decode's scores: `Chunk.logits`).
Shapes are the attention interface's: q `[B, Hq, T, D]`, k and v `[B, Hkv, S, D]`, `Hq = G * Hkv`.

- budget_attention.py: budgeted causal attention over the kept keys (sink + local, and top-k's
  threshold), with the tile helpers the others share; `reference_keep`, `budget_attention_reference`.
- budget_topk.py: the exact per-row top-k threshold; `select_in_buffer_reference`.
- budget_quest.py: Quest's pages on the same tiles; `quest_keep_from_masks`.
- h2o_prefill.py: H2O's pool walk; `h2o_sparse_prefill_reference`.
- decode_scores.py: float32 `q . k` of a decode query against half-precision keys, without a
  float32 copy of them (`Chunk.logits` of every decode step on a GPU); `decode_scores_reference`.

Importing this package compiles nothing; the modules import triton when imported themselves.
"""
