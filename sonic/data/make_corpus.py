"""Writes sonic/data/corpus/embedded.txt, the offline default corpus: `python -m sonic.data.make_corpus`.

Templated English over a small fixed world (each animal has one colour, home, food and sound; each
town one river), arithmetic, counting and question-answer pairs, documents separated by blank lines.
The text is structured enough that a tiny model's loss falls far below the byte unigram entropy in
~100 CPU steps, and varied enough (random names, numbers and order) that it cannot just be memorised.
Deterministic: the same bytes on every run (tests check the shipped file against this script).
"""
from __future__ import annotations

import argparse
import os
import random

from sonic.data.local_text import embedded_path

SEED = 2512
TARGET_BYTES = 300_000

ANIMALS = {  # animal: (colour, home, food, sound)
    "fox": ("red", "forest", "berries", "barks"), "rabbit": ("brown", "meadow", "clover", "thumps"),
    "owl": ("grey", "old oak", "mice", "hoots"), "frog": ("green", "pond", "flies", "croaks"),
    "bear": ("black", "cave", "honey", "growls"), "duck": ("white", "lake", "bread", "quacks"),
    "cat": ("orange", "barn", "fish", "purrs"), "goat": ("yellow", "hill", "grass", "bleats"),
}
TOWNS = {"Alder": "Sil", "Brook": "Tamm", "Cress": "Ure", "Dunmore": "Vell", "Elmsby": "Wyn", "Fenwick": "Yare"}
NAMES = ["Pip", "Moss", "Tilly", "Bram", "Nell", "Otto", "Rue", "Sage", "Finn", "Ivy", "Juno", "Kit", "Lark", "Milo"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]


def story(r: random.Random) -> str:
    animal = r.choice(list(ANIMALS))
    colour, home, food, sound = ANIMALS[animal]
    name, friend = r.sample(NAMES, 2)
    other = r.choice([a for a in ANIMALS if a != animal])
    day, n = r.choice(DAYS), r.randint(2, 9)
    lines = [f"{name} is a {colour} {animal}. {name} lives in the {home}.",
             f"Every morning {name} eats {food}. When {name} is happy, the {animal} {sound}.",
             f"On {day}, {name} met {friend} the {ANIMALS[other][0]} {other} from the {ANIMALS[other][1]}.",
             f"{friend} likes {ANIMALS[other][2]}, but {name} likes {food}.",
             f"Together they walked {NUMBER_WORDS[n]} miles and came home to the {home}."]
    return "\n".join(lines[:r.randint(3, 5)])


def sums(r: random.Random) -> str:
    lines = [f"Worksheet {r.randint(1, 99)}."]
    for _ in range(r.randint(4, 12)):
        a, b = r.randint(0, 20), r.randint(0, 20)
        op = r.choice("+-x")
        if op == "-" and b > a:
            a, b = b, a
        if op == "x":
            a, b = a % 11, b % 11
        value = a + b if op == "+" else a - b if op == "-" else a * b
        lines.append(f"{a} {op} {b} = {value}")
    return "\n".join(lines)


def counting(r: random.Random) -> str:
    step, start = r.randint(1, 5), r.randint(0, 30)
    seq = ", ".join(str(start + step * i) for i in range(r.randint(5, 12)))
    letters = "abcdefghijklmnopqrstuvwxyz"
    first = r.randint(0, 18)
    return f"Counting by {step} from {start}: {seq}.\nLetters from {letters[first]}: {' '.join(letters[first:first + 8])}."


def towns(r: random.Random) -> str:
    picked = r.sample(list(TOWNS), r.randint(2, 4))
    lines = []
    for town in picked:
        bridges = r.randint(1, 9)
        lines.append(f"The town of {town} stands on the river {TOWNS[town]}. {town} has {NUMBER_WORDS[bridges]} "
                     f"bridge{'s' if bridges > 1 else ''}.")
    return "\n".join(lines)


def questions(r: random.Random) -> str:
    lines = []
    for _ in range(r.randint(3, 6)):
        kind = r.randrange(4)
        if kind == 0:
            animal = r.choice(list(ANIMALS))
            lines.append(f"Q: What colour is the {animal}? A: The {animal} is {ANIMALS[animal][0]}.")
        elif kind == 1:
            animal = r.choice(list(ANIMALS))
            lines.append(f"Q: Where does the {animal} live? A: The {animal} lives in the {ANIMALS[animal][1]}.")
        elif kind == 2:
            town = r.choice(list(TOWNS))
            lines.append(f"Q: Which river runs through {town}? A: The river {TOWNS[town]}.")
        else:
            a, b = r.randint(0, 9), r.randint(0, 9)
            lines.append(f"Q: What is {a} plus {b}? A: {a} plus {b} is {a + b}.")
    return "\n".join(lines)


KINDS = (story, sums, counting, towns, questions)


def generate(seed: int = SEED, target_bytes: int = TARGET_BYTES) -> str:
    """Documents separated by one blank line (the txt `paragraph` layout)."""
    r = random.Random(seed)
    docs, size = [], 0
    while size < target_bytes:
        doc = r.choice(KINDS)(r)
        docs.append(doc)
        size += len(doc.encode()) + 2
    return "\n\n".join(docs) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=embedded_path(), help="where to write (default: the packaged corpus)")
    out = parser.parse_args().out
    text = generate()
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
        f.write(text)
    print(f"wrote {out}: {len(text.encode()):,} bytes, {text.count(chr(10) * 2) + 1} documents")


if __name__ == "__main__":
    main()
