"""The prompts the tail drafter's training data answers, made up here combinatorially.

Why made up: the drafter must learn what the model says to work nobody tuned for, so its data is
the model's own answers to thousands of varied chat, code and instruction prompts, none of them the
benchmarks' or the tests' (:func:`foreign_prompts` reads those from the repository and
:func:`prompt_bank` drops any match). A fixed hash split keeps about 1 in 40 prompts out of
training for measurement (:func:`is_held_out`): the split depends on the prompt's text alone, so it
does not move when the bank grows or is reordered.
"""

from __future__ import annotations

import ast
import hashlib
import random
import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HELD_OUT_ONE_IN = 40

TOPICS = (
    "the water cycle|photosynthesis|volcanoes|black holes|the moon's phases|ocean tides|earthquakes|rainbows|"
    "the immune system|vaccines|sleep|dreams|memory|the human heart|bees|whales|dinosaurs|coral reefs|"
    "rainforests|deserts|glaciers|climate change|renewable energy|solar panels|wind turbines|electric cars|"
    "the printing press|the Roman Empire|ancient Egypt|the Silk Road|the Renaissance|the industrial revolution|"
    "the internet|email|smartphones|GPS|cryptography|passwords|cloud computing|databases|compilers|"
    "operating systems|computer memory|binary numbers|prime numbers|fractions|probability|statistics|"
    "the Pythagorean theorem|gravity|magnets|electricity|light|sound|friction|atoms|chemical reactions|"
    "the periodic table|DNA|evolution|ecosystems|recycling|composting|gardening|houseplants|cooking pasta|"
    "baking bread|making coffee|healthy eating|running|yoga|swimming|chess|learning a language|public speaking|"
    "time management|budgeting|saving money|job interviews|writing a resume|team work|leadership|"
    "taking notes|reading more books|museums|travel on a budget|camping|hiking safety|first aid|"
    "fire safety|road safety|bicycles|trains|airplanes|rockets|satellites|Mars|Jupiter|the Sun|comets|"
    "music theory|the piano|the guitar|painting|photography|poetry|short stories|theatre|film|"
    "friendship|kindness|honesty|curiosity|patience|pets|dogs|cats|birds|owls|penguins|elephants|"
    "the weather|snow|thunderstorms|hurricanes|rivers|mountains|islands|maps|city planning|libraries|"
    "volunteering|elections|taxes|banks|markets|supply and demand|inflation|small businesses|"
    "online privacy|video games|board games|robots|artificial intelligence|spreadsheets|typing faster"
).split("|")

CHAT = (
    "What is {t}?|Explain {t} in simple terms.|Explain {t} to a ten-year-old.|Give me three facts about {t}.|"
    "Why does {t} matter?|Write a short paragraph about {t}.|Write a short poem about {t}.|"
    "What are the pros and cons of {t}?|How would you teach someone about {t}?|Summarize {t} in two sentences.|"
    "Tell me a short story that involves {t}.|What are common misconceptions about {t}?|"
    "List five questions a student might ask about {t}.|Write a haiku about {t}.|"
    "What is the history of {t}, briefly?|How is {t} related to everyday life?|"
    "Give me a fun fact about {t} and explain it.|Describe {t} as if you were a tour guide.|"
    "What should a beginner know about {t}?|Write a limerick about {t}.|"
    "What would the world be like without {t}?|Compare {t} and {u}.|How are {t} and {u} connected?|"
    "Write a dialogue between two friends talking about {t}.|Give me a quiz with three questions on {t}.|"
    "What are three tips related to {t}?|Can you explain the basics of {t}?|Write an encouraging note about {t}."
).split("|")

LANGUAGES = ("Python|JavaScript|TypeScript|Java|C|C++|Go|Rust|Ruby|PHP|Bash|SQL|Kotlin|Swift|C#|Lua").split("|")

TASKS = (
    "reverses a string|counts the vowels in a string|checks whether a number is prime|returns the largest "
    "element of a list|computes the factorial of a number|sums the digits of an integer|removes the duplicates "
    "from a list|checks whether two strings are anagrams|converts a temperature from Fahrenheit to Celsius|"
    "finds the second smallest number in a list|capitalizes every word in a sentence|computes the greatest "
    "common divisor of two numbers|returns the average of a list of numbers|counts how often each word occurs "
    "in a text|checks whether a year is a leap year|converts a decimal number to binary|merges two "
    "dictionaries|finds the longest word in a sentence|rotates a list by k positions|checks whether a list is "
    "sorted|returns the even numbers of a list|generates the first n square numbers|validates an email "
    "address|parses a date string|reads a text file and prints its line count|computes the median of a "
    "list|finds the index of a value with binary search|implements bubble sort|implements a queue|"
    "implements a linked list|transposes a matrix|multiplies two matrices|computes compound interest|"
    "formats a number with thousands separators|splits a list into chunks of size n|finds common elements "
    "of two lists|counts the lines in a string that contain a word|computes the distance between two "
    "points|shuffles a list|checks whether parentheses are balanced|converts Roman numerals to integers|"
    "returns the n-th triangular number|removes whitespace from both ends of a string|truncates a string "
    "to n characters|finds the mode of a list|computes a running total"
).split("|")

CODE = (
    "Write a {lang} function that {task}.|How do I write a {lang} program that {task}?|"
    "Show me {lang} code that {task}, with comments.|Write a {lang} function that {task}, and explain how it "
    "works.|Give me a short {lang} example that {task}.|Write a {lang} function that {task}. Include a test.|"
    "In {lang}, what is the simplest way to write code that {task}?|Write idiomatic {lang} that {task}."
).split("|")

CONCEPTS = (
    "a variable|a loop|a function|recursion|a class|inheritance|an interface|a closure|a pointer|a hash map|"
    "a stack|a queue|a binary tree|a linked list|big O notation|an exception|a unit test|version control|"
    "a pull request|an API|JSON|a REST endpoint|a database index|a SQL join|a race condition|a thread|"
    "an async function|a generator|a decorator|type hints|a compiler|an interpreter|garbage collection|"
    "immutability|a regular expression|a cache|a queue worker|a command line argument|an environment variable"
).split("|")

CONCEPT = (
    "What is {c} in {lang}?|Explain {c} with a {lang} example.|When should I use {c}?|"
    "What are common mistakes with {c} in {lang}?|How does {c} work under the hood?|"
    "Explain {c} to a beginner programmer."
).split("|")

INSTRUCTION = (
    "Write a polite email asking a colleague about {t}.|Make a checklist for a day spent learning about {t}.|"
    "Write a title and three bullet points for a talk on {t}.|Rewrite this sentence more formally: I really "
    "like {t} a lot.|Translate into French: I am reading a book about {t}.|Write a tweet about {t}.|"
    "Plan a one-week study schedule for {t}.|Write a product description for a toy about {t}.|"
    "Give step-by-step instructions for explaining {t} in a classroom.|Write a riddle whose answer is {t}.|"
    "Write an outline for an essay on {t}.|Suggest three names for a blog about {t}."
).split("|")


@dataclass(frozen=True)
class Prompt:
    """One made-up prompt; ``kind`` is chat, code or instruction (held-out figures are per kind)."""

    text: str
    kind: str


def is_held_out(text: str) -> bool:
    """About one prompt in :data:`HELD_OUT_ONE_IN`, chosen by the text's hash: never trained on."""
    digest = hashlib.sha256(text.encode()).digest()
    return int.from_bytes(digest[:4], "big") % HELD_OUT_ONE_IN == 0


def _normal(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().lower()


def _literals(path: Path) -> list[str]:
    """Every string constant in a Python file (f-strings' constant parts included)."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, OSError):
        return []
    return [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def foreign_prompts(repo: Path = REPO) -> tuple[set[str], list[str]]:
    """(every test's and benchmark's string literal, normalized; the prompt files' texts) from the
    repository: a made-up prompt equal to the first or overlapping the second is dropped. Empty where
    the package runs outside its repository (nothing to check against there)."""
    exact: set[str] = set()
    for folder in ("tests", "benchmarks"):
        for path in (repo / folder).rglob("*.py"):
            exact.update(_normal(s) for s in _literals(path) if len(s) >= 12)
    prompt_files = [repo / "tests" / "kit" / "prompts.py", repo / "tests" / "kit" / "heldout_prompts.py"]
    prompt_files += [repo / "benchmarks" / "wan.py"]
    prompt_files += sorted((repo / "benchmarks").glob("*prompt*"))
    texts: list[str] = []
    for path in prompt_files:
        if path.suffix == ".py":
            texts += [_normal(s) for s in _literals(path) if len(s) >= 20]
        elif path.is_file():
            texts.append(_normal(path.read_text(encoding="utf-8", errors="replace")))
    return exact, texts


def _combinations() -> list[Prompt]:
    out: list[Prompt] = []
    rng = random.Random(1234)
    for i, template in enumerate(CHAT):
        for j, topic in enumerate(TOPICS):
            other = TOPICS[(j * 7 + i * 13 + 1) % len(TOPICS)]
            out.append(Prompt(template.format(t=topic, u=other), "chat"))
    for template in CODE:
        for lang in LANGUAGES:
            for task in TASKS:
                out.append(Prompt(template.format(lang=lang, task=task), "code"))
    for template in CONCEPT:
        for concept in CONCEPTS:
            for lang in rng.sample(LANGUAGES, 4):
                out.append(Prompt(template.format(c=concept, lang=lang), "code"))
    for template in INSTRUCTION:
        for topic in TOPICS:
            out.append(Prompt(template.format(t=topic), "instruction"))
    return out


def prompt_bank(seed: int = 0, repo: Path = REPO) -> list[Prompt]:
    """Every made-up prompt not in the tests or benchmarks, deduplicated, in a seeded order (training
    and held-out alike; filter with :func:`is_held_out`)."""
    exact, texts = foreign_prompts(repo)
    seen: set[str] = set()
    out = []
    for prompt in _combinations():
        key = _normal(prompt.text)
        if key in seen or key in exact or any(key in t or (len(t) >= 30 and t in key) for t in texts):
            continue
        seen.add(key)
        out.append(prompt)
    random.Random(seed).shuffle(out)
    return out


def training_prompts(seed: int = 0) -> list[Prompt]:
    return [p for p in prompt_bank(seed) if not is_held_out(p.text)]


def held_out_prompts(seed: int = 0) -> list[Prompt]:
    return [p for p in prompt_bank(seed) if is_held_out(p.text)]
