"""The training stage: `specctl train`, from a feature store (or the verifier in the loop) to
checkpoints of a drafter.

loop.py is the one loop every algorithm trains in (sources, steps, validation, checkpoints,
metrics.jsonl); loader.py the micro-batches a rank reads; tracking.py the experiment trackers
fed from metrics.jsonl; curves.py the learning curves read back from it; epochs.py `--epochs N`
as steps. What training shares with another stage stays below it (specctl.checkpoint is read by
export, specctl.optim and specctl.distributed by the resource plan), since no stage imports
another. The entry points are re-exported here: `from specctl.train import run_training`.
"""

from specctl.train.loop import TrainSummary, run_training, train

__all__ = ["TrainSummary", "run_training", "train"]
