"""A run's life: from the command line (train.py) through validation and resume to its folder."""
