"""Judging loop: pairs each turn with its next state and scores it with pluggable judges.

`prm.main.run(settings, replay=None)` is what `liveloop judge` runs. Judges implement the
`prm.judges.Judge` protocol and are registered in the `liveloop.judges` entry-point group;
`prm.service.JudgeService` is the loop of one process, `prm.pairing` its Redis state.
"""
