#!/bin/sh
# A Slurm prolog: runs as root on each node before a job starts there
# (`gpuclusters clusters configure CLUSTER --prolog examples/prolog.sh`).
# A non-zero exit drains the node and requeues the job; keep it short.
echo "$(date -u +%FT%TZ) job $SLURM_JOB_ID of $SLURM_JOB_USER starts on $(hostname)" \
    >> /var/log/gpuclusters/prolog.log
exit 0
