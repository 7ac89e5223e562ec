"""Errors a user can cause. The CLI turns each into one line and an exit code; nothing else is caught."""

from __future__ import annotations

MAX_LINE = 300  # characters of an error's one line: a value a spec gives is echoed cut to fit


class SpecError(ValueError):
    """The spec is invalid (bad YAML, unknown key, wrong value, impossible graph). Exit code 2.

    `where` is the key path (`parallel.train_tp`), `line` the YAML line when known, `fix` how to repair it.
    """

    exit_code = 2

    def __init__(self, where: str, problem: str, fix: str = "", *, line: int | None = None, file: str = ""):
        self.where, self.problem, self.fix, self.line, self.file = where, problem, fix, line, file
        super().__init__(self.one_line())

    def one_line(self) -> str:
        """`file:line: key: problem; fix`, or only `problem; fix` for one of no spec key or file (a flag's)."""
        place = self.file or "spec"
        if self.line is not None:
            place += f":{self.line}"
        key = f" {self.where}:" if self.where else ""
        if not (self.file or self.where or self.line is not None):
            place, key = "", ""
        fix = f"; {self.fix}" if self.fix else ""
        head = f"{place}:{key} " if place else ""
        room = max(MAX_LINE - len(f"{head}{fix}"), 40)
        problem = self.problem if len(self.problem) <= room else self.problem[: room - 3] + "..."
        return f"{head}{problem}{fix}"

    def located(self, file: str, line: int | None) -> SpecError:
        return SpecError(self.where, self.problem, self.fix, line=self.line if line is None else line, file=file)


class PlanDoesNotFit(RuntimeError):
    """The compiled plan exceeds HBM or host memory. Exit code 1. The message names phase, peak and remedies."""

    exit_code = 1


class RunFailed(RuntimeError):
    """The run met a condition of its machine it cannot go on with (a full disk while checkpointing). Exit code 1.
    The message says what was kept."""

    exit_code = 1


class Stopped(KeyboardInterrupt):
    """A stop signal (`executors.signals`: SIGINT, SIGTERM, SIGHUP) ended the command; exit code 128 + its number, as
    a shell reports a process its signal ended. `message` says what was kept; `said` False: another rank says it,
    and this one prints nothing."""

    def __init__(self, signum: int, message: str = "interrupted", said: bool = True) -> None:
        super().__init__(message)
        self.signum, self.exit_code, self.said = signum, 128 + signum, said
