"""SearchQA: the environment class (env.py), its tasks and data, expert and text rendering."""
