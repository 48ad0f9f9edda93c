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

import ipaddress
import logging
import os
import socket
import tempfile
import threading
import time
from pathlib import Path

import httpx
import uvicorn

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


class AnnouncingServer(uvicorn.Server):
    """A uvicorn server that writes the address file once it answers /health and removes it when it
    begins to shut down (before it stops answering; uvicorn ends the process on SIGTERM right after
    its shutdown, so nothing after `run()` would run).

    Once uvicorn listens (the lifespan, which warms the retriever up, has run), a thread takes the
    port bound (`--port 0` binds any) and polls /health until it answers 200: the worker threads run
    and the retriever reports no problem."""

    def __init__(self, config: uvicorn.Config, directory: str | os.PathLike, host: str):
        super().__init__(config)
        self.directory, self.host = Path(directory), host
        self.address_path: Path | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()  # writing and removing the file never interleave

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:
            port = self.servers[0].sockets[0].getsockname()[1]
            threading.Thread(target=self._announce, args=(port,), name="address-file", daemon=True).start()

    async def shutdown(self, sockets=None) -> None:
        self.withdraw()  # clients stop picking this server before it stops answering
        await super().shutdown(sockets)

    def _announce(self, port: int) -> None:
        local = "127.0.0.1" if self.host in ("0.0.0.0", "") else "::1" if self.host == "::" else self.host
        url = f"http://{address(local, port)}/health"
        started, warned = time.monotonic(), False
        # trust_env=False: a proxy from the environment must not stand between us and ourselves.
        with httpx.Client(timeout=5, trust_env=False) as client:
            while not self._stop.is_set():
                try:
                    if client.get(url).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if not warned and time.monotonic() - started > WARN_AFTER_S:
                    log.warning("%s has not answered 200 for %.0f s; the address file is written once it "
                                "does (see /health for the problem)", url, WARN_AFTER_S)
                    warned = True
                self._stop.wait(POLL_S)
        host = client_host(self.host)
        with self._lock:
            if self._stop.is_set():
                return
            try:
                self.address_path = write_address_file(self.directory, host, port)
            except OSError as e:
                # Clients would never find this server: stop it, with the cause, rather than serve unseen.
                log.error("could not write the address file in %s (%s); stopping the server", self.directory, e)
                self.should_exit = True
                return
        log.info("address %s written to %s", address(host, port), self.address_path)

    def withdraw(self) -> None:
        """Stop announcing and remove the address file, if written."""
        with self._lock:
            self._stop.set()
            if self.address_path is not None:
                self.address_path.unlink(missing_ok=True)
                log.info("address file %s removed", self.address_path)
                self.address_path = None


def make_server(config: uvicorn.Config, save_address_to: str | os.PathLike | None, host: str) -> uvicorn.Server:
    """uvicorn's server, announcing itself in `save_address_to` where given."""
    return AnnouncingServer(config, save_address_to, host) if save_address_to else uvicorn.Server(config)
