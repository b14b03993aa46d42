"""The training data: determinism, the NIAH samples' loss weights, the held-out split."""

import numpy as np

from nsa_eval.train.data import (
    MixConfig,
    corpus_files,
    is_heldout,
    load_corpus,
    make_batch,
    make_retrieval_doc,
    retrieval_segment,
)

MIX = MixConfig(retrieval_lengths=(64, 128), answer_weight=7.0)


def test_same_seed_same_batch_and_steps_differ(tiny_corpus):
    a_ids, a_w = make_batch(tiny_corpus, 3, 5, 4, 256, MIX)
    b_ids, b_w = make_batch(tiny_corpus, 3, 5, 4, 256, MIX)
    assert a_ids.shape == (4, 257) and a_w.shape == (4, 257)
    np.testing.assert_array_equal(a_ids, b_ids)
    np.testing.assert_array_equal(a_w, b_w)
    assert not np.array_equal(a_ids, make_batch(tiny_corpus, 3, 6, 4, 256, MIX)[0])
    assert not np.array_equal(a_ids, make_batch(tiny_corpus, 4, 5, 4, 256, MIX)[0])


def test_batch_mixes_text_and_weighted_answers(tiny_corpus):
    ids, w = make_batch(tiny_corpus, 0, 0, 4, 256, MIX)
    assert ids.min() >= 0 and ids.max() < len(tiny_corpus.tokenizer)
    assert (w[:2] == 7.0).any(axis=1).all()  # the retrieval rows carry weighted answers
    assert (w[2:] == 1.0).all()  # the text rows are plain language modelling


def test_retrieval_fraction_sets_the_share_of_retrieval_rows(tiny_corpus):
    from dataclasses import replace

    _, w = make_batch(tiny_corpus, 0, 0, 8, 256, replace(MIX, retrieval_fraction=0.75))
    assert (w == 7.0).any(axis=1).tolist() == [True] * 6 + [False] * 2


def test_retrieval_segment_weights_only_the_answer(tiny_corpus):
    tok = tiny_corpus.tokenizer
    ids, w = retrieval_segment(tok, 128, 50.0, seed=11, answer_weight=3.0)
    answer = tok.decode(ids[w > 0])
    prompt = tok.decode(ids[w == 0])
    assert answer.strip().rstrip(".").replace(tok.eos_token, "").strip(" .").isdigit()
    value = answer.strip().split(".")[0]
    assert len(value) == 7 and value in prompt  # the needle holds the answer
    assert "special magic number" in prompt
    assert abs(len(ids) - 128) < 40


def test_heldout_split_is_by_name_and_disjoint(tiny_corpus, tmp_path):
    names = [n for n, _ in corpus_files(("stdlib",))]
    held = [n for n in names if is_heldout(n)]
    assert 0 < len(held) < 0.1 * len(names)
    assert is_heldout(held[0]) and held == [n for n in names if is_heldout(n)]
    assert tiny_corpus.heldout.size > 0 and tiny_corpus.train.size > 0


def test_corpus_round_trip(tiny_corpus, tmp_path):
    from nsa_eval.train.data import build_corpus

    again = build_corpus(tmp_path, vocab_size=384, max_files=4, tokenizer_bytes=400_000)
    np.testing.assert_array_equal(again.train, tiny_corpus.train)  # deterministic build
    loaded = load_corpus(tmp_path)
    np.testing.assert_array_equal(loaded.heldout, again.heldout)
    assert loaded.tokenizer("x = 1234")["input_ids"] == again.tokenizer("x = 1234")["input_ids"]


def test_a_batch_does_not_depend_on_what_the_process_built_before(tiny_corpus):
    """Resuming replays batches in a fresh process: one built after longer documents must not differ."""
    from dataclasses import replace

    mix = replace(MIX, retrieval_lengths=(200, 300))
    first = make_batch(tiny_corpus, 0, 3, 2, 512, mix)
    make_retrieval_doc(tiny_corpus.tokenizer, 2000, 50.0, seed=1)  # a larger haystack pool in between
    again = make_batch(tiny_corpus, 0, 3, 2, 512, mix)
    assert all(np.array_equal(a, b) for a, b in zip(first, again, strict=True))


def test_distractors_add_needles_of_other_keys(tiny_corpus):
    import re

    tok = tiny_corpus.tokenizer
    plain = make_retrieval_doc(tok, 512, 30.0, seed=5)
    assert make_retrieval_doc(tok, 512, 30.0, seed=5, distractors=0) == plain
    doc = make_retrieval_doc(tok, 512, 30.0, seed=5, distractors=3)
    needles = re.findall(r"magic numbers for (\w+) is: (\d+)\.", doc["prompt"])
    assert len(needles) == 4 and len({k for k, _ in needles}) == 4
    assert (doc["key"], doc["answer"]) in needles  # the asked key's needle holds the answer
    assert doc["prompt"].count(doc["key"]) == 3  # its needle, the question and the answer prefix
    assert abs(len(tok(doc["prompt"])["input_ids"]) - 512) < 40


def test_distractors_reach_the_batch(tiny_corpus):
    from dataclasses import replace

    mix = replace(MIX, retrieval_lengths=(400,), distractors=2)  # one sample per 512-token row
    ids, w = make_batch(tiny_corpus, 0, 0, 2, 512, mix)
    text = tiny_corpus.tokenizer.decode(ids[0])
    assert text.count("special magic numbers for") == 3 and text.count("What is the special magic") == 1
    assert (w[0] == 7.0).any() and (w[1] == 1.0).all()


def _first_samples(corpus, mix, steps):
    """Each retrieval row's first sample over `steps` batches: (its tokens, the needle's token index)."""
    tok = corpus.tokenizer
    needle = tok(" One of the special magic numbers")["input_ids"][1:4]
    out = []
    for step in range(steps):
        ids, w = make_batch(corpus, 0, step, 4, 512, mix)
        for row, weights in zip(ids, w, strict=True):
            if not (weights == mix.answer_weight).any():
                continue
            end = int(np.flatnonzero(row == tok.eos_token_id)[0]) + 1
            hits = [i for i in range(end) if list(row[i : i + 3]) == needle]
            out.append((end, hits[0]))
    return out


def test_far_needles_open_retrieval_rows_with_the_longest_length_and_an_early_needle(tiny_corpus):
    from dataclasses import replace

    mix = replace(MIX, retrieval_lengths=(100, 200, 400))
    far = _first_samples(tiny_corpus, replace(mix, far_needles=1.0), steps=6)
    plain = _first_samples(tiny_corpus, mix, steps=6)
    assert len(far) == len(plain) == 12
    # 400 tokens, the needle in the first quarter
    assert all(380 < end < 450 and pos < 0.35 * end for end, pos in far)
    assert any(end < 300 for end, _ in plain) and any(pos > 0.35 * end for end, pos in plain)
    half = _first_samples(tiny_corpus, replace(mix, far_needles=0.5), steps=6)
    assert half != far and half != plain


def test_a_mix_without_far_needles_keeps_its_batches(tiny_corpus):
    """The far-needle draw is taken only where the share is on: older runs replay as they were."""
    from dataclasses import replace

    a = make_batch(tiny_corpus, 0, 2, 4, 256, MIX)
    b = make_batch(tiny_corpus, 0, 2, 4, 256, replace(MIX, far_needles=0.0))
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
