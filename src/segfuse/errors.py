"""User-facing errors: each says what went wrong and what to do about it."""

from __future__ import annotations


class SegfuseError(Exception):
    """Base class for errors caused by input or environment, not by a bug.

    The CLI prints these as one line (message plus hint) without a traceback.
    """

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return f"{self.message} ({self.hint})" if self.hint else self.message


class UnknownModelError(SegfuseError):
    """A member name is neither a known model nor an existing file."""


class ModelFileError(SegfuseError):
    """A model file is missing, unreadable, corrupt or not yet prepared."""


class MemberLoadError(SegfuseError):
    """A backend could not load a member."""


class InvalidRequestError(SegfuseError):
    """Bad generation options or an empty prompt; ``field`` names the option at fault, where one is."""

    def __init__(self, message: str, hint: str = "", field: str | None = None) -> None:
        super().__init__(message, hint)
        self.field = field


class PromptTooLongError(InvalidRequestError):
    """The prompt (plus the answer budget) does not fit a member's context window."""


class MemberFailedError(SegfuseError):
    """A member failed while answering and no member is left to finish the answer."""


class NoFreeSlotError(MemberFailedError):
    """A member held no free session slot within its deadline (every slot stayed taken)."""
