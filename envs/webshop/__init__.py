"""WebShop over a generated catalogue (``agentopsd/WebShop-v0``).

env.py the environment and its expert; catalog.py and data.py the generated catalogue and
instructions; pages.py the pages and action grammar; search.py BM25 search; reward.py the WebShop
score; adapter.py the original WebShop behind the same contract.
"""
