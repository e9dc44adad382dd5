"""The engine-core process of `ostinato serve`: the scheduler, the executor and async
scheduling, in a process of their own.

It owns an LLMEngine (without detokenisation: text is the HTTP process's job) and two ZeroMQ
sockets: requests, aborts and queries come in on one, per-step token deltas and replies go out
on the other (messages.py). Between steps it takes every message waiting; when no request
runs it waits on the input socket. It stops for good, saying why in a Dead message and exiting
non-zero, when a step fails or a worker dies; it exits 0 after a Shutdown or SIGTERM. It dies
with the HTTP process (PR_SET_PDEATHSIG) and ignores SIGINT: Ctrl-C is the HTTP process's.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Sequence

import torch
import zmq

from ostinato.config import EngineConfig
from ostinato.engine import messages as m
from ostinato.engine.engine import LLMEngine
from ostinato.lora.request import LoRARequest
from ostinato.outputs import RequestOutput

logger = logging.getLogger("ostinato")

IDLE_POLL_MS = 100  # how often an idle core looks at its workers and at SIGTERM


class Overloaded(Exception):
    pass


class EngineCore:
    def __init__(self, engine: LLMEngine, inputs: zmq.Socket, outputs: zmq.Socket) -> None:
        self.engine = engine
        self.inputs, self.outputs = inputs, outputs
        self.encode = m.encoder().encode
        self.decode = m.input_decoder().decode
        self.stopping = False

    def run(self) -> int:
        """Serve until Shutdown (0) or a failure (1, after a Dead message)."""
        while not self.stopping:
            busy = self.engine.has_unfinished_requests()
            if self.inputs.poll(0 if busy else IDLE_POLL_MS):
                self._take_inputs()
            if self.engine.failed is not None:
                return self._die(self.engine.failed)
            if self.stopping or not self.engine.has_unfinished_requests():
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:
                logger.exception("engine step failed")
                return self._die(f"engine error: {type(e).__name__}: {e}")
            if outputs:
                self._send(m.Step([_delta(out) for out in outputs]))
        return 0

    def _take_inputs(self) -> None:
        while not self.stopping:
            try:
                frame = self.inputs.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._handle(self.decode(frame.buffer))

    def _handle(self, msg: m.Input) -> None:
        if isinstance(msg, m.Add):
            self._send(self._add(msg))
        elif isinstance(msg, m.Abort):
            for request_id in msg.request_ids:
                self.engine.abort_request(request_id)
        elif isinstance(msg, m.Query):
            self._send(self._query(msg))
        else:
            self.stopping = True

    def _add(self, msg: m.Add) -> m.Reply:
        engine = self.engine
        try:
            limit = engine.config.max_waiting_requests
            waiting = engine.stats()["num_waiting"]
            if waiting + len(msg.requests) > limit:
                raise Overloaded(
                    f"too many requests waiting ({waiting}, limit {limit}); retry later"
                )
            taken = [r.request_id for r in msg.requests if r.request_id in engine.requests]
            if taken:
                raise ValueError(f"request id {taken[0]!r} is already running: use a new id")
            added: list[str] = []
            try:
                for r in msg.requests:
                    engine.add_request(r.prompt_token_ids, r.params, r.request_id, msg.lora)
                    added.append(r.request_id)
            except Exception:
                for request_id in added:  # all or none
                    engine.abort_request(request_id)
                raise
        except Exception as e:
            return m.Reply(msg.call_id, error=str(e), error_kind=_kind(e))
        return m.Reply(msg.call_id)

    def _query(self, msg: m.Query) -> m.Reply:
        try:
            report = {"stats": self.engine.stats(), "graph_report": self.engine.graph_report()}
        except Exception as e:
            return m.Reply(msg.call_id, error=str(e), error_kind="error")
        return m.Reply(msg.call_id, result=report)

    def _die(self, reason: str) -> int:
        self._send(m.Dead(reason))
        return 1

    def _send(self, msg: m.Output) -> None:
        self.outputs.send(self.encode(msg), copy=False)


def _kind(e: Exception) -> str:
    if isinstance(e, Overloaded):
        return "overloaded"
    return "invalid" if isinstance(e, ValueError) else "error"


def _delta(out: RequestOutput) -> m.Delta:
    new = out.new_token_ids
    logprobs = out.logprobs[len(out.logprobs) - len(new) :] if out.logprobs is not None else None
    reason = out.finish_reason if out.finished else None
    first = len(new) == len(out.token_ids)  # the prompt is scored before the first token
    prompt = out.prompt_logprobs if first else None
    return m.Delta(out.request_id, list(new), logprobs, reason, out.num_cached_tokens, prompt)


def core_main(
    config: EngineConfig,
    adapters: Sequence[LoRARequest],
    input_address: str,
    output_address: str,
    parent: int,
) -> None:
    """The engine-core process's entry point (spawned by EngineCoreClient)."""
    from ostinato.distributed.worker import die_with

    die_with(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="engine-core %(levelname)s: %(message)s")
    if not config.is_cuda:  # leave the HTTP process a core: idle CPU threads spin a while
        torch.set_num_threads(max(1, (os.cpu_count() or 1) - 1))
    context = zmq.Context()
    inputs = context.socket(zmq.PULL)
    inputs.connect(input_address)
    outputs = context.socket(zmq.PUSH)
    outputs.setsockopt(zmq.LINGER, 5000)  # a last Dead message still leaves as we exit
    outputs.setsockopt(zmq.SNDHWM, 0)  # a slow HTTP process never blocks a step
    outputs.connect(output_address)
    encode = m.encoder().encode
    try:
        engine = LLMEngine(config, detokenize=False)
        for adapter in adapters:
            engine.register_lora(adapter)
    except Exception as e:
        logger.exception("the engine failed to start")
        kind = "invalid" if isinstance(e, ValueError) else None
        outputs.send(encode(m.Dead(f"{type(e).__name__}: {e}", kind)))
        context.destroy(linger=5000)
        sys.exit(1)
    core = EngineCore(engine, inputs, outputs)

    def stop(*_) -> None:
        core.stopping = True

    signal.signal(signal.SIGTERM, stop)
    outputs.send(encode(m.Ready(engine.executor.num_blocks)))
    try:
        code = core.run()
    finally:
        engine.shutdown()  # worker processes, before this one goes
    context.destroy(linger=5000)
    sys.exit(code)
