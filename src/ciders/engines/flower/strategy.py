"""CidersStrategy: a `flwr.serverapp.strategy.Strategy` whose every step is the in-process engine's.

Flower round r (1-based) is ciders round t = first + r - 1 (a resumed run starts after its checkpoint).
  configure_train    find which SuperNode hosts which client (a `query` to nodes not mapped yet; waiting
                     `flower.node_wait_s` for all of them at the first round, `flower.rejoin_wait_s`
                     for dropped-out ones later; a round none of whose clients is connected stops the
                     run with an error instead of committing an empty round), sample
                     clients exactly as the in-process engine, one message per client with its own
                     broadcast (Coordinator.broadcast). A sampled client without a connected node misses
                     the round, like a lost reply.
  aggregate_train    replies -> checked payloads -> Coordinator.aggregate (Eq. 11-12) and .takd (Eq. 13).
                     Error replies, replies from nodes that claim another client's id, and bad payloads
                     are rejected and logged with the client id; they never touch global state.
                     Replies that come after `flower.round_timeout_s` are not part of the round (Flower
                     drops them), so p_i is renormalised over the uploads that arrived.
  evaluate_fn        (called by Strategy.start after each round) when the round evaluates, a `report`
                     request (message type evaluate) to the nodes of the clients whose personalized
                     messengers the evaluation reads, waiting up to `flower.eval_timeout_s` and asking
                     again a client whose node dropped out once it has rejoined (evaluation
                     traffic, not counted in the training bytes, as in-process where the engine reads
                     them from the client store); then Coordinator.finish: evaluate, log, checkpoint,
                     commit. (Strategy.start's own evaluate phase is unused: it shares the train timeout.)
"""

from __future__ import annotations

import time
from typing import Callable, Iterable

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from ciders.core.wire import PayloadError
from ciders.errors import CidersError
from ciders.engines.flower import messages as fm
from ciders.engines.flower.nodes import NodeMap
from ciders.engines.rounds import Coordinator, Reply


class CidersStrategy(Strategy):
    def __init__(self, co: Coordinator, config_text: str, log: Callable[[str], None] = print):
        self.co, self.config_text, self.log = co, config_text, log
        self.first = co.first_round
        self.fcfg = co.cfg.flower
        self.nodes = NodeMap(co.ids, co.sizes, self.fcfg.round_timeout_s, log)
        self.node_of, self.asked = self.nodes.node_of, self.nodes.asked  # client id <-> node id, shared dicts
        self.grid: Grid | None = None
        self.sent: dict[int, str] = {}  # node id -> client id of this round's train messages

    def summary(self) -> None:
        from ciders import algorithms

        self.log(f"CidersStrategy: {algorithms.method_name(self.co.cfg)}, rounds {self.first}..{self.co.cfg.federation.rounds - 1}")

    # ------------------------------------------------------------------ nodes -> clients
    def _discover(self, grid: Grid, grace: float, quiet: bool = False) -> None:
        self.nodes.discover(grid, grace, quiet)

    def _round(self, server_round: int) -> int:
        return self.first + server_round - 1

    # ------------------------------------------------------------------ train
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        t = self._round(server_round)
        self.grid = grid
        self._discover(grid, self.fcfg.node_wait_s if server_round == 1 else self.fcfg.rejoin_wait_s)
        sampled = self.co.begin(t)
        if not any(cid in self.node_of for cid in sampled):
            raise CidersError(f"round {t}: none of the sampled clients ({', '.join(sampled)}) has a connected "
                              f"SuperNode; the run stops after round {self.co.committed} (committed). Start the "
                              "SuperNodes and launch again with resume=true")
        self.sent = {}
        out = []
        for cid in sampled:
            node = self.node_of.get(cid)
            if node is None:
                continue
            fields = {"kind": "train", "round": t, "committed": self.co.committed, "config": self.config_text}
            out.append(Message(fm.pack(fields, self.co.broadcast(t, cid)), dst_node_id=node, message_type="train"))
            self.sent[node] = cid
        return out

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        t = self._round(server_round)
        got, bad = [], {}
        for rep in replies:
            cid = self.sent.get(rep.metadata.src_node_id)
            if cid is None:
                self.log(f"round {t}: reply from node {rep.metadata.src_node_id}, which was sent nothing: ignored")
                continue
            if rep.has_error():
                bad[cid] = f"client error: {rep.error.reason}"
                self.asked.pop(rep.metadata.src_node_id, None)
                self.co.contacted.discard(cid)  # e.g. lost its static components: send them again
                continue
            try:
                f = fm.fields_of(rep.content)
                if f.get("client_id") != cid:
                    raise PayloadError(f"reply claims to be from {f.get('client_id')!r}")
                got.append(Reply(cid, fm.payload_of(rep.content), fm.record_of(f)))
            except PayloadError as exc:
                bad[cid] = str(exc)
        missing = sorted(set(self.co.sampled) - {r.client_id for r in got} - set(bad))
        if missing:
            self.log(f"round {t}: no reply from {', '.join(missing)} within the round")
        self.co.aggregate(t, got, rejected=bad)  # logs every rejection with the client id
        self.co.takd(t)
        return None, MetricRecord({"replies": len(got)})

    # ------------------------------------------------------------------ evaluate
    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        return []  # personalized messengers are collected in evaluate_fn, with their own timeout

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        return None

    def _collect_personalized(self, t: int) -> dict:
        """The personalized messengers of `Coordinator.eval_clients(t)`, waiting up to
        `flower.eval_timeout_s`. A client whose node is unreachable (Flower answers NODE_UNAVAILABLE once
        the killed node's heartbeat lapses) is asked again when its SuperNode comes back under a new or
        the same node id, so a client restarted during the round is evaluated as in-process. Clients with no
        node when the evaluation starts and no training message this round are not waited for."""
        from ciders.core.wire import decode

        grid, wanted = self.grid, self.co.eval_clients(t)
        deadline = time.monotonic() + self.fcfg.eval_timeout_s
        fields = {"kind": "report", "round": t, "committed": self.co.committed, "config": self.config_text}
        pending: dict[str, tuple[str, int]] = {}  # message id -> (client id, node id asked)
        out: dict[str, dict] = {}
        done: set[str] = set()  # answered: with a messenger, without one, or with a rejected report
        self._discover(grid, 0.0)  # a node restarted during training gets its new node id mapped
        # waited for: clients with a node now, and those sent this round's training (a node that died after
        # training, before its heartbeat lapsed, may be gone now and back in a minute); others are not
        trained = set(self.sent.values())
        expect = [c for c in wanted if c in self.node_of or c in trained]
        while True:
            asking = {c for c, _ in pending.values()}
            new = [(c, self.node_of[c]) for c in wanted if c not in done and c not in asking and c in self.node_of]
            msgs = [Message(fm.pack(fields), dst_node_id=n, message_type="evaluate") for _, n in new]
            pending.update((mid, asked) for mid, asked in zip(grid.push_messages(msgs) if msgs else [], new) if mid)
            for rep in grid.pull_messages(list(pending)) if pending else []:
                cid, node = pending.pop(rep.metadata.reply_to_message_id, (None, None))
                if cid is None:
                    continue
                if rep.has_error() and rep.error.code == ErrorCode.NODE_UNAVAILABLE:
                    self.log(f"round {t}: {cid}'s node is unavailable; asking again if it rejoins in time")
                    self.nodes.forget(cid, node)  # _discover maps its successor
                    continue
                done.add(cid)
                if rep.has_error():
                    self.log(f"round {t}: no personalized messenger from {cid} ({rep.error.reason})")
                elif (got := self._read_report(t, cid, rep, decode)) is not None:
                    out[cid] = got
            if all(c in done for c in expect) or time.monotonic() >= deadline:
                break
            time.sleep(1.0)
            self._discover(grid, 0.0, quiet=True)
        missing = sorted(set(wanted) - set(out))
        if missing:
            self.log(f"round {t}: evaluating without the personalized messengers of {', '.join(missing)}")
        return out

    def _read_report(self, t: int, cid: str, rep: Message, decode) -> dict | None:
        try:
            comps, meta = decode(fm.payload_of(rep.content), {"personalized": self.co.ref})
            if meta.get("client_id") != cid:
                raise PayloadError(f"report claims to be from {meta.get('client_id')!r}")
        except PayloadError as exc:
            self.log(f"round {t}: rejected report from {cid}: {exc}")
            return None
        return comps.get("personalized")

    def evaluate_fn(self, server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        if server_round == 0:  # the pre-round evaluation happened when the run was set up
            return None
        t = self._round(server_round)
        pers = self._collect_personalized(t) if self.co.eval_due(t) else {}
        self.co.finish(t, pers)
        return MetricRecord({"round": t})
