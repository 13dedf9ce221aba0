"""The one user-facing error type of the tools."""


class ToolError(Exception):
    """Bad user input (a file, a field, an argument). The message names the file and the field,
    the value found and the value expected. The command-line tools print it and exit with status 1."""
