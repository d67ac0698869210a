"""The HTTP process of `pocketllm serve`: uvicorn serving the app, and the way it ends. SIGINT or
SIGTERM here, or the engine process's own stop, stops admitting (503) while the engine process
cancels every request (each answers with an error saying the server shut down), runs the step that
frees them and closes the scheduler; open connections get GRACEFUL_SHUTDOWN_S. A second signal
skips that wait. An engine failure, or the engine process gone, ends every open request with a
500 and stops the server; the engine process reports the failure."""

from __future__ import annotations

import ipaddress
import sys
import time

import uvicorn

from pocketllm.serving.app import Served, build_app

# The most uvicorn waits for open connections once the requests are cancelled.
GRACEFUL_SHUTDOWN_S = 3
# The most this process waits for the engine process to close the scheduler once stopped.
ENGINE_CLOSE_S = 5.0


class _Server(uvicorn.Server):
    """uvicorn's server, ending as described above. uvicorn's own handler would raise the signal
    again once it stopped, killing the process with it instead of exiting 0."""

    def __init__(self, config: uvicorn.Config, served: Served):
        super().__init__(config)
        self.served = served

    def handle_exit(self, sig, frame) -> None:
        if self.should_exit:
            self.force_exit = True
            return
        self.served.engine.request_stop()
        self.should_exit = True

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started and self.servers and self.servers[0].sockets:
            # The bound port, which --port 0 leaves to the kernel; a client (or a test) reads it here.
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            served = self.served
            auth = "API key required" if served.api_key else "no authentication"
            # An IPv6 address is bracketed in a URL (http://[::1]:8000).
            where = f"[{host}]" if ":" in host else host
            reasoning = f", reasoning parser {served.limits.reasoning_parser}" if served.limits.reasoning_parser else ""
            print(f"serving {served.limits.model} on http://{where}:{port} (max_len={served.limits.max_len}, {auth}{reasoning})",
                  file=sys.stderr, flush=True)
            note = exposure_note(host, served.api_key)
            if note:
                print(note, file=sys.stderr, flush=True)


def exposure_note(host: str, api_key: str | None) -> str | None:
    """The line said when the server listens beyond this machine with no key: anyone who reaches
    the port may use the model (README: such a host wants a key). host: the address the socket
    is bound to (a name given as --host is resolved by then), so a name is taken as exposed."""
    if api_key:
        return None
    try:
        if ipaddress.ip_address(host.split("%", 1)[0]).is_loopback:
            return None
    except ValueError:
        pass
    return (f"note: listening on {host} with no API key: anyone who can reach this port can use the model; "
            f"set POCKETLLM_API_KEY (or --api-key) to require one")


def serve(served: Served, host: str, port: int) -> int:
    """Serve until stopped; 0 once the engine closed, 1 when it failed, 2 when the address could
    not be listened on (the engine process is told why)."""
    engine = served.engine
    served.created = int(time.time())
    # Access lines would cost the event loop a write per request; errors still reach stderr.
    config = uvicorn.Config(build_app(served), host=host, port=port, log_level="warning", access_log=False,
                            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S, lifespan="off")
    server = _Server(config, served)
    engine.on_end = lambda: setattr(server, "should_exit", True)
    engine.start()
    try:
        server.run()
    except SystemExit:
        # uvicorn exits this way when it cannot listen (the port taken since the check).
        engine.tell_unusable(f"cannot listen on {host}:{port}; see the line above")
        engine.request_stop()
        engine.ended.wait(ENGINE_CLOSE_S)
        return 2
    engine.request_stop()
    engine.ended.wait(ENGINE_CLOSE_S)
    return 0 if engine.failure is None else 1
