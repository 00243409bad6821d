"""Test doubles the tests and the CPU rehearsals share (never shipped in the wheel)."""
