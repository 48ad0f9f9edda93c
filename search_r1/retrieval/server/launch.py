"""`serve`: the retrieval app on uvicorn, as `search-r1 serve` runs it: the tokenizer's threads, the
GIL's switch interval, and connections that wait too long for a request's headers closed."""
from __future__ import annotations

import logging
import os
import sys

from search_r1.retrieval.base import Retriever
from search_r1.retrieval.corpus import Pages
from search_r1.retrieval.server.app import create_app
from search_r1.retrieval.server.config import ServerConfig

log = logging.getLogger(__name__)


def parallel_tokenizers() -> None:
    """Let the Rust tokenizer use every core in this process (and the worker process it starts).

    A shell or training setup often exports TOKENIZERS_PARALLELISM=false (it silences a warning
    about forking); in a server that never forks it only slows tokenising, a large part of
    encoding a batch (benchmarks/RESULTS.md, "The query encoder")."""
    if os.environ.get("TOKENIZERS_PARALLELISM", "true").lower() not in ("1", "true", "yes", "on"):
        log.info("TOKENIZERS_PARALLELISM=%s ignored: the server tokenises queries in parallel",
                 os.environ["TOKENIZERS_PARALLELISM"])
    os.environ["TOKENIZERS_PARALLELISM"] = "true"


def serve(retriever: Retriever, cfg: ServerConfig, host: str = "127.0.0.1", port: int = 8000,
          name: str = "retriever", pages: Pages | None = None, save_address_to: str | None = None):
    """`save_address_to`: a directory where the address file of ASearcher's and RLinf's clients is
    written once the server is healthy (search_r1.retrieval.address_file)."""
    from search_r1.retrieval.address_file import make_server

    app = create_app(retriever, cfg, name, pages)
    # The event loop (HTTP, JSON) and the worker (kernel launches) share the GIL. Under load the
    # worker waited up to the default 5 ms switch interval for each hand-over, which slowed
    # encoding down; a shorter interval lets it in sooner (benchmarks/RESULTS.md, "Whole server").
    sys.setswitchinterval(cfg.switch_interval_s)
    log.info("serving %s on http://%s:%d/retrieve", name, host, port)
    make_server(uvicorn_config(app, cfg, host, port), save_address_to, host).run()


def uvicorn_config(app, cfg: ServerConfig, host: str, port: int):
    """The server's uvicorn settings: quiet logs, and connections that wait too long for headers closed."""
    import uvicorn
    return uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                          http=_with_header_deadline(cfg.header_timeout_s))


def _with_header_deadline(seconds: float):
    """uvicorn's HTTP protocol (httptools if installed, else h11) that closes a connection still
    waiting for a request's headers `seconds` after it opened or after its last response. uvicorn
    itself waits for headers forever; its keep-alive timeout starts only after a response."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as Base
    except ImportError:
        from uvicorn.protocols.http.h11_impl import H11Protocol as Base

    class HeaderDeadline(Base):
        _timer = None

        def connection_made(self, transport):
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self):
            super().on_response_complete()
            self._arm()

        def connection_lost(self, exc):
            if self._timer is not None:
                self._timer.cancel()
            super().connection_lost(exc)

        def _arm(self):
            if self._timer is not None:
                self._timer.cancel()
            self._timer = self.loop.call_later(seconds, self._check)

        def _check(self):
            # A request whose headers arrived has a cycle still answering: leave it to the handler
            # (its body has a deadline of its own). Otherwise the headers are late: close.
            waiting = self.cycle is None or self.cycle.response_complete
            if waiting and not self.transport.is_closing():
                self.transport.close()

    return HeaderDeadline
