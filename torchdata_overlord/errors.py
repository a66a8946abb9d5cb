"""Exceptions raised by torchdata_overlord; each message names the offending input and a fix."""


def a_type(value_or_name) -> str:
    """``"an int"``, ``"a str"``: a type's name (a value's type, or a name given as a string) with its
    article, for messages (``f"got a {type(x).__name__}"`` read "got a int")."""
    name = value_or_name if isinstance(value_or_name, str) else type(value_or_name).__name__
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


class OverlordError(Exception):
    """Base class for every error this library raises on purpose."""


class ConfigError(OverlordError, ValueError):
    """A configuration argument is invalid (mesh sizes, weights, axis or method names...)."""


class OversizeSampleError(OverlordError, ValueError):
    """A sample does not fit the token budget and the oversize policy is ``"error"``."""


class BufferShortageError(OverlordError, RuntimeError):
    """A source's read buffer holds fewer samples than the mixing schedule asks for this step."""
