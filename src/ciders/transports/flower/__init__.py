"""The Flower transport (flwr 1.42, Message API): the same round loop as in-process, its messages carried
by a Flower Grid.

  exchange.py    FlowerExchange: one round phase's messages to the SuperNodes and the replies back (both
                 method families; `federation.exchange` is the interface)
  nodes.py       NodeMap: which SuperNode hosts which stable client id
  server_app.py  the ServerApp (`flwr run` / simulation): the run's own loop over a FlowerExchange, and
                 `run_simulation` for `--engine flower-sim`
  client_app.py  the ClientApp: the client functions of `federation.rounds` / `federation.bilevel_rounds`
                 on the node's own state directory
  bilevel.py     the RABO family's client side on a node (its between-phase scratch space)
  messages.py    what travels: ciders wire bytes as one uint8 Array, routing fields in a ConfigRecord
  deploy.py      SuperLink / SuperNode processes, certificates and keys for a deployment (`ciders flower`)
  fleet_gateway.py  the only door SuperNodes get: relays Flower's Fleet API to the SuperLink, refuses the rest

Heavy imports (torch, transformers) happen inside the handlers, so a `query` message is cheap.
"""
