"""The kind of expected error that every rank raises alike.

Expected errors (a flag, a file, a combination a user got wrong) are ValueErrors (and OSErrors
of files) whose message is one line naming the flag or file; the entry points turn them into
that line and exit status 2 (megatron.training.arguments.errors). An `AgreedError` is raised with the
same message on every rank (found before any process group exists, or agreed on through a
collective), so rank 0 alone needs to print it.
"""


class AgreedError(ValueError):
    """An expected error raised alike on every rank."""
