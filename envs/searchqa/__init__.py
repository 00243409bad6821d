"""Multi-turn question answering with a search engine, Search-R1 protocol (``agentopsd/SearchQA-v0``).

env.py the environment and its expert; corpus.py the embedded generated corpus and questions;
data.py a user's corpus and question files; retrieval.py BM25 in process or an HTTP retriever.
"""
