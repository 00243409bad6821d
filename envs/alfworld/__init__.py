"""ALFWorld household tasks in text, on the real ``alfworld`` engine (``agentopsd/ALFWorld-v0``).

env.py the environment; engine.py the engine and its handcoded expert (imported lazily: the
``[alfworld]`` extra); data.py where games come from (the official release or generated scenes);
rooms.py and scenes.py the generated scenes; generate.py writes them ahead of time
(``python -m agentopsd.envs.alfworld.generate``).
"""
