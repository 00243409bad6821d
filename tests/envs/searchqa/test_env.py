"""Search-QA: the Search-R1 protocol over the generated corpus, user data files and an HTTP retriever."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import gymnasium as gym
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from gymnasium.utils.env_checker import check_env
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import agentopsd.envs  # noqa: F401  (registers the ids)
from agentopsd.envs.searchqa.corpus import (
    HOP_CATEGORIES,
    RELATION_PATTERNS,
    Corpus,
    Doc,
    corpus_fingerprint,
    embedded_corpus,
)
from agentopsd.envs.searchqa.env import ENV_ID, SearchQAEnv, exact_match, normalize_answer, parse_action
from agentopsd.envs.searchqa.retrieval import HttpRetriever, RetrieverError, format_information, shared_bm25
from agentopsd.rollout.skills import SkillBank

# Pinned: a change means the embedded corpus (and every number measured on it) changed.
EMBEDDED_FINGERPRINT = "d57d2da7e8a54697460f92a31d97c256dc6befec6e5e9ebbaf0c098e1e22c78d"


@pytest.fixture(scope="module")
def eval_env() -> SearchQAEnv:
    return SearchQAEnv(split="eval")


def play_expert(env: gym.Env) -> tuple[bool, int]:
    steps, terminated, truncated, info = 0, False, False, {}
    while not (terminated or truncated):
        _, _, terminated, truncated, info = env.step(env.unwrapped.expert_action())
        steps += 1
    return info["won"], steps


# ---------------------------------------------------------------- answers and actions


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The  Eiffel Tower!", "eiffel tower"),
        ("an Apple, a day", "apple day"),
        ("Zürich", "zurich"),
        ("Banana", "banana"),  # articles go only as whole words
        ("  U.S.A. ", "usa"),
        ("", ""),
    ],
)
def test_normalize_answer(text: str, expected: str) -> None:
    assert normalize_answer(text) == expected


def test_exact_match() -> None:
    assert exact_match("Paris.", ["London", "paris"])
    assert exact_match("the Amsel River", ["Amsel River"])
    assert not exact_match("Paris, France", ["Paris"])
    assert not exact_match("", ["Paris"])


@pytest.mark.parametrize(
    ("action", "expected"),
    [
        ("<search>a</search><answer>b</answer>", ("search", "a")),
        ("<answer>b</answer><search>a</search>", ("answer", "b")),
        ("<think>hm</think> <search>x <answer>y</answer>", ("answer", "y")),  # unclosed search skipped
        ("<SEARCH>Who</Search>", ("search", "Who")),
        ("junk <answer>\n 42 </answer> junk", ("answer", "\n 42 ")),
        ("no tags at all", None),
        ("<search>never closed", None),
    ],
)
def test_parse_action_first_complete_tag_wins(action: str, expected: tuple[str, str] | None) -> None:
    assert parse_action(action) == expected


# ---------------------------------------------------------------- embedded corpus


def test_corpus_is_large_deterministic_and_fast() -> None:
    start = time.perf_counter()
    fresh: Corpus = embedded_corpus.__wrapped__()  # bypass the per-process cache
    assert time.perf_counter() - start < 3.0
    assert corpus_fingerprint(fresh) == corpus_fingerprint(embedded_corpus()) == EMBEDDED_FINGERPRINT
    assert len(fresh.docs) >= 2000 and len({d.title for d in fresh.docs}) == len(fresh.docs)
    assert len(fresh.train) + len(fresh.eval) >= 1000
    assert Counter(q.category for q in fresh.eval) == {c: 50 for c in HOP_CATEGORIES}
    assert {q.question for q in fresh.train}.isdisjoint(q.question for q in fresh.eval)
    for q in fresh.eval:
        assert len(q.hops) == int(q.category[0])
        assert q.hops[-1].target in q.answers


def test_every_eval_hop_is_retrievable_and_readable(eval_env: SearchQAEnv) -> None:
    docs = {d.title: d.text for d in embedded_corpus().docs}
    for q in eval_env.questions:
        for hop in q.hops:
            titles = [d.title for d in eval_env.retriever.search(hop.entity, eval_env.topk)]
            assert hop.entity in titles, (q.question, hop)
            assert RELATION_PATTERNS[hop.relation].search(docs[hop.entity]).group(1) == hop.target


def test_bm25_index_is_shared_across_instances(eval_env: SearchQAEnv) -> None:
    assert SearchQAEnv(split="train").retriever is eval_env.retriever


# ---------------------------------------------------------------- gymnasium contract


@pytest.mark.parametrize("env_id", [ENV_ID])
def test_check_env(env_id: str) -> None:
    check_env(gym.make(env_id).unwrapped)


def test_registered_horizon_and_splits() -> None:
    spec = gym.spec(ENV_ID)
    assert spec.max_episode_steps == 4 and isinstance(spec.entry_point, str)
    assert SearchQAEnv(split="eval").num_tasks == 150
    assert SearchQAEnv(split="train").num_tasks == len(embedded_corpus().train)


def test_expert_wins_every_eval_task_within_the_horizon() -> None:
    env = gym.make(ENV_ID, split="eval")
    for index in range(env.unwrapped.num_tasks):
        _, info = env.reset(options={"task_index": index})
        won, steps = play_expert(env)
        assert won, info["task"]
        assert steps == info["expert_steps"] == int(info["skill_key"][0]) + 1


def test_reset_info_and_search_observation(eval_env: SearchQAEnv) -> None:
    obs, info = eval_env.reset(options={"task_index": 2})
    question = eval_env.questions[2]
    assert question.question in obs and "<search>" in obs
    assert info["admissible_actions"] is None and info["action_valid"] and not info["won"]
    assert info["task"] == question.question and info["task_index"] == 2
    assert info["skill_key"] == info["task_type"] == question.category
    obs, reward, terminated, _, info = eval_env.step(f"<think>x</think><search>{question.hops[0].entity}</search>")
    assert obs.startswith("<information>Doc 1 (Title: ") and obs.endswith("</information>")
    assert obs.count("Doc ") == 3 and reward == 0.0 and not terminated and info["action_valid"]


def test_wrong_answer_ends_with_zero(eval_env: SearchQAEnv) -> None:
    eval_env.reset(options={"task_index": 0})
    _, reward, terminated, _, info = eval_env.step("<answer>certainly not this</answer>")
    assert (reward, terminated, info["won"]) == (0.0, True, False)
    obs, _, terminated, _, info = eval_env.step("<answer>again</answer>")
    assert terminated and not info["action_valid"] and "over" in obs


def test_determinism_for_a_seed() -> None:
    def rollout(seed: int) -> list:
        env = SearchQAEnv(split="train")
        obs, info = env.reset(seed=seed)
        trace = [obs, info["task_index"]]
        for _ in range(3):
            trace.append(env.step(env.expert_action())[:3])
        return trace

    assert rollout(7) == rollout(7)
    assert rollout(7)[1] != rollout(8)[1] or rollout(7)[1] != rollout(9)[1]


junk_commands = st.builds(
    lambda pre, tag, body, post: f"{pre}<{tag}>{body}</{tag}>{post}",
    st.text(max_size=50), st.sampled_from(["search", "answer", "SEARCH"]), st.text(max_size=50), st.text(max_size=50),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(action=st.one_of(
    st.text(),
    st.text(alphabet=st.characters(max_codepoint=31), max_size=200),  # control characters
    st.builds(lambda unit, n: (unit * n)[:10_000], st.text("<>/searchanswerSEARCH x", min_size=1, max_size=12),
              st.integers(500, 10_000)),  # long strings full of half-tags
    junk_commands,
))
def test_step_never_raises(eval_env: SearchQAEnv, action: str) -> None:
    eval_env.reset(options={"task_index": 5})
    before = eval_env.expert_action()
    obs, reward, terminated, truncated, info = eval_env.step(action)
    assert eval_env.observation_space.contains(obs)
    assert reward in (0.0, 1.0) and not truncated
    if not info["action_valid"]:
        assert "Invalid action" in obs and not terminated and eval_env.expert_action() == before


def test_non_string_and_long_actions_are_invalid_not_errors(eval_env: SearchQAEnv) -> None:
    eval_env.reset(options={"task_index": 1})
    for action in (None, 3, "x" * 10_000, "<search>   </search>", "<answer></answer>"):
        obs, _, terminated, _, info = eval_env.step(action)  # type: ignore[arg-type]
        assert not info["action_valid"] and not terminated and eval_env.observation_space.contains(obs)


@pytest.mark.parametrize("index", [-1, 150, "3", 2.0, True])
def test_bad_task_index(eval_env: SearchQAEnv, index: object) -> None:
    with pytest.raises(ValueError, match=r"\[0, 149\]"):
        eval_env.reset(options={"task_index": index})


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"split": "test"}, ValueError, "'train', 'eval'"),
        ({"retriever": "dense"}, ValueError, "'bm25', 'http'"),
        ({"topk": 0}, ValueError, "topk"),
        ({"retriever": "http"}, ValueError, "retriever_url"),
        ({"retriever": "http", "retriever_url": "localhost:8000"}, ValueError, "http"),
        ({"qa_path": "/nonexistent/qa.jsonl", "corpus_path": "/nonexistent/c.jsonl"}, FileNotFoundError, "qa.jsonl"),
    ],
)
def test_bad_constructor_arguments(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        SearchQAEnv(**kwargs)


# ---------------------------------------------------------------- skills


def test_skill_bank_categories(eval_env: SearchQAEnv) -> None:
    bank = SkillBank.for_env("searchqa")
    assert {c.name for c in bank.categories} == {*HOP_CATEGORIES, "open_domain"}
    for index in range(3):  # eval is interleaved 1/2/3-hop
        _, info = eval_env.reset(options={"task_index": index})
        assert bank.retrieve(info["skill_key"], info["task"]).categories == (info["skill_key"],)
    assert bank.retrieve("open_domain", "who wrote hamlet").categories == ("open_domain",)
    unrelated = bank.retrieve("cooking", "put a clean mug in the microwave")
    assert unrelated.categories == () and unrelated.general and not unrelated.skills


# ---------------------------------------------------------------- user corpus and QA files

USER_CORPUS = [
    {"id": "0", "contents": '"Quorvale"\nQuorvale is a harbour town famous for blue lanterns.'},
    {"id": "1", "contents": '"Mt. Ystre"\nMount Ystre is the tallest peak of the Ossian range.'},
    {"id": "2", "title": "Lanterns", "text": "Blue lanterns were first made by the glassblower Ema Tovik."},
    {"id": "3", "text": "Untitled passage about river barges."},
]
USER_QA = [
    {"question": "Which town is famous for blue lanterns?", "golden_answers": ["Quorvale"]},
    {"question": "What is the tallest peak of the Ossian range?", "golden_answers": ["Mount Ystre", "Ystre"]},
    {"question": "Who first made blue lanterns?", "golden_answers": ["Ema Tovik"], "data_source": "nq"},
]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture()
def user_files(tmp_path: Path) -> dict[str, Path]:
    return {"corpus_path": write_jsonl(tmp_path / "corpus.jsonl", USER_CORPUS),
            "qa_path": write_jsonl(tmp_path / "qa.jsonl", USER_QA)}


def test_user_corpus_and_jsonl_qa(user_files: dict[str, Path]) -> None:
    train = SearchQAEnv(split="train", eval_size=1, **user_files)
    evaluation = SearchQAEnv(split="eval", eval_size=1, **user_files)
    assert (train.num_tasks, evaluation.num_tasks) == (2, 1)
    assert evaluation.questions[0].question == USER_QA[0]["question"]
    obs, info = train.reset(options={"task_index": 1})
    assert info["skill_key"] == "open_domain" and info["task_type"] == "nq" and info["expert_steps"] == 1
    obs, *_ = train.step("<search>who made blue lanterns</search>")
    assert obs.startswith("<information>Doc 1 (Title: Lanterns) Blue lanterns were first made")
    assert "Doc 2 (Title: Quorvale)" in obs  # Search-R1 contents: quoted title on the first line
    obs, *_ = train.step("<search>river barges</search>")
    assert obs == "<information>Doc 1 Untitled passage about river barges.</information>"
    _, reward, terminated, _, info = train.step(train.expert_action())
    assert (reward, terminated, info["won"]) == (1.0, True, True)
    train.reset(options={"task_index": 0})
    assert train.step("<answer>ystre</answer>")[1] == 1.0  # any gold answer counts


@pytest.mark.parametrize("answer_field", ["answers", "answer"])
def test_parquet_qa_with_nq_and_hotpot_fields(tmp_path: Path, user_files: dict[str, Path], answer_field: str) -> None:
    answers = [["Quorvale"], ["Mount Ystre"], ["Ema Tovik"]]
    column = answers if answer_field == "answers" else [a[0] for a in answers]
    table = pa.table({"question": [q["question"] for q in USER_QA], answer_field: column, "extra": [1, 2, 3]})
    pq.write_table(table, tmp_path / "qa.parquet")
    env = SearchQAEnv(corpus_path=user_files["corpus_path"], qa_path=tmp_path / "qa.parquet",
                      eval_qa_path=user_files["qa_path"], split="train")
    assert env.num_tasks == 3  # eval comes from its own file, so train keeps every row
    _, info = env.reset(options={"task_index": 2})
    assert info["task"] == USER_QA[2]["question"]
    assert env.step("<answer>ema tovik</answer>")[1] == 1.0


@pytest.mark.parametrize(
    ("row", "match"),
    [
        ({"golden_answers": ["x"]}, "missing field 'question'"),
        ({"question": "q?", "label": "x"}, r"\['golden_answers', 'answers', 'answer'\]"),
        ({"question": "q?", "answers": []}, "no non-empty answer"),
    ],
)
def test_qa_missing_fields(tmp_path: Path, user_files: dict[str, Path], row: dict, match: str) -> None:
    bad = write_jsonl(tmp_path / "bad_qa.jsonl", USER_QA + [row])
    with pytest.raises(ValueError, match=match):
        SearchQAEnv(corpus_path=user_files["corpus_path"], qa_path=bad)


def test_parquet_missing_question_column(tmp_path: Path, user_files: dict[str, Path]) -> None:
    pq.write_table(pa.table({"query": ["q?"], "golden_answers": [["a"]]}), tmp_path / "qa.parquet")
    with pytest.raises(ValueError, match="missing field 'question'"):
        SearchQAEnv(corpus_path=user_files["corpus_path"], qa_path=tmp_path / "qa.parquet")


def test_corpus_missing_field_and_missing_files(tmp_path: Path, user_files: dict[str, Path]) -> None:
    bad = write_jsonl(tmp_path / "bad_corpus.jsonl", USER_CORPUS + [{"id": "9", "body": "no text"}])
    with pytest.raises(ValueError, match=r"bad_corpus.jsonl:5: .*'contents'.*'text'"):
        SearchQAEnv(corpus_path=bad, qa_path=user_files["qa_path"], eval_size=1)
    with pytest.raises(FileNotFoundError, match="corpus_path"):
        SearchQAEnv(corpus_path=tmp_path / "missing.jsonl", qa_path=user_files["qa_path"], eval_size=1)
    with pytest.raises(ValueError, match="needs corpus_path"):
        SearchQAEnv(qa_path=user_files["qa_path"], eval_size=1)
    with pytest.raises(ValueError, match="needs qa_path"):
        SearchQAEnv(corpus_path=user_files["corpus_path"])
    with pytest.raises(ValueError, match="eval_size"):
        SearchQAEnv(split="eval", eval_size=3, **user_files)


def test_format_information_folds_accents_and_stays_ascii() -> None:
    obs = format_information([Doc(title="Zürich", text="Größte “Stadt” ☃")])
    assert obs == '<information>Doc 1 (Title: Zurich) Grosste "Stadt" ?</information>'


# ---------------------------------------------------------------- HTTP retriever


class _Server:
    """A Search-R1-style /retrieve endpoint over the embedded corpus, on 127.0.0.1."""

    def __init__(self, mode: str = "scores") -> None:
        index = shared_bm25("embedded", lambda: embedded_corpus().docs)
        self.requests: list[dict] = []
        server_self = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server API)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server_self.requests.append(body)
                if mode == "slow":
                    time.sleep(1.0)
                results = []
                for query in body["queries"]:
                    hits = [{"contents": f'"{d.title}"\n{d.text}'} for d in index.search(query, body["topk"])]
                    results.append([{"document": h, "score": 1.0} for h in hits] if mode != "bare" else hits)
                reply = b"not json" if mode == "broken" else json.dumps({"result": results}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: object) -> None:  # keep test output clean
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/retrieve"
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture()
def server(request: pytest.FixtureRequest) -> Iterator[_Server]:
    srv = _Server(getattr(request, "param", "scores"))
    yield srv
    srv.close()


@pytest.mark.parametrize("server", ["scores", "bare"], indirect=True)
def test_http_retriever_plays_the_embedded_eval(server: _Server) -> None:
    env = gym.make(ENV_ID, split="eval", retriever="http", retriever_url=server.url, retriever_timeout=5.0)
    for index in range(6):
        env.reset(options={"task_index": index})
        assert play_expert(env)[0]
    assert server.requests[0] == {"queries": [server.requests[0]["queries"][0]], "topk": 3, "return_scores": True}


@pytest.mark.parametrize("server", ["broken"], indirect=True)
def test_http_retriever_malformed_reply(server: _Server) -> None:
    with pytest.raises(RetrieverError, match="malformed reply"):
        HttpRetriever(server.url).search("anything", 3)


@pytest.mark.parametrize("server", ["slow"], indirect=True)
def test_http_retriever_timeout(server: _Server) -> None:
    with pytest.raises(RetrieverError, match="within 0.2 s"):
        HttpRetriever(server.url, timeout=0.2).search("anything", 3)


def test_http_retriever_server_down() -> None:
    srv = _Server()
    url = srv.url
    srv.close()
    with pytest.raises(RetrieverError, match=url.replace(".", r"\.")):
        HttpRetriever(url, timeout=2.0).search("anything", 3)
