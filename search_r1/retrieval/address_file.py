"""`search-r1 serve --save-address-to DIR`: the address file through which ASearcher's and RLinf's
clients find a retrieval server.

The contract, as their `launch_local_server.sh` and clients use it: DIR is a directory (created if
missing); the server writes `Host<host>_IP<port>.txt` in it, whose whole text is `<host>:<port>`
with no newline; a client reads every `DIR/Host*_IP*.txt` (ASearcher: `RAG_SERVER_ADDR_DIR`), takes
one line and posts to `http://<line>/retrieve`. A trailing newline would end up in that URL.

Deviations from the peers' servers, which write the file before loading their index:
- the file appears only once the server answers `GET /health` with 200, so a client never finds a
  server that cannot answer yet;
- it is written to a temporary name first and renamed, so a client never reads half an address;
- it is removed when the server shuts down, so clients stop picking a server that is gone.
A server listening on every interface (`--host 0.0.0.0`) writes this machine's address as the
peers do (the address of its host name), and where that is a loopback one, the address of the
interface that leads off the machine, since clients on other nodes read the file too.
"""
from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import socket
import tempfile
import threading
import time
from pathlib import Path

import httpx

log = logging.getLogger(__name__)

ANY_INTERFACE = ("0.0.0.0", "::", "")
POLL_S = 0.2
WARN_AFTER_S = 60.0


def check_directory(directory: str) -> Path:
    """The address directory, created now: a bad path stops the start before the index loads."""
    path = Path(directory)
    if path.exists() and not path.is_dir():
        raise ValueError(f"--save-address-to {directory} is a file: it names a directory, in which the server "
                         "writes Host<host>_IP<port>.txt (ASearcher's and RLinf's clients read DIR/Host*_IP*.txt)")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--save-address-to {directory}: cannot create the directory ({e})") from None
    if not os.access(path, os.W_OK):
        raise ValueError(f"--save-address-to {directory}: the directory is not writable")
    return path


def client_host(host: str) -> str:
    """The host part of the address clients connect to, for a server listening on `host`."""
    if host not in ANY_INTERFACE:
        return host
    try:
        ip = socket.gethostbyname(socket.gethostname())
    except OSError:
        ip = "127.0.0.1"
    if ipaddress.ip_address(ip).is_loopback:
        ip = _outbound_ip() or ip
    return ip


def _outbound_ip() -> str | None:
    """The address of the interface a packet off this machine would leave by. A UDP `connect` only
    picks the route; nothing is sent."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.254.254.254", 1))
            return s.getsockname()[0]
        except OSError:
            return None


def address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def write_address_file(directory: str | os.PathLike, host: str, port: int) -> Path:
    """Write `host:port` to `directory/Host<host>_IP<port>.txt` atomically; return its path."""
    directory = Path(directory)
    path = directory / f"Host{host}_IP{port}.txt"
    # The temporary name starts with a dot: it never matches the clients' Host*_IP*.txt.
    fd, tmp = tempfile.mkstemp(prefix=".address-", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(address(host, port))
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes it private; clients of other users read it
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


class AddressAnnouncer:
    """Writes the address file once the uvicorn `server` answers /health, removes it at exit.

    A thread waits for uvicorn to listen (`server.started`: the lifespan, which warms the retriever
    up, has run), takes the port it bound (`--port 0` binds any), and polls /health until it answers
    200: the worker threads run and the retriever reports no problem."""

    def __init__(self, server, directory: str | os.PathLike, host: str):
        self.server, self.directory, self.host = server, Path(directory), host
        self.path: Path | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="address-file", daemon=True)

    def __enter__(self) -> "AddressAnnouncer":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.remove()

    def _run(self) -> None:
        while not self.server.started:
            if self._stop.wait(POLL_S) or self.server.should_exit:
                return
        port = self.server.servers[0].sockets[0].getsockname()[1]
        local = "127.0.0.1" if self.host in ("0.0.0.0", "") else "::1" if self.host == "::" else self.host
        url = f"http://{address(local, port)}/health"
        waited, warned = time.monotonic(), False
        # trust_env=False: a proxy from the environment must not stand between us and ourselves.
        with httpx.Client(timeout=5, trust_env=False) as client:
            while not (self._stop.is_set() or self.server.should_exit):
                try:
                    if client.get(url).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if not warned and time.monotonic() - waited > WARN_AFTER_S:
                    log.warning("%s has not answered 200 for %.0f s; the address file is written once it "
                                "does (see /health for the problem)", url, WARN_AFTER_S)
                    warned = True
                self._stop.wait(POLL_S)
            else:
                return
        host = client_host(self.host)
        try:
            self.path = write_address_file(self.directory, host, port)
        except OSError as e:
            # Clients will not find the server: stop it, with the cause, rather than serve unseen.
            log.error("could not write the address file in %s (%s); stopping the server", self.directory, e)
            self.server.should_exit = True
            return
        log.info("address %s written to %s", address(host, port), self.path)

    def remove(self) -> None:
        if self.path is not None:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
            log.info("address file %s removed", self.path)
            self.path = None


def announced(server, directory: str | os.PathLike | None, host: str):
    """Context for `server.run()`: with a directory, the address file is written once the server is
    healthy and removed at exit; without, nothing happens."""
    return AddressAnnouncer(server, directory, host) if directory else contextlib.nullcontext()
