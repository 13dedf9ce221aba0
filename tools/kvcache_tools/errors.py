"""The one user-facing error type of the tools."""
import signal
import sys


class ToolError(Exception):
    """Bad user input (a file, a field, an argument). The message names the file and the field,
    the value found and the value expected. The command-line tools print it and exit with status 1."""


def one_line(msg: str) -> str:
    return " ".join(str(msg).split("\n"))


def _terminate(signum, frame):
    raise KeyboardInterrupt  # unwinds like Ctrl-C: atomic outputs delete their temp files


def run_cli(action, done_message: str) -> int:
    """Runs action(); on ToolError prints 'error: <message>' (one line) to stderr and returns 1, else
    prints done_message and returns 0. The tools' main() functions end with this.

    Ctrl-C and SIGTERM unwind the action (so every temp file is removed) and return 130; an OSError
    that escaped the tool's own checks (a file vanishing mid-run, a full disk) is reported in one
    line naming the file and returns 1, never as a traceback."""
    old = None
    try:
        old = signal.signal(signal.SIGTERM, _terminate)
    except ValueError:  # not the main thread: leave signals alone
        pass
    try:
        action()
    except ToolError as e:
        print(f"error: {one_line(e)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("error: interrupted (no half-written file left behind)", file=sys.stderr)
        return 130
    except OSError as e:
        where = f"{e.filename}: " if e.filename else ""
        print(f"error: {where}{one_line(e.strerror or e)}", file=sys.stderr)
        return 1
    finally:
        if old is not None:
            signal.signal(signal.SIGTERM, old)
    print(done_message)
    return 0
