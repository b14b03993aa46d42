"""AIME 2024 as the NSA paper runs it: k sampled answers per problem, avg@k and pass@k.

Sampling: temperature 0.7, top-p 0.95, k = `repeats` samples per problem (default 16), at most 8,192
(`nsa_aime24_8k`) or 16,384 (`nsa_aime24_16k`) new tokens. The paper reports the mean correctness
of the 16 samples (avg@16); pass@k (any sample right) and maj@k (the most common answer right)
come from the same samples at no cost.

Prompt: the problem, then DeepSeek-R1's instruction "Please reason step by step, and put your final
answer within \\boxed{}." (lm-eval's aime24 uses "Question: ...\\nAnswer:" and scores one greedy
answer). Answer extraction (`extract_answer`), in order: the last \\boxed{...} (or \\fbox); else the
last "answer is N" / "Answer: N"; else the last integer in the text. Integers compare as integers, so
"033", "33" and "33.0" all match 33. Dataset: Maxwell-Jia/AIME_2024 (split train: ID, Problem,
Solution, Answer).
"""

from __future__ import annotations

import re
from collections import Counter

INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


def doc_to_text(doc: dict) -> str:
    return f"{doc['Problem'].strip()}\n{INSTRUCTION}"


def _last_boxed(text: str) -> str | None:
    """Contents of the last \\boxed{...} / \\fbox{...} (braces balanced), or of `\\boxed 5`."""
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
    return None  # unbalanced: the answer was cut off


_NUMBER = r"-?\d[\d,]*(?:\.\d+)?"


def _to_int(text: str) -> int | None:
    """The integer a short answer string names: '033' -> 33, '1,000' -> 1000, '33.0' -> 33."""
    text = re.sub(r"\\(?:text|mathrm|textbf)\{([^}]*)\}", r"\1", text)
    numbers = re.findall(_NUMBER, text.replace("{,}", ","))
    if not numbers:
        return None
    value = float(numbers[-1].replace(",", ""))
    return int(value) if value.is_integer() else None


def extract_answer(response: str) -> int | None:
    """The final integer answer of a response (module docstring: the order of the rules)."""
    boxed = _last_boxed(response)
    if boxed is not None:
        return _to_int(boxed)
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
