"""SkillBank: privileged hints for the teacher view (SkillRL layout).

A skill file ``agentopsd/rollout/skills/<env>.json`` holds::

    {
      "scope":      "episode",                      # or "turn" (see below)
      "general":    ["skill text", ...],            # always retrieved
      "categories": {
        "<category>": {
          "keywords": ["word", ...],               # matched against skill_key and task text
          "skills":   ["skill text", ...],          # task-specific skills
          "mistakes": ["common mistake", ...]       # what goes wrong in this category
        }
      },
      "situations": {
        "<situation>": {
          "when":     "regular expression",        # searched in the turn's observation
          "skills":   ["skill text", ...],
          "mistakes": ["common mistake", ...]
        }
      }
    }

With ``scope: episode`` (the default) the teacher view of every turn holds the skills retrieved
once for the task. With ``scope: turn`` it holds, on each turn, only the situations whose pattern
the current observation shows, and nothing on turns that show none: there the teacher view is
the student view token for token, so the log-prob gap is exactly 0, and the teacher's evidence
comes only from the turns the skills are about (a key in front, a locked door, the target).

Skills are training-only: they feed the teacher view and must never reach an evaluation
prompt (``agentopsd.rollout.prompts`` guards that).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

SKILL_DIR = Path(__file__).parent / "skills"
_WORD = re.compile(r"[a-z0-9]+")


@dataclass(frozen=True)
class Category:
    """One task category of a SkillBank."""

    name: str
    keywords: tuple[str, ...]
    skills: tuple[str, ...]
    mistakes: tuple[str, ...]


@dataclass(frozen=True)
class Situation:
    """Skills that apply on a turn whose observation matches ``when``."""

    name: str
    when: re.Pattern[str]
    skills: tuple[str, ...]
    mistakes: tuple[str, ...]


SCOPES = ("episode", "turn")


@dataclass(frozen=True)
class RetrievedSkills:
    """What the SkillBank returns for one task."""

    general: tuple[str, ...]
    categories: tuple[str, ...]
    """Names of the matched categories, best match first."""
    skills: tuple[str, ...]
    mistakes: tuple[str, ...]

    def render(self) -> str:
        """The skill block inserted into the teacher view."""
        lines = ["General skills:"] + [f"- {s}" for s in self.general] if self.general else []
        if self.skills:
            lines += ["Task skills:"] + [f"- {s}" for s in self.skills]
        if self.mistakes:
            lines += ["Common mistakes:"] + [f"- {s}" for s in self.mistakes]
        return "\n".join(lines)


def _words(text: str) -> set[str]:
    return set(_WORD.findall(text.lower()))


class SkillBank:
    """Keyword retrieval over general skills, per-category skills and common mistakes."""

    def __init__(self, general: list[str], categories: list[Category], top_k: int = 1, max_general: int | None = None,
                 situations: list[Situation] | None = None, scope: str = "episode") -> None:
        if top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k}")
        if scope not in SCOPES:
            raise ValueError(f"skill scope must be one of {SCOPES}, got {scope!r}")
        if scope == "turn" and not situations:
            raise ValueError("a skill file with scope 'turn' needs a 'situations' section: the teacher view would never differ")
        self.scope = scope
        self.situations = tuple(situations or ())
        # small models and short contexts: the first few general skills only (None = all)
        self.general = tuple(general)[:max_general] if max_general is not None else tuple(general)
        self.categories = tuple(categories)
        self.top_k = top_k

    @classmethod
    def from_file(cls, path: str | Path, top_k: int = 1, max_general: int | None = None) -> SkillBank:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"skill file {path} not found: pass an existing JSON file or an env name in {list_skill_files()}")
        raw = json.loads(path.read_text())
        cats = [
            Category(
                name=name,
                keywords=tuple(k.lower() for k in body.get("keywords", [])),
                skills=tuple(body.get("skills", [])),
                mistakes=tuple(body.get("mistakes", [])),
            )
            for name, body in raw.get("categories", {}).items()
        ]
        try:
            situations = [
                Situation(name=name, when=re.compile(body["when"]), skills=tuple(body.get("skills", [])),
                          mistakes=tuple(body.get("mistakes", [])))
                for name, body in raw.get("situations", {}).items()
            ]
        except (KeyError, re.error) as err:
            raise ValueError(f"skill file {path}: every situation needs a valid regular expression under 'when' ({err})") from err
        return cls(list(raw.get("general", [])), cats, top_k=top_k, max_general=max_general, situations=situations,
                   scope=raw.get("scope", "episode"))

    @classmethod
    def for_env(cls, name: str, top_k: int = 1, max_general: int | None = None) -> SkillBank:
        """The shipped skill file of an environment (``babyai``, ``webshop``, ``searchqa``, ``alfworld``),
        or a path to your own ``.json`` file in the same format."""
        path = Path(name) if name.endswith(".json") else SKILL_DIR / f"{name}.json"
        return cls.from_file(path, top_k=top_k, max_general=max_general)

    def match(self, skill_key: str, task: str = "") -> list[str]:
        """Names of the categories whose keywords hit, best first.

        The ``skill_key`` is matched first as an exact category name, then by keywords;
        keyword hits on the key count double those on the task text.
        """
        key = skill_key.strip().lower()
        scores: dict[str, float] = {}
        key_words, task_words = _words(key), _words(task)
        for cat in self.categories:
            if key and key == cat.name.lower():
                scores[cat.name] = 1e6
                continue
            score = 0.0
            for kw in cat.keywords:
                kw_words = _words(kw)
                if not kw_words:
                    continue
                if kw_words <= key_words:
                    score += 2.0 * len(kw_words)
                elif kw_words <= task_words:
                    score += 1.0 * len(kw_words)
            if score > 0:
                scores[cat.name] = score
        return sorted(scores, key=lambda n: -scores[n])[: self.top_k]

    def retrieve(self, skill_key: str, task: str = "") -> RetrievedSkills:
        names = self.match(skill_key, task)
        by_name = {c.name: c for c in self.categories}
        chosen = [by_name[n] for n in names]
        return RetrievedSkills(
            general=self.general,
            categories=tuple(names),
            skills=tuple(s for c in chosen for s in c.skills),
            mistakes=tuple(m for c in chosen for m in c.mistakes),
        )

    def situational(self, observation: str) -> RetrievedSkills:
        """The situations ``observation`` shows, in file order (none: an empty block)."""
        hit = [s for s in self.situations if s.when.search(observation)]
        return RetrievedSkills(general=(), categories=tuple(s.name for s in hit), skills=tuple(x for s in hit for x in s.skills),
                               mistakes=tuple(m for s in hit for m in s.mistakes))

    def block(self, skill_key: str, task: str, observation: str) -> str:
        """The skill block of one turn's teacher view: the task's skills (scope ``episode``) or the
        situations this turn's observation shows (scope ``turn``; "" on a turn that shows none)."""
        if self.scope == "turn":
            return self.situational(observation).render()
        return self.retrieve(skill_key, task).render()

    def all_lines(self) -> tuple[str, ...]:
        """Every skill and mistake line of the bank (to check that none reaches an evaluation prompt)."""
        lines = list(self.general)
        for group in (*self.categories, *self.situations):
            lines += list(group.skills) + list(group.mistakes)
        return tuple(lines)


def list_skill_files() -> list[str]:
    return sorted(p.stem for p in SKILL_DIR.glob("*.json"))
