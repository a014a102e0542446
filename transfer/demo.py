"""Deterministic synthetic demo data: a general corpus and a 4-class "lead topic" task from one template grammar.

No third-party text: every sentence comes from the word lists and templates below. A labelled text's class is
the topic of its first sentence; the sentences after it are about other topics. Word counts cannot say which
topic leads, word order can: TF-IDF stays near 1 in 2, a sequence model that reads the text does far better.
The texts share the general corpus's grammar and topic words, so a language model pretrained on it transfers.
"""

from __future__ import annotations

import csv
import random
import re
from pathlib import Path

from transfer.io_utils import atomic_path

__all__ = ["TOPICS", "make_demo"]

_NOUNS = """city river book house road village family story letter window garden bridge museum school church
island mountain forest valley station harbour street painting song film novel poem language teacher student
farmer writer artist doctor soldier sailor child friend neighbour king queen castle tower market wall gate field
lake coast ship train machine engine map clock door table lamp horse dog bird tree flower stone car journey
festival library hospital kitchen room building palace theatre bell voice dream memory winter
summer morning evening question answer problem idea plan rule law history tradition custom""".split()
_VERBS = """visit build describe carry open close watch paint write find see follow cross leave reach join study
explore repair discover remember design sell buy move hold support protect change keep bring teach mention
receive enter approach admire restore replace improve""".split()
_ADJECTIVES = """old new small large quiet famous ancient modern narrow wide northern southern eastern western local
early late popular public private wooden green red dark bright long short simple strange beautiful busy
empty crowded rich poor young gentle proud careful heavy warm cold distant hidden""".split()
_ADVERBS = "quickly slowly often rarely carefully later soon again finally suddenly quietly gradually".split()
_DEGREES = "very quite rather surprisingly remarkably".split()
_PREPOSITIONS = "in near across behind beside along through under above towards around".split()
_FIRST = """Anna Ben Clara David Elena Frank Grace Henry Iris James Karen Leo Maria Nora Oscar Paula Quentin Rosa
Samuel Tara Victor Wendy""".split()
_LAST = """Abbot Barlow Carver Dalton Ellis Fletcher Garner Hollis Ingram Jarvis Kemp Lowell Mercer Norris
Osborne""".split()
_PLACES = """Ashford Brindle Calloway Dunmore Elmstead Fairhaven Glenrock Harwick Ivydale Kingsbury Larkfield
Millbrook Northwick Oakhurst Pemberton Ravenhill Stonebridge Thornbury Westmere Yarrow""".split()
_NUMBERS = "two three four five six seven eight nine ten twelve twenty forty hundred".split()
_TIMES = """in the spring|during the winter|the next day|two years later|in the morning|after the war|before dawn
|at the end of the year|for many years|in the summer""".replace("\n", "").split("|")

TOPICS: dict[str, dict[str, list[str]]] = {
    "sports": {
        "nouns": """match team player coach goal season league stadium championship tournament striker referee
final victory defeat medal race athlete cup title fan score penalty club captain keeper trophy record contract
""".split(),
        "verbs": "defeat win train beat tackle qualify score coach play transfer".split(),
        "adjectives": "unbeaten defensive athletic winning injured fastest olympic".split(),
    },
    "business": {
        "nouns": """company market share investor profit bank price bond merger revenue customer factory trade deal
loan budget economy tax firm stock dividend contract supplier retailer executive board leader""".split(),
        "verbs": "invest acquire merge trade borrow hire export raise fund sell".split(),
        "adjectives": "quarterly financial corporate profitable commercial annual fiscal".split(),
    },
    "science": {
        "nouns": """experiment scientist molecule cell planet telescope laboratory theory protein gene particle
species fossil orbit galaxy climate sample researcher physicist vaccine enzyme atom record""".split(),
        "verbs": "measure observe analyse publish detect test simulate sequence predict study".split(),
        "adjectives": "genetic chemical molecular experimental solar quantum biological".split(),
    },
    "world": {
        "nouns": """government minister election president parliament army border treaty protest refugee embassy
diplomat ceasefire vote capital rebel summit sanction party leader ambassador province climate trade""".split(),
        "verbs": "elect sign negotiate protest invade govern vote announce condemn declare".split(),
        "adjectives": "diplomatic military political foreign national civil electoral".split(),
    },
}

_IRREGULAR_PAST = {
    "build": "built", "write": "wrote", "find": "found", "see": "saw", "leave": "left", "sell": "sold",
    "buy": "bought", "hold": "held", "keep": "kept", "bring": "brought", "teach": "taught", "win": "won",
    "beat": "beat", "transfer": "transferred",
}
_IRREGULAR_PLURAL = {"child": "children", "person": "people"}


def _plural(noun: str) -> str:
    if noun in _IRREGULAR_PLURAL:
        return _IRREGULAR_PLURAL[noun]
    if re.search(r"[^aeiou]y$", noun):
        return noun[:-1] + "ies"
    if re.search(r"(s|sh|ch|x)$", noun):
        return noun + "es"
    return noun + "s"


def _past(verb: str) -> str:
    if verb in _IRREGULAR_PAST:
        return _IRREGULAR_PAST[verb]
    if verb.endswith("e"):
        return verb + "d"
    if re.search(r"[^aeiou]y$", verb):
        return verb[:-1] + "ied"
    if re.search(r"[^aeiou][aeiou][bdgmnpt]$", verb) and verb not in {"visit", "open"}:
        return verb + verb[-1] + "ed"  # stop -> stopped
    return verb + "ed"


def _third_person(verb: str) -> str:
    return _plural(verb)  # same spelling rules: carry -> carries, watch -> watches


class _Writer:
    """Fills the sentence templates, drawing each content word from the topic lists with probability p_topic."""

    def __init__(self, rng: random.Random, topic: str | None, p_topic: float):
        self.rng, self.topic, self.p_topic = rng, topic, p_topic

    def _pick(self, kind: str, general: list[str]) -> str:
        if self.topic is not None and self.rng.random() < self.p_topic:
            return self.rng.choice(TOPICS[self.topic][kind])
        return self.rng.choice(general)

    def noun(self) -> str:
        return self._pick("nouns", _NOUNS)

    def nouns(self) -> str:
        return _plural(self.noun())

    def verb(self) -> str:
        return self._pick("verbs", _VERBS)

    def adj(self) -> str:
        return self._pick("adjectives", _ADJECTIVES)

    def name(self) -> str:
        return f"{self.rng.choice(_FIRST)} {self.rng.choice(_LAST)}"

    def det(self) -> str:
        return self.rng.choice(["the", "the", "a", "this", "every"])

    def past(self) -> str:
        return _past(self.verb())

    def prep(self) -> str:
        return self.rng.choice(_PREPOSITIONS)

    def place(self) -> str:
        return self.rng.choice(_PLACES)

    def sentence(self) -> str:
        r = self.rng
        c = r.randrange(12)
        if c == 0:
            s = f"the {self.adj()} {self.noun()} {self.past()} the {self.noun()} {self.prep()} the {self.noun()}"
        elif c == 1:
            s = f"{self.name()} {self.past()} a {self.adj()} {self.noun()} {r.choice(_TIMES)}"
        elif c == 2:
            s = f"in {r.randint(1800, 2020)}, the {self.nouns()} of {self.place()} {self.past()} {self.det()} {self.noun()}"
        elif c == 3:
            s = f"the {self.noun()} that {self.name()} {self.past()} was {r.choice(_DEGREES)} {self.adj()}"
        elif c == 4:
            s = f"{self.name()} said that the {self.noun()} will {self.verb()} the {self.nouns()} {r.choice(_TIMES)}"
        elif c == 5:
            s = f"many {self.nouns()} {self.past()} the {self.noun()} {r.choice(_ADVERBS)}"
        elif c == 6:
            s = f"{self.det()} {self.noun()} {_third_person(self.verb())} the {self.noun()} and the {self.noun()}"
        elif c == 7:
            s = f"{self.name()} and {self.name()} {self.past()} the {self.adj()} {self.nouns()} {self.prep()} {self.place()}"
        elif c == 8:
            s = f"there were {r.choice(_NUMBERS)} {self.nouns()} {self.prep()} the {self.noun()}"
        elif c == 9:
            s = f"the {self.noun()} of {self.place()} is {r.choice(_DEGREES)} {self.adj()} and {self.adj()}"
        elif c == 10:
            s = f"after the {self.noun()}, {self.det()} {self.noun()} {self.past()} {r.choice(_ADVERBS)}"
        else:
            s = f"it is {self.adj()} that the {self.nouns()} {self.verb()} {self.det()} {self.noun()}"
        s = re.sub(r"\ba ([aeiou])", r"an \1", s)
        return s[0].upper() + s[1:] + "."

    def document(self, n_sentences: int) -> str:
        return " ".join(self.sentence() for _ in range(n_sentences))


def make_demo(
    out_dir: str | Path,
    seed: int = 0,
    n_general_docs: int = 5000,
    n_labelled: int = 2000,
    test_frac: float = 0.25,
    label_noise: float = 0.05,
) -> dict[str, Path]:
    """Write general.txt (one doc per line), train.csv and test.csv (text,label); same seed, same bytes."""
    out_dir = Path(out_dir)
    rng = random.Random(seed)
    labels = list(TOPICS)

    docs = []
    for _ in range(n_general_docs):
        # a document is 1-3 runs of sentences on one topic (or none), as an article moves between subjects: to
        # predict the next word an LM must track the current topic, which is what the classifier then reads
        runs = [_Writer(rng, rng.choice([None, *labels]), rng.uniform(0.5, 0.9)).document(rng.randint(2, 4))
                for _ in range(rng.randint(1, 3))]
        docs.append(" ".join(runs))

    rows = []
    for _ in range(n_labelled):
        # The label is the topic of the lead sentence; the 1-2 sentences after it are about other topics, as a
        # story drifts. Every topic in a document gets one sentence, so a bag of words (TF-IDF) sees the label's
        # words no more often than the others': only the order says which one leads.
        topic = rng.choice(labels)
        others = rng.sample([x for x in labels if x != topic], rng.randint(1, 2))
        text = " ".join(_Writer(rng, t, rng.uniform(0.7, 0.95)).sentence() for t in [topic, *others])
        label = rng.choice([x for x in labels if x != topic]) if rng.random() < label_noise else topic
        rows.append((text, label))
    n_test = round(n_labelled * test_frac)

    paths = {"general": out_dir / "general.txt", "train": out_dir / "train.csv", "test": out_dir / "test.csv"}
    with atomic_path(paths["general"]) as tmp:
        tmp.write_text("\n".join(docs) + "\n", encoding="utf-8")
    _write_csv(paths["train"], rows[: n_labelled - n_test])
    _write_csv(paths["test"], rows[n_labelled - n_test :])
    return paths


def _write_csv(path: Path, rows: list[tuple[str, str]]) -> None:
    with atomic_path(path) as tmp:
        with open(tmp, "w", newline="", encoding="utf-8") as f:
            writer = csv.writer(f, lineterminator="\n")
            writer.writerow(["text", "label"])
            writer.writerows(rows)


if __name__ == "__main__":
    import sys

    for name, p in make_demo(sys.argv[1] if len(sys.argv) > 1 else "data/demo").items():
        print(f"{name}: {p}")
