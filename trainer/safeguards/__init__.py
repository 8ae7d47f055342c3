"""The learning-safety layer: the promotion gate, the served-quality watch, their decisions.

- `guards.Safeguards`: what the trainer asks for a decision after each update and between
  updates;
- `decisions`: `Decision` (serve / refuse / roll back, the version to go on from, the next
  update's learning-rate scale, the checkpoints to protect) and `Rollback`;
- `gate.PromotionGate`: probes a candidate's weights and compares them with the serving
  version's and version 0's;
- `probing`: answering, judging and measuring a probe set;
- `sources`: where probes come from (`trainer.gate.probe_source`);
- `watch.ServedWatch`: judges what each live version actually served.
"""

from liveloop.trainer.safeguards.decisions import Decision, Rollback, Verdict

__all__ = ["Decision", "Rollback", "Verdict"]
