"""The Flower engine (flwr 1.42, Message API): the same rounds as the in-process engine, over Flower.

  strategy.py    CidersStrategy (a flwr.serverapp.strategy.Strategy) around the `engines.rounds.Coordinator`
  server_app.py  the ServerApp (`flwr run` / simulation) and `run_simulation` for `--engine flower-sim`
  client_app.py  the ClientApp: `engines.rounds.client_round` on the node's own state directory
  messages.py    what travels: ciders wire bytes as one uint8 Array, routing fields in a ConfigRecord
  deploy.py      SuperLink / SuperNode processes, certificates and keys for a deployment (`ciders flower`)

Heavy imports (torch, transformers) happen inside the handlers, so a `query` message is cheap.
"""
