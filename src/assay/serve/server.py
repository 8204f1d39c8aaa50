"""`assay serve`: load a policy, start the engine thread, and run the API under uvicorn.

The listening socket is bound here, before uvicorn starts, so that a port of 0 (the system picks one) is
known and logged; `start_server` runs the same server on a thread of the calling process (tests, a
program embedding it)."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import uvicorn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from assay.core.checkpoint import latest_checkpoint
from assay.core.errors import AssayError
from assay.rollout.engine import Engine, EngineConfig
from assay.serve.app import ServeState, make_app
from assay.serve.batcher import Batcher
from assay.serve.canary import CanaryConfig, Deployment, canary
from assay.serve.golden import Gate, evaluate_golden, golden_suite, load_gate, served_hashes
from assay.serve.metrics import make_metrics
from assay.serve.profile import ServeProfile
from assay.serve.session_log import SessionLog
from assay.serve.sessions import PolicyVersion, attach_log, weights_hash
from assay.serve.verify import attach_verifier, suite_verifier

log = logging.getLogger("assay.serve")


@dataclass(frozen=True)
class ServeOptions:
    host: str = "127.0.0.1"  # the loopback: reachable from this machine only, unless asked otherwise
    port: int = 8000  # 0: the system picks a free one
    max_queue: int = 64  # requests waiting for the batch; one more is answered 429
    max_batch: int | None = None  # sequences in the engine at once; None: the profile's
    api_key_env: str | None = None  # the environment variable holding the key; None: no key
    model_id: str | None = None  # the name clients pass as `model`; None: the policy argument as given
    log: str | None = None  # the session log: a directory or fsspec URL; None: no log
    canary: Path | None = None  # a candidate policy served to a share of sessions beside the stable one
    canary_config: CanaryConfig | None = None  # share, the sequential test's alpha and margin
    deployment_record: Path | None = None  # a JSON file holding the deployment (versions, hashes, pointer)
    golden: tuple[Path, ...] = ()  # a pinned suite file, or records of both policies on one: gate the promotion
    golden_margin: float | None = None  # the pass@1 loss the gate tolerates; None: the canary's margin
    verify_suite: Path | None = None  # a pinned suite whose single-turn tasks, named by a request, are verified
    threads: int = 0  # torch threads; 0: the count measured fastest for the model here


def policy_dir(policy: Path) -> Path:
    """A run directory stands for its latest checkpoint (or, for an SFT run, its saved policy); anything else
    is loaded as it is (a Hugging Face directory, a .gguf file, a packaged model's name)."""
    if (policy / "checkpoints").is_dir():
        return latest_checkpoint(policy)
    if (policy / "policy" / "config.json").is_file():
        return policy / "policy"
    return policy


def api_key(env: str | None) -> str | None:
    if env is None:
        return None
    key = os.environ.get(env, "")
    if not key:
        raise AssayError(f"--api-key-env {env}: the variable is not set (or empty); export it with the key clients "
                         "must send, or leave the option out to serve without a key")
    return key


def build_state(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, model_id: str, profile: ServeProfile,
                options: ServeOptions, engine: EngineConfig | None = None, version: int = 1,
                policy_name: str | None = None) -> ServeState:
    """The engine (the profile's configuration unless given) and its thread, started; the routes' state."""
    key = api_key(options.api_key_env)
    eng = Engine(model.eval(), tokenizer, engine or profile.engine)
    holder: list[Batcher] = []
    metrics = make_metrics(lambda: holder[0].queue.qsize() if holder else 0,
                           lambda: holder[0].running if holder else 0)
    batcher = Batcher(eng, options.max_queue, options.max_batch or profile.max_batch,
                      on_step=lambda sec, n: (metrics.step_seconds.observe(sec), metrics.generated_tokens.inc(n)),
                      on_admit=metrics.queue_wait.observe, on_abort=metrics.aborted.inc)
    holder.append(batcher)
    batcher.start()
    return ServeState(model_id, tokenizer, batcher, metrics, eng.model.max_positions, len(tokenizer),
                      frozenset(eng.default_stop), api_key=key,
                      version=PolicyVersion(version, policy_name or model_id, weights_hash(model)), profile=profile.name)


def golden_gate_of(stable: Path, options: ServeOptions, profile: ServeProfile) -> Gate | None:
    """The golden-suite gate `options.golden` asks for, on the stable policy directory and the canary's, from the
    records given or from both policies' evaluations on the suite file given (`evaluate_golden`, run here); None
    without --golden. `serve` calls it before loading either policy to serve, so a bad suite or a mismatched
    record is refused at once and no request is served before the verdict."""
    if not options.golden:
        return None
    if options.canary is None:
        raise AssayError("--golden gates a canary's promotion: pass --canary CANDIDATE with it")
    cfg = options.canary_config or CanaryConfig()
    margin = cfg.margin if options.golden_margin is None else options.golden_margin
    candidate, weights = policy_dir(options.canary), profile.engine.weights
    suite = golden_suite(options.golden)
    hashes = served_hashes(stable, candidate)
    records = options.golden if suite is None else evaluate_golden(suite, stable, candidate, weights, hashes)
    return load_gate(records, stable, candidate, weights, margin, cfg.alpha, hashes)


def _candidate(stable: ServeState, options: ServeOptions, profile: ServeProfile, gate: Gate | None
               ) -> tuple[ServeState, Deployment]:
    """Load the canary's policy as version 2 and put both in a deployment."""
    from assay.core.modeling import load_model

    assert options.canary is not None
    where = policy_dir(options.canary)
    model, tokenizer = load_model(where)
    candidate = build_state(model, tokenizer, stable.model_id, profile, options, version=2, policy_name=str(where))
    cfg = options.canary_config or CanaryConfig()
    record = options.deployment_record
    log.info("canary: version 2 (%s, %s) gets %.0f%% of sessions beside version 1 (%s, %s); rollback on a significant "
             "success-rate loss, promotion when within %.3f (alpha %.3f)%s", where, candidate.version.hash[:19],
             100 * cfg.share, stable.version.name, stable.version.hash[:19], cfg.margin, cfg.alpha,
             f"; deployment record {record}" if record else "")
    if gate is None:
        log.info("canary: promotion by live feedback only (--golden DIR gates it on a golden-suite evaluation too)")
    deployment = canary(stable, candidate, cfg, record, gate)  # logs the gate's verdict, and a failing gate's rollback
    return candidate, deployment


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise AssayError(f"cannot listen on {host}:{port} ({e.strerror}); pick another --port or --host") from None
    sock.listen(128)
    sock.setblocking(False)
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"


def _uvicorn(state: ServeState, access_log: bool) -> uvicorn.Server:
    config = uvicorn.Config(make_app(state), log_config=None, access_log=access_log, lifespan="off",
                            timeout_graceful_shutdown=5)
    return uvicorn.Server(config)


def serve(policy: Path, profile: ServeProfile, options: ServeOptions) -> None:
    """Serve until interrupted (the command's body)."""
    from assay.core.modeling import apply_threads, load_model

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    where = policy_dir(policy)
    key_env = options.api_key_env
    api_key(key_env)  # an unset variable fails before the model loads
    if options.verify_suite is not None and options.canary is None:
        raise AssayError("--verify-suite feeds a canary's test with the suite's verifiers: pass --canary CANDIDATE "
                         "with it")
    verifier = suite_verifier(options.verify_suite) if options.verify_suite is not None else None
    gate = golden_gate_of(where, options, profile)  # last: it may evaluate both policies, after every other check
    model, tokenizer = load_model(where)
    threads = apply_threads(options.threads, model)
    state = build_state(model, tokenizer, options.model_id or str(policy), profile, options, policy_name=str(where))
    states = [state]
    if options.canary is not None:
        candidate, deployment = _candidate(state, options, profile, gate)
        states.append(candidate)
        if verifier is not None:
            attach_verifier(verifier, deployment)
            log.info("canary: requests naming one of the %d single-turn tasks of suite %s are graded by its "
                     "verifiers", len(verifier.tasks), verifier.suite)
    sessions = SessionLog(options.log) if options.log else None
    if sessions is not None:
        for s in states:
            attach_log(s, sessions)
        log.info("logging every completed request to %s", options.log)
    sock = bind(options.host, options.port)
    url = url_of(sock)
    log.info("serving %s (%s) as model %r, profile %s, %d torch threads, at %s/v1; queue %d, batch %d; %s",
             where, type(model).__name__, state.model_id, profile.name, threads, url, options.max_queue,
             state.batcher.max_batch, f"API key from ${key_env}" if key_env else "no API key")
    if options.host not in ("127.0.0.1", "::1", "localhost"):
        log.warning("listening on %s: reachable from other machines%s", options.host,
                    "" if key_env else ", with no API key (--api-key-env NAME)")
    try:
        _uvicorn(state, access_log=True).run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn shut down gracefully, then raised the signal again
        log.info("stopped")
    finally:
        for s in states:
            s.batcher.stop()
        sock.close()
        if sessions is not None:
            sessions.close()
        if verifier is not None:
            verifier.close()


@dataclass
class RunningServer:
    """A server on a thread of this process; `close` stops it and its engine thread."""

    url: str  # http://host:port
    state: ServeState
    server: uvicorn.Server
    thread: threading.Thread

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.state.batcher.stop()


def start_server(state: ServeState, host: str = "127.0.0.1", port: int = 0) -> RunningServer:
    """Serve `state` on a thread; returns once the server accepts connections."""
    sock = bind(host, port)
    server = _uvicorn(state, access_log=False)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="assay-serve-http", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise AssayError("the server did not start")
        time.sleep(0.01)
    return RunningServer(url_of(sock), state, server, thread)
