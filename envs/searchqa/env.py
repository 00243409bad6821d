"""Search-QA: multi-turn question answering with a search engine, in the Search-R1 protocol."""

from __future__ import annotations

import re
import string
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import gymnasium as gym
from gymnasium.error import ResetNeeded

from agentopsd.envs.base import action_space, clean_text, observation_space
from agentopsd.envs.searchqa.corpus import RELATION_PATTERNS, Doc, Question, embedded_corpus
from agentopsd.envs.searchqa.data import file_key, load_corpus_jsonl, load_qa_shared
from agentopsd.envs.searchqa.retrieval import (
    HttpRetriever,
    Retriever,
    ascii_fold,
    format_information,
    shared_bm25,
)

ENV_ID = "agentopsd/SearchQA-v0"
DEFAULT_TURNS = 4
SPLITS = ("train", "eval")
RETRIEVERS = ("bm25", "http")
USER_SKILL_KEY = "open_domain"

PROMPT = (
    "Answer the question below. You may reason first. To look something up, write "
    "<search>your query</search>; the search engine returns the best matching passages between "
    "<information> and </information>. Search as many times as you need. When you know the answer, "
    "write only the answer between <answer> and </answer>, for example <answer>Paris</answer>.\n"
    "Question: {question}"
)
FORMAT_HINT = "Write <search>query</search> to search or <answer>text</answer> to answer."

_OPEN_TAG = re.compile(r"<(search|answer)>", re.IGNORECASE)
_CLOSE_TAG = {tag: re.compile(f"</{tag}>", re.IGNORECASE) for tag in ("search", "answer")}
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD normalization (lower-case, drop punctuation and articles, collapse whitespace),
    after folding accents so an answer typed from the ASCII observation matches "Zürich"."""
    text = ascii_fold(text).lower()
    text = "".join(ch for ch in text if ch not in _PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(prediction: str, golds: Sequence[str]) -> bool:
    pred = normalize_answer(prediction)
    return any(pred == normalize_answer(g) for g in golds)


def parse_action(text: str) -> tuple[str, str] | None:
    """``(tag, content)`` of the first complete ``<search>``/``<answer>`` tag (by opening position).

    A tag whose closing is missing is skipped, so ``<search>x <answer>y</answer>`` answers ``y``.
    Linear time: once a tag has no closing after some opening, none of its later openings can close.
    """
    unclosed: set[str] = set()
    for opening in _OPEN_TAG.finditer(text):
        tag = opening.group(1).lower()
        if tag in unclosed:
            continue
        closing = _CLOSE_TAG[tag].search(text, opening.end())
        if closing is None:
            unclosed.add(tag)
            continue
        return tag, text[opening.end() : closing.start()]
    return None


class SearchQAEnv(gym.Env[str, str]):
    """Answer a question by searching a passage corpus (the Search-R1 protocol).

    The embedded default is a generated corpus of fictional countries, cities, rivers,
    universities, people and companies (about 2,100 passages) with 1,500 questions that need
    1, 2 or 3 look-ups (``skill_key`` "1hop"/"2hop"/"3hop"); the eval split is a fixed list of
    150 (50 per hop count). ``corpus_path``/``qa_path`` switch to user data (Search-R1 jsonl corpus,
    jsonl/parquet QA; ``skill_key`` "open_domain"), ``retriever="http"`` to a retrieval server.

    ## Action Space
    The model's text. The first complete tag decides (by where it opens):
    ``<search>query</search>`` searches, ``<answer>text</answer>`` answers; text around the tag
    (e.g. ``<think>`` reasoning) is ignored. Anything else, or an empty query/answer, is invalid:
    the observation repeats the expected format, ``info["action_valid"]`` is False, nothing changes.
    ``admissible_actions`` is None (free text).

    ## Observation Space
    At reset, the instructions and the question. After a search, the top-``topk`` passages as
    ``<information>Doc 1 (Title: t) text ...</information>``. Printable ASCII (accents folded).

    ## Rewards
    1.0 for an answer that exactly matches a gold answer after SQuAD normalization
    (lower-case, no punctuation, no articles, single spaces), else 0.0. Searches pay 0.

    With ``retriever="http"``, a server that is down, slow past ``retriever_timeout`` or answers
    garbage makes ``step`` raise ``RetrieverError``: a fault of the infrastructure, not of the action.

    ## Episode End
    Terminates on the first answer (``info["won"]`` is True when it is correct). Truncated by the
    registered ``max_episode_steps`` (4 turns: a 3-hop question needs 3 searches and the answer).
    """

    metadata = {"render_modes": []}

    def __init__(
        self,
        split: str = "train",
        corpus_path: str | Path | None = None,
        qa_path: str | Path | None = None,
        eval_qa_path: str | Path | None = None,
        eval_size: int = 150,
        retriever: str = "bm25",
        retriever_url: str | None = None,
        retriever_timeout: float = 30.0,
        topk: int = 3,
    ) -> None:
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}: choose one of {list(SPLITS)}")
        if retriever not in RETRIEVERS:
            raise ValueError(f"unknown retriever {retriever!r}: choose one of {list(RETRIEVERS)}")
        if topk < 1:
            raise ValueError(f"topk must be >= 1, got {topk}")
        self.split = split
        self.topk = topk
        user_data = any(p is not None for p in (corpus_path, qa_path, eval_qa_path))
        if user_data:
            self.questions = _user_questions(split, qa_path, eval_qa_path, eval_size)
        else:
            corpus = embedded_corpus()
            self.questions = corpus.train if split == "train" else corpus.eval
        self.retriever = _make_retriever(retriever, corpus_path, retriever_url, retriever_timeout, user_data)
        self.observation_space = observation_space()
        self.action_space = action_space()
        self._question: Question | None = None
        self._task_index = -1
        self._seen: dict[str, str] = {}
        self._done = False
        self._won = False

    @property
    def num_tasks(self) -> int:
        return len(self.questions)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict]:
        super().reset(seed=seed)
        index = (options or {}).get("task_index")
        if index is None:
            index = int(self.np_random.integers(self.num_tasks))
        elif not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < self.num_tasks:
            raise ValueError(f"task_index must be an int in [0, {self.num_tasks - 1}], got {index!r}")
        self._task_index = index
        self._question = self.questions[index]
        self._seen = {}
        self._done = False
        self._won = False
        info = self._info(action_valid=True)
        info["expert_steps"] = len(self._question.hops) + 1
        return clean_text(ascii_fold(PROMPT.format(question=self._question.question))), info

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        if self._question is None:
            raise ResetNeeded("call reset() before step()")
        if self._done:
            return "The episode is over: call reset().", 0.0, True, False, self._info(action_valid=False)
        parsed = parse_action(action) if isinstance(action, str) else None
        content = " ".join(parsed[1].split()) if parsed else ""
        if parsed is None or not content:
            why = "No complete <search> or <answer> tag found." if parsed is None else f"Empty <{parsed[0]}> tag."
            return clean_text(f"Invalid action. {why} {FORMAT_HINT}"), 0.0, False, False, self._info(False)
        if parsed[0] == "search":
            passages = self.retriever.search(content, self.topk)
            self._remember(passages)
            return format_information(passages), 0.0, False, False, self._info(action_valid=True)
        self._done = True
        self._won = exact_match(content, self._question.answers)
        verdict = "correct" if self._won else "not correct"
        obs = clean_text(ascii_fold(f"Your answer: {content}. That is {verdict}."))
        return obs, float(self._won), True, False, self._info(action_valid=True)

    def expert_action(self) -> str:
        """Follow the hop chain: search the next entity, read its relation off the retrieved passage,
        answer once the chain is resolved. User QA files carry no chain: answer the gold answer."""
        if self._question is None:
            raise ResetNeeded("call reset() before expert_action()")
        if not self._question.hops:
            return f"<answer>{self._question.answers[0]}</answer>"
        current = self._question.hops[0].entity
        for hop in self._question.hops:
            text = self._seen.get(current)
            found = RELATION_PATTERNS[hop.relation].search(text) if text is not None else None
            if found is None:
                return f"<search>{current}</search>"
            current = found.group(1).strip()
        return f"<answer>{current}</answer>"

    def _remember(self, passages: Sequence[Doc]) -> None:
        for doc in passages:
            self._seen.setdefault(doc.title, doc.text)

    def _info(self, action_valid: bool) -> dict[str, Any]:
        assert self._question is not None  # internal: only called after reset
        category = self._question.category
        return {
            "task": self._question.question,
            "admissible_actions": None,
            "skill_key": category if self._question.hops else USER_SKILL_KEY,
            "task_type": category,
            "task_index": self._task_index,
            "won": self._won,
            "action_valid": action_valid,
        }


def _user_questions(
    split: str, qa_path: str | Path | None, eval_qa_path: str | Path | None, eval_size: int
) -> tuple[Question, ...]:
    """Train = ``qa_path``; eval = ``eval_qa_path``, or else the first ``eval_size`` rows of
    ``qa_path`` (then held out of train), so the eval list is fixed by the files alone."""
    if split == "eval" and eval_qa_path is not None:
        return load_qa_shared(eval_qa_path)
    if qa_path is None:
        needed = "qa_path or eval_qa_path" if split == "eval" else "qa_path"
        raise ValueError(f"split {split!r} with user data needs {needed} (a jsonl/parquet QA file)")
    rows = load_qa_shared(qa_path)
    if eval_qa_path is not None:
        return rows
    if not 0 < eval_size < len(rows):
        raise ValueError(f"eval_size must be in [1, {len(rows) - 1}] for {qa_path} ({len(rows)} rows), got {eval_size}")
    return rows[:eval_size] if split == "eval" else rows[eval_size:]


def _make_retriever(
    kind: str, corpus_path: str | Path | None, url: str | None, timeout: float, user_data: bool
) -> Retriever:
    if kind == "http":
        if url is None:
            raise ValueError("retriever='http' needs retriever_url, e.g. http://127.0.0.1:8000/retrieve")
        if corpus_path is not None:
            raise ValueError("corpus_path is only read by retriever='bm25'; the HTTP server holds its own corpus")
        return HttpRetriever(url, timeout=timeout)
    if corpus_path is None:
        if user_data:
            raise ValueError("retriever='bm25' with a user qa_path needs corpus_path (a jsonl corpus)")
        return shared_bm25("embedded", lambda: embedded_corpus().docs)
    if not Path(corpus_path).is_file():
        raise FileNotFoundError(f"corpus_path {corpus_path} does not exist: pass a .jsonl file with one passage per line")
    key = file_key(corpus_path)
    return shared_bm25(repr(key), lambda: load_corpus_jsonl(key[0]))


def register_envs() -> None:
    """Register ``agentopsd/SearchQA-v0`` (idempotent; string entry point keeps import cheap)."""
    if ENV_ID not in gym.registry:
        gym.register(id=ENV_ID, entry_point="agentopsd.envs.searchqa.env:SearchQAEnv", max_episode_steps=DEFAULT_TURNS, kwargs={})
