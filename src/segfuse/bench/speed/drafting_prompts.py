"""The drafting benchmark's prompts, by task: short and varied, so that drafters meet prose, new code, code
that repeats the prompt (an edit), extraction (copies of the given text) and arithmetic (GSM8K, read from
the shared data folder, never copied here)."""

from __future__ import annotations

from pathlib import Path

from ...eval.tasks import get_task

CHAT = [
    "Explain in two sentences what a hash table is.",
    "Why is the sky blue? Answer briefly.",
    "What is the difference between a process and a thread? Keep it short.",
    "Explain what HTTP status code 404 means, in one short paragraph.",
    "What does a compiler do? Answer in three sentences.",
    "Briefly explain what recursion is, with a tiny example.",
    "What is photosynthesis? Two sentences.",
    "Explain the idea of Big-O notation briefly.",
    "What is the purpose of a version control system like git? Be brief.",
    "Why do we use unit tests? Answer in a few sentences.",
]

CODE = [
    "Write a Python function is_palindrome(s) that ignores case and spaces.",
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Write a Python function flatten(xs) that flattens a nested list of lists.",
    "Write a JavaScript function that counts the vowels in a string.",
    "Write a Python function that merges two sorted lists into one sorted list.",
    "Write a Python function word_counts(text) returning a dict of word frequencies.",
    "Write a C function that reverses a string in place.",
    "Write a Python function that checks whether a number is prime.",
    "Write a Python function chunk(xs, n) that splits a list into pieces of size n.",
    "Write a SQL query that returns the ten customers with the highest total order amount.",
]

_EDITS = [
    ("Add type hints and a docstring to this function", "def area(w, h):\n    return w * h\n"),
    (
        "Rename the variable `x` to `total` in this function",
        "def sum_list(items):\n    x = 0\n    for item in items:\n        x += item\n    return x\n",
    ),
    (
        "Rewrite this function to use a list comprehension",
        "def squares(n):\n    out = []\n    for i in range(n):\n        out.append(i * i)\n    return out\n",
    ),
    (
        "Make this function return None instead of raising on an empty list",
        "def first(items):\n    if not items:\n        raise ValueError('empty')\n    return items[0]\n",
    ),
    (
        "Add input validation (n must be a non-negative int) to this function",
        "def factorial(n):\n    result = 1\n    for i in range(2, n + 1):\n        result *= i\n    return result\n",
    ),
    (
        "Convert this function to use pathlib instead of os.path",
        "import os\n\ndef config_path(home):\n    return os.path.join(home, '.config', 'app', 'settings.toml')\n",
    ),
    (
        "Rewrite this JavaScript function with const/let and an arrow function",
        "function double(values) {\n  var out = [];\n  for (var i = 0; i < values.length; i++) {\n"
        "    out.push(values[i] * 2);\n  }\n  return out;\n}\n",
    ),
    (
        "Fix the off-by-one bug in this function",
        "def last_n(items, n):\n    return items[len(items) - n - 1:]\n",
    ),
    (
        "Add logging of the arguments to this function",
        "def divide(a, b):\n    if b == 0:\n        return None\n    return a / b\n",
    ),
    (
        "Rewrite this class as a dataclass",
        "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    ),
]
EDIT = [f"{what}. Reply with the whole function.\n\n```\n{code}```" for what, code in _EDITS]

_TEXTS = [
    "Maria Lopez, 34, moved from Madrid to Berlin in March 2021 to work as a data engineer at Zalando.",
    "The meeting with Acme Corp is on 12 May 2024 at 14:30 in room B204; Tom Reed and Ana Silva will attend.",
    "Order #5531: 3 blue mugs at $7.50 each and 1 teapot at $24.00, shipped to 18 Elm Street, Leeds.",
    "Dr. Kenji Sato published 'Deep Sea Vents' in 2019 with Ocean Press; it has 312 pages.",
    "The flight LH 402 leaves Frankfurt at 10:05 and lands in New York JFK at 12:50 local time.",
    "Our new laptop, the Zen 14, weighs 1.2 kg, has 16 GB of RAM, a 512 GB SSD and costs 999 euros.",
    "Paris recorded 31 degrees on Tuesday, 28 on Wednesday and a storm with 40 mm of rain on Thursday.",
    "Contact support at help@example.org or call +44 20 7946 0958 between 9am and 5pm, Monday to Friday.",
    "The recipe needs 200 g flour, 2 eggs, 300 ml milk and a pinch of salt; it serves four people.",
    "Liam Chen, a 27-year-old nurse from Toronto, won the city marathon in 2 hours 41 minutes.",
]
JSON = [
    f"Extract the facts of this text as a JSON object with short keys. Reply with JSON only.\n\nText: {t}"
    for t in _TEXTS
]

TASKS = ("chat", "code", "edit", "json", "gsm8k")
_WRITTEN = {"chat": CHAT, "code": CODE, "edit": EDIT, "json": JSON}


def task_prompts(task: str, count: int, data: Path) -> list[str]:
    """The first `count` prompts of `task`; gsm8k's from ``<data>/gsm8k/test_first1000.jsonl`` in the eval's
    own prompt (step by step, then "The answer is N.")."""
    if task == "gsm8k":
        return [item.prompt for item in get_task("gsm8k").load(data / "gsm8k" / "test_first1000.jsonl", limit=count)]
    if task not in _WRITTEN:
        raise ValueError(f"unknown task {task!r}: one of {', '.join(TASKS)}")
    prompts = _WRITTEN[task]
    if count > len(prompts):
        raise ValueError(f"{task}: {len(prompts)} prompts written, {count} asked")
    return prompts[:count]
