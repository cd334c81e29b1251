#!/bin/bash
# EC2 user data for a replacement Spot node: install dashrun, then resume the job where dash-memd
# says it stands. The launch template's AMI carries the training code at the same path as on the
# node that started the job (dash-memd stores the working directory and the command line).
#
# Fill in: the address of the stable VM, where the job's credential comes from, and the job id.
# The node gets the job's credential (dash-memd token --job JOB), never the cluster's token: code in a
# rank can then reach this job's checkpoints and no other job's. The operator's PUBLIC key (the .pub
# of dash-memd keys) is baked into the AMI or fetched here; the private key never leaves the operator.
set -euo pipefail
MEMD=10.0.0.5:7070
JOB_ID=gpt-1
TOKEN_FILE=/etc/dash/gpt-1.credential
OPERATOR_PUBKEY=/etc/dash/operator.pub

mkdir -p /etc/dash
# The credential: from a secret store, never baked into the AMI. umask 077: the file is never readable
# by others, not even for a moment (dashrun refuses a token file group or others may read).
(umask 077 && aws secretsmanager get-secret-value --secret-id dash-gpt-1-credential --query SecretString \
    --output text > "$TOKEN_FILE")

# dashrun needs the torch the AMI provides; pip keeps it and installs the rest.
python3 -m pip install --quiet dashrun

# Relaunch the job as it was launched; it resumes from the newest committed checkpoint. This runs as
# root, so resume runs the stored command line only if the operator's key signed it (dashrun
# --operator-key at launch) and it is no older than one this node ran: write access to the bucket or
# to dash-memd's disk, or any credential, alone cannot plant a command (docs/security.md).
# `dashrun resume --dry-run` (same options) prints what would run and runs nothing.
# Exit 75 means preempted again with the state safe: the next replacement resumes it.
exec dashrun resume --memd "$MEMD" --token-file "$TOKEN_FILE" --operator-pubkey "$OPERATOR_PUBKEY" \
    --job-id "$JOB_ID"
