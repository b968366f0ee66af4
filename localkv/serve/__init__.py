"""`localkv serve`: an OpenAI-compatible HTTP server over one engine and its Scheduler.

openai.py reads requests, replies.py shapes answers, runner.py is the engine's thread, app.py the
routes, metrics.py the Prometheus text, server.py the socket and uvicorn."""
