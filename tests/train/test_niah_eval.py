"""NIAH scoring of trained checkpoints: teacher-forced hits equal what greedy decoding would emit."""

import torch

from nsa_eval.train.niah_eval import plot_heatmap, score_doc, summarize


class _Oracle(torch.nn.Module):
    """Predicts the next token of `script` at every position (a model that has memorised it)."""

    def __init__(self, script: list[int], vocab: int, wrong_at: int | None = None):
        super().__init__()
        self.script, self.vocab, self.wrong_at = script, vocab, wrong_at

    def forward(self, input_ids, use_cache=False):
        T = input_ids.shape[1]
        nxt = torch.tensor(self.script[1 : T + 1] + [self.script[-1]] * (T + 1 - len(self.script[1:])))[:T]
        if self.wrong_at is not None:
            nxt[self.wrong_at] = (nxt[self.wrong_at] + 1) % self.vocab
        logits = torch.nn.functional.one_hot(nxt, self.vocab).float()[None]  # [1, T, V]
        return type("Out", (), {"logits": logits})()


def test_teacher_forced_scoring(tiny_corpus):
    tok = tiny_corpus.tokenizer
    doc = {"prompt": "the magic number for x is: 4711003.\nThe magic number for x is", "answer": "4711003"}
    prompt = tok(doc["prompt"])["input_ids"]
    script = prompt + tok(" 4711003.")["input_ids"]
    assert score_doc(_Oracle(script, len(tok)), tok, doc)["score"] == 1.0
    first_digit = len(prompt)  # logits at position len(prompt) predict the first digit
    miss = score_doc(_Oracle(script, len(tok), wrong_at=first_digit), tok, doc)
    assert miss["score"] == 0.0 and miss["prediction"].startswith(" ")
    longer = prompt + tok(" 47110039")["input_ids"]  # an extra digit: not the value as a whole number
    assert score_doc(_Oracle(longer, len(tok)), tok, doc)["score"] == 0.0


def test_summary_and_heatmap(tmp_path):
    rows = [{"context_length": n, "depth_percent": d, "score": float(n == 512 or d == 100)}
            for n in (512, 1024, 4096) for d in (0.0, 50.0, 100.0)]
    s = summarize(rows, within=1024)
    assert s["accuracy_by_length"][512] == 1.0 and abs(s["accuracy_within"] - 4 / 6) < 1e-9
    assert abs(s["accuracy_beyond"] - 1 / 3) < 1e-9
    plot_heatmap(rows, tmp_path / "h.png", "test")
    assert (tmp_path / "h.png").stat().st_size > 1000
