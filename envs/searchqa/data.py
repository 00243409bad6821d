"""User data for Search-QA real runs: a passage corpus (jsonl) and question files (jsonl/parquet).

Formats follow Search-R1/FlashRAG (``contents`` = "title\\ntext", ``question`` + ``golden_answers``)
and accept the NQ (``answers``) and HotpotQA (``answer``) field names.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from agentopsd.envs.searchqa.corpus import Doc, Question
from agentopsd.envs.searchqa.retrieval import doc_from_record


def load_corpus_jsonl(path: str | Path) -> tuple[Doc, ...]:
    """A user corpus: one JSON object per line with ``contents`` (Search-R1 wiki: "title\\ntext")
    or ``text`` (and optionally ``title``)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"corpus_path {path} does not exist: pass a .jsonl file with one passage per line")
    docs = []
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({err})") from err
            if not isinstance(record, dict) or not ("contents" in record or "text" in record):
                fields = sorted(record) if isinstance(record, dict) else type(record).__name__
                raise ValueError(
                    f"{path}:{lineno}: a corpus line needs the field 'contents' (Search-R1 format "
                    f"'title\\ntext') or 'text' (optionally with 'title'); found {fields}"
                )
            docs.append(doc_from_record(record))
    if not docs:
        raise ValueError(f"corpus_path {path} holds no passages")
    return tuple(docs)


QUESTION_FIELD = "question"
ANSWER_FIELDS = ("golden_answers", "answers", "answer")


def load_qa(path: str | Path) -> tuple[Question, ...]:
    """User questions from ``.jsonl`` or ``.parquet``: ``question`` plus ``golden_answers``
    (Search-R1/FlashRAG), ``answers`` (NQ) or ``answer`` (HotpotQA), a string or a list of strings.
    ``data_source`` (Search-R1's merged files), when present, becomes the task type."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"QA file {path} does not exist: pass a .jsonl or .parquet file")
    rows = _read_parquet(path) if path.suffix == ".parquet" else _read_jsonl(path)
    questions = tuple(_question_from_row(row, f"{path}:{i}") for i, row in enumerate(rows, start=1))
    if not questions:
        raise ValueError(f"QA file {path} holds no questions")
    return questions


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    rows = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({err})") from err
    return rows


def _read_parquet(path: Path) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq  # only for parquet QA files

    names = pq.read_schema(path).names
    # Only the columns we use: Search-R1 files also carry large nested prompt columns.
    wanted = [c for c in (QUESTION_FIELD, *ANSWER_FIELDS, "data_source") if c in names]
    return pq.read_table(path, columns=wanted).to_pylist()


def _question_from_row(row: Any, where: str) -> Question:
    if not isinstance(row, dict) or QUESTION_FIELD not in row:
        found = sorted(row) if isinstance(row, dict) else type(row).__name__
        raise ValueError(f"{where}: missing field '{QUESTION_FIELD}' (the question text); found {found}")
    field = next((f for f in ANSWER_FIELDS if f in row), None)
    if field is None:
        raise ValueError(
            f"{where}: missing the answer field: expected one of {list(ANSWER_FIELDS)} "
            f"(a string or a list of strings); found {sorted(row)}"
        )
    raw = row[field]
    answers = tuple(str(a).strip() for a in (raw if isinstance(raw, (list, tuple)) else [raw]) if a is not None)
    answers = tuple(a for a in answers if a)
    if not answers:
        raise ValueError(f"{where}: field '{field}' holds no non-empty answer")
    category = str(row.get("data_source") or "open_domain")
    return Question(question=str(row[QUESTION_FIELD]).strip(), answers=answers, hops=(), category=category)


def file_key(path: str | Path) -> tuple[str, int, int]:
    """Identity of a file's current content: an edited file gets a new key and is re-read."""
    resolved = Path(path).resolve()
    if not resolved.is_file():
        raise FileNotFoundError(f"{resolved} does not exist: pass an existing file")
    stat = resolved.stat()
    return str(resolved), stat.st_mtime_ns, stat.st_size


@functools.lru_cache(maxsize=8)
def _load_qa_keyed(key: tuple[str, int, int]) -> tuple[Question, ...]:
    return load_qa(key[0])


def load_qa_shared(path: str | Path) -> tuple[Question, ...]:
    """QA files are parsed once per process, not once per env instance."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"QA file {path} does not exist: pass a .jsonl or .parquet file")
    return _load_qa_keyed(file_key(path))
