"""A retriever that runs in a process of its own (`search-r1 serve --worker_process`).

In one process the server's event loop (HTTP, JSON) and its worker thread (tokenising, launching
the encoder's kernels, the search) share one interpreter lock. Under load the worker waits for the
lock before many of its hundreds of small kernel launches, so encoding ran well below what the
GPU allows (benchmarks/RESULTS.md, "Whole server"). Here the retriever is built and called in a child
process; the worker thread only sends queries down a pipe and waits, without the lock, for the hits.

The child is started with `spawn` (a forked CUDA context is unusable) and loads the index itself.
An exception in a search is sent back and raised in the server, which answers that batch with an
error and keeps serving; if the child dies, the next search starts a new one (loading the index
again) and the batch that saw it die gets an error.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import traceback
from collections.abc import Callable

from search_r1.retrieval.base import Hit, Retriever

log = logging.getLogger(__name__)


def _child(conn, build: Callable[[], Retriever]) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s [worker]: %(message)s")
    try:
        retriever = build()
        retriever.warmup()
    except Exception as e:  # raised again in the server, as is: it must not start half-built
        try:
            conn.send(("error", e))
        except Exception:  # an exception that does not pickle
            conn.send(("error", RuntimeError(f"{type(e).__name__}: {e}")))
        return
    conn.send(("ready", (retriever.max_topk, retriever.probe_at_startup)))
    while True:
        try:
            msg = conn.recv()
        except EOFError:  # the server went away without saying so
            break
        if msg is None:
            break
        queries, topk = msg
        try:
            conn.send(("hits", retriever.search(queries, topk), retriever.stats()))
        except Exception:
            conn.send(("error", traceback.format_exc(limit=5)))
    retriever.close()


class ProcessRetriever(Retriever):
    """The retriever that `build()` returns, built and run in a child process; `build` must pickle
    (a module-level function, or `functools.partial` of one, e.g. `partial(build_retriever, args)`).
    Called from one thread only (the server's worker), like every retriever."""

    def __init__(self, build: Callable[[], Retriever]):
        self.build = build
        self._stats: dict = {}
        self._start()

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        self._proc = ctx.Process(target=_child, args=(child_conn, self.build), name="retrieval-worker", daemon=True)
        self._proc.start()
        child_conn.close()
        try:
            kind, payload = self._conn.recv()
        except EOFError:
            self._proc.join(5)
            raise RuntimeError(f"the retrieval worker process exited while loading (exit code "
                               f"{self._proc.exitcode}); see the log above") from None
        if kind == "error":  # the child's own exception (a missing file, mismatched sizes, …)
            self._proc.join(5)
            raise payload
        self.max_topk, self.probe_at_startup = payload
        log.info("retrieval worker process %d ready", self._proc.pid)

    def search(self, queries: list[str], topk: int) -> list[list[Hit]]:
        if not self._proc.is_alive():
            log.error("retrieval worker process %d exited (code %s); starting a new one",
                      self._proc.pid, self._proc.exitcode)
            self._conn.close()
            self._start()
        try:
            self._conn.send((queries, topk))
            reply = self._conn.recv()
        except (EOFError, BrokenPipeError, ConnectionResetError) as e:
            raise RuntimeError("the retrieval worker process died during a search; the next search "
                               "starts a new one") from e
        if reply[0] == "error":
            raise RuntimeError(f"search failed in the retrieval worker process:\n{reply[1]}")
        _, hits, self._stats = reply
        return hits

    def stats(self) -> dict:
        """The child's counters as of the last search (asking it now would race the worker thread)."""
        return self._stats

    def close(self) -> None:
        if self._proc.is_alive():
            try:
                self._conn.send(None)
            except (BrokenPipeError, OSError):
                pass
            self._proc.join(30)
        if self._proc.is_alive():
            self._proc.kill()
        self._conn.close()
