"""Judging loop: pairs each turn with its next state and scores it with pluggable judges."""
