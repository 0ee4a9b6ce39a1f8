"""Writes data/corpus/stories.jsonl: self-generated English-like prose for tests, examples and benchmarks.

Every word and template is written here, so the corpus has no licence question and is
reproduced byte for byte by `python data/corpus/make_corpus.py`. Documents vary in length
(a line to a few pages) and mix what tokenizers must get right: contractions, numbers and
years, quotes and dialogue, accented names, other scripts, emoji, tabs and runs of spaces.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

SEED = 20240611
DOCUMENTS = 500
OUT = Path(__file__).with_name("stories.jsonl")

NAMES = [
    "Ada",
    "Bram",
    "Clara",
    "Dmitri",
    "Elif",
    "Farid",
    "Greta",
    "Hugo",
    "Ines",
    "Jonas",
    "Kaito",
    "Lena",
    "Mateo",
    "Nadia",
    "Oskar",
    "Priya",
    "Quinn",
    "Rosa",
    "Soren",
    "Tomas",
    "Zoë",
    "Renée",
    "Jürgen",
    "Łukasz",
    "Søren",
    "Chloé",
    "José",
    "Noémie",
    "Björn",
    "Ayşe",
]
PLACES = [
    "the harbour",
    "the old mill",
    "the market square",
    "the lighthouse",
    "the orchard",
    "the station",
    "the library",
    "the river bank",
    "the bakery",
    "the hill road",
    "São Paulo",
    "Kraków",
    "Zürich",
    "Reykjavík",
    "the Café Müller",
    "Malmö",
    "the Île de Ré",
    "Córdoba",
]
ANIMALS = ["fox", "heron", "cat", "badger", "goat", "sparrow", "otter", "hound", "owl", "tortoise"]
OBJECTS = [
    "lantern",
    "letter",
    "map",
    "kettle",
    "violin",
    "compass",
    "ledger",
    "umbrella",
    "clock",
    "basket",
    "bicycle",
    "telescope",
    "notebook",
    "key",
    "loaf of bread",
    "jar of honey",
]
ADJECTIVES = [
    "quiet",
    "bright",
    "crooked",
    "ancient",
    "tiny",
    "restless",
    "patient",
    "golden",
    "muddy",
    "narrow",
    "cheerful",
    "weathered",
    "curious",
    "heavy",
    "silver",
    "forgotten",
    "gentle",
    "stubborn",
]
VERBS_PAST = [
    "found",
    "carried",
    "mended",
    "painted",
    "borrowed",
    "counted",
    "hid",
    "polished",
    "sold",
    "lost",
    "opened",
    "described",
    "weighed",
    "returned",
    "noticed",
    "followed",
    "measured",
    "wrapped",
]
ADVERBS = [
    "slowly",
    "carefully",
    "at once",
    "without a word",
    "twice",
    "before dawn",
    "after supper",
    "in the rain",
    "by accident",
    "with great care",
    "almost cheerfully",
    "now and then",
]
WEATHER = [
    "The wind came off the sea",
    "Rain drummed on the roofs",
    "Fog sat low over the fields",
    "The sun was hot on the stones",
    "Snow fell all afternoon",
    "A storm was building in the west",
]
FEELINGS = ["glad", "puzzled", "tired", "hopeful", "uneasy", "proud", "amused", "homesick"]
SAYINGS = [
    "I don't think it's ours",
    "We'll need more rope",
    "You're late again",
    "It isn't far now",
    "They've gone to the coast",
    "She'd never seen one so big",
    "Let's count them twice",
    "I can't hear you over the wind",
    "Who's been reading my notebook?",
    "We're nearly out of tea",
]
FOREIGN = ["καλημέρα", "спасибо", "こんにちは", "谢谢", "शुक्रिया", "مرحبا", "안녕하세요", "שלום"]
EMOJI = ["🙂", "🌧️", "🚲", "📚", "🦊", "☕", "🎻", "⭐", "👍🏽", "🏳️‍🌈"]
TITLES = [
    "The {adj} {obj}",
    "{name} and the {animal}",
    "A Winter in {place}",
    "Notes from {place}",
    "How {name} {verb} the {obj}",
    "The {animal} of {place}",
]


def pick(rng, items):
    return items[rng.randrange(len(items))]


def fill(rng, template: str) -> str:
    return template.format(
        name=pick(rng, NAMES),
        place=pick(rng, PLACES),
        animal=pick(rng, ANIMALS),
        obj=pick(rng, OBJECTS),
        adj=pick(rng, ADJECTIVES),
        verb=pick(rng, VERBS_PAST),
        adv=pick(rng, ADVERBS),
        feel=pick(rng, FEELINGS),
        say=pick(rng, SAYINGS),
        weather=pick(rng, WEATHER),
        year=rng.randrange(1850, 2030),
        num=rng.randrange(2, 500),
        price=f"{rng.randrange(1, 99)}.{rng.randrange(100):02d}",
        foreign=pick(rng, FOREIGN),
        emoji=pick(rng, EMOJI),
    )


SENTENCES = [
    "{name} {verb} the {adj} {obj} {adv}.",
    "In {year}, {name} {verb} a {obj} near {place}.",
    "{weather}, and {name} felt {feel}.",
    '"{say}," said {name}.',
    '"{say}!" {name} called from {place}.',
    "The {animal} watched {name} {adv}.",
    "There were {num} {animal}s by {place} that year.",
    "{name} paid {price} crowns for the {obj}, which was {adj}.",
    "Nobody knew why the {obj} was {adj}; {name} didn't ask.",
    "A {adj} {animal} crossed {place} {adv}.",
    '{name} wrote "{foreign}" on the back of the {obj} {emoji}',
    "It's {num} steps from {place} to the {obj} shop, or so {name} says.",
    "By {year} the {obj} had become {adj}, and the {animal} had grown {adj}.",
    "{name}'s {obj} weighed {num} grams — {adj}, but not {adj}.",
]


def paragraph(rng) -> str:
    sentences = [fill(rng, pick(rng, SENTENCES)) for _ in range(rng.randrange(2, 9))]
    text = " ".join(sentences)
    if rng.random() < 0.08:
        text = text.replace(" ", "   ", 1)
    if rng.random() < 0.05:
        text = "\t" + text
    return text


def document(rng) -> str:
    kind = rng.random()
    if kind < 0.1:
        return fill(rng, pick(rng, SENTENCES))
    title = fill(rng, pick(rng, TITLES))
    paragraphs = [paragraph(rng) for _ in range(rng.randrange(1, 7 if kind < 0.9 else 18))]
    if rng.random() < 0.2:
        paragraphs.append("\n".join(f"{i}. {fill(rng, '{adj} {obj}')}" for i in range(1, rng.randrange(3, 8))))
    return title + "\n\n" + "\n\n".join(paragraphs) + "\n"


def main() -> None:
    rng = random.Random(SEED)
    with open(OUT, "w", encoding="utf-8") as f:
        for i in range(DOCUMENTS):
            f.write(json.dumps({"id": i, "text": document(rng)}, ensure_ascii=False) + "\n")
    print(f"wrote {OUT} ({OUT.stat().st_size / 1e3:.0f} kB, {DOCUMENTS} documents)")


if __name__ == "__main__":
    main()
