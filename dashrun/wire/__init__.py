"""The wire: the one framed, authenticated format every link speaks, and the clients built on it.

``protocol`` (the frame: header, JSON body, data with its CRC-32C; field checks),
``messages`` (shards, checkpoints, launch specs, notices), ``agent_messages``
(rank <-> dash-agent), ``channel`` (frames over a socket), ``tls`` (TLS on TCP
links and the channel binding), ``auth`` (the token handshake, bound to TLS),
``memd_client`` (dash-memd's client), ``agent_link`` (a rank's link to its
agent), ``layout`` (a checkpoint's bytes: a shard's parts and description,
versioned; a committed checkpoint laid out in one buffer), ``planner`` (which
holder serves each byte range of a restore).
Nothing here imports torch.
"""

__all__: list[str] = []
