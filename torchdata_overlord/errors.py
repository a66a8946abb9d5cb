"""Exceptions raised by torchdata_overlord; each message names the offending input and a fix."""


class OverlordError(Exception):
    """Base class for every error this library raises on purpose."""


class ConfigError(OverlordError, ValueError):
    """A configuration argument is invalid (mesh sizes, weights, axis or method names...)."""


class OversizeSampleError(OverlordError, ValueError):
    """A sample does not fit the token budget and the oversize policy is ``"error"``."""


class BufferShortageError(OverlordError, RuntimeError):
    """A source's read buffer holds fewer samples than the mixing schedule asks for this step."""
