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

# Small changes to code of 10-20 lines, as an editor asks for them: most of the answer repeats the given code.
_PARSE = """def parse_line(line):
    parts = line.strip().split(",")
    if len(parts) != 3:
        raise ValueError("expected 3 fields")
    name = parts[0].strip()
    age = int(parts[1])
    city = parts[2].strip()
    return {"name": name, "age": age, "city": city}


def parse_file(path):
    people = []
    with open(path) as handle:
        for line in handle:
            if line.strip():
                people.append(parse_line(line))
    return people
"""
_STATS = """def summarize(values):
    if not values:
        return None
    total = 0
    count = 0
    smallest = values[0]
    largest = values[0]
    for value in values:
        total += value
        count += 1
        if value < smallest:
            smallest = value
        if value > largest:
            largest = value
    mean = total / count
    return {"mean": mean, "min": smallest, "max": largest, "count": count}
"""
_RETRY = """import time


def fetch_with_retry(fetch, url, attempts=3, delay=1.0):
    last_error = None
    for attempt in range(attempts):
        try:
            return fetch(url)
        except ConnectionError as error:
            last_error = error
            time.sleep(delay)
            delay = delay * 2
    raise RuntimeError(f"giving up on {url}") from last_error
"""
_CART = """class Cart:
    def __init__(self):
        self.items = []

    def add(self, name, price, quantity=1):
        self.items.append({"name": name, "price": price, "quantity": quantity})

    def total(self):
        return sum(item["price"] * item["quantity"] for item in self.items)

    def remove(self, name):
        self.items = [item for item in self.items if item["name"] != name]

    def count(self):
        return sum(item["quantity"] for item in self.items)
"""
_JS = """function groupBy(items, key) {
  const groups = {};
  for (const item of items) {
    const value = item[key];
    if (!groups[value]) {
      groups[value] = [];
    }
    groups[value].push(item);
  }
  return groups;
}

function countBy(items, key) {
  const groups = groupBy(items, key);
  const counts = {};
  for (const value of Object.keys(groups)) {
    counts[value] = groups[value].length;
  }
  return counts;
}
"""
_EDITS = [
    ("Rename the function `parse_line` to `parse_record` everywhere in this code", _PARSE),
    ("Make `parse_line` accept semicolons as well as commas between the fields", _PARSE),
    ("Rename `summarize` to `describe` in this code", _STATS),
    ('Add the sum of the values under the key "sum" to the dictionary `summarize` returns', _STATS),
    ("Change the default number of attempts to 5 in this code", _RETRY),
    ("Catch `TimeoutError` as well as `ConnectionError` in this code", _RETRY),
    ("Add a method `clear` that empties the cart to this class", _CART),
    ("Make `add` refuse a negative price with a ValueError in this class", _CART),
    ("Rename `groupBy` to `groupByKey` everywhere in this code", _JS),
    ("Make `countBy` skip items whose key is undefined in this code", _JS),
]
EDIT = [f"{what}. Reply with the whole code.\n\n```\n{code}```" for what, code in _EDITS]

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
