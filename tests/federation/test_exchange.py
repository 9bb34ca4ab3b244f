"""Client ids on the wire: `client<i>`, nothing else, and only ids of the run's clients."""

import pytest

from ciders.federation.exchange import client_id, client_index


def test_client_ids_round_trip():
    assert [client_index(client_id(i), 12) for i in range(12)] == list(range(12))


@pytest.mark.parametrize("bad", ["client3", "client-1", "client01", "c1", "client", "client1 ", 1, None, "CLIENT1"])
def test_anything_but_a_client_of_the_run_is_refused(bad):
    with pytest.raises(ValueError):
        client_index(bad, 3)
