"""The pure steps of a CIDERS round (`federation.rounds`): what reaches the server update and why the rest
does not. Each bad delivery is one a hostile or broken client or transport can produce."""

import pytest
import torch

from ciders.algorithms import ciders as alg
from ciders.federation import codec
from ciders.config import load_config
from ciders.federation.exchange import Reply
from synthetic import VEC, VectorTask, checked_uploads, one_round

def test_only_valid_uploads_of_sampled_clients_reach_the_server(tmp_path):
    cfg, task, ref, rnd, ups = one_round(tmp_path)
    a, b, c = rnd.sampled
    nan = codec.decode_upload(ups[c][0], ref)
    nan = codec.encode_upload(alg.Upload(nan.client_id, nan.round, nan.base_version,
                                         {k: torch.full_like(v, float("nan")) for k, v in nan.dc.items()}))[0]
    replies = [Reply(b, ups[a][0], ups[b][1]),  # b's node sends a's upload: claims another id
               Reply(a, *ups[a]),  # fine (arrives after b, is taken in sampling order)
               Reply(c, nan, ups[c][1]),  # not finite
               Reply(task.ids[3], ups[a][0], {}),  # never sampled this round
               Reply(c, b"", {}, kind="copy", rejected="not one flat uint8 array")]
    checked = checked_uploads(cfg, ref, task.clients(), rnd, replies)
    assert [u.client_id for u in checked.uploads] == [a]
    assert "claims to be from" in checked.rejected[b] and "NaN" in checked.rejected[c]
    assert "sent no train message in round 0" in checked.rejected[task.ids[3]]
    assert [r["bytes_up"] for r in checked.client_records] == [len(ups[a][0]), len(ups[a][0]), len(ups[c][0])]


def test_client_errors_and_transport_rejections_are_kept_with_their_reason(tmp_path):
    cfg, task, ref, rnd, ups = one_round(tmp_path)
    a, b, c = rnd.sampled
    replies = [Reply(a, error="ClientApp raised ValueError"), Reply(b, rejected="unreadable record"), Reply(c, *ups[c])]
    checked = checked_uploads(cfg, ref, task.clients(), rnd, replies)
    assert checked.rejected == {a: "client error: ClientApp raised ValueError", b: "unreadable record"}
    assert [u.client_id for u in checked.uploads] == [c] and len(checked.client_records) == 1


def test_late_and_duplicated_deliveries_are_checked_by_their_content(tmp_path):
    """A delayed upload (kind late) goes first, a duplicate (kind copy) last; both are decoded and checked
    like any upload (the server update then refuses a stale or repeated one by its round and version)."""
    cfg, task, ref, rnd, ups = one_round(tmp_path)
    a, b, _ = rnd.sampled
    replies = [Reply(b, *ups[b]), Reply(a, ups[a][0], {}, kind="late"), Reply(b, ups[b][0], {}, kind="copy"),
               Reply(a, b"garbage", {}, kind="copy")]
    checked = checked_uploads(cfg, ref, task.clients(), rnd, replies)
    assert [u.client_id for u in checked.uploads] == [a, b, b]
    assert len(checked.client_records) == 1 and list(checked.rejected) == ["#0"]


def test_a_late_or_copied_upload_of_an_unregistered_client_is_rejected(tmp_path):
    cfg, task, ref, rnd, ups = one_round(tmp_path)
    a, b, c = rnd.sampled
    known = {a: 10, b: 10}  # c is not registered with this server
    checked = checked_uploads(cfg, ref, known, rnd, [Reply(a, *ups[a]), Reply(c, ups[c][0], {}, kind="copy")])
    assert [u.client_id for u in checked.uploads] == [a] and checked.rejected == {c: "unknown client id"}


class StaticTask(VectorTask):
    """VectorTask with a static downlink component (sent at first contact only, like a fixed B_L)."""

    def downlink_extra(self, extra) -> dict:
        return {"emulator": {"w": torch.ones(4, dtype=torch.float64)}}

    def static_extra(self):
        return {"emulator"}


@pytest.mark.parametrize("secure", [False, True])
def test_a_client_that_failed_gets_its_first_contact_components_again(tmp_path, secure):
    """Its error may mean it lost them (a restarted node without its state directory); under secure aggregation,
    an error in the train phase (the one that carries the broadcast) does the same."""
    from ciders.federation.inprocess import Faults
    from ciders.federation.ciders_loop import run_federation
    from ciders.fileio import read_jsonl

    extra = ["federation.rounds=3"] + (["federation.secure_aggregation=true"] if secure else [])

    def run(out, faults):
        run_federation(load_config(None, VEC + extra), StaticTask(3), out, faults=faults,
                       progress=False, log=lambda s: None)
        rows = read_jsonl(out / "metrics.jsonl")
        return [("emulator" in r["bytes_down"]) for r in rows if r["event"] == "round"], \
            [r for r in rows if r["event"] == "server"]

    assert run(tmp_path / "ok", Faults())[0] == [True, False, False]
    sent, server = run(tmp_path / "fail", Faults(error={(1, "train", "c0001")}))  # contacted in round 0, fails in 1
    assert sent == [True, False, True] and "client error" in server[1]["rejected"]["c0001"]


def test_uploads_and_records_are_taken_in_sampling_order_whatever_the_arrival(tmp_path):
    """The server's sums are order-sensitive in floating point: the same uploads in another arrival order give the
    same uploads list and records, in sampling order."""
    cfg, task, ref, rnd, ups = one_round(tmp_path)
    a, b, c = rnd.sampled
    checked = checked_uploads(cfg, ref, task.clients(), rnd, [Reply(c, *ups[c]), Reply(a, *ups[a]), Reply(b, *ups[b])])
    assert [u.client_id for u in checked.uploads] == [a, b, c] == [r["client"] for r in checked.client_records]
