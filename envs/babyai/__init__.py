"""BabyAI levels as text (``agentopsd/BabyAI-<Level>-v0``).

env.py the environment; levels.py the level ladder and minigrid helpers; custom.py levels of our
own; expert.py minigrid's BabyAIBot kept in step with the env; text.py the egocentric view as
sentences; view.py the fast egocentric view it reads.
"""
