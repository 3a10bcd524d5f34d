"""One model split over several processes with MLX's distributed layer: pipeline parallelism.

``mtp-runner --model M --ranks N`` starts N ranks on this machine (ring backend on
loopback); under ``mlx.launch --hostfile hosts.json`` each rank runs ``--distributed``.
The layers are split by bytes (``split``), each rank loads only its own (``stage``), rank 0
serves the protocol through the usual engine over a model whose ``hidden`` runs the ranks in
turn (``pipeline``, ``engine``), the others follow its commands (``follower``) over one
channel of MLX sends and receives (``channel``; a rank waits for its previous rank's bytes
in ``poll``, not in MLX's spinning receive: ``inbound``), and a watchdog bounds every wait
(``watchdog``). The prefix cache drives the other ranks' caches through one stand-in cache
whose snapshots stay on the ranks that hold the layers (``remote``). ``ranks`` sets up the
environment (each local rank's share of the cores), ``main`` runs a rank.
Speculation runs on rank 0 as in one process (the suffix drafter, or an MTP head beside the
embedding and the final hidden rows): a verify feed is one forward down the chain and its
rejected rows one rewind command.
"""
