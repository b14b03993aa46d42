"""The haystack a NIAH needle hides in: varied English from a seeded grammar, or a folder of .txt files.

The built-in grammar needs no download and holds no digits, so the needle's 7-digit value is the only
number in the prompt. A folder's .txt files are read in name order and repeated when short (e.g. Paul
Graham's essays).
"""

from __future__ import annotations

import os
import random
import re
import stat
from functools import lru_cache
from pathlib import Path

from nsa_eval.errors import UsageError

_GRAMMAR = {
    "subject": (
        "the old farmer|a quiet engineer|the travelling musician|my neighbour|the river guide|"
        "a young painter|the village baker|the ship's captain|an honest clerk|the night watchman|"
        "a curious student|the mountain shepherd|our teacher|the city gardener|a tired courier|"
        "the lighthouse keeper|a careful tailor|the market trader|an elderly poet|the forest ranger"
    ),
    "verb": (
        "carried|painted|repaired|described|discovered|borrowed|admired|measured|collected|"
        "followed|remembered|noticed|cleaned|polished|planted|studied|ignored|sketched|traded|folded"
    ),
    "object": (
        "a wooden chair|the broken lantern|an empty basket|the blue notebook|a bundle of letters|"
        "the heavy anchor|a jar of honey|the silver kettle|an old map|the woollen scarf|"
        "a stack of firewood|the painted door|a box of apples|the narrow bridge|a copper bell|"
        "the garden fence|a loaf of bread|the torn sail|a pair of boots|the stone wall"
    ),
    "place": (
        "near the harbour|behind the mill|across the valley|beside the old well|under the bridge|"
        "in the crowded square|along the river|at the edge of the forest|inside the library|"
        "on the hill|past the orchard|by the railway station|in the quiet courtyard|"
        "over the frozen lake|around the market"
    ),
    "time": (
        "early in the morning|after the long rain|before the festival|late one evening|"
        "during the harvest|in the spring|at dawn|when the snow melted|on a windy afternoon|"
        "every summer|after supper|before the storm"
    ),
    "adjective": (
        "calm|bright|patient|cheerful|stubborn|gentle|restless|clever|humble|careful|noisy|"
        "generous|thoughtful|weary|proud"
    ),
    "feeling": (
        "it seemed like the right thing to do|nobody else had the time|the weather was kind|"
        "the town needed it|it reminded everyone of home|the old ways still mattered|"
        "a friend had asked for help|the work brought some peace|it was simply a habit by then"
    ),
}
_WORDS = {k: v.split("|") for k, v in _GRAMMAR.items()}
_PATTERNS = (
    "{Subject} {verb} {object} {place}.",
    "{Time}, {subject} {verb} {object}.",
    "{Subject} was {adjective}, so {subject} {verb} {object} {time}.",
    "Because {feeling}, {subject} {verb} {object}.",
    "{Subject} {verb} {object} {place}, and {subject} {verb} {object} {time}.",
    "Nobody knew why {subject} {verb} {object}, but {feeling}.",
    "{Place}, {subject} {verb} {object} while {subject} looked {adjective}.",
    "It was {adjective} work, yet {subject} {verb} {object} {place}.",
)


def _fill(pattern: str, rng: random.Random) -> str:
    def word(match: re.Match) -> str:
        name = match.group(1)
        text = rng.choice(_WORDS[name.lower()])
        return text[0].upper() + text[1:] if name[0].isupper() else text

    return re.sub(r"\{(\w+)\}", word, pattern)


def builtin_haystack(num_chars: int, rng: random.Random) -> str:
    """Varied English filler of at least num_chars characters (paragraphs of 4-8 sentences)."""
    paragraphs, size = [], 0
    while size < num_chars:
        sentences = [_fill(rng.choice(_PATTERNS), rng) for _ in range(rng.randint(4, 8))]
        paragraphs.append(" ".join(sentences))
        size += len(paragraphs[-1]) + 2
    return "\n\n".join(paragraphs)


@lru_cache(maxsize=4)
def _folder_text(folder: str) -> str:
    files = sorted(Path(folder).glob("*.txt"))
    if not files:
        raise UsageError(f"NIAH haystack folder {folder} has no .txt files (or use niah_haystack: builtin)")
    return "\n\n".join(f.read_text(encoding="utf-8", errors="replace").strip() for f in files)


def haystack_text(haystack: str, num_chars: int, rng: random.Random) -> str:
    """At least num_chars of haystack: the builtin grammar, or a .txt folder repeated as needed."""
    if haystack == "builtin":
        return builtin_haystack(num_chars, rng)
    folder = Path(haystack).expanduser()  # as check_haystack reads it
    if not folder.is_dir():
        raise UsageError(f"NIAH haystack must be 'builtin' or a folder of .txt files; got {haystack!r}")
    text = _folder_text(str(folder.resolve()))
    return "\n\n".join([text] * (num_chars // max(len(text), 1) + 1))


def check_haystack(haystack: str, where: str) -> None:
    """UsageError unless `haystack` is 'builtin' or a folder of readable, non-empty .txt files (read
    from the current directory, as the task reads it), so a missing or empty folder fails before any
    model loads; `where` starts the message (the suite's file and key)."""
    if haystack == "builtin":
        return
    folder = Path(haystack).expanduser()
    if not folder.is_dir():
        raise UsageError(f"{where}: {haystack!r} is not a folder (relative to the current directory, "
                         f"{Path.cwd()}); expected 'builtin' or a folder of .txt files")
    texts = sorted(folder.glob("*.txt"))
    if not texts:
        raise UsageError(f"{where}: {haystack!r} has no .txt files; expected 'builtin' or a folder of "
                         ".txt files")
    has_text = False
    for path in texts:
        try:
            if not stat.S_ISREG(os.stat(path).st_mode):
                raise UsageError(f"{where}: {path} is not a regular file; expected .txt files")
            with open(path, "rb") as f:
                has_text = has_text or bool(f.read(1 << 16).strip())
        except OSError as err:
            raise UsageError(f"{where}: cannot read {path} ({err.strerror})") from None
    if not has_text:
        raise UsageError(f"{where}: the .txt files of {haystack!r} are empty; expected text to hide the "
                         "needle in")
