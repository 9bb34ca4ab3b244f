"""Which SuperNode hosts which client, for both Flower strategies (CIDERS and the bilevel family).

Flower's node ids change per run and per restart; a client's stable id is `client<partition-id>`, which
the node reports in reply to a `hello` query. `discover` asks every connected node not mapped yet,
repeating for up to `grace` seconds while some client has no node; a node that left is forgotten and
asked again if it comes back (a restarted node replaces the old one).
"""

from __future__ import annotations

import time
from typing import Callable, Container, Sequence

from flwr.app import Message
from flwr.serverapp import Grid

from ciders.core.wire import PayloadError
from ciders.transports.flower import messages as fm


class NodeMap:
    def __init__(self, ids: Sequence[str], valid: Container[str], hello_timeout_s: float,
                 log: Callable[[str], None] = print):
        self.ids, self.valid, self.hello_timeout_s, self.log = list(ids), valid, hello_timeout_s, log
        self.node_of: dict[str, int] = {}  # client id -> node id hosting it now
        self.asked: dict[int, str] = {}  # node id -> client id it reported
        self.edge_of: dict[str, str] = {}  # client id -> digest of the edge spec its node holds ("" none)

    def discover(self, grid: Grid, grace: float, quiet: bool = False) -> None:
        deadline = time.monotonic() + grace
        while True:
            nodes = set(grid.get_node_ids())
            for cid in [c for c, n in self.node_of.items() if n not in nodes]:
                self.asked.pop(self.node_of.pop(cid), None)  # gone: ask again if it comes back
            new = [n for n in nodes if self.asked.get(n) is None]
            if new:
                self._hello(grid, new)
            missing = [c for c in self.ids if c not in self.node_of]
            if not missing or time.monotonic() >= deadline:
                break
            time.sleep(2.0)
        if missing and not quiet:
            self.log(f"no SuperNode for {', '.join(missing)}")

    def forget(self, cid: str, node: int) -> None:
        """`node` no longer answers for `cid` (e.g. Flower reported it unavailable)."""
        if self.node_of.get(cid) == node:
            self.asked.pop(self.node_of.pop(cid), None)

    def _hello(self, grid: Grid, nodes: list[int]) -> None:
        msgs = [Message(fm.pack({"kind": "hello"}), dst_node_id=n, message_type="query") for n in nodes]
        for rep in grid.send_and_receive(msgs, timeout=min(self.hello_timeout_s, 60.0)):
            node = rep.metadata.src_node_id
            if rep.has_error():
                self.log(f"node {node}: no client id ({rep.error.reason})")
                continue
            try:
                cid = str(fm.fields_of(rep.content)["client_id"])
            except (PayloadError, KeyError) as exc:
                self.log(f"node {node}: unreadable hello reply ({exc})")
                continue
            if cid not in self.valid:
                self.log(f"node {node} hosts {cid!r}, which is not a client of this run: ignored")
                continue
            self.asked[node] = cid
            self.node_of[cid] = node  # a restarted node replaces the old one
            edge = fm.fields_of(rep.content).get("edge", "")
            self.edge_of[cid] = edge if isinstance(edge, str) else ""
