"""Errors a user can act on. The CLI prints them as one line and exits non-zero."""


class SpecctlError(Exception):
    """A known failure with a message that says what, where, and what to do next."""

    exit_code = 1


class RecipeError(SpecctlError):
    """The recipe (or a --set override) is invalid; exit code 2 like any usage error."""

    exit_code = 2


class DataError(SpecctlError):
    """Conversation data is missing, empty or malformed."""


class VerifierError(SpecctlError):
    """The verifier cannot be found or loaded."""


class FeatureStoreError(SpecctlError):
    """The feature store is corrupt, incomplete or does not match the recipe."""


class CheckpointError(SpecctlError):
    """A training checkpoint is missing, corrupt (checksum mismatch) or does not fit the drafter."""
