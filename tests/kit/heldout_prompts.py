"""Held-out workloads for `make bench-wan-heldout`: request-first prompts written for measurement only.

Issue #39 asks for speculation measured on work nobody tuned for: these prompts appear in no test
(tests/kit/prompts.py holds the tests' and the older benchmark workloads) and in no drafter training
data (server/drafter_prompts.py drops any made-up prompt that overlaps this file's strings;
tests/generation/test_drafter_data.py checks the bank against them). Code edits
put the request first and the code after it, as a user types into a chat box; open chat asks for
answers that are not in the prompt.
"""


def _request_first(instruction: str, language: str, code: str) -> str:
    return f"{instruction}\n\n```{language}\n{code}```"


HELD_OUT_CHAT = [
    "What should I pack for a three-day hiking trip in the mountains?",
    "Explain how a bicycle's gears make pedaling easier uphill.",
    "Suggest a weekly plan for learning to play the guitar as an adult beginner.",
    "Why does bread go stale, and how can I keep it fresh longer?",
    "Describe how a lighthouse keeper's day might have looked a hundred years ago.",
    "What are the pros and cons of working from home?",
    "How do bees decide where to build a new hive?",
    "Give me advice for my first job interview at a small bakery.",
    "Explain the difference between a comet and an asteroid to a ten-year-old.",
    "Write a friendly note to a neighbour asking them to water my plants next week.",
    "What makes a board game fun to play with a large group?",
    "How would you explain compound interest to a teenager saving for a bike?",
]

HELD_OUT_CODE = [
    _request_first(
        "Add a docstring to each function in this code and return the whole code.",
        "python",
        "def area_of_circle(radius):\n    return 3.14159 * radius * radius\n\n\n"
        "def circumference(radius):\n    return 2 * 3.14159 * radius\n",
    ),
    _request_first(
        "Change this function so that it skips empty lines, and show the full function.",
        "python",
        "def read_names(path):\n    names = []\n    with open(path) as handle:\n"
        "        for line in handle:\n            names.append(line.strip())\n    return names\n",
    ),
    _request_first(
        "Rename the function `calc` to `total_price` everywhere in this code.",
        "python",
        "def calc(items, tax):\n    subtotal = sum(item.price for item in items)\n"
        "    return subtotal * (1 + tax)\n\n\nprint(calc(cart, 0.2))\n",
    ),
    _request_first(
        "Convert this loop into a list comprehension and show the result.",
        "python",
        "squares = []\nfor number in range(20):\n    if number % 3 == 0:\n        squares.append(number * number)\n",
    ),
    _request_first(
        "Rewrite this JavaScript function using const and arrow functions.",
        "javascript",
        "function greet(name) {\n  var message = 'Hello, ' + name + '!';\n  return message;\n}\n\n"
        "function shout(name) {\n  var message = greet(name);\n  return message.toUpperCase();\n}\n",
    ),
    _request_first(
        "Add type hints to this class and return the full class.",
        "python",
        "class Counter:\n    def __init__(self, start):\n        self.value = start\n\n"
        "    def increment(self, step):\n        self.value += step\n        return self.value\n",
    ),
    _request_first(
        "Replace the print calls with logging calls in this script, keeping everything else.",
        "python",
        "def copy_file(source, target):\n    print('copying', source)\n    with open(source) as src:\n"
        "        data = src.read()\n    with open(target, 'w') as dst:\n        dst.write(data)\n"
        "    print('done', target)\n",
    ),
    _request_first(
        "Make this SQL query return only customers from Canada, ordered by name.",
        "sql",
        "SELECT id, name, email, country\nFROM customers\nWHERE active = 1;\n",
    ),
    _request_first(
        "Add error handling to this function so that a missing key returns None.",
        "python",
        "def get_port(config):\n    server = config['server']\n    return int(server['port'])\n",
    ),
    _request_first(
        "Rewrite this function to use a while loop instead of recursion.",
        "python",
        "def count_down(n):\n    if n == 0:\n        return\n    print(n)\n    count_down(n - 1)\n",
    ),
]

HELD_OUT = HELD_OUT_CHAT + HELD_OUT_CODE
