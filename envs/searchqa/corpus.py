"""The embedded Search-QA data: a generated knowledge corpus of fictional entities and multi-hop questions.

Everything here is pure Python driven by a small SplitMix64 generator (not ``random`` or numpy,
whose streams may change between versions), so the corpus is byte-identical on every machine.
Entities: countries, cities, rivers, universities, people and companies, linked by relations
(a person was born in a city, a company was founded by a person, a city is in a country, ...).
Each entity gets one document whose sentences state its own relations and never transitive
facts, so a k-hop question needs k look-ups.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from functools import cache

from agentopsd.envs.rng import SplitMix64

SEED = 20_240_611
NUM_COUNTRIES = 40
CITIES_PER_COUNTRY = 10
RIVERS_PER_COUNTRY = 3
NUM_UNIVERSITIES = 150
NUM_PEOPLE = 900
NUM_COMPANIES = 520
QUESTIONS_PER_HOP = 500
EVAL_PER_HOP = 50
HOP_CATEGORIES = ("1hop", "2hop", "3hop")

@dataclass(frozen=True)
class Doc:
    """One passage: Search-R1 stores it as ``contents = title + "\\n" + text``."""

    title: str
    text: str


@dataclass(frozen=True)
class Hop:
    """One look-up: search ``entity``, read ``relation`` from its document, get ``target``."""

    entity: str
    relation: str
    target: str


@dataclass(frozen=True)
class Question:
    """A question with its gold answers; ``hops`` is empty for user-supplied QA files."""

    question: str
    answers: tuple[str, ...]
    hops: tuple[Hop, ...]
    category: str


@dataclass(frozen=True)
class Corpus:
    docs: tuple[Doc, ...]
    train: tuple[Question, ...]
    eval: tuple[Question, ...]


# How each relation is phrased in the subject's document; the expert reads targets back with these.
RELATION_PATTERNS: dict[str, re.Pattern[str]] = {
    "born_in": re.compile(r"was born in the city of ([^.]+)\."),
    "studied_at": re.compile(r"studied at ([^.]+)\."),
    "founded_by": re.compile(r"was founded by ([^.]+?) in \d{4}\."),
    "headquartered_in": re.compile(r"headquarters are in ([^.]+)\."),
    "country": re.compile(r"is a city in the country of ([^.]+)\."),
    "river": re.compile(r"lies on the banks of the ([^.]+)\."),
    "capital": re.compile(r"Its capital city is ([^.]+)\."),
    "uni_city": re.compile(r"is a university located in ([^.]+)\."),
    "source": re.compile(r"rises in the mountains of ([^.]+)\."),
}

_ONSETS = ("b", "br", "c", "d", "dr", "f", "g", "gr", "h", "k", "kr", "l", "m", "n", "p", "pr", "r",
           "s", "sk", "st", "t", "tr", "th", "v", "vr", "z", "sh", "j", "w", "y")
_VOWELS = ("a", "e", "i", "o", "u", "ae", "ia", "ou", "ei", "y")
_CODAS = ("", "", "", "n", "r", "l", "s", "th", "m", "k", "nd", "rt")
_PROFESSIONS = ("painter", "engineer", "botanist", "composer", "architect", "chemist", "novelist",
                "sculptor", "economist", "astronomer", "physician", "historian", "poet", "pilot")
_INDUSTRIES = ("shipping", "software", "textile", "mining", "brewing", "publishing", "robotics",
               "insurance", "aerospace", "furniture", "pharmaceutical", "glassmaking")
_COMPANY_SUFFIXES = ("Industries", "Holdings", "Works", "Group", "Labs", "Systems", "Trading")
_LANGUAGES = ("Veltic", "Orsan", "Kamri", "Lusevan", "Tandric", "Mirel", "Soraic", "Ebrani")
_SEAS = ("Northern Sea", "Amber Sea", "Grey Ocean", "Southern Gulf", "Pale Bay", "Iron Sea")
# Template words: a generated name must not collide with them or the retriever would confuse them.
_RESERVED = {"river", "city", "country", "university", "born", "founded", "company", "capital", "the"}


class _Names:
    """Globally unique invented words, so a name's tokens point at one entity."""

    def __init__(self, rng: SplitMix64) -> None:
        self.rng = rng
        self.used: set[str] = set(_RESERVED)

    def word(self, syllables: int, suffix: str = "") -> str:
        while True:
            parts = [self.rng.choice(_ONSETS) + self.rng.choice(_VOWELS) for _ in range(syllables)]
            w = ("".join(parts) + self.rng.choice(_CODAS) + suffix).capitalize()
            if len(w) >= 4 and w.lower() not in self.used:
                self.used.add(w.lower())
                return w


@dataclass
class _World:
    """Entity tables: each relation maps a subject name to its target name."""

    kinds: dict[str, str]
    rel: dict[str, dict[str, str]]
    docs: list[Doc]


def _build_world(rng: SplitMix64) -> _World:
    names = _Names(rng)
    rel: dict[str, dict[str, str]] = {r: {} for r in RELATION_PATTERNS}
    kinds: dict[str, str] = {}
    countries = [names.word(2, rng.choice(("ia", "land", "ora", "stan"))) for _ in range(NUM_COUNTRIES)]
    cities: list[str] = []
    rivers: list[str] = []
    for country in countries:
        kinds[country] = "country"
        local_rivers = [names.word(2) + " River" for _ in range(RIVERS_PER_COUNTRY)]
        local_cities = [names.word(rng.choice((2, 3))) for _ in range(CITIES_PER_COUNTRY)]
        for river in local_rivers:
            rel["source"][river] = country
            kinds[river] = "river"
        for city in local_cities:
            rel["country"][city] = country
            rel["river"][city] = rng.choice(local_rivers)
            kinds[city] = "city"
        rel["capital"][country] = local_cities[0]
        cities += local_cities
        rivers += local_rivers
    universities = []
    for _ in range(NUM_UNIVERSITIES):
        uni = names.word(2) + rng.choice((" University", " Institute of Technology", " College"))
        rel["uni_city"][uni] = rng.choice(cities)
        kinds[uni] = "university"
        universities.append(uni)
    first_names = [names.word(2) for _ in range(120)]
    surnames = [names.word(rng.choice((2, 3))) for _ in range(NUM_PEOPLE)]
    people = [f"{rng.choice(first_names)} {surname}" for surname in surnames]
    for person in people:
        rel["born_in"][person] = rng.choice(cities)
        rel["studied_at"][person] = rng.choice(universities)
        kinds[person] = "person"
    # Each founder founds one company, so "the founder of X" and the person's own document stay unambiguous.
    founders = list(people)
    rng.shuffle(founders)
    for founder in founders[:NUM_COMPANIES]:
        company = f"{names.word(2)} {rng.choice(_COMPANY_SUFFIXES)}"
        rel["founded_by"][company] = founder
        rel["headquartered_in"][company] = rng.choice(cities)
        kinds[company] = "company"
    return _World(kinds=kinds, rel=rel, docs=_write_docs(rng, kinds, rel))


def _a(word: str) -> str:
    return f"an {word}" if word[0] in "aeiou" else f"a {word}"


def _write_docs(rng: SplitMix64, kinds: dict[str, str], rel: dict[str, dict[str, str]]) -> list[Doc]:
    docs = []
    for name, kind in kinds.items():
        year = 1800 + rng.below(200)
        if kind == "country":
            text = (f"{name} is a sovereign country. Its capital city is {rel['capital'][name]}. "
                    f"The official language of {name} is {rng.choice(_LANGUAGES)}, and its coast faces "
                    f"the {rng.choice(_SEAS)}.")
        elif kind == "city":
            text = (f"{name} is a city in the country of {rel['country'][name]}. {name} lies on the banks "
                    f"of the {rel['river'][name]}. It was first chartered in {year} and has about "
                    f"{10_000 + rng.below(900_000)} inhabitants.")
        elif kind == "river":
            text = (f"The {name} rises in the mountains of {rel['source'][name]}. The {name} is about "
                    f"{50 + rng.below(900)} km long and empties into the {rng.choice(_SEAS)}.")
        elif kind == "university":
            text = (f"{name} is a university located in {rel['uni_city'][name]}. {name} was established "
                    f"in {year} and is known for its {rng.choice(_PROFESSIONS)} programme.")
        elif kind == "person":
            surname = name.split(" ", 1)[1]
            text = (f"{name} (born {year}) is {_a(rng.choice(_PROFESSIONS))}. {name} was born in the city of "
                    f"{rel['born_in'][name]}. {surname} studied at {rel['studied_at'][name]}.")
        else:
            text = (f"{name} is {_a(rng.choice(_INDUSTRIES))} company. {name} was founded by "
                    f"{rel['founded_by'][name]} in {year}. Its headquarters are in "
                    f"{rel['headquartered_in'][name]}.")
        docs.append(Doc(title=name, text=text))
    return docs


# (relation chain, question template over the start entity). The chain starts at an entity of the
# relation's subject kind; each template names only the start entity, never an intermediate one.
TEMPLATES: dict[str, tuple[tuple[tuple[str, ...], str], ...]] = {
    "1hop": (
        (("born_in",), "In which city was {0} born?"),
        (("studied_at",), "At which university did {0} study?"),
        (("founded_by",), "Who founded {0}?"),
        (("headquartered_in",), "In which city is {0} headquartered?"),
        (("country",), "In which country is the city of {0}?"),
        (("river",), "On which river does the city of {0} lie?"),
        (("capital",), "What is the capital of {0}?"),
        (("uni_city",), "In which city is {0} located?"),
        (("source",), "In which country does the {0} rise?"),
    ),
    "2hop": (
        (("founded_by", "born_in"), "In which city was the founder of {0} born?"),
        (("born_in", "country"), "In which country was {0} born?"),
        (("headquartered_in", "country"), "In which country is {0} headquartered?"),
        (("country", "capital"), "What is the capital of the country where {0} is located?"),
        (("born_in", "river"), "On which river lies the city where {0} was born?"),
        (("studied_at", "uni_city"), "In which city is the university where {0} studied?"),
        (("uni_city", "country"), "In which country is {0}?"),
        (("source", "capital"), "What is the capital of the country where the {0} rises?"),
        (("founded_by", "studied_at"), "At which university did the founder of {0} study?"),
    ),
    "3hop": (
        (("founded_by", "born_in", "country"), "In which country was the founder of {0} born?"),
        (("born_in", "country", "capital"), "What is the capital of the country where {0} was born?"),
        (("headquartered_in", "country", "capital"),
         "What is the capital of the country where {0} is headquartered?"),
        (("founded_by", "born_in", "river"), "On which river lies the birthplace of the founder of {0}?"),
        (("founded_by", "studied_at", "uni_city"),
         "In which city is the university where the founder of {0} studied?"),
        (("studied_at", "uni_city", "country"), "In which country is the university where {0} studied?"),
        (("studied_at", "uni_city", "river"),
         "On which river lies the city of the university where {0} studied?"),
        (("country", "capital", "river"), "On which river lies the capital of the country where {0} is?"),
    ),
}


def _chain(rel: dict[str, dict[str, str]], start: str, relations: tuple[str, ...]) -> tuple[Hop, ...]:
    hops, cur = [], start
    for r in relations:
        target = rel[r][cur]
        hops.append(Hop(entity=cur, relation=r, target=target))
        cur = target
    return tuple(hops)


def _aliases(answer: str) -> tuple[str, ...]:
    """Gold answers: a river is also right without its " River" suffix."""
    if answer.endswith(" River"):
        return (answer, answer.removesuffix(" River"))
    return (answer,)


def _make_questions(rng: SplitMix64, rel: dict[str, dict[str, str]], category: str) -> list[Question]:
    """Round-robin over the category's templates so every relation chain is represented."""
    templates = TEMPLATES[category]
    starts = [sorted(rel[rels[0]]) for rels, _ in templates]
    for s in starts:
        rng.shuffle(s)
    out: list[Question] = []
    seen: set[str] = set()
    cursor = [0] * len(templates)
    while len(out) < QUESTIONS_PER_HOP:
        for t, (relations, text) in enumerate(templates):
            if len(out) == QUESTIONS_PER_HOP:
                break
            start = starts[t][cursor[t] % len(starts[t])]
            cursor[t] += 1
            question = text.format(start)
            hops = _chain(rel, start, relations)
            # A chain that revisits an entity (a capital's own country) would let fewer searches do.
            if question in seen or len({start, *(h.target for h in hops)}) <= len(hops):
                continue
            seen.add(question)
            out.append(Question(question=question, answers=_aliases(hops[-1].target), hops=hops, category=category))
    return out


@cache
def embedded_corpus() -> Corpus:
    """Build (once per process) the generated corpus and its fixed train/eval question splits."""
    rng = SplitMix64(SEED)
    world = _build_world(rng)
    train: list[Question] = []
    per_hop_eval: list[list[Question]] = []
    for category in HOP_CATEGORIES:
        qs = _make_questions(rng, world.rel, category)
        rng.shuffle(qs)
        per_hop_eval.append(qs[:EVAL_PER_HOP])
        train += qs[EVAL_PER_HOP:]
    # Interleave 1/2/3-hop so any prefix of the eval list is balanced across hop counts.
    eval_qs = [q for group in zip(*per_hop_eval) for q in group]
    return Corpus(docs=tuple(world.docs), train=tuple(train), eval=tuple(eval_qs))


def corpus_fingerprint(corpus: Corpus) -> str:
    """A SHA-256 over documents and questions: equal on every machine for the embedded corpus."""
    payload = {
        "docs": [[d.title, d.text] for d in corpus.docs],
        "train": [[q.question, list(q.answers), [[h.entity, h.relation, h.target] for h in q.hops]]
                  for q in corpus.train],
        "eval": [[q.question, list(q.answers), [[h.entity, h.relation, h.target] for h in q.hops]]
                 for q in corpus.eval],
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()

