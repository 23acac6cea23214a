"""Disaggregated prefill on loopback: ``cupaged demo --disaggregated``.

A prefill process computes each prompt's K/V; a decode process receives them into its own paged
cache over NIXL (:mod:`cupaged.transfer`) and generates. The two talk through a pipe, the
application's channel: NIXL moves the blocks, the application ships the metadata and the
requests. The parent (the command) runs the same requests through one process first, the
reference, and holds every logits vector of the decode side against it::

    parent                    prefill process P                decode process D
    ------                    -----------------                ----------------
    reference run (Engine)
    spawns P and D ------->   model, cache, agent              model, cache, agent
                              metadata ------- pipe -------->  connect(P)
                              connect(D) <---- pipe ---------  metadata
                                                               per request, in order:
                              <--- (rid, incoming.request) --    expect(prompt): reserve blocks,
                              admit + prefill the prompt          prefix hits are not moved
                              send(): offer the blocks ------>   wait(): READ them, commit,
                              hold them until "done" <--------     tell P "done"
                              ---- (rid, logits, stats) ---->    fork the request's samples
                                                               decode every sequence to its end
    compares D's logits <------------------------------------  logits, tokens, transfer counts

Each sample's first token is chosen on the decode side from the prefill's last-token logits,
the rest from its own decode steps: the logits of every token either side chose are compared with
the reference's at the demo's tolerance for the model's dtype. Every wait is bounded; the
children are killed if anything goes wrong.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import time
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from .. import resolve_device, to_numpy
from ..models import COMMAND_ERRORS, error_line, limit_blas_threads
from ..serving import Engine, Request, Sampler, Sequence
from ..transfer import KVTransferAgent, nixl_available
from . import TOLERANCES, Demo, DemoConfig, backend_name
from .report import write_output

__all__ = [
    "INSTALL",
    "DisaggregatedRun",
    "command",
    "nixl_available",
    "print_report",
    "run_disaggregated",
]

INSTALL = "pip install --no-deps nixl nixl-cu12"  # NIXL without the CUDA PyTorch it would pull
MESSAGE_TIMEOUT = 120.0  # seconds a process waits for the other's next message
# The default mode pulls (docs/transfer.md): the decode side reads, and commits only what it read
# within the prefill side's hold, counted from its expect(); the hold covers the prompt's
# prefill too. (Pushing, the receiver's wait would have to outlast the sender's writes.)
SEND_TIMEOUT = 30.0  # seconds the prefill side holds a request's blocks for the decode side
WAIT_TIMEOUT = 90.0  # seconds the decode side waits for a request's blocks

LogitsKey = tuple[int, int, int]  # (request id, sample, tokens generated before this one)


@dataclass(frozen=True, slots=True)
class DisaggregatedRun:
    """What ``cupaged demo --disaggregated`` produced.

    Attributes:
        summary: every number of the run, JSON-ready: ``transfer`` (blocks moved and not moved,
            bytes, seconds, GB/s, per request), ``checks`` (the logits against the reference).
        outputs: the decode side's tokens of every sample, by ``(request id, sample)``.
    """

    summary: dict[str, Any]
    outputs: dict[tuple[int, int], list[int]]


def run_disaggregated(config: DemoConfig, timeout: float = 600.0) -> DisaggregatedRun:
    """Serve the demo's workload split over a prefill and a decode process, and check the decode
    side's logits against a single-process run of the same requests.

    Both caches are sized to hold every sequence at once (the decode side runs them as one
    batch, with no preemption); the requests' arrival steps are not used.

    Args:
        config: the demo's options (``prefill_chunk`` not used).
        timeout: seconds the whole two-process part may take.

    Raises:
        RuntimeError: NIXL is not installed, or a process failed (its one-line reason).
        TimeoutError: the processes did not finish within ``timeout``.
    """
    if not nixl_available():
        raise RuntimeError(f"--disaggregated needs NIXL: {INSTALL}")
    demo = Demo(dataclasses.replace(config, device=resolve_device(config.device)))
    config = dataclasses.replace(demo.config, num_blocks=blocks_needed(demo))
    # The reference first: it builds the kernels the children then find built.
    cache = demo.model.make_cache(config.num_blocks, config.block_size, kv_scales=config.kv_scales)
    reference: dict[LogitsKey, np.ndarray] = {}

    def record(seq: Sequence, logits: np.ndarray) -> None:
        reference[(seq.request.rid, seq.sample, len(seq.generated))] = np.array(logits)

    eos = demo.tokenizer.eos_id if demo.tokenizer is not None else None
    sampler = Sampler(temperature=demo.temperature, seed=config.seed)
    engine = Engine(demo.model, cache, sampler, max_batch=config.max_batch, eos_id=eos)
    expected = engine.run(demo.requests, on_logits=record).outputs
    prefill, decode = run_processes(config, timeout)
    checks = compare(decode["logits"], reference, TOLERANCES[config.dtype])
    checks["tokens_equal"] = decode["outputs"] == expected
    checks["passed"] = checks["passed"] and checks["tokens_equal"]
    transfers = prefill["transfers"]
    moved = sum(t["bytes_moved"] for t in transfers)
    seconds = sum(t["seconds"] for t in transfers)
    summary = {
        "config": asdict(config),
        "model": demo.describe_model(),
        "backend": backend_name(demo.device),
        "requests": len(demo.requests),
        "sequences": len(decode["outputs"]),
        "tokens_generated": sum(len(t) for t in decode["outputs"].values()),
        "transfer": {
            "blocks_moved": sum(t["blocks_moved"] for t in transfers),
            "blocks_cached": sum(decode["blocks_cached"].values()),
            "bytes_moved": moved,
            "descriptors": sum(t["descriptors"] for t in transfers),
            "seconds": seconds,
            "gbps": moved / seconds / 1e9 if seconds else 0.0,
            "bytes_per_block": demo.cache.spec.bytes_per_block,
            "per_request": [
                t | {"blocks_cached": decode["blocks_cached"][t["rid"]]} for t in transfers
            ],
        },
        "checks": checks,
        "seconds": {"prefill_process": prefill["seconds"], "decode_process": decode["seconds"]},
    }
    return DisaggregatedRun(summary, decode["outputs"])


def blocks_needed(demo: Demo) -> int:
    """Blocks that hold every sample of every request at its longest at once, plus two."""
    spec, config = demo.cache.spec, demo.config
    need = sum(
        r.num_samples * spec.blocks_for(len(r.prompt) + r.max_new_tokens) for r in demo.requests
    )
    return max(config.num_blocks, need + 2)


def compare(
    got: dict[LogitsKey, np.ndarray],
    expected: dict[LogitsKey, np.ndarray],
    tolerance: tuple[float, float],
) -> dict[str, Any]:
    """Every logits vector of ``got`` against ``expected``'s, normwise as the demo's check:
    ``max|diff| <= atol + rtol * max|expected|``; the keys must be the same."""
    atol, rtol = tolerance
    errors, ok = [], set(got) == set(expected)
    for key in sorted(set(got) & set(expected)):
        error = float(np.max(np.abs(got[key] - expected[key])))
        errors.append(error)
        ok &= error <= atol + rtol * float(np.max(np.abs(expected[key])))
    return {
        "logits_compared": len(errors),
        "logits_expected": len(expected),
        "max_abs_error": max(errors, default=0.0),
        "passed": bool(ok),
    }


# ---------------------------------------------------------------------------------- processes


def run_processes(config: DemoConfig, timeout: float) -> tuple[dict[str, Any], dict[str, Any]]:
    """Start the prefill and the decode process, wait (bounded) for both results, and leave no
    process running, whatever happens."""
    ctx = multiprocessing.get_context("spawn")  # no inherited threads or UCX state
    prefill_end, decode_end = ctx.Pipe()  # the application's channel between the two
    prefill_out, prefill_in = ctx.Pipe(duplex=False)
    decode_out, decode_in = ctx.Pipe(duplex=False)
    workers = [
        ctx.Process(
            target=prefill_worker, args=(config, prefill_end, prefill_in), name="cupaged-prefill"
        ),
        ctx.Process(
            target=decode_worker, args=(config, decode_end, decode_in), name="cupaged-decode"
        ),
    ]
    results: dict[str, Any] = {}
    try:
        for worker in workers:
            worker.start()
        for end in (prefill_end, decode_end, prefill_in, decode_in):
            end.close()  # the children hold them: a child's death is then seen as EOF
        deadline = time.monotonic() + timeout
        pending = {"prefill": (prefill_out, workers[0]), "decode": (decode_out, workers[1])}
        while pending:
            for role, (out, worker) in list(pending.items()):
                if out.poll(0.05):
                    try:
                        status, value = out.recv()
                    except EOFError:
                        status, value = "error", f"exited with status {worker.exitcode}"
                    if status != "ok":
                        raise RuntimeError(f"the {role} process failed: {value}")
                    results[role] = value
                    del pending[role]
                elif not worker.is_alive() and not out.poll(0):
                    raise RuntimeError(
                        f"the {role} process exited with status {worker.exitcode} and no result"
                    )
            if pending and time.monotonic() > deadline:
                raise TimeoutError(
                    f"expected both processes done within {timeout:g} s, got no result from "
                    f"{' and '.join(pending)}"
                )
    finally:
        for worker in workers:
            if worker.pid is None:  # never started
                continue
            if worker.is_alive():
                worker.kill()
            worker.join(timeout=5)
    return results["prefill"], results["decode"]


def prefill_worker(config: DemoConfig, link: Connection, results: Connection) -> None:
    """The prefill process: prefill each prompt the decode side asks for, offer its blocks."""
    send_outcome(results, lambda: serve_prefill(config, link))


def decode_worker(config: DemoConfig, link: Connection, results: Connection) -> None:
    """The decode process: receive every request's blocks, then generate."""
    send_outcome(results, lambda: serve_decode(config, link))


def send_outcome(results: Connection, work: Any) -> None:
    """Run ``work()`` and send ``("ok", its result)``, or ``("error", one line)``, to the
    parent."""
    try:
        results.send(("ok", work()))
    except BaseException as error:  # the parent reports it in one line
        results.send(("error", " ".join(f"{type(error).__name__}: {error}".split())))


def receive(link: Connection, timeout: float = MESSAGE_TIMEOUT) -> Any:
    """The next message from the other process, waited for at most ``timeout`` seconds."""
    if not link.poll(timeout):
        raise TimeoutError(f"expected a message from the other process within {timeout:g} s")
    return link.recv()


def setup(config: DemoConfig) -> Demo:
    """A worker's model, cache and requests (the same seed makes the same requests), loopback
    only, one BLAS thread (two processes share the cores)."""
    os.environ["UCX_NET_DEVICES"] = "lo"  # read when the agent starts: loopback only
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # no INFO lines amid the report
    demo = Demo(config)
    if demo.device == "cpu":
        limit_blas_threads(1)
    return demo


def serve_prefill(config: DemoConfig, link: Connection) -> dict[str, Any]:
    start = time.perf_counter()
    demo = setup(config)
    model, cache = demo.model, demo.cache
    prompts = {r.rid: r.prompt for r in demo.requests}
    transfers = []
    with KVTransferAgent(cache, name="prefill") as agent:
        link.send(agent.metadata())
        agent.connect(receive(link))
        while (message := receive(link))[0] == "request":
            _, rid, request = message
            admission = cache.admit(prompts[rid])
            logits = to_numpy(model.prefill(cache, [admission], [prompts[rid]]))[0]
            stats = agent.send(admission.sid, request, timeout=SEND_TIMEOUT)
            cache.free(admission.sid)  # its blocks stay in the prefix cache, evictable
            link.send(("prefilled", rid, logits))
            transfers.append({"rid": rid} | transfer_numbers(stats))
        cache.check_invariants()
    return {"transfers": transfers, "seconds": time.perf_counter() - start}


def transfer_numbers(stats: Any) -> dict[str, Any]:
    """A :class:`~cupaged.transfer.TransferStats` as plain numbers."""
    return {
        "blocks_moved": int(stats.blocks_moved),
        "bytes_moved": int(stats.bytes_moved),
        "descriptors": int(stats.descriptors),
        "seconds": float(stats.seconds),
    }


def serve_decode(config: DemoConfig, link: Connection) -> dict[str, Any]:
    start = time.perf_counter()
    demo = setup(config)
    cache = demo.cache
    eos = demo.tokenizer.eos_id if demo.tokenizer is not None else None
    decoder = Decoder(demo, Sampler(temperature=demo.temperature, seed=config.seed), eos)
    blocks_cached = {}
    with KVTransferAgent(cache, name="decode") as agent:
        peer = agent.connect(receive(link))
        link.send(agent.metadata())
        for request in demo.requests:
            incoming = agent.expect(request.prompt, peer=peer)
            link.send(("request", request.rid, incoming.request))
            agent.wait(incoming, timeout=WAIT_TIMEOUT)
            _, rid, logits = receive(link)
            assert rid == request.rid, (rid, request.rid)
            blocks_cached[rid] = int(incoming.blocks_cached)
            decoder.start(incoming.sid, request, logits)
        link.send(("done",))
    decoder.run()
    cache.check_invariants()
    if cache.num_free_blocks != cache.num_blocks:
        raise AssertionError("blocks leaked: every sequence finished but blocks are still in use")
    return {
        "logits": decoder.logits,
        "outputs": decoder.outputs,
        "blocks_cached": blocks_cached,
        "seconds": time.perf_counter() - start,
    }


class Decoder:
    """The decode side's generation: every sample of every received request in one batch, a
    token a step, until each is done (no admission, no preemption: the cache holds them all).

    Attributes:
        logits: the ``[vocab]`` host logits each token was chosen from, by
            ``(request id, sample, tokens generated before it)``.
        outputs: the tokens of every finished sample, by ``(request id, sample)``.
    """

    def __init__(self, demo: Demo, sampler: Sampler, eos_id: int | None) -> None:
        self.model, self.cache, self.sampler, self.eos_id = demo.model, demo.cache, sampler, eos_id
        self.running: list[Sequence] = []
        self.logits: dict[LogitsKey, np.ndarray] = {}
        self.outputs: dict[tuple[int, int], list[int]] = {}

    def start(self, sid: int, request: Request, logits: np.ndarray) -> None:
        """The prompt of ``request`` is in sequence ``sid``: fork it for every further sample
        and choose each one's first token from the prefill's last-token ``logits``."""
        sids = [sid, *self.cache.fork_many(sid, request.num_samples - 1)]
        for sample, s in enumerate(sids):
            rng = self.sampler.generator(request.rid, sample)
            seq = Sequence(s, request, sample, rng, len(self.running), 0, len(request.prompt))
            self.running.append(seq)
            self._take(seq, logits)
        self._finish()

    def run(self) -> None:
        """Decode until every sample is done."""
        while self.running:
            batch = self.cache.batch([s.sid for s in self.running])
            tokens = [s.generated[-1] for s in self.running]
            logits = to_numpy(self.model.decode(self.cache, batch, tokens))
            for seq, row in zip(self.running, logits, strict=True):
                self._take(seq, row)
            self._finish()

    def _take(self, seq: Sequence, logits: np.ndarray) -> None:
        self.logits[(seq.request.rid, seq.sample, len(seq.generated))] = np.array(logits)
        seq.generated.append(self.sampler.sample(logits, seq.rng))

    def _finish(self) -> None:
        for seq in [s for s in self.running if s.finished(self.eos_id)]:
            self.running.remove(seq)
            self.outputs[(seq.request.rid, seq.sample)] = seq.generated
            self.cache.free(seq.sid)


# ---------------------------------------------------------------------------------- the command


def command(args: argparse.Namespace, config: DemoConfig, parser: argparse.ArgumentParser) -> int:
    """``cupaged demo --disaggregated``: run, print the report, write ``--json``; the exit
    status (1 when the logits check fails). A refusal or failure is one line on stderr."""
    from rich.console import Console

    for flag, given in (("--plot", args.plot), ("--prefill-chunk", config.prefill_chunk)):
        if given is not None:  # the decode side prefills nothing, and keeps no per-step series
            parser.error(f"{flag}: expected none with --disaggregated, got {given}")
    if config.kv_scales == "auto":  # the receiver's scales would be fixed after the K/V came
        parser.error(
            "--kv-scales: expected a number with --disaggregated (both caches' fp8 scales fixed "
            "and equal before blocks move), got auto"
        )
    if not nixl_available():
        return error_line(parser.prog, RuntimeError(f"--disaggregated needs NIXL: {INSTALL}"))
    console = Console()
    try:
        device = resolve_device(config.device)
        if device == "cpu":
            limit_blas_threads(1)  # small products: spinning BLAS threads cost more than they give
        console.print("serving the requests in one process (the reference), then in two ...")
        run = run_disaggregated(config)
        print_report(console, run.summary)
        if args.json:
            write_output(args.json, (json.dumps(run.summary, indent=2) + "\n").encode())
            console.print(f"numbers written to {args.json}")
    except (RuntimeError, *COMMAND_ERRORS) as error:  # a process's failure: its one line
        return error_line(parser.prog, error)
    return 0 if run.summary["checks"]["passed"] else 1


# ---------------------------------------------------------------------------------- the report


def print_report(console: Any, summary: dict[str, Any]) -> None:
    """The run's numbers as a table on ``console`` (a ``rich.console.Console``)."""
    from rich.table import Table

    transfer, checks = summary["transfer"], summary["checks"]
    table = Table(title="cupaged demo --disaggregated (prefill and decode processes)")
    table.show_header = False
    table.add_row("model", summary["model"])
    table.add_row("backend", summary["backend"])
    table.add_row("transport", "NIXL over UCX, loopback; metadata and requests through a pipe")
    table.add_row("requests / sequences", f"{summary['requests']} / {summary['sequences']}")
    table.add_row("tokens generated (decode side)", f"{summary['tokens_generated']:,}")
    table.add_row(
        "blocks moved",
        f"{transfer['blocks_moved']:,} ({transfer['bytes_per_block']:,} bytes per block, "
        f"every layer's K and V; {transfer['descriptors']:,} descriptors)",
    )
    table.add_row("blocks not moved (prefix cache)", f"{transfer['blocks_cached']:,}")
    table.add_row("bytes moved", f"{transfer['bytes_moved']:,}")
    table.add_row(
        "transfer time, rate",
        f"{1e3 * transfer['seconds']:.2f} ms, {transfer['gbps']:.3f} GB/s (decimal)",
    )
    verdict = "equal" if checks["passed"] else "[red]DIFFERENT[/red]"
    tokens = "tokens equal" if checks["tokens_equal"] else "[red]tokens differ[/red]"
    table.add_row(
        "decode-side vs single-process logits",
        f"{verdict}: {checks['logits_compared']} of {checks['logits_expected']} vectors "
        f"(max |diff| {checks['max_abs_error']:.2e}), {tokens}",
    )
    console.print(table)
