"""The one error type the quantizer raises for problems a user can cause or fix."""


class QuantizeError(Exception):
    """A bad input, an unsupported model or a full disk; the message is one line that says what to do."""
