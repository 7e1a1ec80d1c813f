"""Preemption notices: something says "this device goes away soon" before it does.

A :class:`NoticeSource` is polled at every step boundary; the first notice wins. Sources:

- :class:`SignalNotice`: SIGTERM (what a provider's agent, Kubernetes or ``kill`` sends first).
- :class:`FileNotice`: a file appears (a sidecar that talks to a provider can create it).
- :class:`HttpNotice`: a cloud metadata endpoint, polled in a background thread with a timeout
  (:func:`aws_spot_notice`, :func:`gcp_preemption_notice`); any other endpoint with a ``parse`` function.

Add a source by implementing ``start()``, ``poll()`` and ``stop()``; none may block for long.
"""

from __future__ import annotations

import logging
import signal
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Protocol, runtime_checkable

from starverse.runtime.callbacks import Notice

log = logging.getLogger(__name__)

__all__ = ["FileNotice", "HttpNotice", "Notice", "NoticeSource", "NoticeWatcher", "SignalNotice", "answers_ok",
           "answers_true", "aws_spot_notice", "gcp_preemption_notice"]


@runtime_checkable
class NoticeSource(Protocol):
    """Something that can warn of a preemption."""

    def start(self) -> None:
        """Begin watching (install a handler, start a poller). Called once per rank process."""

    def poll(self) -> Notice | None:
        """The notice if one arrived, else None. Must return quickly."""

    def stop(self) -> None:
        """Stop watching and restore what ``start`` changed."""


class SignalNotice:
    """A signal (default SIGTERM) is a notice: record it instead of dying, stop at the step boundary.

    Must be started from the main thread (Python delivers signals there). A second signal of the same
    kind while the first is being handled is ignored: the emergency checkpoint is already on its way.
    """

    def __init__(self, signum: int = signal.SIGTERM):
        """Watch ``signum``."""
        self.signum = signum
        self._notice: Notice | None = None
        self._previous: object = None

    def _handler(self, signum: int, frame: object) -> None:
        if self._notice is None:
            self._notice = Notice(source=signal.Signals(signum).name, detail=f"received {signal.Signals(signum).name}")

    def start(self) -> None:
        """Install the handler (main thread only)."""
        self._previous = signal.signal(self.signum, self._handler)

    def poll(self) -> Notice | None:
        """The signal's notice, if it arrived."""
        return self._notice

    def stop(self) -> None:
        """Restore the previous handler."""
        if self._previous is not None:
            signal.signal(self.signum, self._previous)  # type: ignore[arg-type]
            self._previous = None


class FileNotice:
    """A file appearing is a notice (its content, if any, is the detail)."""

    def __init__(self, path: str | Path):
        """Watch ``path``."""
        self.path = Path(path)

    def start(self) -> None:
        """Nothing to install."""

    def poll(self) -> Notice | None:
        """A notice once the file exists."""
        if not self.path.exists():
            return None
        try:
            detail = self.path.read_text(errors="replace")[:200].strip()
        except OSError:
            detail = ""
        return Notice(source=str(self.path), detail=detail)

    def stop(self) -> None:
        """Nothing to undo."""


class HttpNotice:
    """Poll a metadata endpoint every ``interval_s`` in a daemon thread; ``parse(status, body)`` says
    whether the response is a notice. Network errors and timeouts are logged once and retried."""

    def __init__(
        self,
        url: str,
        parse: Callable[[int, str], bool],
        *,
        headers: dict[str, str] | None = None,
        interval_s: float = 5.0,
        timeout_s: float = 1.0,
    ):
        """Watch ``url`` (GET with ``headers``), every ``interval_s``, each request bounded by ``timeout_s``."""
        self.url = url
        self.parse = parse
        self.headers = dict(headers or {})
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._notice: Notice | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._warned = False

    # pickled into every rank process (the local and the Ray launcher): thread and event are made there
    def __getstate__(self) -> dict[str, object]:
        state = dict(self.__dict__)
        state.update(_stop=None, _thread=None, _notice=None)
        return state

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        self._stop = threading.Event()

    def check_once(self) -> Notice | None:
        """One request; the notice if the endpoint announces one."""
        req = urllib.request.Request(self.url, headers=self.headers)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                status, body = resp.status, resp.read(4096).decode(errors="replace")
        except urllib.error.HTTPError as e:
            status, body = e.code, ""
        except (urllib.error.URLError, OSError) as e:
            if not self._warned:
                log.warning("preemption endpoint %s unreachable (%s); still polling", self.url, e)
                self._warned = True
            return None
        if self.parse(status, body):
            return Notice(source=self.url, detail=body.strip()[:200])
        return None

    def _loop(self) -> None:
        while not self._stop.is_set() and self._notice is None:
            self._notice = self.check_once()
            self._stop.wait(self.interval_s)

    def start(self) -> None:
        """Start the polling thread."""
        self._thread = threading.Thread(target=self._loop, name="preemption-poll", daemon=True)
        self._thread.start()

    def poll(self) -> Notice | None:
        """The notice, once the endpoint announced one."""
        return self._notice

    def stop(self) -> None:
        """Stop the polling thread."""
        self._stop.set()


def answers_ok(status: int, body: str) -> bool:
    """``parse`` for an endpoint that answers 200 once a preemption is scheduled (404 or an error before)."""
    return status == 200


def answers_true(status: int, body: str) -> bool:
    """``parse`` for an endpoint whose 200 body turns ``TRUE`` (GCP's ``instance/preempted``)."""
    return status == 200 and body.strip().upper() == "TRUE"


def aws_spot_notice(base: str = "http://169.254.169.254", *, interval_s: float = 5.0,
                    timeout_s: float = 1.0) -> HttpNotice:
    """AWS EC2 spot interruption notice (about 2 minutes ahead): ``spot/instance-action`` answers 200
    with a JSON action once the instance is scheduled to stop, 404 before."""
    return HttpNotice(f"{base}/latest/meta-data/spot/instance-action", answers_ok, interval_s=interval_s,
                      timeout_s=timeout_s)


def gcp_preemption_notice(base: str = "http://metadata.google.internal", *, interval_s: float = 5.0,
                          timeout_s: float = 1.0) -> HttpNotice:
    """GCP preemption notice (about 30 s ahead): ``instance/preempted`` turns ``TRUE``."""
    return HttpNotice(
        f"{base}/computeMetadata/v1/instance/preempted",
        answers_true,
        headers={"Metadata-Flavor": "Google"},
        interval_s=interval_s,
        timeout_s=timeout_s,
    )


class NoticeWatcher:
    """Several sources behind one ``poll()``; the first notice is kept."""

    def __init__(self, sources: list[NoticeSource]):
        """Watch ``sources``."""
        self.sources = list(sources)
        self.notice: Notice | None = None

    def start(self) -> None:
        """Start every source."""
        for s in self.sources:
            s.start()

    def poll(self) -> Notice | None:
        """The first notice any source raised (kept once seen)."""
        if self.notice is None:
            for s in self.sources:
                n = s.poll()
                if n is not None:
                    self.notice = n
                    log.warning("preemption notice from %s: %s", n.source, n.detail)
                    break
        return self.notice

    def check_now(self) -> Notice | None:
        """Ask every source that can be asked synchronously (``check_once``: an endpoint) right now, rather than
        waiting for its next poll: used when a peer saw a notice, so that a notice already up on this
        device's endpoint is seen in the same step and the device is counted as preempted, not as a survivor."""
        if self.notice is None:
            for s in self.sources:
                check = getattr(s, "check_once", None)
                n = check() if callable(check) else None
                if n is not None:
                    self.notice = n
                    log.warning("preemption notice from %s: %s", n.source, n.detail)
                    break
        return self.notice

    def stop(self) -> None:
        """Stop every source."""
        for s in self.sources:
            s.stop()
