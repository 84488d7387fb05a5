"""Errors a user can act on. The CLI prints them as one line and exits non-zero."""


def first_line(error: BaseException | str, limit: int = 300) -> str:
    """The first line of an error (or text) for a one-line message, at most `limit` characters.

    A KeyError's text is its key, quoted; an error without text is named by its type, so the
    message never ends in "()".
    """
    if isinstance(error, KeyError) and error.args:
        return repr(error.args[0])[:limit]
    text = str(error).strip()
    if not text:
        return "" if isinstance(error, str) else type(error).__name__
    return " ".join(text.splitlines()[0].split())[:limit]


class SpecctlError(Exception):
    """A known failure with a message that says what, where, and what to do next."""

    exit_code = 1


class UsageError(SpecctlError):
    """What the user typed is wrong: a flag's value, flags that do not go together, a path that
    does not exist. Exit code 2, as for a bad recipe (docs/troubleshooting.md)."""

    exit_code = 2


class RecipeError(UsageError):
    """The recipe (or a --set override) is invalid; exit code 2 like any usage error."""


class ForeignDirError(UsageError):
    """A stage was pointed (by a run name, an --output) at a directory holding files it did not
    write; it refuses to replace or delete them. Exit code 2: the path chosen is the mistake."""


class DataError(SpecctlError):
    """Conversation data is missing, empty or malformed."""


class MissingDataError(UsageError, DataError):
    """The data file a recipe or flag names does not exist: bad input (exit 2), and a DataError to
    the code that handles data errors."""


class VerifierError(SpecctlError):
    """The verifier cannot be found or loaded."""


class FeatureStoreError(SpecctlError):
    """The feature store is corrupt, incomplete or does not match the recipe."""


class CheckpointError(SpecctlError):
    """A training checkpoint is missing, corrupt (checksum mismatch) or does not fit the drafter."""
