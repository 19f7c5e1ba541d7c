"""Benchmark workloads. Code editing: the answer must largely repeat code from the prompt.
Open chat: the answer is not in the prompt."""

CODE_EDITING = [
    "Rename the variable `total` to `running_sum` in this function and change nothing else:\n\n"
    "def accumulate(values):\n    total = 0\n    for value in values:\n        total = total + value\n"
    "    return total\n",
    "Add type hints to this Python function and keep the body exactly as it is:\n\n"
    "def scale_points(points, factor):\n    result = []\n    for x, y in points:\n"
    "        result.append((x * factor, y * factor))\n    return result\n",
    "Translate the comments of this code to English and keep the code unchanged:\n\n"
    "def moyenne(nombres):\n    # calcule la somme des nombres\n    somme = sum(nombres)\n"
    "    # divise par le nombre d'elements\n    return somme / len(nombres)\n",
    "Convert this JavaScript function to Python:\n\n"
    "function countWords(text) {\n  const words = text.split(' ');\n  let count = 0;\n"
    "  for (const word of words) {\n    if (word.length > 0) {\n      count += 1;\n    }\n  }\n  return count;\n}\n",
    "Rename the function `get_data` to `load_records` everywhere in this code:\n\n"
    "import json\n\ndef get_data(path):\n    with open(path) as f:\n        return json.load(f)\n\n"
    "def main():\n    data = get_data('records.json')\n    print(len(data))\n",
]

OPEN_CHAT = [
    "What are three good reasons to learn a second language?",
    "Explain why the sky is blue to a ten year old.",
    "Give me some tips for sleeping better.",
    "What is the difference between a virus and a bacterium?",
    "Suggest a name for a small bakery and explain your choice.",
]

WORKLOADS = {"code editing": CODE_EDITING, "open chat": OPEN_CHAT}
