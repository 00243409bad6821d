"""Study code: diagnostics that measure the method, never user-facing algorithms of the paper.

:mod:`agentopsd.study.oracle` feeds AgentOPSD's recursion a ground-truth turn value instead of the
teacher-student gap, to measure how far the bounded multiplier can move learning when the evidence is right.
"""
