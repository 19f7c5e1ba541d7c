"""Benchmark workloads. Code editing: the answer must largely repeat code from the prompt.
Open chat: the answer is not in the prompt.

Code-editing prompts put the code first and the instruction after it ("Rewrite the code above ..."),
the way editing tools send a file and then the request. Asked the other way round (instruction,
then code), SmolLM2-135M mostly answers about the code instead of rewriting it, so the workload
would not be the one it is named for (2026-11-29, suffix drafting: 1.45 tokens/lap that way, 1.7 this;
docs/benchmarks.md).
"""


def _edit(code: str, language: str, instruction: str) -> str:
    return f"```{language}\n{code}```\n\n{instruction}"


CODE_EDITING = [
    _edit(
        "def accumulate(values):\n    total = 0\n    for value in values:\n"
        "        total = total + value\n    return total\n\n\ndef average(values):\n"
        "    total = accumulate(values)\n    return total / len(values)\n",
        "python",
        "Rewrite the code above, with the variable `total` renamed to `running_sum`.",
    ),
    _edit(
        "def scale_points(points, factor):\n    result = []\n    for x, y in points:\n"
        "        result.append((x * factor, y * factor))\n    return result\n\n\n"
        "def shift_points(points, dx, dy):\n    result = []\n    for x, y in points:\n"
        "        result.append((x + dx, y + dy))\n    return result\n",
        "python",
        "Rewrite the code above with type hints added to both functions.",
    ),
    _edit(
        "def moyenne(nombres):\n    # calcule la somme des nombres\n    somme = sum(nombres)\n"
        "    # divise par le nombre d'elements\n    return somme / len(nombres)\n\n\n"
        "def maximum(nombres):\n    # commence avec le premier nombre\n"
        "    plus_grand = nombres[0]\n    # parcourt les autres nombres\n"
        "    for n in nombres[1:]:\n        if n > plus_grand:\n            plus_grand = n\n"
        "    return plus_grand\n",
        "python",
        "Rewrite the code above with its comments translated to English.",
    ),
    _edit(
        "function countWords(text) {\n  const words = text.split(' ');\n  let count = 0;\n"
        "  for (const word of words) {\n    if (word.length > 0) {\n      count += 1;\n    }\n"
        "  }\n  return count;\n}\n",
        "javascript",
        "Rewrite the code above in Python.",
    ),
    _edit(
        "import json\n\n\ndef get_data(path):\n    with open(path) as f:\n"
        "        return json.load(f)\n\n\ndef main():\n    data = get_data('records.json')\n"
        "    print(len(data))\n\n\nif __name__ == '__main__':\n    main()\n",
        "python",
        "Rewrite the code above, with the function `get_data` renamed to `load_records`.",
    ),
]

OPEN_CHAT = [
    "What are three good reasons to learn a second language?",
    "Explain why the sky is blue to a ten year old.",
    "Give me some tips for sleeping better.",
    "What is the difference between a virus and a bacterium?",
    "Suggest a name for a small bakery and explain your choice.",
]


CODE_FOLLOW_UP = "Now rewrite it once more, with a docstring added to each function."
"""The second turn of a code-editing conversation: the context now holds the model's own
rewrite (the first turn's answer), and the answer should largely repeat it again."""
