"""Ctrl-C and SIGTERM as a KeyboardInterrupt, and what an error means once one came.

The CLI's handler raises KeyboardInterrupt where the main thread is, so the same cleanup runs for a
SLURM time limit as for Ctrl-C (vLLM process groups stopped, partial results kept). Python runs the
handler between bytecodes, and that can be inside native code calling back into Python: there the
KeyboardInterrupt becomes that code's own error. Seen in `train`: a SIGTERM during a safetensors
slice read came out as `ValueError: could not determine the shape of object type
'torch.storage.UntypedStorage'`, a traceback and exit 1 instead of exit 130 and the resume line. So
once a signal has come, any error is the interruption (`signalled`).
"""

from __future__ import annotations

received: list[int] = []  # SIGINT / SIGTERM received, in order (the CLI clears it per command)


def handler(signum: int, frame: object) -> None:
    """The CLI's SIGINT / SIGTERM handler: record the signal, unwind like Ctrl-C."""
    received.append(signum)
    raise KeyboardInterrupt


def signalled() -> bool:
    """Whether a signal came: an error raised since is its doing, whatever its type."""
    return bool(received)
