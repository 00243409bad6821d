"""The user tools around a run: export, evaluation only, the report and the memory plan."""
