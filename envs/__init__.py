"""Gymnasium text environments, registered on import as ``agentopsd/<Name>-v0``.

One package per environment family (``babyai``, ``alfworld``, ``webshop``, ``searchqa``), each with
its environment class in ``env.py``; what they share (base spaces, the batched runner, fault
injection, seeding) lives here. Each family registers its own ids with string entry points, so
importing this package never imports an optional engine (ALFWorld's is imported only when its env
is made).
"""

from agentopsd.envs.alfworld import env as alfworld_env
from agentopsd.envs.babyai import env as babyai_env
from agentopsd.envs.searchqa import env as searchqa_env
from agentopsd.envs.webshop import env as webshop_env

for _module in (babyai_env, webshop_env, searchqa_env, alfworld_env):
    _module.register_envs()
