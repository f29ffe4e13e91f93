"""More than one node: which node each rank runs on, and the bytes that cross between nodes.

Node of a rank: torchrun's node rank ``GROUP_RANK`` where every rank has it (each agent of a
c10d rendezvous gets one; ranks ``[k·P, (k+1)·P)`` of P processes per node run on node k), else
the rank's host name (the nodes in order of their lowest rank). Every rank reports
``{"rank", "node", "host", "local_rank"}`` (:func:`this_node`), gathered once before the
modes run; rank 0 keeps the map (:func:`node_map`, report.json ``nodes``).

Bytes between nodes (:func:`node_traffic`, each run's ``nodes``): every measured collective
of every rank (all bytes, not only the dedicated share: what the network carries), charged
per member with the per-rank wire model of ``verify.traffic.wire`` (ring in group-rank order,
chains for broadcast / reduce, pairwise all_to_all), and the part each member sends to, and
receives from, a member on another node:

- ring ops (all_reduce, all_gather, reduce_scatter) and the broadcast / reduce chains: a
  member sends to the next group rank and receives from the previous one, so its bytes
  cross nodes when that neighbour is on another node;
- all_to_all: a member sends to and receives from every other member, an equal part each
  (exact for an even all_to_all; DMuon's uneven ones on gloo record no per-peer sizes);
- gather / scatter: the root and each other member;
- send / recv / barrier: no group peer recorded, left out (``unplaced_events`` counts them).

A group's members are its ``group_id`` (sorted world ranks, ``tracer.events``); group rank i
is the i-th of them. Where a group holds one member per node, as HSDP's replicate groups when
the replicate axis spans the nodes, every byte it moves crosses nodes. NCCL's own ring is
chosen by its topology search (it keeps a node's ranks together where it can), so for groups
with several members per node this is the bytes under the group-rank ring, not a measurement
of the network.
"""

from __future__ import annotations

import json
import os
import socket
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path

from tracer.events import CollectiveEvent

from verify.traffic.wire import wire_report

#: File a node without rank 0 writes in its output folder: where the report is.
NODE_FILE = "node.json"
_RING = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce")


def this_node() -> dict:
    """This rank's ``{"rank", "node", "host", "local_rank"}`` from torchrun's environment
    (``RANK``, ``GROUP_RANK``, ``LOCAL_RANK``; ``node`` is ``None`` without ``GROUP_RANK``)."""
    group = os.environ.get("GROUP_RANK")
    return {"rank": int(os.environ.get("RANK", "0")), "node": int(group) if group else None,
            "host": socket.gethostname(), "local_rank": int(os.environ.get("LOCAL_RANK", "0"))}


def node_map(infos: Sequence[dict]) -> dict:
    """report.json ``nodes`` from every rank's :func:`this_node`, in rank order:
    ``{"count", "source", "of_rank": [node per rank], "hosts": [host per node]}``.

    Raises:
        ValueError: the ranks are not 0..W-1 in order.
    """
    if [i["rank"] for i in infos] != list(range(len(infos))):
        raise ValueError(f"Invalid node infos: ranks {[i['rank'] for i in infos]}. Must be 0..W-1 in order.")
    if all(i["node"] is not None for i in infos):
        of_rank, source = [i["node"] for i in infos], "GROUP_RANK (torchrun's node rank)"
    else:
        order = list(dict.fromkeys(i["host"] for i in infos))
        of_rank, source = [order.index(i["host"]) for i in infos], "host name"
    count = max(of_rank) + 1
    hosts = [next(i["host"] for i in infos if n == of_rank[i["rank"]]) for n in range(count)]
    return {"count": count, "source": source, "of_rank": of_rank, "hosts": hosts}


def _members(ev: CollectiveEvent) -> list[int] | None:
    """The world ranks of ``ev``'s group in group-rank order, or ``None`` where the event
    does not say them (no ``group_id``, or its rank is not the member at its group rank)."""
    if not ev.group_id or ev.group_rank is None:
        return None
    members = [int(r) for r in ev.group_id.split(",")]
    if len(members) != ev.group_size or members[ev.group_rank] != ev.rank:
        return None
    return members


def cross_share(ev: CollectiveEvent, node_of: Sequence[int]) -> tuple[float, float] | None:
    """``(sent, received)`` fractions of one member's wire elements of ``ev`` that go to, and
    come from, members on another node (module docstring); ``None`` where it cannot be placed."""
    members = _members(ev)
    if members is None or ev.op in ("send", "recv"):
        return None
    n, g = len(members), ev.group_rank
    if n <= 1 or ev.op == "barrier":
        return 0.0, 0.0
    mine = node_of[ev.rank]

    def away(r: int) -> float:
        return float(node_of[r] != mine)

    others = sum(away(r) for r in members if r != ev.rank) / (n - 1)
    if ev.op in _RING:
        return away(members[(g + 1) % n]), away(members[(g - 1) % n])
    if ev.op == "all_to_all":
        return others, others
    root = members[ev.root] if ev.root is not None and 0 <= ev.root < n else None
    if root is None:
        return None
    if ev.op == "gather":
        return (0.0, others) if ev.rank == root else (away(root), 0.0)
    return (others, 0.0) if ev.rank == root else (0.0, away(root))  # scatter


def node_traffic(events: Sequence[CollectiveEvent], node_of: Sequence[int], steps: int,
                 self_elems: Callable[[CollectiveEvent], int | None] | None = None,
                 hosts: Sequence[str] = ()) -> dict:
    """A run's ``nodes``: per node its ranks and bytes per step, and the share that crosses.

    Args:
        events: every rank's measured events over ``steps`` steps.
        node_of: the node of each world rank (:func:`node_map`'s ``of_rank``).
        self_elems: an uneven all_to_all's own chunk (``verify.traffic.wire``), from the
            prediction; without it such a call is left out of the bytes.
        hosts: host name per node, for the table.

    Returns:
        ``{"per_node": [{"node", "host", "ranks", "sent_bytes", "recv_bytes",
        "inter_node_sent_bytes", "inter_node_recv_bytes"}], "inter_node_sent_bytes",
        "sent_bytes", "inter_node_share", "spanning_groups": {group_id: inter-node bytes sent
        per step}, "unplaced_events"}``; bytes per step, all collectives.
    """
    world = len(node_of)
    placed, unplaced = [], 0
    shares: dict[int, tuple[float, float]] = {}
    for ev in events:
        share = cross_share(ev, node_of)
        if share is None:
            unplaced += 1
            continue
        placed.append(ev)
        shares[id(ev)] = share
    total = wire_report(placed, world_size=world, steps=steps, share=lambda ev: 1.0, self_elems=self_elems)
    cross = wire_report(placed, world_size=world, steps=steps, share=lambda ev: shares[id(ev)],
                        self_elems=self_elems)
    by_group: dict[str, list] = defaultdict(list)
    for ev in placed:
        by_group[ev.group_id].append(ev)
    spanning = {}
    for gid, evs in sorted(by_group.items()):
        one = wire_report(evs, world_size=world, steps=steps, share=lambda e: shares[id(e)],
                          self_elems=self_elems)
        if any(e["sent_bytes"] for e in one["per_rank"]):
            spanning[gid] = sum(e["sent_bytes"] for e in one["per_rank"])
    per_node = []
    for n in range(max(node_of) + 1):
        ranks = [r for r in range(world) if node_of[r] == n]
        per_node.append({
            "node": n, "host": hosts[n] if n < len(hosts) else "", "ranks": ranks,
            "sent_bytes": sum(total["per_rank"][r]["sent_bytes"] for r in ranks),
            "recv_bytes": sum(total["per_rank"][r]["recv_bytes"] for r in ranks),
            "inter_node_sent_bytes": sum(cross["per_rank"][r]["sent_bytes"] for r in ranks),
            "inter_node_recv_bytes": sum(cross["per_rank"][r]["recv_bytes"] for r in ranks),
        })
    sent = sum(e["sent_bytes"] for e in per_node)
    inter = sum(e["inter_node_sent_bytes"] for e in per_node)
    return {"per_node": per_node, "sent_bytes": sent, "inter_node_sent_bytes": inter,
            "inter_node_share": inter / sent if sent else 0.0,
            "spanning_groups": spanning, "unplaced_events": unplaced}


def own_chunks(layout) -> Callable[[CollectiveEvent], int | None]:
    """An uneven all_to_all's own chunk from the run's prediction (what ``verify.traffic.wire``
    needs to charge it), by the comparison's event key."""
    from verify.compare import event_key

    by_key = {e.key(): e for e in layout.predict_calls()}
    return lambda ev: getattr(by_key.get(event_key(ev)), "self_elems", None)


def write_node_file(out_dir: str | Path, node: int, ranks: list[int], report_host: str, code: int) -> Path:
    """On a node without rank 0: ``<out_dir>/node.json`` saying where the report is."""
    path = Path(out_dir) / NODE_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"node": node, "ranks": ranks, "report_host": report_host,
                                "exit_code": code}) + "\n")
    return path


def report_elsewhere(out_dir: str | Path) -> str | None:
    """What the launcher prints on a node whose folder has no report (``node.json``), or ``None``."""
    path = Path(out_dir) / NODE_FILE
    if not path.is_file() or (Path(out_dir) / "report.json").is_file():
        return None
    info = json.loads(path.read_text())
    return (f"node {info['node']} (ranks {info['ranks']}): rank 0 wrote the report on host "
            f"{info['report_host']}; this node's files were sent to it")
