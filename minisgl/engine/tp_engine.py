"""Tensor parallelism: one model across N ranks, rank 0 driving the others over ZMQ PUB/SUB.

Only rank 0 receives requests. Every `step()` it publishes exactly one message holding the
request operations (adds, aborts) that arrived since the previous step; every rank applies the
same operations in the same order and then steps, so every rank's scheduler builds the identical
batch and the all-reduces inside the model line up. Only rank 0's outputs are used.

Before the first real message, rank 0 repeats a hello on the PUB socket until every follower has
confirmed (over a PUSH socket back to rank 0) that it received one: a SUB socket that connects
late silently misses what was published before (the slow-joiner problem).

Every socket is authenticated with the group's secret (`curve`): a process without it
receives no step and delivers no message. A malformed message from a peer that does hold it is
logged and dropped, never a crash.

Start-up never waits on a rank that is gone: each follower checks in (over the same PUSH
socket) before it joins torch.distributed, whose rendezvous would otherwise wait for a dead
rank for its whole timeout; a follower that fails reports its error there, and one that dies
before running (spawn could not start it) is noticed by its exit; rank 0 joins torch.distributed
only once every follower is inside its rendezvous, so one that fails on its way in is reported
at once too.

On one node rank 0 binds every port (the group's store's included) before a follower starts, on
the kernel's pick (but a rendezvous port --dist-init-addr names): a port picked, released and
bound later could be taken in between, by an outbound connection's source port among others.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing as mp
import os
import time
from typing import TYPE_CHECKING, Any

import msgpack
import zmq

from minisgl.config import EngineArgs
from minisgl.distributed import default_backend, init_distributed, rendezvous_store
from minisgl.engine import curve
from minisgl.engine.engine import Engine, StepOutput
from minisgl.engine.multinode import (
    NodeLink,
    bind_address,
    check_args,
    exit_group,
    local_ranks,
    rank_device,
)
from minisgl.engine.node_auth import group_secret
from minisgl.engine.startup import spawn_main_problem
from minisgl.process import freeze_startup_objects, ignore_group_signals, leave_with_parent
from minisgl.sampling_params import SamplingParams
from minisgl.scheduler.scheduler import SchedulerStats
from minisgl.structured.compile_worker import CompileOutcome

if TYPE_CHECKING:
    from torch.distributed import TCPStore

logger = logging.getLogger(__name__)

_HELLO, _STEP, _STATS, _EXIT = "hello", "step", "stats", "exit"
_UP, _FAILED = "up", "failed"  # follower -> rank 0 during start-up: [kind, rank, detail]
_HANDSHAKE_TIMEOUT_S = 300.0  # followers load weights before they subscribe


def split_host_port(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    return host.strip("[]") or "127.0.0.1", int(port or 0)


def _zmq_addr(host: str, port: int) -> str:
    where = port or "*"  # 0: the kernel's pick
    return f"tcp://[{host}]:{where}" if ":" in host else f"tcp://{host}:{where}"


def _bound_port(sock: zmq.Socket) -> int:
    return int(sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])


@dataclasses.dataclass(frozen=True)
class Rendezvous:
    host: str
    dist_port: int  # torch.distributed
    pub_port: int  # rank 0's PUB socket
    ack_port: int  # followers' PUSH back to rank 0 (handshake)
    link_port: int = 0  # multi-node: the nodes' link to node 0 (multinode.NodeLink)
    secret: str = dataclasses.field(default="", repr=False)  # hex: see node_auth.group_secret

    @classmethod
    def for_args(cls, args: EngineArgs) -> Rendezvous:
        host, port = split_host_port(args.dist_init_addr)
        secret = group_secret(args).hex()
        if args.nnodes > 1:
            # Fixed ports next to the rendezvous: every node must know them in advance.
            return cls(host, port, port + 1, port + 2, port + 3, secret)
        return cls(host, port, 0, 0, 0, secret)  # 0: the kernel's pick, once rank 0 binds


def _join_group(args: EngineArgs, rank: int, store: TCPStore) -> None:
    import torch

    if args.device in ("auto", "cuda") and torch.cuda.is_available():
        torch.cuda.set_device(rank_device(rank, args, torch.cuda.device_count()))
    init_distributed(rank=rank, world_size=args.tp_size, device=args.device, store=store)


class TPRankError(RuntimeError):
    """A tensor-parallel rank failed or died: raised in rank 0, with that rank's error."""


class TPEngine:
    """The `Engine` interface for tp_size > 1; runs rank 0 in this process."""

    def __init__(self, args: EngineArgs) -> None:
        self._failures: dict[int, str] = {}  # rank -> error it reported
        self._closed_sockets = False
        check_args(args)
        self.rdv = Rendezvous.for_args(args)
        secret = bytes.fromhex(self.rdv.secret)
        # Multi-node: only where the other nodes reach node 0, never every interface.
        bind = bind_address(self.rdv.host) if args.nnodes > 1 else self.rdv.host
        self._store = rendezvous_store(bind, self.rdv.dist_port, args.tp_size, 0)
        self._num_followers = args.tp_size - 1  # on every node
        self._ctx = zmq.Context()
        self._guard = curve.PortGuard(self._ctx, secret)
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 1000)
        self._ack = self._ctx.socket(zmq.PULL)
        self._ack.setsockopt(zmq.LINGER, 0)
        ports = []
        for sock, port, what in (
            (self._pub, self.rdv.pub_port, "step broadcast"),
            (self._ack, self.rdv.ack_port, "acks"),
        ):
            curve.serve(sock, secret)
            sock.setsockopt(zmq.IPV6, ":" in bind)
            sock.bind(_zmq_addr(bind, port))
            ports.append(_bound_port(sock))
            self._guard.watch(sock, f"tensor-parallel {what} port {ports[-1]}")
        self._guard.start()
        self.rdv = dataclasses.replace(
            self.rdv, dist_port=self._store.port, pub_port=ports[0], ack_port=ports[1]
        )
        self._link: NodeLink | None = None
        spawn = mp.get_context("spawn")
        self._procs = [
            spawn.Process(
                target=follower_main,
                args=(dataclasses.asdict(args), rank, dataclasses.asdict(self.rdv), os.getpid()),
                name=f"minisgl-tp{rank}",
                daemon=True,
            )
            for rank in local_ranks(args)
            if rank > 0
        ]
        for p in self._procs:
            p.start()
        if args.nnodes > 1:
            procs = self._procs
            self._link = NodeLink(
                bind, self.rdv.link_port, args.nnodes, secret, lambda why: exit_group(why, procs)
            )
        try:
            self._wait_checked_in()
            self._wait_joining(args)
            _join_group(args, 0, self._store)
            self.engine = Engine(args, tp_rank=0)
            self._handshake(self._num_followers)
        except BaseException as exc:
            failure = None
            if not isinstance(exc, TPRankError):  # e.g. a collective broken by a dead rank
                for p in self._procs:
                    p.join(timeout=2)  # such a rank is on its way out: let its report arrive
                failure = self._follower_failure()
            self.shutdown()
            if failure is not None:
                raise TPRankError(failure) from exc
            raise
        self._ops: list[list[Any]] = []
        self._grammar_info_sent = False
        self._closed = False

    # the Engine interface -----------------------------------------------------------------
    @property
    def model_path(self):  # noqa: ANN201 - same as Engine.model_path
        return self.engine.model_path

    @property
    def max_seq_len(self) -> int:
        return self.engine.max_seq_len

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @property
    def eos_token_ids(self) -> list[int]:
        return self.engine.eos_token_ids

    @property
    def num_pages(self) -> int:
        return self.engine.num_pages

    def validate(
        self, prompt_ids: list[int], params: SamplingParams, *, compile_grammar: bool = True
    ) -> None:
        self.engine.validate(prompt_ids, params, compile_grammar=compile_grammar)

    # Grammars compile on rank 0 only (its compile worker); the other ranks get each compiled
    # grammar, serialized, in the step message before the first request that uses it, and drop
    # it when rank 0's cache does, so every rank holds what rank 0 decided.
    def grammar_ready(self, kind: str, value: str) -> bool:
        return self.engine.grammar_ready(kind, value)

    def request_grammar(self, kind: str, value: str) -> None:
        self.engine.request_grammar(kind, value)

    def cancel_grammar(self, kind: str, value: str) -> None:
        self.engine.cancel_grammar(kind, value)

    def finished_grammars(self) -> list[CompileOutcome]:
        return self.engine.finished_grammars()

    def install_grammar(self, outcome: CompileOutcome) -> None:
        self.engine.install_grammar(outcome)
        info = self.engine.grammar_info_json
        if not self._grammar_info_sent and info is not None:
            self._ops.append(["grammar_info", info])
            self._grammar_info_sent = True
        self._ops.append(["grammar", outcome.kind, outcome.value, outcome.serialized])
        self._ops += [["grammar_forget", kind, value] for kind, value in outcome.evicted]

    def add_request(
        self,
        rid: str,
        prompt_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> None:
        self.engine.validate(prompt_ids, params)
        arrival = time.time() if arrival_time is None else arrival_time
        seed = params.seed if params.seed is not None else self.engine.draw_seed()
        params = dataclasses.replace(params, seed=seed)  # every rank samples alike
        self._ops.append(["add", rid, list(prompt_ids), dataclasses.asdict(params), arrival])

    def abort_request(self, rid: str, index: int | None = None) -> bool:
        pending = any(op[0] == "add" and op[1] == rid for op in self._ops)
        known = pending or self.engine.is_live(rid)
        if known:
            self._ops.append(["abort", rid, index])
        return known

    def has_unfinished(self) -> bool:
        return bool(self._ops) or self.engine.has_unfinished()

    def stats(self) -> SchedulerStats:
        return self.engine.stats()

    def rank_stats(self, timeout_s: float = 10.0) -> list[SchedulerStats]:
        """Every rank's own scheduler stats (rank 0 first): they must agree, leaks included."""
        self._pub.send(msgpack.packb([_STATS, []]))
        replies: dict[int, SchedulerStats] = {}
        deadline = time.monotonic() + timeout_s
        while len(replies) < self._num_followers:
            if time.monotonic() > deadline:
                raise TimeoutError("tensor-parallel ranks did not report their stats")
            if self._ack.poll(100):
                msg = _decode(self._ack.recv())
                if isinstance(msg, list):  # [rank, stats]; late handshake acks are ints
                    rank, stats = _rank_stats(msg)
                    if rank is not None and stats is not None:
                        replies[rank] = stats
        return [self.engine.stats()] + [replies[r] for r in sorted(replies)]

    def step(self) -> list[StepOutput]:
        self._check_followers()
        ops, self._ops = self._ops, []
        self._pub.send(msgpack.packb([_STEP, ops]))
        apply_ops(self.engine, ops)
        return self.engine.step()

    def shutdown(self) -> None:
        if getattr(self, "_closed", False):
            return
        self._closed = True
        if hasattr(self, "engine"):
            self.engine.shutdown()  # its grammar compile worker
        with contextlib.suppress(zmq.ZMQError):
            self._pub.send(msgpack.packb([_EXIT, []]))
        for p in self._procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self._guard.close()
        self._pub.close()
        self._ack.close()
        self._closed_sockets = True
        self._ctx.term()
        if self._link is not None:
            self._link.close()
        _destroy_distributed()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.shutdown()

    # internals ----------------------------------------------------------------------------
    def _wait_checked_in(self) -> None:
        """Every follower is running our code, right before it joins torch.distributed."""
        up: set[int] = set()
        deadline = time.monotonic() + _HANDSHAKE_TIMEOUT_S
        while len(up) < self._num_followers:  # other nodes' ranks check in too
            self._check_followers()
            if time.monotonic() > deadline:
                raise TPRankError("tensor-parallel ranks did not start in time")
            msg = self._recv_start_message(50)
            if isinstance(msg, list) and msg[0] == _UP and 0 < msg[1] <= self._num_followers:
                up.add(msg[1])

    def _wait_joining(self, args: EngineArgs) -> None:
        """Until every follower is inside torch.distributed's rendezvous: gloo's rank 0 would
        wait there, for the group's whole timeout, for a rank that failed on its way in. Each
        follower's address in the group's store says it is in (rank 0 adds its own only when
        it joins); one that dies after that fails rank 0's connection to it at once. NCCL
        joins lazily: its rank 0 waits for nobody there."""
        if default_backend(args.device) != "gloo":
            return
        deadline = time.monotonic() + _HANDSHAKE_TIMEOUT_S
        while self._store.num_keys() < self._num_followers:
            self._check_followers()
            if time.monotonic() > deadline:
                raise TPRankError("tensor-parallel ranks did not join torch.distributed in time")
            self._recv_start_message(20)  # a failure report raises

    def _handshake(self, num_followers: int) -> None:
        confirmed: set[int] = set()
        deadline = time.monotonic() + _HANDSHAKE_TIMEOUT_S
        while len(confirmed) < num_followers:
            self._check_followers()
            if time.monotonic() > deadline:
                raise TimeoutError("tensor-parallel followers did not subscribe in time")
            self._pub.send(msgpack.packb([_HELLO, []]))
            msg = self._recv_start_message(50)
            if isinstance(msg, int) and 0 < msg <= num_followers:
                confirmed.add(msg)
        logger.info("tensor parallel: %d follower rank(s) subscribed", num_followers)

    def _recv_start_message(self, timeout_ms: int) -> Any:
        """The next start-up message from a follower, None if none came; a failure raises."""
        if not self._ack.poll(timeout_ms):
            return None
        msg = _start_message(_decode(self._ack.recv()))
        if isinstance(msg, list) and msg[0] == _FAILED:
            self._failures[msg[1]] = msg[2]
            raise TPRankError(self._follower_failure() or msg[2])
        return msg

    def _follower_failure(self) -> str | None:
        """What went wrong with the followers, in words: their own reports, else their exits."""
        with contextlib.suppress(zmq.ZMQError):
            while not self._closed_sockets and self._ack.poll(0):
                msg = _start_message(_decode(self._ack.recv()))
                if isinstance(msg, list) and msg[0] == _FAILED:
                    self._failures[msg[1]] = msg[2]
        if self._failures:
            return "; ".join(
                f"tensor-parallel rank {r} failed during start-up: {e}"
                for r, e in sorted(self._failures.items())
            )
        dead = [(r, p) for r, p in enumerate(self._procs, start=1) if p.exitcode is not None]
        if not dead:
            return None
        parts = [
            f"tensor-parallel rank {r} (pid {p.pid}) exited with code {p.exitcode}" for r, p in dead
        ]
        why = spawn_main_problem()
        why = why or (
            "its error is printed above; one that dies before running our code usually means "
            "spawn could not re-run the main script: start tensor-parallel engines under "
            "`if __name__ == '__main__':`"
        )
        return "; ".join(parts) + f": {why}"

    def _check_followers(self) -> None:
        if any(not p.is_alive() for p in self._procs):
            for p in self._procs:
                p.join(timeout=1)  # let a failing rank's report arrive before its exit code
            raise TPRankError(self._follower_failure() or "a tensor-parallel rank died")


_DROPPED = object()  # a message that was logged and dropped


def _decode(raw: bytes) -> Any:
    try:
        return msgpack.unpackb(raw)
    except Exception as e:  # msgpack raises several kinds on bad input
        logger.warning("tensor-parallel acks: dropped a message that is not msgpack (%s)", e)
        return _DROPPED


def _start_message(msg: Any) -> Any:
    """A follower's start-up message as rank 0 reads it: a rank (subscribed), [up, rank, ""]
    or [failed, rank, error]; anything else is logged and dropped."""
    if msg is _DROPPED:
        return None
    if isinstance(msg, int) and not isinstance(msg, bool):
        return msg
    if (
        isinstance(msg, list)
        and len(msg) == 3
        and msg[0] in (_UP, _FAILED)
        and isinstance(msg[1], int)
        and isinstance(msg[2], str)
    ):
        return msg
    if isinstance(msg, list) and len(msg) == 2:
        return None  # a late stats reply: nobody waits for it
    logger.warning("tensor-parallel acks: dropped a malformed start-up message %.200r", msg)
    return None


def _rank_stats(msg: list[Any]) -> tuple[int | None, SchedulerStats | None]:
    """A follower's [rank, stats] reply; (None, None) after logging when it is not one."""
    try:
        rank, fields = msg
        if not isinstance(rank, int) or not isinstance(fields, dict):
            raise TypeError("not [rank, {stats}]")
        return rank, SchedulerStats(**fields)
    except (TypeError, ValueError) as e:
        logger.warning("tensor-parallel acks: dropped a malformed stats reply %.200r (%s)", msg, e)
        return None, None


def apply_ops(engine: Engine, ops: list[list[Any]]) -> None:
    for op in ops:
        if op[0] == "add":
            _, rid, prompt_ids, params, arrival = op
            engine.add_request(rid, prompt_ids, SamplingParams(**params), arrival_time=arrival)
        elif op[0] == "abort":
            engine.abort_request(op[1], op[2])
        elif op[0] == "grammar_info":
            engine.grammars.adopt_info(op[1])
        elif op[0] == "grammar":
            _, kind, value, serialized = op
            if not engine.grammars.has(kind, value):  # rank 0 has it already
                compiled = engine.grammars.deserialize(serialized)
                engine.grammars.install(kind, value, compiled, None)
        elif op[0] == "grammar_forget":
            engine.grammars.forget((op[1], op[2]))


def _destroy_distributed() -> None:
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass


def follower_main(args_dict: dict, rank: int, rdv_dict: dict, parent_pid: int) -> None:
    """Ranks 1..N-1: load the shard, subscribe, then mirror rank 0 step by step."""
    # A terminal's Ctrl-C and a service manager's SIGTERM reach the whole process group; rank 0
    # decides when followers stop (on a node of its own, its agent: STOP_SIGNAL).
    ignore_group_signals()
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s tp{rank} %(levelname)s %(message)s"
    )
    args, rdv = EngineArgs(**args_dict), Rendezvous(**rdv_dict)
    # Rank 0 gone (killed while this rank loads, or later): nothing is left to follow.
    leave_with_parent(parent_pid)
    ctx = zmq.Context()
    ack = ctx.socket(zmq.PUSH)
    ack.setsockopt(zmq.LINGER, 1000)
    _connect(ack, rdv, rdv.ack_port)
    try:
        sub, engine = _follower_start(args, rank, rdv, ctx, ack)
    except BaseException as exc:
        # Rank 0 waits for this rank: tell it why it will not come, then leave.
        ack.send(msgpack.packb([_FAILED, rank, f"{type(exc).__name__}: {exc}"]))
        ack.close()
        ctx.term()
        raise
    _follow(engine, rank, parent_pid, ctx, sub, ack)


def _connect(sock: zmq.Socket, rdv: Rendezvous, port: int) -> None:
    curve.connect_as_client(sock, bytes.fromhex(rdv.secret))
    sock.setsockopt(zmq.IPV6, 1)
    sock.connect(_zmq_addr(rdv.host, port))


def _follower_start(
    args: EngineArgs, rank: int, rdv: Rendezvous, ctx: zmq.Context, ack: zmq.Socket
) -> tuple[zmq.Socket, Engine]:
    # Test hook: a follower that subscribes late must still see every message (slow joiner).
    time.sleep(float(os.environ.get("MINISGL_TP_SUBSCRIBE_DELAY_S", "0")))
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVHWM, 0)
    _connect(sub, rdv, rdv.pub_port)
    ack.send(msgpack.packb([_UP, rank, ""]))
    try:
        store = rendezvous_store(rdv.host, rdv.dist_port, args.tp_size, rank)
        _join_group(args, rank, store)
        engine = Engine(args, tp_rank=rank)
    except BaseException:
        sub.close(0)
        raise
    freeze_startup_objects()
    return sub, engine


def _follow(
    engine: Engine, rank: int, parent_pid: int, ctx: zmq.Context, sub: zmq.Socket, ack: zmq.Socket
) -> None:
    acked = False
    try:
        while True:
            if not sub.poll(1000):
                if os.getppid() != parent_pid:  # rank 0 is gone: do not linger
                    return
                continue
            kind, ops = msgpack.unpackb(sub.recv(), strict_map_key=False)  # logit_bias: int keys
            if kind == _HELLO:
                if not acked:
                    ack.send(msgpack.packb(rank))
                    acked = True
            elif kind == _STEP:
                apply_ops(engine, ops)
                engine.step()
            elif kind == _STATS:
                ack.send(msgpack.packb([rank, dataclasses.asdict(engine.stats())]))
            elif kind == _EXIT:
                return
    finally:
        sub.close(0)
        ack.close()
        ctx.term()
        _destroy_distributed()
