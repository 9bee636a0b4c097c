"""Network and server faults of a push: which are worth retrying (:func:`retryable`), which mean DEST cannot be
reached at all (:func:`unreachable`), and the one line that says what happened and what to do
(:func:`describe_fault`, :func:`fault_error`). The wording of every DEST fault comes from here.
"""

from __future__ import annotations

import errno
import socket
from typing import NamedTuple

from zckpt.errors import EndpointUnreachable, InvalidArgument, NetworkError, PushInterrupted, ZckptError

#: errnos that repeat however often one asks: bad request, no permission, no such file, disk full, read-only
_PERMANENT_ERRNOS = (errno.EINVAL, errno.EACCES, errno.EPERM, errno.ENOENT, errno.ENOSPC, errno.EROFS,
                     errno.ENOTDIR, errno.EISDIR, errno.EEXIST, errno.ENAMETOOLONG, errno.EDQUOT)
#: exception class names (botocore and friends, matched by name so that no backend need be imported)
_PERMANENT_NAMES = ("NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError", "ProfileNotFound",
                    "NoRegionError", "ParamValidationError", "InvalidS3AddressingStyleError",
                    "UnknownSignatureVersionError", "RepositoryNotFoundError", "GatedRepoError",
                    "RevisionNotFoundError", "EntryNotFoundError", "LocalTokenNotFoundError")
_PERMANENT_CODES = ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "NoSuchBucket",
                    "AllAccessDisabled", "InvalidBucketName", "AccountProblem", "ExpiredToken", "InvalidToken")


def retryable(exc: BaseException) -> bool:
    """Transient (connection lost, timeout, server error 5xx, throttling 408/429) rather than a refusal that will
    repeat: an unknown URL scheme, a missing backend (s3fs), missing or wrong credentials, no permission, no such
    bucket or file, a full or read-only disk, a bad argument. Walks the ``__cause__``/``__context__`` chain, since
    zckpt's StorageError wraps the backend's exception."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, (ImportError, ValueError, TypeError, NotImplementedError, PermissionError,
                            FileNotFoundError, FileExistsError, IsADirectoryError, NotADirectoryError,
                            InvalidArgument, PushInterrupted)):
            return False  # (zckpt's own StorageError is an OSError, not a ValueError: its cause decides)
        if type(exc).__name__ in _PERMANENT_NAMES:
            return False
        status = getattr(getattr(exc, "response", None), "status_code", None)
        if isinstance(status, int) and 400 <= status < 500 and status not in (408, 429):
            return False
        response = getattr(exc, "response", None)
        code = response.get("Error", {}).get("Code") if isinstance(response, dict) else None
        if code in _PERMANENT_CODES:
            return False
        if isinstance(exc, OSError) and exc.errno in _PERMANENT_ERRNOS:
            return False
        exc, seen = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__), seen + 1
    return True


class Fault(NamedTuple):
    what: str  # what happened, after the server's name: "unreachable (connection refused)"
    todo: str  # what the user should do
    unreachable: bool  # the server cannot be reached at all (push gives up on DEST: nothing more can get there)


_AGAIN = "run again when it is back"
#: (what the exception chain shows, what zckpt says, what the user should do, connection-level): first match wins
_FAULTS = (
    (("gaierror", "Name or service not known", "nodename nor servname", "Temporary failure in name resolution",
      "getaddrinfo failed", "No address associated with hostname", "ClientConnectorDNSError"),
     "unreachable (host name not resolved)", "check the host name in the endpoint URL and the network", True),
    (("ConnectionRefusedError", "Connection refused", "Connect call failed"),
     "unreachable (connection refused)", f"check that it runs at that address; {_AGAIN}", True),
    (("No route to host", "Network is unreachable", "EHOSTUNREACH", "ENETUNREACH"),
     "unreachable (no route to the host)", f"check the network; {_AGAIN}", True),
    (("ConnectTimeout", "Connect timeout", "connect timed out"),
     "unreachable (connect timed out)", f"check the endpoint and any firewall; {_AGAIN}", True),
    (("EndpointConnectionError", "Could not connect to the endpoint", "ClientConnectorError", "ConnectError"),
     "unreachable (cannot connect)", f"check the endpoint and the network; {_AGAIN}", True),
    (("ReadTimeoutError", "Read timeout", "ReadTimeout", "timed out"),
     "stalled (no answer within the read timeout)", "retry when it answers again", False),
    (("TooManyRequests", "429 Too Many", "(429)"), "throttled the upload (429 Too Many Requests)",
     "retry later, or with fewer --workers", False),
    (("SlowDown", "reduce your request rate", "Throttl"),
     "throttled the upload (503 SlowDown)", "retry later, or with fewer --workers", False),
    (("ConnectionClosedError", "ConnectionResetError", "Connection was closed", "reset by peer", "ProtocolError",
      "RemoteDisconnected", "BrokenPipeError", "IncompleteRead", "Broken pipe"),
     "dropped the connection", "retry when it is stable again", False),
    (("InternalError", "ServiceUnavailable", "BadGateway", "GatewayTimeout", "(500)", "(502)", "(503)", "(504)"),
     "answered with a server error (HTTP 5xx)", "retry when it is healthy again", False),
)
#: errnos of a connection that could not be made at all (the first four entries of _FAULTS, by number)
_UNREACHABLE_ERRNOS = {errno.ECONNREFUSED: 1, errno.EHOSTUNREACH: 2, errno.ENETUNREACH: 2}
RESUME_NOTE = "finished files will not be resent"


def cause_chain(exc: BaseException) -> list[BaseException]:
    out, seen = [], 0
    while exc is not None and seen < 8:
        out.append(exc)
        exc, seen = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__), seen + 1
    return out


def describe_fault(exc: BaseException) -> Fault | None:
    """``(what happened, what to do, connection-level)`` for a network or server fault in ``exc``'s chain, else
    None (a refusal or a local error keeps its own message)."""
    chain = cause_chain(exc)
    if any(isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT) for e in chain):
        return None
    if any(isinstance(e, socket.gaierror) for e in chain):
        return Fault(*_FAULTS[0][1:])
    for e in chain:
        if isinstance(e, OSError) and not isinstance(e, socket.gaierror) and e.errno in _UNREACHABLE_ERRNOS:
            return Fault(*_FAULTS[_UNREACHABLE_ERRNOS[e.errno]][1:])
    text = " | ".join(f"{type(e).__name__}: {e}" for e in chain)
    if any(isinstance(e, OSError) and e.errno == errno.EBUSY for e in chain):  # s3fs's word for SlowDown
        text += " SlowDown"
    for needles, *fault in _FAULTS:
        if any(n in text for n in needles):
            return Fault(*fault)
    return None


def unreachable(exc: BaseException) -> bool:
    """Whether ``exc`` says the server could not be reached at all (connection refused, host name not resolved,
    no route, connect timeout), as opposed to a server that answered badly (throttling, 5xx) or a connection
    that broke once made."""
    if isinstance(exc, EndpointUnreachable):
        return True
    fault = describe_fault(exc)
    return fault is not None and fault.unreachable


def fault_error(server: str, fault: Fault, doing: str, url: str) -> NetworkError:
    """The one-line error for ``fault`` of ``server`` while ``doing`` something to ``url``."""
    cls = EndpointUnreachable if fault.unreachable else NetworkError
    return cls(f"{server} {fault.what} while {doing}", path=url, hint=f"{fault.todo}; {RESUME_NOTE}")


def one_line(exc: BaseException, what: str) -> str:
    """``exc`` as one line without its hint, naming ``what`` unless it names its own path."""
    if isinstance(exc, ZckptError):
        text = " ".join(exc.message.split())
        path = exc.path or what
        return text if text.startswith(path) else f"{path}: {text}"
    return f"{what}: {' '.join(str(exc).split())}"
