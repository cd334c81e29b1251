"""dash-agent: the sidecar on every node of a dashrun job.

It receives staged shards from the node's ranks over a Unix socket (the
bytes stay in shared memory), streams them to dash-memd, and fetches
checkpoints for the ranks to restore. It imports no torch.
"""
