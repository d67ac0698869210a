"""`pocketllm serve`: an OpenAI-compatible HTTP server over the scheduler (pocketllm.engine.scheduler).
protocol parses and checks requests, errors shapes OpenAI error bodies, chat_template renders chats,
text turns tokens into text with stop strings, engine_loop drives the scheduler from its own thread,
streaming writes server-sent events, metrics counts, app holds the routes and server runs it all."""
