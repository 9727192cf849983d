"""Files that survive crashes and cross nodes (ground layer: imports nothing of asyncrl).

``atomic``: directories written aside and switched in whole, sealed by a manifest of
sizes and CRC32s, fsynced; symlinks swapped atomically. ``sink``: a Ray actor on the
driver's node that writes other nodes' files into the driver's run directory and serves
them back; ``remote``: a process's side of it (is this the driver's node, and moving
files and trees to and from it). docs/cluster.md and docs/reliability.md use them.
"""
