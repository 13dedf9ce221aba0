"""The one user-facing error type of the tools."""


class ToolError(Exception):
    """Bad user input (a file, a field, an argument). The message names the file and the field,
    the value found and the value expected. The command-line tools print it and exit with status 1."""


def run_cli(action, done_message: str) -> int:
    """Runs action(); on ToolError prints 'error: <message>' to stderr and returns 1, else prints
    done_message and returns 0. The tools' main() functions end with this."""
    import sys
    try:
        action()
    except ToolError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(done_message)
    return 0
