"""`rollplex run` of a one-node cluster of several GPUs from the one command: it compiles and checks the spec
first, then starts one process per GPU on this machine, each `python -m rollplex run` with the same arguments,
through torch's elastic launcher as `torchrun --standalone --nproc-per-node N` would (a rendezvous on a free
local port, no restarts).

What the command prints stays the ranks' own: their progress, their one-line errors (the spec's are found before any
process starts; one every rank meets, a flag's, rank 0 alone says), the summary rank 0 writes. The launcher's own
logging (its warnings, and the failure report torchrun prints as a traceback) is silenced; a rank that a signal
killed, which says nothing itself, gets one line naming it. The command exits with the first failed rank's code (128
+ the signal's number for a rank a signal ended), 0 when every rank finished. A stop signal (Ctrl-C, SIGTERM,
SIGHUP) reaches the ranks, which save their last step as a one-process run does; they are killed only after
SAVE_SECONDS (torchrun's default gives them 30). Several nodes still need torchrun on each node
(`report.tables.launch_command`).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import uuid
from dataclasses import fields

from rollplex.errors import RunFailed

LAUNCHER_LOGGERS = ("torch.distributed.elastic", "torch.distributed.run", "torch.distributed.launcher")  # prefixes
SAVE_SECONDS = 600  # after a stop signal, how long the ranks have to save their last step before they are killed


def launches_here(nodes: int, gpus_per_node: int) -> bool:
    """Whether `rollplex run` starts the spec's processes itself: one node of several GPUs, and this process is
    not one a launcher started (torchrun sets WORLD_SIZE)."""
    return nodes == 1 and gpus_per_node > 1 and "WORLD_SIZE" not in os.environ


def launch_local(processes: int, argv: list[str]) -> int:
    """Runs `python -m rollplex <argv>` as `processes` ranks on this machine; the exit code (module docstring).
    Each rank keeps one CPU thread for torch's host ops unless OMP_NUM_THREADS says otherwise (as torchrun)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(SAVE_SECONDS))  # read where the config has no field
    grace = {"shutdown_timeout": SAVE_SECONDS} if "shutdown_timeout" in {f.name for f in fields(LaunchConfig)} else {}
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=processes, run_id=str(uuid.uuid4()),
        rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, **grace,
    )  # fmt: skip
    loggers = [  # each module of the launcher logs through a logger of its own, some with a level set
        logging.getLogger(name) for name in logging.root.manager.loggerDict if name.startswith(LAUNCHER_LOGGERS)
    ]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        elastic_launch(config, sys.executable)("-m", "rollplex", *argv)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        return exit_code(rank, processes, failure.exitcode)
    except SignalException as e:  # this process was signalled: the launcher stopped the ranks, and they said so
        return 128 + int(e.sigval)
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)
    return 0


def exit_code(rank: int, processes: int, code: int) -> int:
    """The command's exit code for a rank that exited with `code` (negative: ended by that signal). A signal's
    end raises RunFailed naming the rank (the rank could say nothing): the code is then 128 + its number."""
    if code >= 0:
        return code
    try:
        name = signal.Signals(-code).name
    except ValueError:  # a number no name of this platform's has
        name = f"signal {-code}"
    why = " (most often the out-of-memory killer)" if -code == signal.SIGKILL else ""
    error = RunFailed(f"rank {rank} of {processes} was ended by {name}{why}; the other ranks were stopped")
    error.exit_code = 128 - code
    raise error
