"""Writes sonic_world.jsonl, the offline multiple-choice task: `python -m eval.tasks.sonic_world.build`.

Questions about the small fixed world of the embedded corpus (sonic/data/make_corpus.py): an
animal's sound, colour, home and food, a town's river, sums and products. A model trained on the
default corpus should beat chance (25%); a random one should not. The facts come from
make_corpus itself, so the task cannot drift from the corpus (a test checks the shipped file).
Deterministic: the same bytes on every run.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

from sonic.data.make_corpus import ANIMALS, NAMES, TOWNS

SEED = 14080
PER_KIND = 20
DATA_FILE = Path(__file__).with_name("sonic_world.jsonl")


def _item(r: random.Random, kind: str, context: str, answer: str, pool: list[str]) -> dict:
    """One question with the answer and three distractors from `pool`, in random order."""
    choices = [answer] + r.sample(sorted(set(pool) - {answer}), 3)
    r.shuffle(choices)
    return {"kind": kind, "context": context, "choices": choices, "label": choices.index(answer)}


def _numbers(r: random.Random, value: int) -> list[str]:
    return [str(v) for v in range(max(0, value - 4), value + 5)]


def items(seed: int = SEED, per_kind: int = PER_KIND) -> list[dict]:
    r = random.Random(seed)
    animals = sorted(ANIMALS)
    colours, homes, foods, sounds = ([a[i] for a in ANIMALS.values()] for i in range(4))  # ANIMALS order
    out = []
    for _ in range(per_kind):
        name, animal = r.choice(NAMES), r.choice(animals)
        colour, home, food, sound = ANIMALS[animal]
        out.append(_item(r, "sound", f"{name} is a {colour} {animal}. When {name} is happy, the {animal}",
                         sound, sounds))
        out.append(_item(r, "food", f"{name} is a {colour} {animal}. {name} lives in the {home}.\n"
                                    f"Every morning {name} eats", food, foods))
        animal = r.choice(animals)
        out.append(_item(r, "colour", f"Q: What colour is the {animal}? A: The {animal} is",
                         ANIMALS[animal][0], colours))
        animal = r.choice(animals)
        out.append(_item(r, "home", f"Q: Where does the {animal} live? A: The {animal} lives in the",
                         ANIMALS[animal][1], homes))
        town = r.choice(sorted(TOWNS))
        out.append(_item(r, "river", f"Q: Which river runs through {town}? A: The river", TOWNS[town],
                         list(TOWNS.values())))
        a, b = r.randint(0, 9), r.randint(0, 9)
        out.append(_item(r, "sum", f"Q: What is {a} plus {b}? A: {a} plus {b} is", str(a + b),
                         _numbers(r, a + b)))
    return out


def render(rows: list[dict]) -> str:
    return "".join(json.dumps(row) + "\n" for row in rows)


def main() -> None:
    DATA_FILE.write_text(render(items()))
    print(f"wrote {DATA_FILE}")


if __name__ == "__main__":
    main()
