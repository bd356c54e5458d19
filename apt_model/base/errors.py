"""Exceptions raised by apt_model.

Every error names the bad value and the valid ones, so a user can fix their call or
environment without reading our source.
"""


__all__ = ["VBError", "ConfigError", "DeviceSelectionError", "FigureUnavailable", "DistributedError",
           "USER_ERRORS", "USAGE_EXIT", "one_line", "program_name", "report_user_error"]


class VBError(Exception):
    """Base class of every apt_model error."""


class ConfigError(VBError, ValueError):
    """An invalid setting: bad argument to ``enable()``, bad environment variable, bad file."""


class DeviceSelectionError(VBError, RuntimeError):
    """The requested device (``VB_DEVICE``, ``device=``) does not exist or is not usable here."""


class FigureUnavailable(VBError, RuntimeError):
    """A memory or device figure cannot be read on this device; the message says why."""


class DistributedError(VBError, RuntimeError):
    """A multi-process setup that cannot work here (a backend with no devices to serve, a model the
    switch pages being handed to DDP/FSDP/DataParallel); the message says what to do instead."""


#: The errors every entry point (the main job, ``apt-vb``, activation at import) reports as one
#: line with exit status 2: something the user typed (a flag, a variable, a ``.vbrc`` value) is wrong.
USER_ERRORS = (ConfigError, DeviceSelectionError)

#: Exit status of an entry point for a usage or configuration error (as argparse uses).
USAGE_EXIT = 2


def one_line(err: BaseException | str) -> str:
    """The error's message (or a text) on one line (line breaks become ``"; "``)."""
    parts = [p.strip() for p in str(err).splitlines() if p.strip()]
    return "; ".join(parts) or type(err).__name__


def program_name(argv0: str | None = None) -> str:
    """The command the user ran, for ``<prog>: error: ...`` lines: the script's file name,
    ``python -m <package>`` for ``-m``, ``python`` for ``-c`` and interactive sessions."""
    import os
    import sys

    arg = sys.argv[0] if argv0 is None and sys.argv else (argv0 or "")
    orig = list(getattr(sys, "orig_argv", []) or [])
    if arg == "-m" or (argv0 is None and "-m" in orig[1:2]):  # while python -m imports its module
        i = orig.index("-m") if "-m" in orig else -1
        return f"python -m {orig[i + 1]}" if 0 <= i < len(orig) - 1 else "python -m"
    base = os.path.basename(arg)
    if base == "__main__.py":
        return f"python -m {os.path.basename(os.path.dirname(arg))}"
    if not base or base == "-c":
        return "python"
    return base


def report_user_error(err: BaseException, prog: str | None = None, file=None, message: str | None = None) -> int:
    """Print ``err`` for the user as one line, ``<prog>: error: <message>``, on stderr.

    With ``VB_LOG_LEVEL=DEBUG`` the traceback is printed first (the line stays last).

    Args:
        err: the error (usually one of :data:`USER_ERRORS`, whose messages name what the user
            typed and the valid forms).
        prog: the command's name; default :func:`program_name`.
        file: the stream (default ``sys.stderr``).
        message: the text to print instead of the error's own (made one line as well).

    Returns:
        :data:`USAGE_EXIT` (2), the exit status entry points use for it.
    """
    import sys

    from apt_model.base.settings import LOG_LEVEL, read_env

    stream = file if file is not None else sys.stderr
    try:
        debug = (read_env(LOG_LEVEL) or (None,))[0] == "DEBUG"
    except ConfigError:  # a bad VB_LOG_LEVEL is reported elsewhere; here it means no traceback
        debug = False
    if debug:
        import traceback

        traceback.print_exception(type(err), err, err.__traceback__, file=stream)
    text = one_line(message if message is not None else err)
    print(f"{prog or program_name()}: error: {text}", file=stream, flush=True)
    return USAGE_EXIT


# Tracebacks and pickles name the documented public path (apt_model.errors re-exports these).
for _cls in (VBError, ConfigError, DeviceSelectionError, FigureUnavailable, DistributedError):
    _cls.__module__ = "apt_model.errors"
del _cls
