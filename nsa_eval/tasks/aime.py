"""AIME 2024 as the NSA paper runs it: k sampled answers per problem, avg@k and pass@k.

Sampling: temperature 0.7, top-p 0.95, k = `repeats` samples per problem (default 16), at most 8,192
(`nsa_aime24_8k`) or 16,384 (`nsa_aime24_16k`) new tokens. The paper reports the mean correctness
of the 16 samples (avg@16); pass@k (any sample right) and maj@k (the most common answer right)
come from the same samples at no cost.

Prompt: the problem, then DeepSeek-R1's instruction "Please reason step by step, and put your final
answer within \\boxed{}." (lm-eval's aime24 uses "Question: ...\\nAnswer:" and scores one greedy
answer). Answer extraction (`extract_answer`), as a careful grader reads a finished solution:
- a reasoning trace's answer is read after its last `</think>`; a response that opens `<think>` and
  never closes it was cut off by the token limit and has no answer;
- the answer is the last complete \\boxed{...} (or \\fbox, or `\\boxed 42`), normalised: formatting
  wrappers (\\mathbf, \\boldsymbol, \\textbf, \\text, \\mathrm, ...), `$`, a currency sign, a
  multiple-choice label ("(B) 33", "B. 33"), an "Answer:" label and a trailing unit ("m^2",
  "degrees", %) are dropped, and an equation gives its right-hand side ("m+n=33" is 33);
- what is left must be one integer: anything else (\\frac{1}{2}, 2^{10}, 3\\sqrt{2}, "12, 34") is no
  answer, so it never scores by a number inside it;
- a response without a complete box has no answer and scores 0: the instruction asks for the box, and
  a trace cut off by the generation limit (the quantity the paper's 8k / 16k limits measure) must
  not score by a number it happened to write on the way ("the answer is 5, but wait...").
Integers compare as integers, so "033", "33", "1,000" and "33.0" match 33 and 1000.
Dataset: Maxwell-Jia/AIME_2024 (split train: ID, Problem, Solution, Answer).
"""

from __future__ import annotations

import re
from collections import Counter

INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def doc_to_text(doc: dict) -> str:
    return f"{doc['Problem'].strip()}\n{INSTRUCTION}"


def _last_boxed(text: str) -> str | None:
    """The contents of the last \\boxed{...} / \\fbox{...} or `\\boxed 5`; None without a box or where
    the box is cut off (no closing brace)."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    rest = text[start:]
    brace = rest.find("{")
    if brace < 0 or rest[len("\\boxed") : brace].strip():  # "\boxed 42" form
        match = re.match(r"\\(?:boxed|fbox)\s+([^\s$]+)", rest)
        return match.group(1) if match else None
    depth = 0
    for i in range(brace, len(rest)):
        depth += {"{": 1, "}": -1}.get(rest[i], 0)
        if depth == 0:
            return rest[brace + 1 : i]
    return None


# LaTeX commands that only format their argument: \mathbf{33} is 33
_WRAPPERS = re.compile(
    r"\\(?:text|textbf|textrm|textit|texttt|textnormal|mathbf|mathrm|mathit|mathsf|mathtt|mathnormal|"
    r"boldsymbol|bm|mbox|operatorname|underline|overline|displaystyle|textstyle|large|Large)\s*\{([^{}]*)\}"
)
_SWITCHES = re.compile(r"\\(?:displaystyle|textstyle|bf|it|rm|left|right)(?![A-Za-z])")
# an integer (thousands grouped by commas or not, ".0" allowed), then at most a unit word
_BOXED_INTEGER = re.compile(r"(-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.0+)?)(?:\s*[A-Za-z]+(?:\^\{?\d\}?)?)?\.?")


def _boxed_int(content: str) -> int | None:
    """The integer a box holds when it holds nothing else (module docstring), else None."""
    text = content
    while (unwrapped := _WRAPPERS.sub(r"\1", text)) != text:  # nested: \mathbf{\text{33}}
        text = unwrapped
    text = _SWITCHES.sub("", text)
    text = text.replace("{,}", ",").replace("\\!", "").replace("\\,", "").replace("\\ ", " ")
    text = re.sub(r"\\\$|\\textdollar|\\pounds|\\euro|[$£€¥]", "", text)  # a currency sign, or math $
    text = re.sub(r"\^\s*\{?\\circ\}?|\\?%|\\degree", "", text)
    text = text.strip().strip("{}").strip()
    text = re.sub(r"^(?:final\s+)?answer\s*(?:is)?\s*[:=]?\s*", "", text, flags=re.IGNORECASE)
    text = re.sub(r"^(?:\(\s*[A-E]\s*\)|[A-E]\s*[.):])\s*", "", text)  # "(B) 33", "B. 33", "B) 33"
    if "=" in text:  # an equation gives its right-hand side, unless it lists several ("x=1, y=2")
        *left, text = text.split("=")
        if any(re.search(r"[,;]", side) for side in left):
            return None
    match = _BOXED_INTEGER.fullmatch(text.strip())
    return int(float(match.group(1).replace(",", ""))) if match else None


def final_answer_text(response: str) -> str | None:
    """The part of a response that holds its final answer: after the last `</think>` of a reasoning
    trace; None for a trace that opens `<think>` and never closes it (cut off mid-thought)."""
    if THINK_CLOSE in response:
        return response[response.rfind(THINK_CLOSE) + len(THINK_CLOSE) :]
    if THINK_OPEN in response:
        return None
    return response


def extract_answer(response: str) -> int | None:
    """The final integer answer of a response, or None (module docstring: what counts)."""
    text = final_answer_text(response)
    boxed = _last_boxed(text) if text is not None else None
    return None if boxed is None else _boxed_int(boxed)  # no box, or one cut off by the limit: none


def keep_all(resps, docs):
    """lm-eval filter (`custom`): keep every sampled response (the default keeps only the first)."""
    return resps


def process_results(doc: dict, results: list) -> dict[str, float]:
    """avg@k: mean correctness of the k samples; pass@k: any correct; maj@k: most common answer correct."""
    samples = results[0] if results and isinstance(results[0], list | tuple) else results
    target = int(str(doc["Answer"]).strip())
    answers = [extract_answer(r) for r in samples]
    correct = [a == target for a in answers]
    voted = Counter(a for a in answers if a is not None).most_common(1)
    return {
        "avg_at_k": sum(correct) / len(correct),
        "pass_at_k": float(any(correct)),
        "maj_at_k": float(bool(voted) and voted[0][0] == target),
    }
