"""The project's user errors, and how any exception becomes the one line a user reads.

The entry points print a user error as `error: <one_line(error)>` and exit with status 2, without a
traceback. Our own errors (the three below, transformer.checkpoint.CheckpointError and
transformer.distributed.PeerFailure) are written as one line already; the messages of the libraries below us
are not: Hydra's run to several lines with the useful part in the cause, torch's to paragraphs with the
reason on a later line, datasets' embed newlines. `one_line` is the one place that knows how to shorten each
of them, used by the entry points and by every `raise ... from None` that quotes a library's message.

They live here, in the lower package, because data/ raises them too and imports nothing from transformer/.
"""

from __future__ import annotations


class DataError(Exception):
    """A user error in the data setup (files, config keys, vocabulary): one line that names the problem and
    what to do."""


class ConfigError(ValueError):
    """A configuration the user must change; the message is one line that says how."""


class WriteError(Exception):
    """A file that had to be written could not be (disk full, unwritable directory): one line naming the
    file, the reason and the fix; whatever the file held before is intact."""


def one_line(error: BaseException, *, limit: int | None = None) -> str:
    """The first meaningful line of `error`'s message, with the detail its library puts elsewhere; at most
    `limit` characters (for a library's message quoted inside one of ours)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    text = lines[0]
    cause = error.__cause__
    # Hydra: "Error merging override k=v" holds no reason; its cause (OmegaConf) names the key and the type.
    if text.startswith("Error merging override ") and cause is not None and str(cause).strip():
        text = (f"{text.removeprefix('Error merging override ')} is invalid: {str(cause).strip().splitlines()[0]}; "
                "give a value of the key's type (transformer/config.py lists every key with its type)")
    if ("Could not override" in text or "Key '" in text and "not in struct" in text) and "config.py" not in text:
        text += " (check the key's spelling; transformer/config.py lists every key)"
    if "Could not find" in text:  # a config group option that does not exist: Hydra lists the others below
        options = [line for line in lines[1:] if not line.startswith(("Config search path", "provider="))]
        if options:
            text += " — " + " ".join(options).replace("Available options in", "options in")
    # torch.load(weights_only=True): the first line is advice; the reason is the "WeightsUnpickler error" line.
    reason = next((line for line in lines[1:] if "unsupported" in line.lower()), None)
    if reason is not None:
        text = f"{text.split('. ')[0].rstrip('.')}: {reason.split('error: ', 1)[-1]}"
    if len(text) < 12:  # e.g. KeyError('101'): the type says more than the message
        text = f"{type(error).__name__} {text}".strip()
    return text if limit is None or len(text) <= limit else text[: limit - 3] + "..."
