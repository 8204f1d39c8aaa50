"""Serving a policy behind an OpenAI-compatible API on Assay's own engine (`assay serve`).

protocol.py   request and response models, OpenAI's error JSON
prompt.py     messages through the model's chat template (tools included); completion prompts
output.py     sampled tokens to text, reasoning and tool calls, streamed without taking anything back
batcher.py    the engine thread: continuous batching behind a bounded queue, aborts on disconnect
metrics.py    Prometheus metrics
app.py        the FastAPI routes
profile.py    serving profiles, by name (standard)
server.py     loading the policy, binding the socket, uvicorn
sessions.py   a completed request as a record for observers and as trajectories
session_log.py  the session log: a journal durable per request, compacted into Parquet shards (fsspec)
replay.py     assay replay: logged sessions sampled again on another policy, outcomes compared
canary.py     deployments: versions with hashes, sticky canary routing, feedback, the sequential test
golden.py     the golden-suite gate on a canary's promotion: both policies evaluated on a pinned suite (or their
              records), the two records to a verdict
"""

from importlib.util import find_spec

from assay.core.errors import AssayError


def require_installed() -> None:
    """Refuse in one line where the `serve` extra is missing, before anything loads."""
    missing = [m for m in ("fastapi", "uvicorn", "prometheus_client") if find_spec(m) is None]
    if missing:
        raise AssayError(f"assay serve needs {', '.join(missing)}: pip install 'assay[serve]'")
