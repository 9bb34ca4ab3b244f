"""The Flower transport: one round phase's messages sent through a Flower `Grid` (simulation or deployment),
the replies collected. It is the in-process transport's twin (`federation.exchange`), for both method
families: the round loop stays ciders's (`federation.loop.run_rounds`), Flower only moves the bytes.

Per phase:
  setup    (CIDERS, at a client's first contact) the edge spec (`models.edge_spec`: AdapEmu's config, the
           tokenizer, the split) to every addressed client whose `hello` reported another digest; the
           emulator's weights follow in its first broadcast, so the client never needs the full model
  nodes    `NodeMap` maps SuperNodes to stable client ids (a `hello` query); at a round's first phase it
           waits `flower.node_wait_s` (the first round) or `flower.rejoin_wait_s` (later rounds) for
           missing clients. A CIDERS train phase none of whose clients has a node stops the run with an
           error instead of committing an empty round.
  train    one Flower message per addressed client {family, phase, round, committed, config} + its bytes,
           collected for up to `flower.round_timeout_s` (later replies are not part of the round: Flower
           drops them). A client error reply comes back as Reply.error (the node is asked its id again);
           a reply that claims another client's id or cannot be read comes back as Reply.rejected.
  report   (CIDERS evaluation) a Flower `evaluate` message to each client whose personalized messenger
           the evaluation reads, waiting up to `flower.eval_timeout_s`; a client whose node is reported
           unavailable is asked again when its SuperNode rejoins (under a new or the same node id).
           Clients with no node when the evaluation starts and no train message this round are not
           waited for.
"""

from __future__ import annotations

import time
from typing import Callable

from flwr.app import Message
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid

from ciders.core.wire import PayloadError
from ciders.errors import CidersError
from ciders.models.edge_spec import spec_digest
from ciders.federation.exchange import Reply
from ciders.transports.flower import messages as fm
from ciders.transports.flower.nodes import NodeMap


class FlowerExchange:
    """`family`: "ciders" or "bilevel" (the client dispatches on it); `first_phases`: the phases that open
    a round (node discovery waits there)."""

    def __init__(self, grid: Grid, config_text: str, ids: list[str], fcfg, family: str,
                 log: Callable[[str], None] = print, first_phases: tuple[str, ...] = ("train", "inner", "local", "secagg_keys"),
                 edge_spec: dict[str, bytes] | None = None):
        self.grid, self.config_text, self.fcfg, self.family, self.log = grid, config_text, fcfg, family, log
        self.edge_spec = edge_spec
        self.edge_sha = spec_digest(edge_spec) if edge_spec else ""
        self.setup_bytes: dict[str, int] = {}  # client id -> bytes of the edge spec sent to it
        self.nodes = NodeMap(ids, set(ids), fcfg.round_timeout_s, log)
        self.first_phases, self.started = first_phases, False
        self.trained: set[str] = set()  # clients sent this round's train message (waited for at report)

    def __call__(self, phase: str, t: int, messages: dict[str, bytes]) -> list[Reply]:
        if phase == "report":
            return self._report(t, list(messages))
        opening = phase in self.first_phases
        grace = (self.fcfg.rejoin_wait_s if self.started else self.fcfg.node_wait_s) if opening else 0.0
        self.nodes.discover(self.grid, grace, quiet=not opening)
        self.started = True
        if self.edge_spec and opening:
            self._setup([c for c in messages if c in self.nodes.node_of and self.nodes.edge_of.get(c) != self.edge_sha])
        if self.family == "ciders" and messages and not any(c in self.nodes.node_of for c in messages):
            raise CidersError(f"round {t}: none of the sampled clients ({', '.join(messages)}) has a connected "
                              f"SuperNode; the run stops after round {t - 1} (committed). Start the SuperNodes "
                              "and launch again with resume=true")
        sent, out = {}, []
        for cid, payload in messages.items():
            node = self.nodes.node_of.get(cid)
            if node is None:
                continue
            out.append(Message(fm.pack(self._fields(phase, t), payload), dst_node_id=node, message_type="train"))
            sent[node] = cid
        if phase == "train" or opening:  # (a secure round opens with secagg_keys; its train phase comes later)
            self.trained = set(sent.values())
        replies = []
        for rep in self.grid.send_and_receive(out, timeout=self.fcfg.round_timeout_s) if out else []:
            cid = sent.get(rep.metadata.src_node_id)
            if cid is None:
                self.log(f"round {t} {phase}: reply from node {rep.metadata.src_node_id}, which was sent nothing: "
                         "ignored")
                continue
            if rep.has_error():
                self.nodes.asked.pop(rep.metadata.src_node_id, None)  # ask its id again
                replies.append(Reply(cid, error=str(rep.error.reason)))
                continue
            try:
                f = fm.fields_of(rep.content)
                if f.get("client_id") != cid:
                    raise PayloadError(f"reply claims to be from {f.get('client_id')!r}")
                replies.append(Reply(cid, fm.payload_of(rep.content), fm.record_of(f)))
            except PayloadError as exc:
                replies.append(Reply(cid, rejected=str(exc)))
        return replies

    def _setup(self, cids: list[str]) -> None:
        """First contact: the edge spec (AdapEmu's config, the tokenizer, the split) to each client that does
        not hold this run's; a client that fails to store it fails its train message, and is sent it again."""
        if not cids:
            return
        names = sorted(self.edge_spec)
        fields = {"kind": "setup", "sha": self.edge_sha, "names": names,
                  **{f"file{i}": self.edge_spec[n] for i, n in enumerate(names)}}
        size = sum(len(b) for b in self.edge_spec.values())
        sent = {self.nodes.node_of[c]: c for c in cids}
        msgs = [Message(fm.pack(fields), dst_node_id=n, message_type="query") for n in sent]
        for rep in self.grid.send_and_receive(msgs, timeout=self.fcfg.round_timeout_s):
            cid = sent.get(rep.metadata.src_node_id)
            if cid is None:
                continue
            if rep.has_error():
                self.log(f"{cid}: the edge spec was not stored ({rep.error.reason})")
                continue
            try:
                held = fm.fields_of(rep.content).get("edge")
            except PayloadError as exc:
                self.log(f"{cid}: unreadable setup reply ({exc})")
                continue
            if held == self.edge_sha:
                self.nodes.edge_of[cid] = self.edge_sha
                self.setup_bytes[cid] = self.setup_bytes.get(cid, 0) + size
                self.log(f"{cid}: sent the edge spec ({size / 2**20:.2f} MiB: AdapEmu's config, tokenizer, split)")

    def _fields(self, phase: str, t: int) -> dict:
        # rounds commit in order, so the last committed one is t - 1 (the client drops later records)
        return {"family": self.family, "phase": phase, "round": t, "committed": t - 1, "config": self.config_text}

    def _report(self, t: int, wanted: list[str]) -> list[Reply]:
        grid, nodes = self.grid, self.nodes
        deadline = time.monotonic() + self.fcfg.eval_timeout_s
        pending: dict[str, tuple[str, int]] = {}  # message id -> (client id, node id asked)
        out: list[Reply] = []
        done: set[str] = set()  # answered: with a messenger, without one, or with an error
        nodes.discover(grid, 0.0)  # a node restarted during training gets its new node id mapped
        # waited for: clients with a node now, and those sent this round's training (a node that died after
        # training, before its heartbeat lapsed, may be gone now and back in a minute); others are not
        expect = [c for c in wanted if c in nodes.node_of or c in self.trained]
        while True:
            asking = {c for c, _ in pending.values()}
            new = [(c, nodes.node_of[c]) for c in wanted if c not in done and c not in asking and c in nodes.node_of]
            msgs = [Message(fm.pack(self._fields("report", t)), dst_node_id=n, message_type="evaluate") for _, n in new]
            pending.update((mid, asked) for mid, asked in zip(grid.push_messages(msgs) if msgs else [], new) if mid)
            for rep in grid.pull_messages(list(pending)) if pending else []:
                cid, node = pending.pop(rep.metadata.reply_to_message_id, (None, None))
                if cid is None:
                    continue
                if rep.has_error() and rep.error.code == ErrorCode.NODE_UNAVAILABLE:
                    self.log(f"round {t}: {cid}'s node is unavailable; asking again if it rejoins in time")
                    nodes.forget(cid, node)  # discover maps its successor
                    continue
                done.add(cid)
                if rep.has_error():
                    self.log(f"round {t}: no personalized messenger from {cid} ({rep.error.reason})")
                    continue
                try:
                    out.append(Reply(cid, fm.payload_of(rep.content)))
                except PayloadError as exc:
                    self.log(f"round {t}: rejected report from {cid}: {exc}")
            if all(c in done for c in expect) or time.monotonic() >= deadline:
                break
            time.sleep(1.0)
            nodes.discover(grid, 0.0, quiet=True)
        return out
