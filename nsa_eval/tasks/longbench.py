"""LongBench v1, the NSA paper's ten subsets, with the official prompts, generation lengths and metrics.

Follows THUDM/LongBench (LongBench/config/dataset2prompt.json, dataset2maxlen.json, metrics.py,
eval.py). Differences from lm-eval's `longbench_*` tasks, which these build on:
- prompts are the official strings: lm-eval drops the trailing space of passage_retrieval_en's
  "The answer is: " and the trailing newline of lcc's "Next line of code:\\n";
- `code_sim_score` takes the first line after leading newlines that has no `, # or // (official);
  lm-eval's copy also skips blank lines;
- the prediction is not stripped before scoring (official); lm-eval strips it;
- rows in either schema work: THUDM's (`input`, `context`, `answers`) or a pre-formatted mirror's
  (`context`, `question`, `answer_prefix`, `answer`(s)), whose prompt is used as written.

Every metric is on the 0-1 scale (the official eval.py reports x100). Each doc scores the max over
its reference answers. `score` is the subset's own metric under one name, so the `nsa_longbench`
group averages it unweighted over the ten subsets, as the paper's Table 2 does.

Truncation: with the task metadata `longbench_max_length: N`, each prompt longer than N tokens is cut
in the middle as LongBench's pred.py cuts it (`truncate_prompt_middle`; longbench_task.LongBenchTask),
so LongBench gets its own length whatever the model's context. Without it, prompts are emitted
whole, and the `nsa-eval` lm-eval model with `truncation=middle` keeps the first and last halves of
the prompt's tokens (`truncate_middle`) when they overflow its max_length - max_gen_toks.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from functools import partial

from nsa_eval.errors import UsageError
from nsa_eval.tasks.metadata import TOKENIZER, MetadataKey
from nsa_eval.values import is_int

# The task metadata key that sets LongBench's own prompt length (longbench_task.LongBenchTask)
MAX_LENGTH_KEY = "longbench_max_length"

# hotpotqa's and 2wikimqa's entry: the official config gives both multi-document QA sets one prompt
_PASSAGES_QA = (
    "Answer the question based on the given passages. Only give me the answer and do not output any "
    "other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the "
    "given passages. Only give me the answer and do not output any other words.\n\n"
    "Question: {input}\nAnswer:",
    32,
    "qa_f1",
)

# subset -> (official prompt, max new tokens, metric)
SUBSETS: dict[str, tuple[str, int, str]] = {
    "multifieldqa_en": (
        "Read the following text and answer briefly.\n\n{context}\n\nNow, answer the following question "
        "based on the above text, only give me the answer and do not output any other words.\n\n"
        "Question: {input}\nAnswer:",
        64,
        "qa_f1",
    ),
    "multifieldqa_zh": (
        "阅读以下文字并用中文简短回答：\n\n{context}\n\n现在请基于上面的文章回答下面的问题，只告诉我答案，"
        "不要输出任何其他字词。\n\n问题：{input}\n回答：",
        64,
        "qa_f1_zh",
    ),
    "qasper": (
        "You are given a scientific article and a question. Answer the question as concisely as you can, "
        "using a single phrase or sentence if possible. If the question cannot be answered based on the "
        'information in the article, write "unanswerable". If the question is a yes/no question, answer '
        '"yes", "no", or "unanswerable". Do not provide any explanation.\n\nArticle: {context}\n\n Answer '
        "the question based on the above article as concisely as you can, using a single phrase or "
        "sentence if possible. If the question cannot be answered based on the information in the "
        'article, write "unanswerable". If the question is a yes/no question, answer "yes", "no", or '
        '"unanswerable". Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:',
        128,
        "qa_f1",
    ),
    "hotpotqa": _PASSAGES_QA,
    "2wikimqa": _PASSAGES_QA,
    "gov_report": (
        "You are given a report by a government agency. Write a one-page summary of the report.\n\n"
        "Report:\n{context}\n\nNow, write a one-page summary of the report.\n\nSummary:",
        512,
        "rouge_l",
    ),
    "dureader": (
        "请基于给定的文章回答下述问题。\n\n文章：{context}\n\n请基于上述文章回答下面的问题。\n\n问题：{input}\n回答：",
        128,
        "rouge_l_zh",
    ),
    "passage_retrieval_en": (
        "Here are 30 paragraphs from Wikipedia, along with an abstract. Please determine which paragraph "
        "the abstract is from.\n\n{context}\n\nThe following is an abstract.\n\n{input}\n\nPlease enter "
        'the number of the paragraph that the abstract is from. The answer format must be like "Paragraph '
        '1", "Paragraph 2", etc.\n\nThe answer is: ',
        32,
        "retrieval",
    ),
    "passage_retrieval_zh": (
        "以下是若干段落文字，以及其中一个段落的摘要。请确定给定的摘要出自哪一段。\n\n{context}\n\n下面是一个摘要\n\n"
        '{input}\n\n请输入摘要所属段落的编号。答案格式必须是"段落1"，"段落2"等格式\n\n答案是：',
        32,
        "retrieval_zh",
    ),
    "lcc": ("Please complete the code given below. \n{context}Next line of code:\n", 64, "code_sim"),
}


# The metadata keys nsa_longbench and each nsa_longbench_<subset> read: LongBench's own prompt length,
# cut as its pred.py cuts it, counted with the model's tokenizer.
METADATA: dict[str, MetadataKey] = {
    MAX_LENGTH_KEY: MetadataKey(lambda v: is_int(v) and v > 0,
                                "a positive integer (prompt tokens; a longer prompt loses its middle)",
                                prompt_length=True),
    "tokenizer": TOKENIZER,
}


# ------------------------------------------------------------------ metrics (official, 0-1 scale)


def normalize_answer(s: str) -> str:
    """Lowercase; drop punctuation, articles (a, an, the) and extra whitespace."""
    s = "".join(ch for ch in s.lower() if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


_ZH_PUNCTUATION = (
    "！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠｢｣"
    "､、〃》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿–—‘’‛“”„‟…‧﹏."
)


def normalize_zh_answer(s: str) -> str:
    """Lowercase; drop English and Chinese punctuation and all whitespace."""
    drop = set(string.punctuation + _ZH_PUNCTUATION)
    return "".join(ch for ch in s.lower() if ch not in drop and not ch.isspace())


def token_f1(prediction: list[str], reference: list[str]) -> float:
    """F1 of the multiset overlap of two token lists."""
    same = sum((Counter(prediction) & Counter(reference)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(prediction), same / len(reference)
    return 2 * precision * recall / (precision + recall)


def qa_f1(prediction: str, reference: str) -> float:
    """Word-level F1 after normalize_answer."""
    return token_f1(normalize_answer(prediction).split(), normalize_answer(reference).split())


def _jieba_words(text: str) -> list[str]:
    import jieba

    return list(jieba.cut(text, cut_all=False))


def qa_f1_zh(prediction: str, reference: str) -> float:
    """F1 over jieba words, each normalized with normalize_zh_answer (empty ones dropped)."""

    def words(text: str) -> list[str]:
        return [w for w in (normalize_zh_answer(t) for t in _jieba_words(text)) if w]

    return token_f1(words(prediction), words(reference))


def rouge_l(prediction: str, reference: str) -> float:
    """ROUGE-L F of the `rouge` package (whitespace tokens); 0 when it cannot score (e.g. empty)."""
    from rouge import Rouge

    try:
        return float(Rouge().get_scores([prediction], [reference], avg=True)["rouge-l"]["f"])
    except Exception:  # the official scorer returns 0 for empty or unscorable text
        return 0.0


def rouge_l_zh(prediction: str, reference: str) -> float:
    """ROUGE-L F over jieba words joined by spaces."""
    return rouge_l(" ".join(_jieba_words(prediction)), " ".join(_jieba_words(reference)))


def _retrieval(prediction: str, reference: str, pattern: str) -> float:
    """Fraction of the numbers in the prediction that equal the reference paragraph's number."""
    wanted = re.findall(pattern, reference)[0]
    numbers = re.findall(r"\d+", prediction)
    return sum(n == wanted for n in numbers) / len(numbers) if numbers else 0.0


def retrieval(prediction: str, reference: str) -> float:
    return _retrieval(prediction, reference, r"Paragraph (\d+)")


def retrieval_zh(prediction: str, reference: str) -> float:
    return _retrieval(prediction, reference, r"段落(\d+)")


def code_sim(prediction: str, reference: str) -> float:
    """fuzz.ratio / 100 between the reference line and the first predicted line without `, # or //.

    fuzz.ratio is fuzzywuzzy's (the official metrics.py's), on python-Levenshtein's ratio (the
    indel similarity 2 * LCS / (len(a) + len(b)), rounded to a whole percent); `fuzz()` refuses
    fuzzywuzzy's pure-python fallback, whose different ratio would change the score.
    """
    first = ""
    for line in prediction.lstrip("\n").split("\n"):
        if "`" not in line and "#" not in line and "//" not in line:
            first = line
            break
    return fuzz().ratio(first, reference) / 100


def fuzz():
    """fuzzywuzzy's `fuzz` module, checked to score with python-Levenshtein (a UsageError if not).

    fuzzywuzzy picks its backend when it is imported: python-Levenshtein's ratio when that package
    is installed, else difflib's SequenceMatcher, whose Ratcliff-Obershelp ratio is not an edit
    similarity and scores code lines up to 20 points apart (56 vs 77 on a swapped call). LongBench
    reports lcc as edit similarity and its metric comes from RepoBench, which requires
    python-Levenshtein, so that is the backend nsa-eval pins (pyproject.toml) and requires here.
    """
    from fuzzywuzzy import fuzz as fuzzywuzzy_fuzz

    backend = fuzzywuzzy_fuzz.SequenceMatcher
    if backend.__module__ != "fuzzywuzzy.StringMatcher":
        raise UsageError(
            "LongBench's code_sim (lcc) needs fuzzywuzzy on python-Levenshtein, but fuzzywuzzy fell back to "
            f"{backend.__module__}.{backend.__name__}, which scores differently; expected "
            "`pip install python-Levenshtein` (a dependency of nsa-eval: reinstall it with its "
            "dependencies)"
        )
    return fuzzywuzzy_fuzz


METRICS = {
    "qa_f1": qa_f1,
    "qa_f1_zh": qa_f1_zh,
    "rouge_l": rouge_l,
    "rouge_l_zh": rouge_l_zh,
    "retrieval": retrieval,
    "retrieval_zh": retrieval_zh,
    "code_sim": code_sim,
}


# ------------------------------------------------------------------ prompts, truncation, lm-eval glue


def answers(doc: dict) -> list[str]:
    refs = doc.get("answers", doc.get("answer"))
    return [refs] if isinstance(refs, str) else list(refs)


def build_prompt(subset: str, doc: dict) -> str:
    """The official prompt for a row (THUDM schema), or the row's own pre-formatted prompt."""
    if "answer_prefix" in doc:  # a mirror that stores context/question already wrapped in the prompt
        return doc["context"] + doc["question"] + doc["answer_prefix"]
    template = SUBSETS[subset][0]
    return template.format(context=doc["context"], input=doc.get("input", doc.get("question", "")))


def score(subset: str, prediction: str, doc: dict) -> dict[str, float]:
    """{"score": s, <metric>: s}, s = max over the reference answers, 0-1 scale."""
    metric = SUBSETS[subset][2]
    value = max((METRICS[metric](prediction, ref) for ref in answers(doc)), default=0.0)
    return {"score": value, metric: value}


def _process_results(subset: str, doc: dict, results: list[str]) -> dict[str, float]:
    return score(subset, results[0], doc)


def truncate_middle(token_ids: list, max_tokens: int) -> list:
    """Keep the first max_tokens // 2 and the last max_tokens - max_tokens // 2 tokens (LongBench pred.py)."""
    if max_tokens <= 0:
        raise ValueError(f"max_tokens must be positive; got {max_tokens}")
    if len(token_ids) <= max_tokens:
        return list(token_ids)
    head = max_tokens // 2
    return list(token_ids[:head]) + list(token_ids[len(token_ids) - (max_tokens - head) :])


def truncate_prompt_middle(tokenizer, prompt: str, max_tokens: int) -> str:
    """The prompt cut as LongBench's pred.py cuts it: tokenized as the model reads it (its special
    tokens included), a prompt of more than max_tokens tokens becomes decode(first max_tokens // 2)
    + decode(last max_tokens // 2), special tokens skipped; a shorter one is returned as it is."""
    ids = tokenizer(prompt)["input_ids"]
    if len(ids) <= max_tokens:
        return prompt
    half = max_tokens // 2
    decode = partial(tokenizer.decode, skip_special_tokens=True)
    return decode(ids[:half]) + decode(ids[len(ids) - half :])


def doc_to_target(doc: dict) -> str:
    return answers(doc)[0] if answers(doc) else ""


# `!function nsa_eval.tasks.longbench.doc_to_text_<subset>` / `process_results_<subset>`
for _subset in SUBSETS:
    globals()[f"doc_to_text_{_subset}"] = partial(build_prompt, _subset)
    globals()[f"process_results_{_subset}"] = partial(_process_results, _subset)
del _subset
