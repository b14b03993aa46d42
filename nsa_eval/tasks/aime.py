"""AIME 2024 as the NSA paper runs it: k sampled answers per problem, avg@k and pass@k.

Sampling: temperature 0.7, top-p 0.95, k = `repeats` samples per problem (default 16), at most 8,192
(`nsa_aime24_8k`) or 16,384 (`nsa_aime24_16k`) new tokens. The paper reports the mean correctness
of the 16 samples (avg@16); pass@k (any sample right) and maj@k (the most common answer right)
come from the same samples at no cost.

Prompt: the problem, then DeepSeek-R1's instruction "Please reason step by step, and put your final
answer within \\boxed{}." (lm-eval's aime24 uses "Question: ...\\nAnswer:" and scores one greedy
answer). Answer extraction (`extract_answer`), in order:
- the last \\boxed{...} (or \\fbox), which must hold one integer and nothing else but its wrappers:
  `$`, spaces, \\text{...}, a leading "x =", a trailing unit ("m^2", "degrees", %); anything else
  (\\frac{1}{2}, 2^{10}, 3\\sqrt{2}, "12, 34") is no answer, so it never scores by a number inside it;
- else the last "answer is N" / "Answer: N";
- else the last integer in the text.
A box cut off by the token limit (no closing brace) is not trusted: the rules apply to the text
before it. Integers compare as integers, so "033", "33", "1,000" and "33.0" match 33 and 1000.
Dataset: Maxwell-Jia/AIME_2024 (split train: ID, Problem, Solution, Answer).
"""

from __future__ import annotations

import re
from collections import Counter

INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


def doc_to_text(doc: dict) -> str:
    return f"{doc['Problem'].strip()}\n{INSTRUCTION}"


def _last_boxed(text: str) -> tuple[int, str | None] | None:
    """(start, contents) of the last \\boxed{...} / \\fbox{...} or `\\boxed 5`; contents None where
    the box is cut off (no closing brace). None without a box."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    rest = text[start:]
    brace = rest.find("{")
    if brace < 0 or rest[len("\\boxed") : brace].strip():  # "\boxed 42" form
        match = re.match(r"\\(?:boxed|fbox)\s+([^\s$]+)", rest)
        return start, match.group(1) if match else None
    depth = 0
    for i in range(brace, len(rest)):
        depth += {"{": 1, "}": -1}.get(rest[i], 0)
        if depth == 0:
            return start, rest[brace + 1 : i]
    return start, None


_NUMBER = r"-?\d[\d,]*(?:\.\d+)?"
# A whole boxed answer: an integer (thousands grouped by commas or not, ".0" allowed), optionally
# after "x =" and before a unit word ("m^2", "degrees", "%")
_BOXED_INTEGER = re.compile(
    r"(?:[A-Za-z]\w*\s*=\s*)?(-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.0+)?)(?:\s*[A-Za-z]+(?:\^\{?\d\}?)?)?\.?"
)


def _to_int(text: str) -> int | None:
    """The integer a short answer string names: '033' -> 33, '1,000' -> 1000, '33.0' -> 33."""
    text = re.sub(r"\\(?:text|mathrm|textbf)\{([^}]*)\}", r"\1", text)
    numbers = re.findall(_NUMBER, text.replace("{,}", ","))
    if not numbers:
        return None
    value = float(numbers[-1].replace(",", ""))
    return int(value) if value.is_integer() else None


def _boxed_int(content: str) -> int | None:
    """The integer a box holds when it holds nothing else (module docstring), else None."""
    text = re.sub(r"\\(?:text|mathrm|textbf|mbox)\s*\{([^}]*)\}", r"\1", content)
    text = text.replace("{,}", ",").replace("\\!", "").replace("\\,", "").replace("$", "")
    text = re.sub(r"\^\s*\{?\\circ\}?|\\?%", "", text).strip()
    match = _BOXED_INTEGER.fullmatch(text)
    return int(float(match.group(1).replace(",", ""))) if match else None


def extract_answer(response: str) -> int | None:
    """The final integer answer of a response (module docstring: the order of the rules)."""
    boxed = _last_boxed(response)
    if boxed is not None:
        start, content = boxed
        if content is not None:
            return _boxed_int(content)
        response = response[:start]  # a box cut off: its digits may be a prefix of the answer
    stated = re.findall(rf"answer(?:\s+is)?\s*[:=]?\s*\$?\s*({_NUMBER})", response, flags=re.IGNORECASE)
    if stated:
        return _to_int(stated[-1])
    return _to_int(response)


def is_correct(response: str, target) -> bool:
    answer = extract_answer(response)
    return answer is not None and answer == int(str(target).strip())


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
