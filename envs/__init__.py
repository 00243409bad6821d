"""Gymnasium text environments, registered on import as ``agentopsd/<Name>-v0``.

Each module registers its own ids with string entry points, so importing this package
never imports an optional engine (ALFWorld's is imported only when its env is made).
"""

from envs import alfworld, babyai, searchqa, webshop

for _module in (babyai, webshop, searchqa, alfworld):
    _module.register_envs()
