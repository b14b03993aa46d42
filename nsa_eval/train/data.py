"""Training data: an offline text corpus mixed with synthetic long-context retrieval (NIAH) samples.

Corpus: the `.py` sources (code + docstrings) that ship with the running Python's standard library
and, optionally, with installed packages (numpy by default). Files are taken in sorted order of
their relative names; a file is held out when sha1(name) % 100 < 2, so the held-out split does not
depend on which files exist. The exact text therefore differs slightly between Python versions;
`manifest.json` records the sources, versions, file count and a sha256 over the token ids, and the
bundled checkpoints were trained on a corpus built once (Python 3.11.7, numpy 2.4.6) and carried to
the GPU machine.

Retrieval samples follow the NIAH format of `nsa_eval.tasks.niah` (instruction, builtin haystack,
needle "One of the special magic numbers for {key} is: {value}.", question, answer prefix, 7-digit
value; `make_retrieval_doc` says how sizing differs). Only the answer tokens
carry loss (weighted up by `answer_weight`), the prompt carries none. Training seeds start at
`TRAIN_SEED_OFFSET`, far from the small seeds the evaluation uses.

A step's batch is a pure function of (seed, step): `np.random.default_rng([seed, step])`. Two runs
with the same seed (the NSA and the full-attention model) therefore see identical tokens.
"""

from __future__ import annotations

import hashlib
import importlib.util
import itertools
import json
import random
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

TRAIN_SEED_OFFSET = 1_000_000_000  # NIAH seeds used for training; evaluation uses small seeds
HELDOUT_SEED_OFFSET = 2_000_000_000  # seeds of the held-out retrieval probe during training
HELDOUT_PERCENT = 2
SKIPPED_DIRS = {"site-packages", "idlelib", "turtledemo", "ensurepip", "__pycache__", "tkinter"}
DEFAULT_SOURCES = ("stdlib", "numpy")  # what the bundled checkpoints were trained on

# ---------------------------------------------------------------------------------------------
# corpus


def corpus_files(sources: tuple[str, ...] = DEFAULT_SOURCES) -> list[tuple[str, Path]]:
    """[(name, path)] of the corpus files, sorted by name; name = "<source>/<relative path>"."""
    files = []
    for source in sources:
        root = source_root(source)
        for path in root.rglob("*.py"):
            rel = path.relative_to(root)
            if SKIPPED_DIRS.intersection(rel.parts):
                continue
            files.append((f"{source}/{rel.as_posix()}", path))
    return sorted(files)


def source_root(source: str) -> Path:
    if source == "stdlib":
        return Path(sysconfig.get_paths()["stdlib"])
    spec = importlib.util.find_spec(source)
    if spec is None or spec.origin is None:
        raise ValueError(f"corpus source {source!r} is not an installed package")
    return Path(spec.origin).parent


def is_heldout(name: str) -> bool:
    return int(hashlib.sha1(name.encode()).hexdigest(), 16) % 100 < HELDOUT_PERCENT


def read_text(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


@dataclass
class Corpus:
    """Token ids of the corpus, files joined by EOS. train/heldout: uint16 [N]."""

    train: np.ndarray
    heldout: np.ndarray
    tokenizer: object
    manifest: dict = field(default_factory=dict)


def build_corpus(
    out_dir: str | Path,
    *,
    sources: tuple[str, ...] = DEFAULT_SOURCES,
    vocab_size: int = 8192,
    max_files: int | None = None,
    tokenizer_bytes: int = 12_000_000,
) -> Corpus:
    """Train the tokenizer and tokenize the corpus into `out_dir` (tokenizer/, tokens.npz, manifest.json).

    `max_files` keeps the first files only (the CPU tests). The tokenizer is trained on every
    training file in order until `tokenizer_bytes` characters.
    """
    from tqdm import tqdm

    from nsa_eval.train.tokenizer import train_bpe

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    files = corpus_files(sources)
    if max_files is not None:
        files = _spread(files, max_files)
    texts = {name: read_text(path) for name, path in files}
    train_names = [n for n, _ in files if not is_heldout(n)]
    heldout_names = [n for n, _ in files if is_heldout(n)]
    if not heldout_names:  # tiny corpora: hold out the last file
        heldout_names, train_names = train_names[-1:], train_names[:-1]

    english = tokenizer_training_texts(min(2_000_000, tokenizer_bytes // 6))
    code = _budgeted((texts[n] for n in train_names), tokenizer_bytes)
    tokenizer = train_bpe(itertools.chain(english, code), vocab_size)
    tokenizer.save_pretrained(str(out_dir / "tokenizer"))
    eos = tokenizer.eos_token_id
    split_ids = {}
    for split, names in (("train", train_names), ("heldout", heldout_names)):
        ids: list[int] = []
        batch = 256
        for i in tqdm(range(0, len(names), batch), desc=f"tokenize {split}", disable=len(names) < 50):
            for enc in tokenizer([texts[n] for n in names[i : i + batch]])["input_ids"]:
                ids.extend(enc)
                ids.append(eos)
        split_ids[split] = np.asarray(ids, dtype=np.uint16)  # [N]
    np.savez_compressed(out_dir / "tokens.npz", **split_ids)  # ~3x smaller: carried to the GPU
    manifest = {
        "sources": list(sources),
        "versions": {"python": sys.version.split()[0], **_versions(sources)},
        "files": {"train": len(train_names), "heldout": len(heldout_names)},
        "tokens": {k: int(v.size) for k, v in split_ids.items()},
        "vocab_size": len(tokenizer),
        "sha256": {k: hashlib.sha256(v.tobytes()).hexdigest() for k, v in split_ids.items()},
        "heldout_files": heldout_names,
    }
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return Corpus(split_ids["train"], split_ids["heldout"], tokenizer, manifest)


def load_corpus(data_dir: str | Path) -> Corpus:
    from nsa_eval.train.tokenizer import load_tokenizer

    data_dir = Path(data_dir)
    tokens = np.load(data_dir / "tokens.npz")
    return Corpus(
        train=tokens["train"],
        heldout=tokens["heldout"],
        tokenizer=load_tokenizer(data_dir / "tokenizer"),
        manifest=corpus_manifest(data_dir),
    )


def corpus_manifest(data_dir: str | Path) -> dict:
    """The manifest a built corpus records: sources, versions, token counts, sha256 of the ids."""
    return json.loads((Path(data_dir) / "manifest.json").read_text())


def corpus_exists(data_dir: str | Path) -> bool:
    d = Path(data_dir)
    return all((d / f).exists() for f in ("tokens.npz", "manifest.json", "tokenizer"))


def _spread(files: list, n: int) -> list:
    """n files spread evenly over the sorted list (deterministic)."""
    step = max(1, len(files) // n)
    return files[::step][:n]


def _budgeted(texts, max_chars: int):
    used = 0
    for text in texts:
        if used >= max_chars:
            return
        used += len(text)
        yield text


def _versions(sources) -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for s in sources:
        if s != "stdlib":
            try:
                out[s] = version(s)
            except PackageNotFoundError:
                out[s] = "unknown"
    return out


# ---------------------------------------------------------------------------------------------
# retrieval samples (NIAH format)

def make_retrieval_doc(tokenizer, context_length: int, depth_percent: float, seed: int,
                       distractors: int = 0, pool_length: int | None = None) -> dict:
    """One training NIAH document in the evaluation's format: {"prompt", "answer", "key", ...}.

    The template, key words and builtin haystack grammar are `nsa_eval.tasks.niah`'s. Its
    `make_niah_doc` sizes a prompt to exactly `context_length` tokens by searching over haystack
    cuts (tens of tokenizations, ~0.1-0.5 s per doc); here the haystack is tokenized once and cut
    at token boundaries, so the prompt is within a few tokens of `context_length` at a fraction of
    the cost (the haystack is a random window of one long text generated and tokenized once per
    process). That matters: a training batch holds ~25 such documents.

    `distractors` adds that many needles of other keys (distinct, random values, uniform depths),
    so the answer needs the asked key, not just any magic number (RULER's multi-key NIAH). With 0
    the document is the evaluation's single-needle format.

    `pool_length` sizes the haystack pool the window is drawn from (default `context_length`; a
    batch passes its longest retrieval length), so a document is a pure function of the arguments.
    """
    from nsa_eval.tasks import niah

    template = niah.DEFAULT_TEMPLATE
    rng = random.Random(f"nsa-train-niah:{seed}")
    key = rng.choice(niah.NEEDLE_KEYS)
    value = str(rng.randint(1_000_000, 9_999_999))
    head = template.instruction + "\n"
    tail = "\n" + template.question.format(key=key) + " " + template.answer_prefix.format(key=key)
    needles = [template.needle.format(key=key, value=value)]
    for other in rng.sample([k for k in niah.NEEDLE_KEYS if k != key], distractors) if distractors else []:
        needles.append(template.needle.format(key=other, value=rng.randint(1_000_000, 9_999_999)))
    fixed = len(tokenizer(head + " ".join(needles) + tail)["input_ids"])
    hay, offsets = _haystack_pool(tokenizer, max(context_length, pool_length or 0))
    budget = min(max(0, context_length - fixed), len(offsets) // 2)  # haystack tokens
    first = rng.randrange(1, len(offsets) - budget - 1)  # a random window of the pool
    depths = [round(depth_percent / 100 * budget)] + [rng.randint(0, budget) for _ in needles[1:]]
    body, prev = [], first  # haystack tokens [first, first + budget), a needle before token first + depth
    for depth, needle in sorted(zip(depths, needles, strict=True), key=lambda dn: dn[0]):
        body += [_haystack_text(hay, offsets, prev, first + depth), needle]
        prev = first + depth
    body.append(_haystack_text(hay, offsets, prev, first + budget))
    prompt = head + " ".join(part for part in body if part) + tail
    return {"prompt": prompt, "answer": value, "key": key, "context_length": context_length,
            "depth_percent": depth_percent, "seed": seed}


def _haystack_text(hay: str, offsets, start: int, stop: int) -> str:
    """The haystack text of tokens [start, stop), stripped; "" when empty."""
    return hay[offsets[start][0] : offsets[stop - 1][1]].strip() if stop > start else ""


_POOLS: dict[tuple[int, int], tuple[object, str, list]] = {}
_POOLS_KEPT = 2  # a run needs its batches' pool and at most one for longer probes


def _haystack_pool(tokenizer, context_length: int):
    """(builtin haystack text, its token offsets) of max(50k, 400 * context_length) characters.

    Its size is a function of `context_length` alone, never of what this process built before:
    documents drawn from it must not depend on call history. Kept per tokenizer and size.
    """
    from nsa_eval.tasks.haystack import builtin_haystack

    n_chars = max(50_000, 400 * context_length)
    key = (id(tokenizer), n_chars)
    if key not in _POOLS:
        while len(_POOLS) >= _POOLS_KEPT:
            del _POOLS[next(iter(_POOLS))]
        hay = builtin_haystack(n_chars, random.Random("nsa-train-haystack"))
        # the tokenizer is held so that its id is not reused while the pool is kept
        _POOLS[key] = tokenizer, hay, tokenizer(hay, return_offsets_mapping=True)["offset_mapping"]
    return _POOLS[key][1:]


def tokenizer_training_texts(n_chars: int = 2_000_000) -> list[str]:
    """English the tokenizer should know besides the corpus: NIAH template + builtin haystack text.

    Without it a code-trained BPE splits English words into fragments, and token counts jump by
    more than one per character, which `make_niah_doc`'s exact sizing cannot handle.
    """
    from nsa_eval.tasks.haystack import builtin_haystack
    from nsa_eval.tasks.niah import DEFAULT_TEMPLATE as t

    template = " ".join([t.instruction, t.needle, t.question, t.answer_prefix]).replace("{key}", "x")
    return [template] * 200 + [builtin_haystack(n_chars, random.Random("nsa-train-tokenizer"))]


def retrieval_segment(tokenizer, context_length: int, depth_percent: float, seed: int, answer_weight: float,
                      distractors: int = 0, pool_length: int | None = None):
    """Token ids and loss weights of one retrieval sample, prompt then " <value>." then EOS.

    Returns (ids int64 [L], weights float32 [L]); weights[i] applies to predicting ids[i].
    """
    doc = make_retrieval_doc(tokenizer, context_length, depth_percent, seed, distractors, pool_length)
    prompt = tokenizer(doc["prompt"])["input_ids"]
    answer = tokenizer(" " + str(doc["answer"]) + ".")["input_ids"] + [tokenizer.eos_token_id]
    ids = np.asarray(prompt + answer, dtype=np.int64)  # [L]
    weights = np.zeros(len(ids), dtype=np.float32)
    weights[len(prompt) :] = answer_weight
    return ids, weights


# ---------------------------------------------------------------------------------------------
# batches


RETRIEVAL_MARGIN = 24  # tokens a retrieval sample may need beyond its context_length: answer, EOS, slack


@dataclass
class MixConfig:
    """How a batch is composed. Context lengths are NIAH `context_length`s, in tokens."""

    retrieval_fraction: float = 0.5  # share of rows that hold retrieval samples
    retrieval_lengths: tuple[int, ...] = (1024, 1280, 1536, 1792, 2000)  # where selection must work
    answer_weight: float = 20.0
    distractors: int = 0  # needles of other keys per retrieval sample (0: the evaluation's format)
    # share of retrieval rows that open with a far needle: a sample of the longest retrieval length with
    # its needle in the first quarter. Uniform depths over the lengths put a needle more than 12k tokens
    # before its question in about one retrieval row in twenty, and reading a selected needle fails there.
    far_needles: float = 0.0


def make_batch(corpus: Corpus, seed: int, step: int, batch_size: int, seq_len: int, mix: MixConfig):
    """The batch of `step`: (ids int64 [B, T+1], weights float32 [B, T+1]); a pure function of its args.

    Text rows are random windows of the training split (weight 1). Retrieval rows pack NIAH samples
    of random lengths and depths from the start of the row (answers weighted, prompts 0), and fill
    the tail with text; with `mix.far_needles`, that share of them opens with a far needle.
    """
    rng = np.random.default_rng([seed, step])
    ids = np.empty((batch_size, seq_len + 1), dtype=np.int64)  # [B, T+1]
    weights = np.ones((batch_size, seq_len + 1), dtype=np.float32)  # [B, T+1]
    n_retrieval = int(round(batch_size * mix.retrieval_fraction))
    for row in range(batch_size):
        if row < n_retrieval:
            ids[row], weights[row] = _retrieval_row(corpus, rng, seq_len + 1, mix, seed, step, row)
        else:
            ids[row] = _text_window(corpus.train, rng, seq_len + 1)
    return ids, weights


def _text_window(tokens: np.ndarray, rng, length: int) -> np.ndarray:
    start = int(rng.integers(0, tokens.size - length))
    return tokens[start : start + length].astype(np.int64)  # [length]


def _retrieval_row(corpus, rng, length: int, mix: MixConfig, seed: int, step: int, row: int):
    ids = np.empty(length, dtype=np.int64)  # [T+1]
    weights = np.ones(length, dtype=np.float32)  # [T+1]
    filled, k = 0, 0
    while True:
        fitting = [c for c in mix.retrieval_lengths if c + RETRIEVAL_MARGIN <= length - filled]
        if not fitting:
            break
        # the draw only where the share is on, so a mix without far needles keeps its batches
        if k == 0 and mix.far_needles > 0 and rng.random() < mix.far_needles:
            context, depth = max(fitting), float(rng.uniform(0, 25))
        else:
            context, depth = int(rng.choice(fitting)), float(rng.uniform(0, 100))
        niah_seed = TRAIN_SEED_OFFSET + ((seed * 1_000_003 + step) * 64 + row) * 64 + k
        seg_ids, seg_w = retrieval_segment(corpus.tokenizer, context, depth, niah_seed, mix.answer_weight,
                                           mix.distractors, pool_length=max(mix.retrieval_lengths))
        seg_ids, seg_w = seg_ids[: length - filled], seg_w[: length - filled]
        ids[filled : filled + seg_ids.size] = seg_ids
        weights[filled : filled + seg_ids.size] = seg_w
        filled += seg_ids.size
        k += 1
    if filled < length:
        ids[filled:] = _text_window(corpus.train, rng, length - filled)
    return ids, weights


def heldout_text_batches(corpus: Corpus, seq_len: int, n_rows: int, batch_size: int):
    """Fixed held-out text: the first n_rows non-overlapping windows; list of int64 [b, T+1]."""
    n_rows = min(n_rows, (corpus.heldout.size - 1) // (seq_len + 1))
    rows = corpus.heldout[: n_rows * (seq_len + 1)].astype(np.int64).reshape(n_rows, seq_len + 1)
    return [rows[i : i + batch_size] for i in range(0, n_rows, batch_size)]


def heldout_retrieval_samples(corpus: Corpus, lengths: tuple[int, ...], n_per_length: int,
                              pool_length: int | None = None):
    """Fixed held-out NIAH samples (seeds disjoint from training): list of (ids [L], weights [L]).

    `pool_length`: as `make_retrieval_doc`'s (training passes its batches' longest retrieval length).
    """
    out = []
    for i, context in enumerate(lengths):
        for j in range(n_per_length):
            depth = 100.0 * j / max(1, n_per_length - 1)
            seed = HELDOUT_SEED_OFFSET + i * 1000 + j
            out.append(retrieval_segment(corpus.tokenizer, context, depth, seed, answer_weight=1.0,
                                         pool_length=pool_length))
    return out


class BatchStream:
    """`make_batch` for steps 0, 1, 2, ... computed ahead by `workers` forked processes (0: inline).

    Create it before CUDA is initialised (the workers are forked and never touch the GPU).
    """

    def __init__(self, corpus: Corpus, seed: int, batch_size: int, seq_len: int, mix: MixConfig,
                 workers: int = 0, ahead: int = 8):
        global _WORKER_CORPUS
        self.args = (seed, batch_size, seq_len, mix)
        self.corpus, self.ahead, self.pending = corpus, ahead, {}
        self.pool = None
        if workers > 0:
            import multiprocessing as mp
            from concurrent.futures import ProcessPoolExecutor

            _WORKER_CORPUS = corpus
            _haystack_pool(corpus.tokenizer, max(mix.retrieval_lengths))  # inherited by the workers
            self.pool = ProcessPoolExecutor(workers, mp_context=mp.get_context("fork"))

    def get(self, step: int):
        """(ids int64 [B, T+1], weights float32 [B, T+1]) of `step`."""
        seed, batch_size, seq_len, mix = self.args
        if self.pool is None:
            return make_batch(self.corpus, seed, step, batch_size, seq_len, mix)
        for s in range(step, step + self.ahead):
            if s not in self.pending:
                self.pending[s] = self.pool.submit(_worker_batch, seed, s, batch_size, seq_len, mix)
        return self.pending.pop(step).result()

    def close(self):
        if self.pool is not None:
            for fut in self.pending.values():
                fut.cancel()
            self.pool.shutdown(wait=True, cancel_futures=True)


_WORKER_CORPUS: Corpus | None = None


def _worker_batch(seed, step, batch_size, seq_len, mix):
    return make_batch(_WORKER_CORPUS, seed, step, batch_size, seq_len, mix)
