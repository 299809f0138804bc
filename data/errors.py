"""The one exception type `data/` raises for user errors."""


class DataError(Exception):
    """A user error in the data setup (files, config keys, vocabulary).

    `str(error)` is a single line that names the problem and what to do; the entry points print it as
    `error: <message>` and exit with status 2, without a traceback.
    """
