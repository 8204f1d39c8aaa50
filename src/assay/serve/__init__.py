"""Serving a policy behind an OpenAI-compatible API on Assay's own engine (`assay serve`).

protocol.py   request and response models, OpenAI's error JSON
prompt.py     messages through the model's chat template (tools included); completion prompts
output.py     sampled tokens to text, reasoning and tool calls, streamed without taking anything back
batcher.py    the engine thread: continuous batching behind a bounded queue, aborts on disconnect
metrics.py    Prometheus metrics
app.py        the FastAPI routes
profile.py    serving profiles, by name (standard)
server.py     loading the policy, binding the socket, uvicorn
"""
