"""Rank 0's part of `pocketllm serve`: uvicorn serving the app in the main thread while the engine
loop steps the scheduler in its own, and the way both end. SIGINT or SIGTERM stops admitting,
cancels every request (each answers with an error saying the server shut down), lets the engine
thread run the step that frees them and close the scheduler, which ends every other rank's
follow(); then the process exits 0. A second signal skips the wait for open connections. An
engine failure (a dead rank) stops the server and is raised again here, so the rank ends with
the launcher's one line."""

from __future__ import annotations

import time

import uvicorn

from pocketllm.errors import UsageError
from pocketllm.model_args import say
from pocketllm.serving.app import Served, build_app
from pocketllm.serving.engine_loop import EngineLoop

# The most uvicorn waits for open connections once the requests are cancelled.
GRACEFUL_SHUTDOWN_S = 3
# The most the engine thread gets to run its last step and close the scheduler.
ENGINE_JOIN_S = 5.0


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
            say(f"serving {served.limits.model} on http://{host}:{port} (max_len={served.limits.max_len}, {auth})")


def serve(served: Served, host: str, port: int) -> int:
    engine = served.engine
    served.created = int(time.time())
    # Access lines would cost the event loop a write per request; errors still reach stderr.
    config = uvicorn.Config(build_app(served), host=host, port=port, log_level="warning", access_log=False,
                            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S, lifespan="off")
    server = _Server(config, served)
    engine.on_failure = lambda: setattr(server, "should_exit", True)
    engine.start()
    try:
        server.run()
    except SystemExit:
        # uvicorn exits this way when it cannot listen (the port taken since the check).
        raise UsageError(f"cannot listen on {host}:{port}; see the line above") from None
    finally:
        engine.begin_shutdown()
        joined = engine.join(ENGINE_JOIN_S)
    if engine.failure is not None:
        raise engine.failure
    if not joined:
        raise RuntimeError(f"the engine thread did not stop within {ENGINE_JOIN_S:g} s of the shutdown")
    say("server stopped")
    return 0
