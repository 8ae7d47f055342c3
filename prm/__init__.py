"""Judging loop: pairs each turn with its next state and scores it with pluggable judges.

`liveloop.prm.main.run(settings, replay=None)` is what `liveloop judge` runs. Judges implement the
`liveloop.prm.judges.Judge` protocol and are registered in the `liveloop.judges` entry-point group;
`liveloop.prm.service.JudgeService` is the loop of one process, `liveloop.prm.pairing` its Redis state.
"""
