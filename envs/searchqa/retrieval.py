"""Search back-ends for Search-QA: an in-process BM25 index (``bm25s``) and a client for an HTTP
retrieval server speaking Search-R1's ``/retrieve`` protocol.

Both return ``Doc(title, text)`` passages; ``format_information`` renders them the way Search-R1
shows them to the model (``Doc 1 (Title: ...) text``).
"""

from __future__ import annotations

import json
import re
import threading
import unicodedata
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from agentopsd.envs.base import clean_text
from agentopsd.envs.searchqa.corpus import Doc

MAX_QUERY_CHARS = 512
MAX_PASSAGE_CHARS = 3_000
_TOKEN = re.compile(r"(?u)\b\w\w+\b")


class RetrieverError(RuntimeError):
    """The retrieval back-end failed (server down, timeout, malformed reply)."""


class Retriever(Protocol):
    def search(self, query: str, k: int) -> list[Doc]: ...


# Letters and punctuation that NFKD does not decompose but Wikipedia text is full of.
_FOLD = str.maketrans({"ß": "ss", "æ": "ae", "Æ": "AE", "œ": "oe", "Œ": "OE", "ø": "o", "Ø": "O", "ł": "l",
                       "Ł": "L", "đ": "d", "Đ": "D", "þ": "th", "Þ": "Th", "‘": "'", "’": "'", "“": '"',
                       "”": '"', "–": "-", "—": "-", "…": "..."})


def ascii_fold(text: str) -> str:
    """Strip accents (Zürich -> Zurich) so real-world passages survive the ASCII observation space."""
    decomposed = unicodedata.normalize("NFKD", text.translate(_FOLD))
    return "".join(ch for ch in decomposed if not unicodedata.combining(ch))


def split_contents(contents: str) -> Doc:
    """Search-R1's wiki format: ``contents = '"Title"\\ntext'``; no newline means no title."""
    head, sep, rest = contents.partition("\n")
    if not sep:
        return Doc(title="", text=contents.strip())
    return Doc(title=head.strip().strip('"').strip(), text=rest.strip())


def format_information(passages: Sequence[Doc]) -> str:
    """The observation after a search: one ``Doc i (Title: t) text`` line per passage."""
    if not passages:
        body = "No documents matched the query."
    else:
        lines = []
        for i, doc in enumerate(passages, start=1):
            title = f" (Title: {doc.title})" if doc.title else ""
            lines.append(f"Doc {i}{title} {doc.text[:MAX_PASSAGE_CHARS]}")
        body = "\n".join(lines)
    return clean_text(ascii_fold(f"<information>{body}</information>"))


def _stopwords() -> frozenset[str]:
    from bm25s.stopwords import STOPWORDS_EN

    return frozenset(STOPWORDS_EN)


class BM25Index:
    """BM25 (Lucene variant, bm25s defaults k1=1.5, b=0.75) over titles and texts."""

    def __init__(self, docs: Sequence[Doc]) -> None:
        import bm25s  # heavy (numpy/scipy): imported only when an index is built

        if not docs:
            raise ValueError("cannot build a BM25 index over an empty corpus")
        self.docs = tuple(docs)
        self._stop = _stopwords()
        self._bm25 = bm25s.BM25()
        tokens = [self.tokenize(f"{d.title}\n{d.text}") for d in self.docs]
        self._bm25.index(tokens, show_progress=False)
        self._vocab = self._bm25.vocab_dict

    def tokenize(self, text: str) -> list[str]:
        return [t for t in _TOKEN.findall(ascii_fold(text).lower()) if t not in self._stop]

    def search(self, query: str, k: int) -> list[Doc]:
        """Top-``k`` documents with a positive score, best first (ties: corpus order)."""
        tokens = [t for t in self.tokenize(query[:MAX_QUERY_CHARS]) if t in self._vocab]
        if not tokens:
            return []
        scores = np.asarray(self._bm25.get_scores(tokens))
        k = min(k, len(scores))
        top = np.argpartition(-scores, k - 1)[:k]
        # Stable order: higher score first, then lower index, so results never depend on partition order.
        top = sorted(top.tolist(), key=lambda i: (-float(scores[i]), i))
        return [self.docs[i] for i in top if scores[i] > 0]


_INDEXES: dict[str, BM25Index] = {}
_INDEX_LOCK = threading.Lock()


def shared_bm25(key: str, load_docs: Callable[[], Sequence[Doc]]) -> BM25Index:
    """One index per corpus per process: the trainer builds 64+ envs over the same corpus."""
    with _INDEX_LOCK:
        if key not in _INDEXES:
            _INDEXES[key] = BM25Index(load_docs())
        return _INDEXES[key]


class HttpRetriever:
    """Client for a Search-R1-style retrieval server (``POST {queries, topk, return_scores}``).

    The reply is ``{"result": [[{"document": {"contents": ...}, "score": s}, ...]]}``, one list per
    query (or bare document dicts when the server drops scores).
    """

    def __init__(self, url: str, timeout: float = 30.0) -> None:
        if not url or not url.startswith(("http://", "https://")):
            raise ValueError(f"retriever_url must be an http(s) URL such as http://127.0.0.1:8000/retrieve, got {url!r}")
        if timeout <= 0:
            raise ValueError(f"retriever_timeout must be > 0 seconds, got {timeout}")
        self.url = url
        self.timeout = timeout

    def search(self, query: str, k: int) -> list[Doc]:
        payload = {"queries": [query[:MAX_QUERY_CHARS]], "topk": k, "return_scores": True}
        request = urllib.request.Request(
            self.url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"}, method="POST"
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                raw = response.read()
        except (urllib.error.URLError, TimeoutError, OSError) as err:
            raise RetrieverError(
                f"HTTP retriever at {self.url} failed ({err}); is the retrieval server running and reachable "
                f"within {self.timeout} s?"
            ) from err
        return parse_retrieval_reply(raw, self.url)[:k]


def parse_retrieval_reply(raw: bytes, url: str = "the retriever") -> list[Doc]:
    """Documents of the first (only) query in a Search-R1 retrieval server reply."""
    try:
        reply = json.loads(raw)
        results = reply["result"][0]
        return [_reply_doc(item) for item in results]
    except (ValueError, KeyError, IndexError, TypeError) as err:
        snippet = raw[:200].decode("utf-8", "replace")
        raise RetrieverError(
            f"malformed reply from {url}: expected {{'result': [[{{'document': {{'contents': ...}}}}, ...]]}}, "
            f"got {snippet!r} ({err})"
        ) from err


def _reply_doc(item: Any) -> Doc:
    doc = item["document"] if isinstance(item, dict) and "document" in item else item
    if not isinstance(doc, dict):
        raise TypeError(f"a retrieved document must be a JSON object, got {type(doc).__name__}")
    return doc_from_record(doc)


def doc_from_record(record: dict[str, Any]) -> Doc:
    """A passage from a corpus/server record: ``contents`` ("title\\ntext") or ``text`` (+ ``title``)."""
    if "contents" in record:
        return split_contents(str(record["contents"]))
    if "text" in record:
        return Doc(title=str(record.get("title", "")).strip(), text=str(record["text"]).strip())
    raise KeyError(f"no 'contents' or 'text' field (fields: {sorted(record)})")

