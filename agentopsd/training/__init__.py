"""The Lightning training glue: the module, its objective and update loop, strategies, data, evaluation."""
