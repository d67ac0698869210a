"""`pocketllm serve`: an OpenAI-compatible HTTP server over the scheduler (pocketllm.engine.scheduler),
in two processes. The engine process (rank 0) runs engine_driver, which steps the scheduler, and
starts the HTTP process (http_process, http_main), linked by wire. In the HTTP process protocol
parses and checks requests, errors shapes OpenAI error bodies, chat_template renders chats, text
turns tokens into text with stop strings, engine_client sends requests and takes their tokens,
streaming writes server-sent events, metrics counts, app holds the routes and server runs them."""
