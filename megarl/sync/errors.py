"""The error every weight-sync step raises."""


class SyncError(RuntimeError):
    """A weight sync step failed; the message names the bucket (owner, tensors) or the step."""
