"""User-facing errors: the CLI prints their message on one line and exits non-zero, no traceback."""


class UserError(Exception):
    """Bad input from the user: the message says what is wrong and how to fix it."""
