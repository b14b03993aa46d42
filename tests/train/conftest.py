"""A tiny corpus (a few stdlib files, 384-token BPE) built once per test session."""

import pytest


@pytest.fixture(scope="session")
def tiny_corpus_dir(tmp_path_factory):
    from nsa_eval.train.data import build_corpus

    path = tmp_path_factory.mktemp("corpus")
    build_corpus(path, vocab_size=384, max_files=4, tokenizer_bytes=400_000)
    return path


@pytest.fixture(scope="session")
def tiny_corpus(tiny_corpus_dir):
    from nsa_eval.train.data import load_corpus

    return load_corpus(tiny_corpus_dir)
